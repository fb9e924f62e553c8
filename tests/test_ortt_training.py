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
import subprocess

import numpy as np
import pytest

from conftest import run_cli
from fusecli.runtime.library import library_path

STEPS = 6

# onnxruntime-training 1.19.2's package __init__ imports torch (for ORTModule and its torch
# optimizers) although the `api` and `artifacts` modules do not use it; .venv-ortt has no torch,
# so the script registers the package without running that __init__. Everything after the
# first three lines is the user-facing API unchanged.
_SCRIPT = r"""
import json, os, sys, types, onnxruntime as ort
sys.modules["onnxruntime.training"] = types.ModuleType("onnxruntime.training")
sys.modules["onnxruntime.training"].__path__ = [os.path.join(os.path.dirname(ort.__file__), "training")]
import numpy as np, onnx
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.training import artifacts
from onnxruntime.training.api import CheckpointState, Module, Optimizer

cfg = json.loads(sys.argv[1])
d = cfg["dir"]


def finish_artifacts():
    # ends an artifacts mode: prints the files made. onnx >= 1.19 (.venv-ortt has 1.23.2)
    # stamps the optimizer model with its own IR version (14), which onnxruntime 1.19.2 refuses
    # (max 10); the ops are unchanged
    opt = onnx.load(os.path.join(d, "optimizer_model.onnx"))
    if opt.ir_version > 10:
        opt.ir_version = 10
        onnx.save(opt, os.path.join(d, "optimizer_model.onnx"))
    print(json.dumps(sorted(os.listdir(d))))
    sys.exit(0)


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

# --- train: the README's loop -----------------------------------------------------------------
import ctypes
calls = ctypes.CDLL(cfg["library"])
calls.fusecli_kernel_calls.restype = ctypes.c_int64
calls.fusecli_kernel_calls.argtypes = [ctypes.c_char_p]
calls.fusecli_reset_kernel_calls.restype = None
batch = np.load(cfg["batch"])
out = {}
for model in cfg["models"]:
    state = CheckpointState.load_checkpoint(os.path.join(d, "checkpoint"))
    so = ort.SessionOptions()
    so.register_custom_ops_library(cfg["library"])
    module = Module(model, state, session_options=so)
    optimizer = Optimizer(os.path.join(d, "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(cfg["lr"])
    calls.fusecli_reset_kernel_calls()
    module.train()
    losses = []
    for step in range(cfg["steps"]):
        loss = module(batch["x"], batch["y"])
        optimizer.step()
        module.lazy_reset_grad()
        losses.append(float(loss))
    out[model] = {"losses": losses,
                  "params": module.get_contiguous_parameters().numpy().tolist(),
                  "calls": {op: calls.fusecli_kernel_calls(op.encode()) for op in cfg["ops"]}}
print(json.dumps(out))
"""


def _ortt(ortt_python: str, cfg: dict):
    proc = subprocess.run([ortt_python, "-c", _SCRIPT, json.dumps(cfg)], capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
