"""Generate corpus training graphs of one family: `gen.py ort-training|torch-joint [ARCH ...]`.

ort-training (build/venv-corpus-ortt): torch.onnx.export (TorchScript, training mode, opset 16 or `--opset N`,
no constant folding, fixed shapes unless the Arch is symbolic or `--symbolic` asks for symbolic
[batch, sequence] inputs) then onnxruntime.training generate_artifacts(the Arch's loss, AdamW);
training_model.onnx is kept as corpus/ortt_<arch>.onnx.
torch-joint (build/venv-corpus-torch): aot_export_module(trace_joint=True) of (model, its loss),
then torch.onnx.export(dynamo=True), F.scaled_dot_product_attention under SDPBackend.MATH (the
backend whose backward torch 2.13 decomposes on CPU); inputs/outputs renamed like samples/ (parameter names,
'loss', '<param>_grad'); node metadata dropped; corpus/torch_<arch>.onnx.
Parameter values go to corpus/<graph>.params.npz keyed by graph input name; one JSON fragment per
graph goes to build/corpus/ (finish.py merges them into corpus/manifest.yaml).

Dropout: random masks differ between two runs unless seeded, so every random node of the
exported graph (Dropout, RandomUniform(Like), Bernoulli) gets a fixed `seed` attribute; a graph
with dropout then computes the same thing in every fresh session (what `verify` compares).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from contextlib import nullcontext
import io
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "samples"))
from archs import (ARCHS, CE_LABEL_SMOOTHING, Arch, count_notes, decoder_model,  # noqa: E402
                   derive_counts, flash_counts, loss_key, make)
from common import assign_roles, input_specs  # noqa: E402
from gen_torch import cross_entropy  # noqa: E402

ROOT = HERE.parents[1]
CORPUS = ROOT / "corpus"
FRAGS = ROOT / "build" / "corpus"
PREFIX = {"ort-training": "ortt", "torch-joint": "torch"}
OPSET = 16  # the ort-training forward's ONNX opset (gen.py --opset N: an exporter setting sweep)
RANDOM_OPS = {"Dropout", "RandomUniform", "RandomUniformLike", "RandomNormal",
              "RandomNormalLike", "Bernoulli", "BitmaskDropout"}


def seed_random_nodes(m: onnx.ModelProto) -> int:
    n = 0
    for node in m.graph.node:
        if node.op_type in RANDOM_OPS:
            n += 1
            for a in list(node.attribute):
                if a.name == "seed":
                    node.attribute.remove(a)
            int_seed = node.op_type in ("Dropout", "BitmaskDropout")  # Random*: float seed
            node.attribute.append(onnx.helper.make_attribute(
                "seed", 1000 + n if int_seed else float(1000 + n)))
    return n


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for p in ("torch", "transformers", "timm", "torchvision", "onnx", "onnxscript",
              "onnxruntime", "onnxruntime-training-cpu", "numpy"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            pass
    return out


def _data_inputs(arch: Arch, inputs: dict) -> dict[str, list[int] | None]:
    return {n: arch.input_ranges.get(n) for n in inputs}


# --- losses (Arch.loss) ---------------------------------------------------------------------------
# mse: the default. ce: cross-entropy over the last dim of the output with ignore_index -100 (a
# third of the labels ignored) and, in torch-joint, label smoothing (archs.CE_LABEL_SMOOTHING;
# onnxblock's CrossEntropyLoss has none); ce_lm: the same without label smoothing in either
# family (a language model's loss: LinearCrossEntropy's in both); the ort-training labels input is onnxblock's `labels`;
# torch-joint exports it written out (gen_torch.cross_entropy: torch 2.13's joint export of
# F.cross_entropy computes wrong gradients), checked against F.cross_entropy's autograd. bce:
# binary cross-entropy with logits against targets in [0, 1]. custom (ort-training only): a user's
# onnxblock.Block loss (custom_loss.py): the ce loss (ignore_index -100) + LOGIT_PENALTY *
# mean(logits^2); its labels input is `labels` as for ce.

LOGIT_PENALTY = 0.01


def _target(loss: str, out: torch.Tensor) -> torch.Tensor:
    if loss in ("ce", "ce_lm", "custom"):
        labels = torch.randint(0, out.shape[-1], out.shape[:-1])
        labels.view(-1)[::3] = -100
        return labels
    if loss == "bce":
        return torch.rand(out.shape)
    return torch.randn(out.shape)


def _loss_fn(loss: str, family: str, exported: bool = False):
    """The loss as torch computes it (the reference a graph is checked against), or, exported:
    as the torch-joint graph is traced from (the same function, "ce" written out)."""
    if loss in ("ce", "ce_lm"):
        eps = CE_LABEL_SMOOTHING[family] if loss == "ce" else 0.0
        if exported and family == "torch-joint":
            return lambda out, t: cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1),
                                                label_smoothing=eps)
        return lambda out, t: F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1),
                                              ignore_index=-100, label_smoothing=eps)
    if loss == "custom":
        return lambda out, t: (F.cross_entropy(out, t, ignore_index=-100)
                               + LOGIT_PENALTY * out.pow(2).mean())
    if loss == "bce":
        return F.binary_cross_entropy_with_logits
    return F.mse_loss


def _target_name(loss: str, family: str) -> str:
    return "labels" if loss in ("ce", "ce_lm", "custom") and family == "ort-training" else "target"


# --- ort-training -------------------------------------------------------------------------------

def _mask_without_vmap() -> None:
    """transformers builds attention masks with torch.vmap, which the TorchScript exporter
    cannot trace ("unordered_map::at"); its own sdpa_mask_without_vmap builds the same boolean
    mask with plain indexing (eager_mask turns it into the additive finfo.min mask as before)."""
    import transformers.masking_utils as mu
    from transformers.integrations.executorch import sdpa_mask_without_vmap

    mu.sdpa_mask = sdpa_mask_without_vmap
    # attn_implementation "sdpa" looks its mask function up in this registry
    mu.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = sdpa_mask_without_vmap


def build_ortt(arch: Arch, model: torch.nn.Module, inputs: dict, name: str, dest: Path,
               check: bool, dynamic: dict | None = None, loss: str = "mse",
               opset: int = 16) -> dict:
    """dynamic: {input name: {axis: dim name}} (torch.onnx.export's dynamic_axes; the output's
    dims are what the exporter's shape inference makes of them): a graph with symbolic dims.
    opset: the exported forward's ONNX opset (older export scripts use 11 or 12)."""
    from onnx import numpy_helper
    from onnxruntime.training import artifacts
    from onnxruntime.training.onnxblock import _graph_utils as onnxblock_graph_utils

    if arch.library == "transformers":
        _mask_without_vmap()

    f = io.BytesIO()
    torch.onnx.export(model, tuple(inputs.values()), f, input_names=list(inputs),
                      output_names=["output"], opset_version=opset, do_constant_folding=False,
                      training=torch.onnx.TrainingMode.TRAINING, dynamo=False,
                      dynamic_axes=dynamic or None)
    fwd = onnx.load_from_string(f.getvalue())
    named = dict(model.named_parameters())
    inits = {i.name: i for i in fwd.graph.initializer}
    trainable = [n for n, p in named.items() if p.requires_grad and n in inits]
    missing = [n for n, p in named.items() if p.requires_grad and n not in inits]
    assert not missing, f"{name}: parameters not exported under their names: {missing}"
    frozen = [n for n in inits if n not in trainable]
    values = {n: numpy_helper.to_array(inits[n]) for n in inits}
    # onnxblock names the loss block's tensors from a process-wide counter: reset it so that
    # a graph comes out the same whether it is built alone or after others
    onnxblock_graph_utils._GRAPH_TOKEN = 0
    with tempfile.TemporaryDirectory() as td:
        artifacts.generate_artifacts(fwd, requires_grad=trainable, frozen_params=frozen,
                                     loss=_ortt_loss(loss),
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=td)
        m = onnx.load(Path(td) / "training_model.onnx")
    n_random = seed_random_nodes(m)
    specs = input_specs(m)
    names = {s["name"] for s in specs}
    kept = {n: v for n, v in values.items() if n in names}
    assign_roles(specs, set(trainable), set(frozen), _data_inputs(arch, inputs))
    err = _check_ortt(m, model, inputs, kept, specs, loss, name) if check else None
    onnx.save(m, dest / f"{name}.onnx")  # only a graph that passed the check
    np.savez(dest / f"{name}.params.npz", **kept)
    return {"runtime": "onnxruntime-training", "loss_output": m.graph.output[0].name,
            "inputs": specs, "random_nodes": n_random, "model": m,
            "max_abs_grad_err_vs_torch": err}


def _run_ort(m: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})))


