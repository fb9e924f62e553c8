"""`fusecli optimize` then `fusecli verify` on every sample, both families, in each family's
own runtime, with the library's kernels doing the work (counted from onnxruntime's profile)."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import onnx
import pytest
from onnx import helper

from conftest import SAMPLES, run_cli

import fusecli
from fusecli.library import has_cuda

SAMPLE_NAMES = sorted(p.stem for p in SAMPLES.glob("*.onnx"))


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_optimize_then_verify(name, tmp_path, ortt_python):
    src = SAMPLES / f"{name}.onnx"
    out = tmp_path / f"{name}.fused.onnx"
    run_cli("optimize", src, "-o", out, "-q")
    report = json.loads(run_cli("verify", src, out, "--json").stdout)
    assert report["ok"], report
    assert report["max_rel"] <= 1e-5
    expected_runtime = "onnxruntime-training" if name.startswith("ortt_") else "onnxruntime "
    assert report["runtime"].startswith(expected_runtime)
    fused_ops = Counter(n.op_type for n in onnx.load(out).graph.node
                        if n.domain == "com.fusecli")
    assert fused_ops  # every sample has something to fuse
    assert report["fused_kernel_runs"] == dict(fused_ops)  # each fused node ran our kernel
    if name.startswith("ortt_"):  # gradients written in place were compared too
        assert any(o["name"].startswith("fed/") and o["name"].endswith("accumulation.buffer")
                   for o in report["outputs"])


def _break_scale(model: onnx.ModelProto) -> str:
    node = next(n for n in model.graph.node if n.op_type == "LinearActivationGrad")
    for a in node.attribute:
        if a.name == "activation":
            node.attribute.remove(a)
            break
    node.attribute.append(helper.make_attribute("activation", "identity"))
    return node.name


def test_verify_names_mismatching_outputs_and_fused_nodes(tmp_path):
    src = SAMPLES / "torch_mlp.onnx"
    out = tmp_path / "fused.onnx"
    run_cli("optimize", src, "-o", out, "-q")
    bad = onnx.load(out)
    broken = _break_scale(bad)
    onnx.save(bad, tmp_path / "bad.onnx")
    proc = run_cli("verify", src, tmp_path / "bad.onnx", check_rc=1)
    assert "FAIL" in proc.stdout
    assert "MISMATCH" in proc.stdout
    mism = [ln for ln in proc.stderr.splitlines() if ln.startswith("fusecli: mismatch in")]
    assert mism and all(broken in ln for ln in mism)
    assert "Traceback" not in proc.stderr


def test_optimize_verify_flag(tmp_path, ortt_python):
    out = tmp_path / "o.onnx"
    proc = run_cli("optimize", SAMPLES / "ortt_cnn.onnx", "-o", out, "--verify")
    assert "PASS" in proc.stdout and "ConvBnReluGrad x2" in proc.stdout


def test_verify_picks_the_training_runtime_and_says_which(tmp_path, ortt_python):
    out = tmp_path / "o.onnx"
    run_cli("optimize", SAMPLES / "ortt_mlp.onnx", "-o", out, "-q")
    proc = run_cli("verify", SAMPLES / "ortt_mlp.onnx", out)
    assert "in onnxruntime-training 1.19.2" in proc.stdout


def test_library_path_is_absolute_and_loads(tmp_path):
    path = run_cli("library-path").stdout.strip()
    assert path == fusecli.library_path()
    assert path.startswith("/") and path.endswith(".so")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA compiler on this machine")
def test_library_has_cuda_kernels_compiled_in():
    assert has_cuda()
