"""The ort-training workflow with a fused model, as users train (README, "Training with a fused
ort-training model"): artifacts from onnxruntime.training.artifacts.generate_artifacts, the
training model fused by `fusecli optimize`, then onnxruntime.training.api Module + Optimizer
with fusecli's library registered in the SessionOptions. A few AdamW steps of the fused model
must give the unfused model's loss curve and parameters, with the fused kernels running.

Runs in .venv-ortt (onnxruntime-training 1.19.2). The forward model is built with onnx.helper
(no torch there): Linear+ReLU, Linear+GELU(erf), Linear+SiLU, Linear, MSE loss.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_cli
from fusecli.runtime.library import library_path
from ortt_train import HEAD, TRAIN, run_ortt

STEPS = 6

# the training part is ortt_train.TRAIN, the README's loop; test_lce and test_flash_training put
# their own artifacts step before this one
_SCRIPT = HEAD + r"""
if cfg["mode"] == "artifacts":
    rng = np.random.default_rng(0)
    sizes = [16, 32, 32, 32, 8]
    inits, nodes, x = [], [], "x"
    for i, act in enumerate(["Relu", "Gelu", "Silu", None]):
        w, b = f"fc{i}.weight", f"fc{i}.bias"
        inits += [numpy_helper.from_array(
                      (rng.standard_normal((sizes[i + 1], sizes[i])) / np.sqrt(sizes[i])).astype(np.float32), w),
                  numpy_helper.from_array((0.1 * rng.standard_normal(sizes[i + 1])).astype(np.float32), b)]
        y = f"fc{i}"
        nodes.append(helper.make_node("Gemm", [x, w, b], [y], transB=1))
        if act == "Relu":
            nodes.append(helper.make_node("Relu", [y], [y + "_act"]))
        elif act == "Gelu":   # x * 0.5 * (1 + erf(x / sqrt(2))), fused to com.microsoft Gelu by ORT
            inits += [numpy_helper.from_array(np.array(v, np.float32), n) for v, n in
                      ((np.sqrt(2.0), "sqrt2"), (1.0, "one"), (0.5, "half"))]
            nodes += [helper.make_node("Div", [y, "sqrt2"], [y + "_d"]),
                      helper.make_node("Erf", [y + "_d"], [y + "_e"]),
                      helper.make_node("Add", [y + "_e", "one"], [y + "_a"]),
                      helper.make_node("Mul", [y, y + "_a"], [y + "_m"]),
                      helper.make_node("Mul", [y + "_m", "half"], [y + "_act"])]
        elif act == "Silu":
            nodes += [helper.make_node("Sigmoid", [y], [y + "_s"]),
                      helper.make_node("Mul", [y, y + "_s"], [y + "_act"])]
        x = y + "_act" if act else y
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    artifacts.generate_artifacts(
        model, requires_grad=[i.name for i in inits if i.name.startswith("fc")],
        loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW,
        artifact_directory=d)
    finish_artifacts()
""" + TRAIN


def _ortt(ortt_python: str, cfg: dict):
    return run_ortt(ortt_python, _SCRIPT, cfg)


def test_fused_training_model_trains_like_the_original(tmp_path, ortt_python):
    art = tmp_path / "artifacts"
    art.mkdir()
    made = _ortt(ortt_python, {"mode": "artifacts", "dir": str(art)})
    assert {"training_model.onnx", "optimizer_model.onnx", "checkpoint"} <= set(made)

    orig, fused = art / "training_model.onnx", art / "fused_training_model.onnx"
    report = json.loads(run_cli("optimize", orig, "-o", fused, "--json").stdout)
    fusions = {p: v["fused"] for p, v in report["patterns"].items() if v["fused"]}
    assert fusions == {"linear_relu": 1, "linear_gelu": 1, "linear_silu": 1}, report["patterns"]

    # one batch with a target the MLP can fit (a linear map of x), seen at every step: the
    # loss falls at every step
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = x @ (rng.standard_normal((16, 8)).astype(np.float32) / 4)
    np.savez(tmp_path / "batch.npz", x=x, y=y)

    res = _ortt(ortt_python, {"mode": "train", "dir": str(art), "library": library_path(),
                              "batch": str(tmp_path / "batch.npz"), "steps": STEPS, "lr": 0.01,
                              "models": [str(orig), str(fused)],
                              "ops": ["LinearActivationGrad"]})
    a, b = res[str(orig)], res[str(fused)]
    assert all(np.diff(a["losses"]) < 0), a["losses"]     # it does train
    np.testing.assert_allclose(b["losses"], a["losses"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(b["params"], a["params"], rtol=1e-4, atol=1e-6)
    assert a["calls"]["LinearActivationGrad"] == 0
    assert b["calls"]["LinearActivationGrad"] == STEPS * sum(fusions.values())


@pytest.fixture(scope="module", autouse=True)
def _library_built():
    library_path()  # a clear failure when `make lib` has not run


def test_budgeted_training_model_trains_like_the_original(tmp_path, ortt_python):
    """`fusecli optimize --max-memory` (half the fused step's estimated saved activations):
    the budgeted training model trains through onnxruntime.training.api with the original's
    losses and parameters, its recomputed nodes running in the backward."""
    import onnx

    from fusecli.engine.recompute import apply_budget

    art = tmp_path / "artifacts"
    art.mkdir()
    _ortt(ortt_python, {"mode": "artifacts", "dir": str(art)})
    orig, fused = art / "training_model.onnx", art / "fused_training_model.onnx"
    budgeted = art / "budgeted_training_model.onnx"
    run_cli("optimize", orig, "-o", fused)
    full = apply_budget(onnx.load(str(fused)), 10**15, {"batch": 32}).before
    report = json.loads(run_cli("optimize", orig, "-o", budgeted, "--max-memory",
                                str(full // 2), "--estimate-only", "--dim", "batch=32",
                                "--json").stdout)
    mb = report["memory_budget"]
    assert mb["met"] and mb["recomputed_total"] > 0 and mb["estimate_after_bytes"] <= full // 2
    assert sum(n.name.endswith("/recompute") for n in onnx.load(str(budgeted)).graph.node) \
        == mb["recomputed_total"]

    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = x @ (rng.standard_normal((16, 8)).astype(np.float32) / 4)
    np.savez(tmp_path / "batch.npz", x=x, y=y)
    res = _ortt(ortt_python, {"mode": "train", "dir": str(art), "library": library_path(),
                              "batch": str(tmp_path / "batch.npz"), "steps": STEPS, "lr": 0.01,
                              "models": [str(orig), str(budgeted)]})
    a, b = res[str(orig)], res[str(budgeted)]
    assert all(np.diff(a["losses"]) < 0), a["losses"]
    np.testing.assert_allclose(b["losses"], a["losses"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(b["params"], a["params"], rtol=1e-4, atol=1e-6)