def _ortt_loss(loss: str):
    from onnxruntime.training import artifacts, onnxblock

    if loss in ("ce", "ce_lm"):
        return onnxblock.loss.CrossEntropyLoss(ignore_index=-100)
    if loss == "custom":
        from custom_loss import TokenCrossEntropyWithLogitPenalty

        return TokenCrossEntropyWithLogitPenalty(LOGIT_PENALTY)
    if loss == "bce":
        return artifacts.LossType.BCEWithLogitsLoss
    return artifacts.LossType.MSELoss


def _torch_ref(model, inputs: dict, target: torch.Tensor, fn=F.mse_loss) -> tuple[float, dict]:
    model.zero_grad()
    loss = fn(model(*inputs.values()), target)
    loss.backward()
    return float(loss), {n: p.grad.numpy() for n, p in model.named_parameters()
                         if p.requires_grad}


# The generation check: a graph whose loss or one of whose gradients differs from torch autograd
# by more than GRAD_ATOL + GRAD_RTOL * (that tensor's max |torch value|) is not written, so that a
# wrong export never enters the corpus (torch 2.13's joint export of F.cross_entropy: 40.1 on
# llama_ce_loss; `verify` cannot see it, it compares against the same wrong graph). Every corpus
# graph meets it (max_abs_grad_err_vs_torch at most 1.3e-4; the two above GRAD_ATOL, ortt_tv_vit
# and ortt_timm_resnet, reach 0.0016 and 0.015 of their per-tensor limit at 1e-3). The limit is
# 1e-2 of the tensor's scale: float32 rounding across a deep BatchNorm network reaches 1.3e-3 of
# it (the bench-size MobileNetV2 of BENCHMARKS (h): 2.9e-4 on a gradient of max 0.215), while a
# wrong export is off by its own size (the F.cross_entropy one: 40.1 on a scale of 4.45).
GRAD_RTOL, GRAD_ATOL = 1e-2, 1e-5


