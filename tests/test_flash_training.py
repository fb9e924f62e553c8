"""The ort-training workflow (README, "Training with a fused ort-training model") on a model
whose causal self-attention the flash rules fuse: artifacts from generate_artifacts, the
training model fused by `fusecli optimize` (FlashAttention + FlashAttentionGrad), then
onnxruntime.training.api Module + Optimizer with fusecli's library. A few AdamW steps of the
fused model must give the unfused model's loss curve and parameters, with the flash kernels
running. Sequence 300: every tile edge of the CPU kernels (64 query rows x 128 keys), and
the causal mask's skipped tiles.

Runs in .venv-ortt (onnxruntime-training 1.19.2); the forward model is built with onnx.helper.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_cli
from fusecli.runtime.library import library_path
from test_ortt_training import _SCRIPT, _ortt

STEPS = 6
SEQ, EMB, HEADS = 300, 32, 2

# the artifacts step of tests/test_ortt_training.py's script, with an attention model in place
# of the MLP (the training part of that script is used unchanged)
_ATTN = r'''
if cfg["mode"] == "attn_artifacts":
    rng = np.random.default_rng(0)
    S, E, H = cfg["seq"], cfg["emb"], cfg["heads"]
    D = E // H
    inits = [numpy_helper.from_array((rng.standard_normal((E, E)) / np.sqrt(E)).astype(np.float32), n)
             for n in ("wq", "wk", "wv", "wo")]
    mask = np.where(np.arange(S)[None, :] <= np.arange(S)[:, None], 0.0,
                    np.finfo(np.float32).min).astype(np.float32).reshape(1, 1, S, S)
    inits += [numpy_helper.from_array(mask, "causal"),
              numpy_helper.from_array(np.array(1 / np.sqrt(D), np.float32), "scaling"),
              numpy_helper.from_array(np.array([1, S, H, D], np.int64), "heads_shape"),
              numpy_helper.from_array(np.array([1, S, E], np.int64), "out_shape")]
    nodes = []
    for n in ("q", "k", "v"):
        nodes += [helper.make_node("MatMul", ["x", "w" + n], [n + "_p"]),
                  helper.make_node("Reshape", [n + "_p", "heads_shape"], [n + "_h"]),
                  helper.make_node("Transpose", [n + "_h"], [n],
                                   perm=[0, 2, 3, 1] if n == "k" else [0, 2, 1, 3])]
    nodes += [helper.make_node("MatMul", ["q", "k"], ["scores"]),
              helper.make_node("Mul", ["scores", "scaling"], ["scaled"]),
              helper.make_node("Add", ["scaled", "causal"], ["masked"]),
              helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "v"], ["ctx"]),
              helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ctx_t", "out_shape"], ["ctx_r"]),
              helper.make_node("MatMul", ["ctx_r", "wo"], ["y"])]
    graph = helper.make_graph(
        nodes, "attn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, S, E])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, S, E])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    artifacts.generate_artifacts(
        model, requires_grad=["wq", "wk", "wv", "wo"], loss=artifacts.LossType.MSELoss,
        optimizer=artifacts.OptimType.AdamW, artifact_directory=d)
    finish_artifacts()
'''
_MARK = 'if cfg["mode"] == "artifacts":'
assert _MARK in _SCRIPT
SCRIPT = _SCRIPT.replace(_MARK, _ATTN.strip("\n") + "\n" + _MARK, 1)


def test_fused_attention_model_trains_like_the_original(tmp_path, ortt_python, monkeypatch):
    import test_ortt_training

    monkeypatch.setattr(test_ortt_training, "_SCRIPT", SCRIPT)
    art = tmp_path / "artifacts"
    art.mkdir()
    made = _ortt(ortt_python, {"mode": "attn_artifacts", "dir": str(art), "seq": SEQ,
                               "emb": EMB, "heads": HEADS})
    assert {"training_model.onnx", "optimizer_model.onnx", "checkpoint"} <= set(made)

    orig, fused = art / "training_model.onnx", art / "fused_training_model.onnx"
    report = json.loads(run_cli("optimize", orig, "-o", fused, "--json").stdout)
    fusions = {p: v["fused"] for p, v in report["patterns"].items() if v["fused"]}
    assert fusions == {"flash_attention": 1}, report["patterns"]   # one attention

    # one batch with a target the model can fit (a linear map of x), seen at every step
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, SEQ, EMB)).astype(np.float32)
    y = x @ (rng.standard_normal((EMB, EMB)).astype(np.float32) / 4)
    np.savez(tmp_path / "batch.npz", x=x, y=y)

    res = _ortt(ortt_python, {"mode": "train", "dir": str(art), "library": library_path(),
                              "batch": str(tmp_path / "batch.npz"), "steps": STEPS, "lr": 0.01,
                              "models": [str(orig), str(fused)],
                              "ops": ["FlashAttention", "FlashAttentionGrad"]})
    a, b = res[str(orig)], res[str(fused)]
    assert all(np.diff(a["losses"]) < 0), a["losses"]     # it does train
    np.testing.assert_allclose(b["losses"], a["losses"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(b["params"], a["params"], rtol=1e-4, atol=1e-6)
    assert a["calls"] == {"FlashAttention": 0, "FlashAttentionGrad": 0}
    assert b["calls"] == {"FlashAttention": STEPS, "FlashAttentionGrad": STEPS}


@pytest.fixture(scope="module", autouse=True)
def _library_built():
    library_path()  # a clear failure when `make lib` has not run
