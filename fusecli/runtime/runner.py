"""Running a model once in its own runtime: onnxruntime, or onnxruntime-training from the
``.venv-ortt`` environment for graphs that hold training ops, through ``runtime_worker.py`` in
a subprocess (``run_in_runtime``); which interpreter that is (``pick_runtime``); a shipped
sample's manifest entry; a worker's one-line failure reason."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

from fusecli.errors import FuseError
from fusecli.runtime.feeds import load_manifest

WORKER = Path(__file__).resolve().parent / "runtime_worker.py"
# Ops only onnxruntime-training registers (stock onnxruntime refuses models holding them).
_TRAINING_OPS = {"InPlaceAccumulator", "InPlaceAccumulatorV2", "ConcatTraining", "SplitTraining",
                 "BatchNormInternal", "SliceGrad", "Scale", "GatherGrad", "YieldOp",
                 "SoftmaxCrossEntropyLossInternal", "SoftmaxCrossEntropyLossInternalGrad",
                 "SoftmaxGrad", "SoftmaxGrad_13", "LogSoftmaxGrad", "LogSoftmaxGrad_13"}


def needs_training_runtime(model: onnx.ModelProto) -> bool:
    for n in model.graph.node:
        if n.op_type in _TRAINING_OPS or (n.op_type.endswith("Grad")
                                          and n.domain in ("com.microsoft", "", "ai.onnx")):
            return True
    return False


def pick_runtime(model: onnx.ModelProto, override: str | None = None) -> str:
    """Python interpreter whose onnxruntime can run ``model``."""
    from fusecli.runtime.library import training_python

    if override or needs_training_runtime(model):
        return training_python(override)
    return sys.executable


def manifest_entry_for(path: str | os.PathLike) -> dict | None:
    """The entry of a sample in the ``manifest.yaml`` beside it (shipped samples: their
    parameters and labels), or None."""
    import yaml

    p = Path(path).resolve()
    manifest = p.parent / "manifest.yaml"
    if not manifest.is_file():
        return None
    try:
        entries = load_manifest(manifest)
    except (OSError, yaml.YAMLError, ValueError, AttributeError, TypeError):
        return None  # not a fusecli sample manifest
    for entry in entries.values():
        if entry.get("file") == p.name:
            return entry
    return None


def worker_error(proc: subprocess.CompletedProcess, python: str = "python") -> str:
    """The one-line reason a worker subprocess failed: its last stderr line (the workers print
    exactly one), or the signal that killed it, or its exit code."""
    from fusecli.runtime.library import worker_failure

    return worker_failure(proc, python)


class RunFailed(FuseError):
    """A model did not run in its runtime; ``detail`` is the runtime's one-line message."""

    def __init__(self, model_path, detail: str):
        super().__init__(f"running {Path(model_path).name} failed: {detail}")
        self.detail = detail


def run_in_runtime(model_path: str | os.PathLike, feeds: dict[str, np.ndarray], python: str,
                   library: str | None = None, opt_level: str = "disable",
                   extra: list[str] | None = None,
                   more_feeds: list[dict[str, np.ndarray]] = ()) -> tuple[dict[str, np.ndarray],
                                                                         dict]:
    """Run a model once through runtime_worker.py in ``python``; return (outputs, info).
    Each of ``more_feeds`` is run in a fresh session; its results are keyed 'run<k>/<name>'."""
    from fusecli.runtime.library import run_worker, worker_failure, worker_result
    from fusecli.runtime.runtime_worker import save_arrays

    with tempfile.TemporaryDirectory(prefix="fusecli-run-") as tmp:
        fpath, opath = Path(tmp) / "feeds.npz", Path(tmp) / "out.npz"
        save_arrays(fpath, feeds)           # names percent-encoded both ways (any name)
        cmd = [python, str(WORKER), "--model", str(model_path), "--feeds", str(fpath),
               "--out", str(opath), "--opt-level", opt_level] + (extra or [])
        for k, more in enumerate(more_feeds, start=1):
            mpath = Path(tmp) / f"feeds{k}.npz"
            save_arrays(mpath, more)
            cmd += ["--feeds", str(mpath)]
        if library:
            cmd += ["--library", library]
        proc = run_worker(cmd, python, "runtime_worker")
        if proc.returncode != 0:
            raise RunFailed(model_path, worker_failure(proc, python))
        info = worker_result(proc, python, "runtime_worker", key="runtime")
        outs = _read_results(opath, python)
    return outs, info


def _read_results(path: Path, python: str) -> dict[str, np.ndarray]:
    """The worker's .npz (keys decoded); RuntimePythonError where there is none to read."""
    import zipfile

    from fusecli.runtime.library import RuntimePythonError
    from fusecli.runtime.runtime_worker import decode_key

    try:
        with np.load(path, allow_pickle=False) as z:
            return {decode_key(k): z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, AttributeError) as exc:
        why = "wrote no results" if isinstance(exc, FileNotFoundError) else (
            "wrote results that cannot be read")
        raise RuntimePythonError(python, f"exited 0 but {why} (it did not run fusecli's "
                                 "runtime_worker)") from None