def _check_vs_torch(name: str, pairs: dict[str, tuple[np.ndarray, np.ndarray]]) -> float:
    """pairs: tensor -> (the graph's value, torch's). Returns max |graph - torch| over all;
    raises ValueError naming the tensors beyond the limit (NaN included)."""
    err, bad = 0.0, []
    for t, (got, ref) in pairs.items():
        got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
        e = float(np.abs(got - ref).max(initial=0.0))
        scale = float(np.abs(ref).max(initial=0.0))
        err = max(err, e)
        if not e <= GRAD_ATOL + GRAD_RTOL * scale:
            bad.append(f"{t}: {e:.3g} (max |torch| {scale:.3g})")
    if bad:
        raise ValueError(f"{name}: loss/gradients differ from torch autograd by more than "
                         f"{GRAD_ATOL:g} + {GRAD_RTOL:g} max|torch| (a wrong export?): "
                         + "; ".join(bad[:4]) + (f"; {len(bad) - 4} more" if len(bad) > 4 else ""))
    return err


def _check_ortt(m, model, inputs, values, specs, loss: str = "mse", name: str = "") -> float:
    target = _target(loss, model(*inputs.values()))
    feeds = {**{k: v.numpy() for k, v in inputs.items()},
             _target_name(loss, "ort-training"): target.numpy(),
             "lazy_reset_grad": np.ones([1], np.bool_)}
    for s in specs:
        if s["role"] in ("parameter", "frozen_parameter"):
            feeds[s["name"]] = values[s["name"]].copy()
        elif s["role"] == "grad_buffer":
            p = s["name"].removesuffix("_grad.accumulation.buffer")
            feeds[s["name"]] = np.zeros(values[p].shape, np.float32)
    out = _run_ort(m, feeds)
    loss, grads = _torch_ref(model, inputs, target, _loss_fn(loss, "ort-training"))
    return _check_vs_torch(name, {
        "loss": (out[m.graph.output[0].name], loss),
        **{f"{n}_grad": (feeds[f"{n}_grad.accumulation.buffer"], g) for n, g in grads.items()}})


# --- torch-joint ------------------------------------------------------------------------------

class MSELoss(torch.nn.Module):
    """(loss,) of the net's output against the last argument; `fn`: the loss (MSE default)."""

    def __init__(self, net: torch.nn.Module, fn=F.mse_loss) -> None:
        super().__init__()
        self.net = net
        self.fn = fn

    def forward(self, *args):
        *inputs, target = args
        return (self.fn(self.net(*inputs), target),)


