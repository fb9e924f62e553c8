"""A LoRA fine-tuning model trained with onnxruntime.training.api after fusion (issue 21: the
fused ort-training graphs train with the loss curve of the original).

The forward model (onnx.helper; .venv-ortt has no torch) is two hand-written LoRA Linear layers
on a 3-D input, y = x W^T + b + s (x A^T) B^T, the first followed by ReLU, MSE loss; the base W
and b are frozen (generate_artifacts' requires_grad = the four adapter matrices only). From this
model code: 2 LoRA-wrapped Linear layers whose backward is in the graph (the first with ReLU and
no input gradient, the second without activation). A few AdamW steps of the fused model must
give the original's losses and parameters, with LoraLinearGrad running.
"""

from __future__ import annotations

import json

import numpy as np

from conftest import run_cli
from fusecli.runtime.library import library_path
from ortt_train import HEAD, TRAIN, run_ortt

STEPS = 6

_SCRIPT = HEAD + r"""
if cfg["mode"] == "artifacts":
    rng = np.random.default_rng(0)
    sizes, r, s = [16, 32, 8], 4, 2.0
    inits = []  # the scale is a Constant node, as the exporters write it
    nodes = [helper.make_node("Constant", [], ["s"], value=numpy_helper.from_array(np.array(s, np.float32)))]
    x = "x"
    trainable = []
    for i in range(2):
        k, n = sizes[i], sizes[i + 1]
        for name, shape, sc in ((f"fc{i}.weight", (n, k), 1 / np.sqrt(k)), (f"fc{i}.bias", (n,), 0.1),
                                (f"fc{i}.A", (r, k), 1 / np.sqrt(k)), (f"fc{i}.B", (n, r), 0.5)):
            inits.append(numpy_helper.from_array((sc * rng.standard_normal(shape)).astype(np.float32), name))
        trainable += [f"fc{i}.A", f"fc{i}.B"]
        p = f"fc{i}"
        nodes += [helper.make_node("Transpose", [f"{p}.weight"], [p + "_wt"], perm=[1, 0]),
                  helper.make_node("MatMul", [x, p + "_wt"], [p + "_mm"]),
                  helper.make_node("Add", [f"{p}.bias", p + "_mm"], [p + "_base"]),
                  helper.make_node("Transpose", [f"{p}.A"], [p + "_at"], perm=[1, 0]),
                  helper.make_node("MatMul", [x, p + "_at"], [p + "_h"]),
                  helper.make_node("Transpose", [f"{p}.B"], [p + "_bt"], perm=[1, 0]),
                  helper.make_node("MatMul", [p + "_h", p + "_bt"], [p + "_u"]),
                  helper.make_node("Mul", [p + "_u", "s"], [p + "_us"]),
                  helper.make_node("Add", [p + "_base", p + "_us"], [p])]
        if i == 0:
            nodes.append(helper.make_node("Relu", [p], [p + "_act"]))
            p += "_act"
        x = p
    graph = helper.make_graph(
        nodes, "lora_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6, 16])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [4, 6, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    artifacts.generate_artifacts(
        model, requires_grad=trainable,
        frozen_params=[i.name for i in inits if i.name not in trainable],
        loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW,
        artifact_directory=d)
    finish_artifacts()
""" + TRAIN


def _ortt(ortt_python: str, cfg: dict):
    return run_ortt(ortt_python, _SCRIPT, cfg)


def test_fused_lora_model_trains_like_the_original(tmp_path, ortt_python):
    art = tmp_path / "artifacts"
    art.mkdir()
    made = _ortt(ortt_python, {"mode": "artifacts", "dir": str(art)})
    assert {"training_model.onnx", "optimizer_model.onnx", "checkpoint"} <= set(made)

    orig, fused = art / "training_model.onnx", art / "fused_training_model.onnx"
    report = json.loads(run_cli("optimize", orig, "-o", fused, "--json").stdout)
    fusions = {p: v["fused"] for p, v in report["patterns"].items() if v["fused"]}
    assert fusions == {"lora": 2}, report["patterns"]

    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 6, 16)).astype(np.float32)
    y = x @ (rng.standard_normal((16, 8)).astype(np.float32) / 4)
    np.savez(tmp_path / "batch.npz", x=x, y=y)
    res = _ortt(ortt_python, {"mode": "train", "dir": str(art), "library": library_path(),
                              "batch": str(tmp_path / "batch.npz"), "steps": STEPS, "lr": 0.01,
                              "models": [str(orig), str(fused)], "ops": ["LoraLinearGrad"]})
    a, b = res[str(orig)], res[str(fused)]
    assert all(np.diff(a["losses"]) < 0), a["losses"]     # the adapters do train
    np.testing.assert_allclose(b["losses"], a["losses"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(b["params"], a["params"], rtol=1e-4, atol=1e-6)
    assert a["calls"]["LoraLinearGrad"] == 0
    assert b["calls"]["LoraLinearGrad"] == STEPS * 2
