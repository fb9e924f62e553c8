"""Training with onnxruntime.training.api (Module + Optimizer) in .venv-ortt (onnxruntime-training
1.19.2), for the tests that train a fused model next to its original: test_ortt_training,
test_finetune_training, test_lora_training (test_lce and test_flash_training through
test_ortt_training's script).

A test's script is HEAD + its own step (`if cfg["mode"] == ...:` building artifacts and ending in
finish_artifacts(), or writing a checkpoint and an optimizer model) + TRAIN; run_ortt runs it
with `cfg` as JSON in argv[1] and returns the JSON line it prints last.
"""

from __future__ import annotations

import json
import subprocess

# onnxruntime-training 1.19.2's package __init__ imports torch (for ORTModule and its torch
# optimizers) although the `api`, `artifacts` and `onnxblock` modules do not use it; .venv-ortt
# has no torch, so the script registers the package without running that __init__. Everything
# after the first three lines is the user-facing API unchanged.
HEAD = r"""
import json, os, sys, types, onnxruntime as ort
sys.modules["onnxruntime.training"] = types.ModuleType("onnxruntime.training")
sys.modules["onnxruntime.training"].__path__ = [os.path.join(os.path.dirname(ort.__file__), "training")]
import numpy as np, onnx
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.training import artifacts, onnxblock
from onnxruntime.training.api import CheckpointState, Module, Optimizer

cfg = json.loads(sys.argv[1])
d = cfg["dir"]


def readable_ir(model):
    # onnx >= 1.19 (.venv-ortt has 1.23.2) stamps the models it builds (the optimizer model)
    # with its own IR version (14), which onnxruntime 1.19.2 refuses (max 10); the ops are
    # unchanged
    model.ir_version = min(model.ir_version, 10)
    return model


def finish_artifacts():
    # ends an artifacts step: prints the files made
    path = os.path.join(d, "optimizer_model.onnx")
    onnx.save(readable_ir(onnx.load(path)), path)
    print(json.dumps(sorted(os.listdir(d))))
    sys.exit(0)
"""

# cfg: dir (the checkpoint and optimizer_model.onnx), models (each trains from that checkpoint),
# batch (an .npz: the Module's inputs in the order saved), steps, lr, library (fusecli's, in the
# SessionOptions); optional ops (fused op names whose kernel calls are counted), mem_reuse
# (SessionOptions.enable_mem_reuse, default on), threads (intra-op threads) and against_first
# (a model too large to print its parameters: param_rel, their largest difference from the
# first model's relative to its largest, instead). Prints {model: {losses, params or
# param_rel, calls, median_step_s}}.
TRAIN = r"""
# --- train: the README's loop
import ctypes, time
calls = ctypes.CDLL(cfg["library"])
calls.fusecli_kernel_calls.restype = ctypes.c_int64
calls.fusecli_kernel_calls.argtypes = [ctypes.c_char_p]
calls.fusecli_reset_kernel_calls.restype = None
batch = np.load(cfg["batch"])
out, first = {}, None
for model in cfg["models"]:
    state = CheckpointState.load_checkpoint(os.path.join(d, "checkpoint"))
    so = ort.SessionOptions()
    so.register_custom_ops_library(cfg["library"])
    so.enable_mem_reuse = cfg.get("mem_reuse", True)
    if cfg.get("threads"):
        so.intra_op_num_threads = cfg["threads"]
    module = Module(model, state, session_options=so)
    optimizer = Optimizer(os.path.join(d, "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(cfg["lr"])
    calls.fusecli_reset_kernel_calls()
    module.train()
    losses, times = [], []
    for step in range(cfg["steps"]):
        t = time.perf_counter()
        loss = module(*[batch[n] for n in batch.files])
        optimizer.step()
        module.lazy_reset_grad()
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
    params = module.get_contiguous_parameters().numpy()
    res = {"losses": losses, "median_step_s": float(np.median(times)),
           "calls": {op: calls.fusecli_kernel_calls(op.encode()) for op in cfg.get("ops", [])}}
    if cfg.get("against_first"):
        first = params.copy() if first is None else first
        res["param_rel"] = float(np.abs(params - first).max() / np.abs(first).max())
    else:
        res["params"] = params.tolist()
    out[model] = res
print(json.dumps(out))
"""


def run_ortt(ortt_python: str, script: str, cfg: dict):
    proc = subprocess.run([ortt_python, "-c", script, json.dumps(cfg)], capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