def build_torch(arch: Arch, model: torch.nn.Module, inputs: dict, name: str, dest: Path,
                check: bool, optimize: bool = True, dynamic: dict | None = None,
                loss: str = "mse") -> dict:
    """dynamic: {input name: {axis: dim name}}: symbolic dims (the target gets the first
    symbolic input's; flattened token labels are fed unflattened, [batch, sequence])."""
    from gen_torch import export_joint

    target = _target(loss, model(*inputs.values()))
    mod = MSELoss(model, _loss_fn(loss, "torch-joint", exported=True))
    dyn = None
    if dynamic:
        key = next(k for k in inputs if k in dynamic)
        first, axes = inputs[key], dynamic[key]
        if loss in ("ce", "ce_lm") and target.dim() == 1 and target.numel() == first.numel():
            # token labels of flattened logits: fed as the ids' [batch, sequence] (HF models
            # take them so); the target's symbolic axes are those where it has the ids' size
            target = target.reshape(first.shape)
        same = {a: n for a, n in axes.items()
                if a < target.dim() and target.shape[a] == first.shape[a]}
        dyn = [dynamic.get(k) for k in inputs] + [same]
    m, values, trainable = export_joint(mod, [*inputs.values(), target], [*inputs, "target"],
                                        metadata=False, optimize=optimize, dynamic=dyn)
    n_random = seed_random_nodes(m)
    specs = input_specs(m)
    assign_roles(specs, trainable, set(values) - trainable, _data_inputs(arch, inputs))
    err = None
    if check:
        out = _run_ort(m, {**values, **{k: v.numpy() for k, v in inputs.items()},
                           "target": target.numpy()})
        ref_loss, ref = _torch_ref(model, inputs, target, _loss_fn(loss, "torch-joint"))
        err = _check_vs_torch(name, {"loss": (out["loss"], ref_loss),
                                     **{n + "_grad": (out[n + "_grad"], g)
                                        for n, g in ref.items()}})
    onnx.save(m, dest / f"{name}.onnx")  # only a graph that passed the check
    np.savez(dest / f"{name}.params.npz", **values)
    return {"runtime": "onnxruntime", "loss_output": "loss", "inputs": specs,
            "gradient_outputs": [o.name for o in m.graph.output][1:], "random_nodes": n_random,
            "model": m, "max_abs_grad_err_vs_torch": err}


def write_fixture(family: str, model: torch.nn.Module, inputs: dict, name: str, dest: Path,
                  input_ranges: dict | None = None, **kw) -> dict:
    """A test fixture: `model` on `inputs` exported by this family's builder (checked against
    torch autograd) as dest/{ortt|torch}_{name}.onnx, its size and error printed; kw: the
    builder's (opset, ...). Returns the builder's result."""
    import shutil
    import types

    arch = types.SimpleNamespace(library="torch", input_ranges=input_ranges or {})
    builder = build_ortt if family == "ort-training" else build_torch
    full = f"{PREFIX[family]}_{name}"
    with tempfile.TemporaryDirectory() as td:
        res = builder(arch, model, inputs, full, Path(td), True, **kw)
        shutil.copy(Path(td) / f"{full}.onnx", dest / f"{full}.onnx")
    print(f"{full}.onnx: {len(res['model'].graph.node)} nodes, max |grad - torch| = "
          f"{res['max_abs_grad_err_vs_torch']:.3g}")
    return res


def build(family: str, arch: Arch) -> None:
    name = f"{PREFIX[family]}_{arch.name}"
    torch.manual_seed(0)
    model, inputs = make(arch, family)
    expected = flash_counts(arch, derive_counts(model, tuple(inputs.values()), arch.attention,
                                                loss_key(arch.loss, family)))
    # symbolic: ids and masks [batch, sequence], images [batch, ...] (their channels and size fixed)
    dynamic = ({k: {0: "batch", 1: "sequence"} if v.dim() == 2 else {0: "batch"}
                for k, v in inputs.items() if v.dim() >= 2} if arch.symbolic else None)
    builder = functools.partial(functools.partial(build_ortt, opset=OPSET)
                                if family == "ort-training" else
                                functools.partial(build_torch, optimize=arch.optimize),
                                dynamic=dynamic, loss=arch.loss)
    if arch.dropout:
        err = dropout_twin_error(builder, arch, model, inputs)
    torch.manual_seed(0)
    res = builder(arch, model, inputs, name, CORPUS, not arch.dropout)
    m = res.pop("model")
    if not arch.dropout:
        err = res["max_abs_grad_err_vs_torch"]
    entry = {
        "file": f"{name}.onnx", "family": family, "architecture": arch.name,
        "library": arch.library, "setup": arch.setup, "description": arch.description,
        "loss": arch.loss,
        "params": f"{name}.params.npz", "expected": expected,
        "expected_from": count_notes(arch), "nodes": len(m.graph.node),
        "ir_version": m.ir_version, "versions": _versions(),
        **res, "max_abs_grad_err_vs_torch": None if err is None else float(f"{err:.3g}"),
    }
    FRAGS.mkdir(parents=True, exist_ok=True)
    (FRAGS / f"{name}.json").write_text(json.dumps(entry, indent=1))
    size = (CORPUS / entry["file"]).stat().st_size + (CORPUS / entry["params"]).stat().st_size
    print(f"{name}: {len(m.graph.node)} nodes, {size // 1024} KB, expected "
          f"{ {k: v for k, v in expected.items() if v} }, random nodes {res['random_nodes']}, "
          f"max |grad - torch| = {err if err is None else f'{err:.3g}'}", flush=True)


