"""Generate the ort-training samples (run in build/venv-gen-ortt).

torch.onnx.export (TorchScript, training mode, opset 16, no constant folding) then
onnxruntime.training.artifacts.generate_artifacts(AdamW); only training_model.onnx is kept,
renamed to samples/<name>.onnx, with the parameter values (forward initializers) in
samples/<name>.params.npz keyed by graph input name.
"""
from __future__ import annotations

import io
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from onnxruntime.training import artifacts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAMPLES, assign_roles, input_specs, run_jobs, write_fragment  # noqa: E402
import models as M  # noqa: E402
from models import CNN, MLP, SEQ, D_MODEL, Block  # noqa: E402


def export(model: torch.nn.Module, x: torch.Tensor, dyn: dict) -> onnx.ModelProto:
    f = io.BytesIO()
    torch.onnx.export(
        model, (x,), f, input_names=["input"], output_names=["output"], opset_version=16,
        do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING,
        dynamic_axes=dyn, dynamo=False,
    )
    return onnx.load_from_string(f.getvalue())


def build(name: str, model: torch.nn.Module, x: torch.Tensor, loss: str, desc: str,
          num_classes: int | None = None, out_dir: Path | None = None) -> None:
    """out_dir None: the shipped samples (samples/, fragment in build/samples); else a benchmark
    copy written to out_dir with its manifest-style entry in out_dir/<name>.json."""
    dest = out_dir or SAMPLES
    torch.manual_seed(0)
    fwd = export(model, x, {"input": {0: "batch"}, "output": {0: "batch"}})
    params = dict(model.named_parameters())
    inits = {i.name: i for i in fwd.graph.initializer}
    requires_grad = [n for n in params if n in inits]
    missing = [n for n in params if n not in inits]
    assert not missing, f"{name}: parameters not exported under their names: {missing}"
    frozen = [n for n in inits if n not in params]  # BN running stats, masks, ...
    values = {n: numpy_helper.to_array(inits[n]) for n in inits}
    lt = artifacts.LossType.CrossEntropyLoss if loss == "cross_entropy" else artifacts.LossType.MSELoss
    with tempfile.TemporaryDirectory() as td:
        artifacts.generate_artifacts(
            fwd, requires_grad=requires_grad, frozen_params=frozen, loss=lt,
            optimizer=artifacts.OptimType.AdamW, artifact_directory=td,
        )
        shutil.copyfile(Path(td) / "training_model.onnx", dest / f"{name}.onnx")
    m = onnx.load(dest / f"{name}.onnx")
    specs = input_specs(m)
    names = {s["name"] for s in specs}
    np.savez(dest / f"{name}.params.npz", **{n: v for n, v in values.items() if n in names})
    assign_roles(specs, set(requires_grad), set(frozen), {"input": None}, [0, num_classes])
    err = verify(m, model, x, values, specs, loss, num_classes)
    g = m.graph
    entry = {
        "file": f"{name}.onnx", "family": "ort-training", "runtime": "onnxruntime-training",
        "description": desc, "loss": loss, "loss_output": g.output[0].name,
        "params": f"{name}.params.npz", "inputs": specs,
        "patterns": dict(model.PATTERNS), "nodes": len(g.node), "ir_version": m.ir_version,
        "zero_grad_params": list(getattr(model, "ZERO_GRAD", [])),
        "max_abs_grad_err_vs_torch": float(f"{err:.3g}"),
    }
    if num_classes:
        entry["num_classes"] = num_classes
    if out_dir is not None:
        import json

        entry["dims"] = {"batch": int(x.shape[0])}
        (out_dir / f"{name}.json").write_text(json.dumps(entry, indent=1))
    else:
        write_fragment(name, entry)
    print(f"{name}: {len(g.node)} nodes, ir {m.ir_version}, inputs {len(specs)}, "
          f"max |grad - torch| = {err:.3g}")


