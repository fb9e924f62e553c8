"""Section (c): the optimiser's own speed (load + match + rewrite + save on deep graphs of
~5k-40k nodes and on a raw Llama-style export) and the whole-process start-up rows of the
console script."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fusecli.bench.measure import REPO, WORKDIR, log


RAW_LAYERS = 44  # the raw-export row of (c): a Llama-style model of 44 layers, ~31k nodes


def raw_export_graph(layers: int = RAW_LAYERS) -> dict | None:
    """The raw `torch.onnx.export(..., dynamo=True, optimize=False)` Llama-style training graph
    of (c) (not committed: scripts/corpus/gen.py --raw writes it, with its expected counts from
    the model code, under build/corpus-scale with the corpus generator's torch venv). None when
    neither the graph nor that venv is there."""
    ddir = REPO / "build" / "corpus-scale"
    meta = ddir / f"torch_llama_raw_L{layers}.json"
    if not (meta.exists() and meta.with_suffix(".onnx").exists()):
        py = REPO / "build" / "venv-corpus-torch" / "bin" / "python"
        if not py.exists():
            log("(c) raw export: no build/venv-corpus-torch (make corpus creates it); row left out")
            return None
        log(f"(c) exporting the raw L{layers} graph (torch dynamo, optimize=False)")
        subprocess.run([str(py), str(REPO / "scripts" / "corpus" / "gen.py"), "--raw",
                        str(layers)], check=True, capture_output=True)
    info = json.loads(meta.read_text())
    exp = {k: v for k, v in info["expected"].items() if v}
    return {"path": str(ddir / info["file"]), "family": "torch-joint (raw export)",
            "nodes": info["nodes"], "copies": 1, "expected": exp,
            "expected_total": sum(exp.values())}


def optimizer_benchmarks(repeats: int = 3) -> list[dict]:
    from fusecli.bench.deepgraph import FAMILIES, SIZES, write_deep_graphs

    ddir = REPO / "build" / "deep-graphs"
    infos = write_deep_graphs(ddir, SIZES, tuple(FAMILIES))
    raw = raw_export_graph()
    return [optimizer_row(info, repeats) for info in infos + ([raw] if raw else [])]


STARTUP_SAMPLE = "torch_mlp.onnx"     # a small shipped sample (47 nodes)


def startup_benchmarks(repeats: int = 10) -> list[dict]:
    """Whole-process wall time of the console script (Python start-up and imports included),
    median of ``repeats``: `fusecli --version`, and `fusecli optimize` of a small sample."""
    fusecli = Path(sys.executable).parent / "fusecli"
    with tempfile.TemporaryDirectory(prefix="startup-", dir=WORKDIR) as tmp:
        commands = {"fusecli --version": ["--version"],
                    f"fusecli optimize samples/{STARTUP_SAMPLE} -o OUT -q":
                        ["optimize", str(REPO / "samples" / STARTUP_SAMPLE), "-o",
                         str(Path(tmp) / "out.onnx"), "-q"]}
        rows = []
        for label, args in commands.items():
            log(f"(c) start-up: {label}")
            times = []
            for _ in range(repeats + 1):             # the first run warms the file cache
                t0 = time.perf_counter()
                proc = subprocess.run([str(fusecli), *args], capture_output=True, text=True)
                times.append(time.perf_counter() - t0)
                if proc.returncode != 0:
                    raise RuntimeError(f"{label}: exit {proc.returncode}: {proc.stderr.strip()}")
            rows.append({"command": label, "median_s": statistics.median(times[1:]),
                         "min_s": min(times[1:]), "max_s": max(times[1:]), "runs": repeats})
    return rows


def optimizer_row(info: dict, repeats: int = 3) -> dict:
    """load + FusionPass (rules loaded included) + save in process, median of ``repeats``
    (wall and CPU seconds), and the wall time of the `fusecli optimize` console script."""
    from fusecli.api import FusionPass
    from fusecli.io.model import load_model, save_model

    fusecli = Path(sys.executable).parent / "fusecli"
    log(f"(c) {Path(info['path']).name}")
    path = Path(info["path"])
    out = path.with_suffix(".fused.onnx")
    phases = {"load": [], "pass": [], "save": [], "total": [], "cpu": []}
    fused = None
    for _ in range(repeats):
        c0 = time.process_time()
        t0 = time.perf_counter()
        m = load_model(path)
        t1 = time.perf_counter()
        fp = FusionPass()
        fp.run(m)
        t2 = time.perf_counter()
        save_model(m, out, path)
        t3 = time.perf_counter()
        phases["cpu"].append(time.process_time() - c0)
        for k, v in zip(("load", "pass", "save", "total"), (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            phases[k].append(v)
        fused = {k: v.fused for k, v in fp.stats.patterns.items()}
    cli = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        proc = subprocess.run([str(fusecli), "optimize", str(path), "-o", str(out), "-q",
                               "--json"], capture_output=True, text=True)
        cli.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            cli = [float("nan")]
            break
    exp = dict(info["expected"])
    med = {k: statistics.median(v) for k, v in phases.items()}
    return {"graph": path.name, "family": info["family"], "nodes": info["nodes"],
            "copies": info["copies"], **{f"{k}_s": v for k, v in med.items()},
            "cli_s": statistics.median(cli),
            "us_per_node": med["total"] / info["nodes"] * 1e6,
            "fused": sum(fused.values()), "expected": info["expected_total"],
            "counts_ok": all(fused.get(k, 0) == v for k, v in exp.items())}