def build_raw(layers: int, dest: Path) -> None:
    """The optimiser scale check's input (not committed): a Llama-style model of `layers`
    layers exported raw, torch.onnx.export(dynamo=True, optimize=False), as people export big
    models (the exporter's optimizer is superlinear): constants stay small constant subgraphs."""
    torch.manual_seed(0)
    arch = ARCHS["llama"]
    model = decoder_model("Llama", 2, layers=layers)("torch-joint")
    inputs = arch.inputs()
    model.arg_names = tuple(inputs)
    dest.mkdir(parents=True, exist_ok=True)
    name = f"torch_llama_raw_L{layers}"
    expected = flash_counts(ARCHS["llama_raw"],
                            derive_counts(model, tuple(inputs.values()), arch.attention))
    res = build_torch(arch, model, inputs, name, dest, False, optimize=False)
    nodes = len(res["model"].graph.node)
    # read by the benchmark suite's optimiser table (fusecli/bench/optimizer.py)
    (dest / f"{name}.json").write_text(json.dumps(
        {"file": f"{name}.onnx", "layers": layers, "nodes": nodes, "expected": expected,
         "versions": _versions()}, indent=1))
    print(f"{dest / name}.onnx: {nodes} nodes, expected {expected}", flush=True)


def dropout_twin_error(builder, arch, model: torch.nn.Module, inputs: dict) -> float:
    """torch and onnxruntime draw different dropout masks, so an export with dropout is checked
    through its twin: the same model with every dropout probability 0 (the same graph
    otherwise), exported by ``builder`` into a temporary folder and compared with torch
    autograd. Returns the twin's max |gradient - torch|; raises when it differs."""
    twin = copy.deepcopy(model)
    for mod in twin.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    with tempfile.TemporaryDirectory() as td:
        torch.manual_seed(0)
        return builder(arch, twin, inputs, "twin", Path(td), True)["max_abs_grad_err_vs_torch"]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--raw"]:  # gen.py --raw LAYERS [LAYERS ...] (into build/corpus-scale)
        for n in argv[1:]:
            build_raw(int(n), ROOT / "build" / "corpus-scale")
        return 0
    global CORPUS, FRAGS, OPSET
    if argv[:1] == ["--out"]:  # gen.py --out DIR FAMILY [ARCH ...]: graphs and fragments in DIR
        CORPUS = FRAGS = ROOT / argv[1]
        argv = argv[2:]
    if argv[:1] == ["--opset"]:  # ... --opset N ort-training [ARCH ...]: the forward's opset
        OPSET = int(argv[1])
        argv = argv[2:]
    symbolic = argv[:1] == ["--symbolic"]  # ... --symbolic FAMILY [ARCH ...]: Arch.symbolic on
    argv = argv[1:] if symbolic else argv
    family, names = argv[0], argv[1:]
    CORPUS.mkdir(parents=True, exist_ok=True)
    failed = []
    for n in names or [a for a in ARCHS if family in ARCHS[a].families
                       and not ARCHS[a].extra]:
        arch = ARCHS[n]
        if family not in arch.families:
            continue
        if symbolic:  # an exporter setting sweep: symbolic [batch, sequence] inputs
            arch = dataclasses.replace(arch, symbolic=True)
        try:
            # torch-joint: F.scaled_dot_product_attention through the math backend, the one whose
            # backward torch 2.13's dynamo exporter decomposes on CPU (eager attention calls none)
            with (sdpa_kernel([SDPBackend.MATH]) if family == "torch-joint" else nullcontext()):
                build(family, arch)
        except Exception as exc:  # noqa: BLE001 - report every architecture, fail at the end
            import traceback

            traceback.print_exc()
            print(f"{PREFIX[family]}_{n}: FAILED: {type(exc).__name__}: "
                  f"{str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
            failed.append(n)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
