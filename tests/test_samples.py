"""The shipped sample training graphs: load, carry their family's markers, and run in their runtime.

ort-training samples run through fusecli/runtime/runtime_worker.py under .venv-ortt/bin/python (made by
`make ortt-env`); torch-joint samples run under this interpreter's onnxruntime.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from fusecli import CANONICAL_PATTERNS
from fusecli.runtime.feeds import load_manifest, make_feeds
from fusecli.runtime.runtime_worker import decode_key, save_arrays

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "samples"
WORKER = ROOT / "fusecli" / "runtime" / "runtime_worker.py"
ORTT_PY = ROOT / ".venv-ortt" / "bin" / "python"
MANIFEST = load_manifest(SAMPLES / "manifest.yaml")
STANDARD_DOMAINS = {"", "ai.onnx", "ai.onnx.ml"}
SAMPLE_PARAMS = [pytest.param(n, marks=pytest.mark.ortt) if e["family"] == "ort-training"
                 else n for n, e in sorted(MANIFEST.items())]
REQUIRED = {"ortt_mlp", "ortt_block", "ortt_block_sdpa", "ortt_cnn", "torch_mlp", "torch_block"}


def _python_for(entry: dict) -> str:
    if entry["runtime"] == "onnxruntime-training":
        if not ORTT_PY.exists():
            pytest.fail(f"{ORTT_PY} is missing: run `make ortt-env` to create the "
                        "onnxruntime-training run-time venv", pytrace=False)
        return str(ORTT_PY)
    return sys.executable


def _run(entry: dict, tmp_path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    model = onnx.load(SAMPLES / entry["file"])
    feeds = make_feeds(model, entry, seed=0)
    fp, op = tmp_path / "feeds.npz", tmp_path / "out.npz"
    save_arrays(str(fp), feeds)       # the worker's file format: keys percent-encoded
    r = subprocess.run([_python_for(entry), str(WORKER), "--model", str(SAMPLES / entry["file"]),
                        "--feeds", str(fp), "--out", str(op)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"runtime_worker failed ({r.returncode}): {r.stderr.strip()}"
    info = json.loads(r.stdout.strip().splitlines()[-1])
    with np.load(op) as z:
        return info, {decode_key(k): z[k] for k in z.files}


def test_manifest_lists_required_samples():
    assert REQUIRED <= set(MANIFEST), sorted(REQUIRED - set(MANIFEST))
    for name, e in MANIFEST.items():
        assert (SAMPLES / e["file"]).exists(), name
        assert e["family"] in ("ort-training", "torch-joint"), name
        assert set(e["patterns"]) <= set(CANONICAL_PATTERNS), name
        assert e["runtime"] == ("onnxruntime-training" if e["family"] == "ort-training"
                                else "onnxruntime"), name


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_family_markers(name):
    e = MANIFEST[name]
    m = onnx.load(SAMPLES / e["file"])
    ops = {(n.domain or "", n.op_type) for n in m.graph.node}
    if e["family"] == "ort-training":
        assert ("com.microsoft", "InPlaceAccumulatorV2") in ops
        grads = {op for d, op in ops if d == "com.microsoft" and op.endswith("Grad")}
        assert grads, "no com.microsoft gradient op"
    else:
        assert {d for d, _ in ops} <= STANDARD_DOMAINS, {d for d, _ in ops}
        assert m.ir_version <= 10, "stock onnxruntime 1.31.1 needs ir_version <= 10 here"


@pytest.mark.parametrize("name", SAMPLE_PARAMS)
def test_runs_with_finite_loss_and_gradients(name, tmp_path):
    e = MANIFEST[name]
    info, out = _run(e, tmp_path)
    assert info["runtime"].startswith(e["runtime"] + " "), info
    loss = out[e["loss_output"]]
    assert loss.size == 1 and np.isfinite(loss).all() and float(loss) > 0, loss
    if e["family"] == "ort-training":
        grads = {k[len("fed/"):-len("_grad.accumulation.buffer")]: v for k, v in out.items()
                 if k.startswith("fed/") and k.endswith("_grad.accumulation.buffer")}
    else:
        grads = {k[:-len("_grad")]: out[k] for k in e["gradient_outputs"]}
    params = [i["name"] for i in e["inputs"] if i.get("role") == "parameter"]
    assert params and sorted(grads) == sorted(params)
    zero_ok = set(e.get("zero_grad_params", []))
    for p, g in grads.items():
        assert np.isfinite(g).all(), f"{p}: non-finite gradient"
        if p in zero_ok:
            assert np.abs(g).max() < 1e-5, f"{p}: expected a (mathematically) zero gradient"
        else:
            assert np.abs(g).max() > 1e-6, f"{p}: zero gradient"