def verify(m: onnx.ModelProto, model: torch.nn.Module, x: torch.Tensor, values: dict,
           specs: list[dict], loss: str, num_classes: int | None) -> float:
    """Run the training graph in onnxruntime-training; compare loss and grads with autograd."""
    import onnxruntime as ort

    rng = np.random.default_rng(1)
    xv = x.numpy()
    feeds: dict[str, np.ndarray] = {}
    for s in specs:
        n = s["name"]
        if n == "input":
            feeds[n] = xv
        elif s["role"] in ("parameter", "frozen_parameter"):
            feeds[n] = values[n].copy()
        elif s["role"] == "grad_buffer":
            feeds[n] = np.zeros(values[n.removesuffix("_grad.accumulation.buffer")].shape, np.float32)
        elif s["role"] == "flag":
            feeds[n] = np.ones([1], np.bool_)
        elif s["role"] == "labels":
            feeds[n] = rng.integers(0, num_classes, size=[xv.shape[0]]).astype(np.int64)
        else:
            feeds[n] = rng.standard_normal(model(x).shape).astype(np.float32)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    out = sess.run(None, feeds)
    model.zero_grad()
    y = model(x)
    if loss == "cross_entropy":
        ref = torch.nn.functional.cross_entropy(y, torch.from_numpy(feeds["labels"]))
    else:
        ref = torch.nn.functional.mse_loss(y, torch.from_numpy(feeds["target"]))
    ref.backward()
    err = abs(float(out[0]) - float(ref))
    for n, p in model.named_parameters():
        g = feeds[f"{n}_grad.accumulation.buffer"]
        err = max(err, float(np.abs(g - p.grad.numpy()).max()))
    return err


