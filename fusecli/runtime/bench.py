"""Benchmark runner behind ``fusecli bench``: time a fused model against its original, side by side.

Both models run in ONE process of the model's runtime (onnxruntime, or onnxruntime-training from
``.venv-ortt``; chosen like ``fusecli verify``) through ``fusecli/runtime/bench_worker.py``: same
SessionOptions (intra-op spinning off, ORT_ENABLE_ALL, ``--threads`` intra-op threads), same
feeds (``fusecli.runtime.feeds.plan_feeds``, as ``fusecli verify`` makes them: ``--feeds FILE.npz``, a
sample's parameters, else realistic values recognised from the graph - fan-in scaled weights,
norm scales 1, biases 0, ids and labels in range, causal/padding masks; in-place gradient
buffers re-copied before every run),
``--warmup`` runs each, then ``--runs`` iterations in alternating order (A B, B A, ...).
Reported: median/min/max per model, the spread, speed-up = original median / fused median, and
the peak memory of one run of each model measured in a fresh process (see bench_worker.py).
"""


from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from fusecli.errors import FuseError
from fusecli.ops.contracts import FUSED_DOMAIN

WORKER = Path(__file__).resolve().parent / "bench_worker.py"


def default_threads() -> int:
    return os.cpu_count() or 1


def _has_fused(model) -> bool:
    return any(n.domain == FUSED_DOMAIN for n in model.graph.node)


def run_bench(original, fused, runs: int = 20, warmup: int = 3, threads: int | None = None,
              runtime_python: str | None = None, dims: dict[str, int] | None = None,
              entry: dict | None = None, seed: int = 0, peak_memory: bool = True,
              profile_dir: str | None = None, opt_level: str = "all",
              feeds: dict[str, np.ndarray] | None = None, timeout: float | None = None,
              min_time_s: float = 0.0, feeds_file: str | os.PathLike | None = None,
              peaks_only: str | None = None) -> dict:
    """Run bench_worker.py on (original, fused); return its JSON plus 'python'.

    ``entry``: a manifest-style entry for make_feeds (default: the shipped sample's entry, if
    ``original`` is one). ``feeds`` overrides the generated feeds entirely; ``feeds_file`` (an
    .npz keyed by input name) gives some or all of them. ``min_time_s``: keep iterating past
    ``runs`` until that much time has passed (short ops get more samples). The result's
    'feeds' maps each input to the policy that fed it. ``peaks_only`` ("a", "b" or "both"):
    no timing, only those models' peak memory (their entries hold just ``peak_bytes``).
    """
    from fusecli.runtime.feeds import plan_feeds, read_feeds_file
    from fusecli.runtime.library import (LibraryNotBuilt, RuntimePythonError, library_path,
                                         run_worker, worker_result)
    from fusecli.runtime.runtime_worker import save_arrays
    from fusecli.io.model import load_model
    from fusecli.runtime.runner import manifest_entry_for, needs_training_runtime, pick_runtime, worker_error

    if runs < 1:
        raise FuseError("--runs must be at least 1")
    if warmup < 0:
        raise FuseError("--warmup must be 0 or more")
    threads = default_threads() if not threads else int(threads)
    if threads < 1:
        raise FuseError("--threads must be at least 1")
    orig = load_model(original)
    fmodel = load_model(fused)
    python = pick_runtime(orig, runtime_python)
    if runtime_python is None and needs_training_runtime(fmodel):
        python = pick_runtime(fmodel, None)  # the fused model still needs the training runtime
    lib = None
    if _has_fused(fmodel) or _has_fused(orig):
        try:
            lib = library_path()
        except LibraryNotBuilt as exc:
            raise FuseError(f"{exc}") from None
    if feeds is None:
        given = read_feeds_file(feeds_file, orig) if feeds_file else None
        try:
            plan = plan_feeds(orig, entry if entry is not None else manifest_entry_for(original),
                              seed=seed, dims=dims, given=given)
        except (FileNotFoundError, NotImplementedError, ValueError) as exc:
            raise FuseError(f"cannot build feeds for {original}: {exc}") from None
        feeds, policy, lines = plan.feeds, plan.policy, plan.lines()
    else:
        policy, lines = {k: "given" for k in feeds}, ["given: " + ", ".join(feeds)]
    with tempfile.TemporaryDirectory(prefix="fusecli-bench-") as tmp:
        fpath = Path(tmp) / "feeds.npz"
        save_arrays(fpath, feeds)           # names percent-encoded (any name)
        cmd = [python, str(WORKER), "--a", str(original), "--b", str(fused), "--feeds", str(fpath),
               "--runs", str(runs), "--warmup", str(warmup), "--threads", str(threads),
               "--opt-level", opt_level, "--min-time", str(min_time_s)]
        if lib:
            cmd += ["--library", lib, "--library-for", "both"]
        if not peak_memory:
            cmd.append("--no-peak-memory")
        if peaks_only:
            cmd += ["--peaks-only", peaks_only]
        if profile_dir:
            cmd += ["--profile", str(profile_dir)]
        try:
            proc = run_worker(cmd, python, "bench_worker", timeout=timeout)
        except subprocess.TimeoutExpired:
            raise FuseError(f"benchmark of {Path(original).name} timed out after {timeout} s; "
                            "use fewer --runs") from None
    if proc.returncode != 0:
        raise FuseError(f"benchmark of {Path(original).name} vs {Path(fused).name} failed: "
                        f"{worker_error(proc, python)}")
    res = worker_result(proc, python, "bench_worker", key="b" if peaks_only == "b" else "a")
    want = ("a", "b") if peaks_only in (None, "both") else (peaks_only,)
    if not all(isinstance(res.get(k), dict) for k in want):
        raise RuntimePythonError(python, "printed a result without both models' timings")
    res["python"] = python
    res["feeds"], res["feed_lines"] = policy, lines
    return res


def summary(res: dict) -> dict:
    """The documented --json object."""
    def part(d):
        return {"median_ms": float(d["median_ms"]), "min_ms": float(d["min_ms"]),
                "max_ms": float(d["max_ms"]),
                "peak_bytes": None if d.get("peak_bytes") is None else int(d["peak_bytes"])}

    a, b = part(res["a"]), part(res["b"])
    speedup = a["median_ms"] / b["median_ms"] if b["median_ms"] > 0 else float("inf")
    return {"original": a, "fused": b, "speedup": float(speedup), "runtime": str(res["runtime"]),
            "threads": int(res["threads"]), "runs": int(res["runs"]),
            "feeds": dict(res.get("feeds", {}))}
