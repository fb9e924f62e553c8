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
_TRAINING_OPS = {"InPlaceAccumulator", "InPlaceAccumulatorV2", "ConcatTraining",
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


def worker_error(proc: subprocess.CompletedProcess) -> str:
    """The one-line reason a worker subprocess failed: its last stderr line (the workers print
    exactly one), or its exit code."""
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit code {proc.returncode}"


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
    import json

    with tempfile.TemporaryDirectory(prefix="fusecli-run-") as tmp:
        fpath, opath = Path(tmp) / "feeds.npz", Path(tmp) / "out.npz"
        np.savez(fpath, **feeds)
        cmd = [python, str(WORKER), "--model", str(model_path), "--feeds", str(fpath),
               "--out", str(opath), "--opt-level", opt_level] + (extra or [])
        for k, more in enumerate(more_feeds, start=1):
            mpath = Path(tmp) / f"feeds{k}.npz"
            np.savez(mpath, **more)
            cmd += ["--feeds", str(mpath)]
        if library:
            cmd += ["--library", library]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RunFailed(model_path, worker_error(proc))
        info = json.loads(proc.stdout.strip().splitlines()[-1])
        with np.load(opath, allow_pickle=False) as z:
            outs = {k: z[k] for k in z.files}
    return outs, info