def main_bench(out_dir: Path, which: list[str]) -> None:
    """Benchmark-size copies of the samples (same code, bigger models) into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    B, S, D = M.BENCH_BLOCK_BATCH, M.BENCH_BLOCK["seq"], M.BENCH_BLOCK["d_model"]
    hw = M.BENCH_CNN_HW
    jobs = {
        "ortt_mlp": lambda: build(
            "ortt_mlp", MLP(**M.BENCH_MLP), torch.randn(M.BENCH_MLP_BATCH, M.BENCH_MLP["inp"]),
            "mse", f"ortt_mlp at bench size {M.BENCH_MLP}, batch {M.BENCH_MLP_BATCH}",
            out_dir=out_dir),
        "ortt_block": lambda: build(
            "ortt_block", Block("explicit", **M.BENCH_BLOCK), torch.randn(B, S, D), "mse",
            f"ortt_block at bench size {M.BENCH_BLOCK}, batch {B}", out_dir=out_dir),
        "ortt_block_sdpa": lambda: build(
            "ortt_block_sdpa", Block("sdpa", **M.BENCH_BLOCK), torch.randn(B, S, D), "mse",
            f"ortt_block_sdpa at bench size {M.BENCH_BLOCK}, batch {B}", out_dir=out_dir),
        "ortt_block_mul": lambda: build(
            "ortt_block_mul", Block("mul", **M.BENCH_BLOCK), torch.randn(B, S, D), "mse",
            f"ortt_block_mul at bench size {M.BENCH_BLOCK}, batch {B}", out_dir=out_dir),
        "ortt_cnn": lambda: build(
            "ortt_cnn", CNN(**M.BENCH_CNN), torch.randn(M.BENCH_CNN_BATCH, 3, hw, hw),
            "cross_entropy", f"ortt_cnn at bench size {M.BENCH_CNN}, {hw}x{hw}, batch "
            f"{M.BENCH_CNN_BATCH}", num_classes=CNN.NUM_CLASSES, out_dir=out_dir),
        "ortt_llama": lambda: build(
            "ortt_llama", M.LlamaStack(D), torch.randn(B, S, D), "mse",
            f"ortt_llama at bench size d={D}, seq {S}, batch {B}", out_dir=out_dir),
    }
    # real-size models: only when named
    rb, rhw = M.REAL_RESNET50_BATCH, M.REAL_RESNET50_HW
    real = {
        "ortt_resnet50": lambda: build(
            "ortt_resnet50", M.ResNet50(), torch.randn(rb, 3, rhw, rhw), "cross_entropy",
            f"ResNet-50 (plain torch, torchvision layout) on {rhw}x{rhw}, batch {rb}",
            num_classes=M.ResNet50.NUM_CLASSES, out_dir=out_dir),
    }
    run_jobs({**jobs, **real}, which or list(jobs), lambda: torch.manual_seed(0))


def main(which: list[str]) -> None:
    if which[:1] == ["--bench"]:
        return main_bench(Path(which[1]), which[2:])
    SAMPLES.mkdir(exist_ok=True)
    jobs = {
        "ortt_mlp": lambda: build(
            "ortt_mlp", MLP(), torch.randn(2, MLP.IN), "mse",
            "MLP [B,16]: Linear+ReLU, Linear+GELU(erf), Linear+SiLU, Linear(bias=False)+ReLU, Linear; MSE."),
        "ortt_block": lambda: build(
            "ortt_block", Block("explicit"), torch.randn(2, SEQ, D_MODEL), "mse",
            "Pre-LN transformer block [B,8,32], 2 heads: separate q/k/v Linears, explicit attention "
            "(q@k^T Div sqrt(16), + additive causal mask, softmax, @v), o-proj, LayerNorms, "
            "Linear+GELU MLP, residual adds; MSE."),
        "ortt_block_sdpa": lambda: build(
            "ortt_block_sdpa", Block("sdpa"), torch.randn(2, SEQ, D_MODEL), "mse",
            "Pre-LN block as ortt_block but fused QKV Linear(32->96)+chunk(3) and "
            "F.scaled_dot_product_attention(is_causal=True); MSE."),
        "ortt_block_mul": lambda: build(
            "ortt_block_mul", Block("mul"), torch.randn(2, SEQ, D_MODEL), "mse",
            "Pre-LN block as ortt_block but the scale is a multiply (q * 16**-0.5) before q@k^T "
            "and the causal mask is masked_fill(-inf) (Where); MSE."),
        "ortt_cnn": lambda: build(
            "ortt_cnn", CNN(), torch.randn(2, 3, 8, 8), "cross_entropy",
            "CNN [B,3,8,8]: Conv(no bias)+BN+ReLU, Conv+BN+ReLU, plus a 1x1 Conv+BN shortcut "
            "WITHOUT ReLU added to it, MaxPool 2x2, mean(H,W), Linear(8->4); cross-entropy.",
            num_classes=CNN.NUM_CLASSES),
        # variants (rules/act_gelu_tanh_grad_ortt.yaml, linear_gelu_tanh_ortt_*.yaml)
        "ortt_v_gelutanh": lambda: build(
            "ortt_v_gelutanh", M.GeluTanhMLP(), torch.randn(2, 4, 8), "mse",
            "GPT-2 style MLP [B,4,8] with GELU(approximate='tanh'): Linear(8->32)+GELU(tanh) on "
            "the 3-D input (MatMul), reshape to [B*4,32], Linear(32->8)+GELU(tanh) (2-D: Gemm), "
            "Linear(8->8), reshape back; MSE."),
        "ortt_llama": lambda: build(
            "ortt_llama", M.LlamaStack(), torch.randn(2, SEQ, D_MODEL), "mse",
            "Llama-style pre-norm residual layers [B,8,32] with RMSNorm (x * rsqrt(mean(x^2) + "
            "1e-6) * weight; ORT fuses it into SimplifiedLayerNormalization): x + Linear(rms(x)) "
            "five times (rsqrt with weight over the input; rsqrt with and without weight, "
            "x / sqrt(...) with and without weight), final RMSNorm; MSE."),
    }
    run_jobs(jobs, which, lambda: torch.manual_seed(0))


if __name__ == "__main__":
    main(sys.argv[1:])
