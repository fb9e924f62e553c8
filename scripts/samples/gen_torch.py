"""Generate the torch-joint samples (run in build/venv-gen-torch: torch 2.13, onnx, onnxscript).

aot_export_module(loss_module, [x, target], trace_joint=True, output_loss_index=0) gives one FX
graph with forward and backward (inputs: parameters, buffers, user inputs; outputs: loss, then the
parameter gradients); torch.onnx.export(gm, dynamo=True) turns it into standard ONNX ops.
Graph inputs/outputs are renamed to the parameter names / 'loss' / '<param>_grad', parameter
(and buffer) values are stored in samples/<name>.params.npz, ir_version is set to 10.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from torch._functorch.aot_autograd import aot_export_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAMPLES, input_specs, run_jobs, write_fragment  # noqa: E402
import models as M  # noqa: E402
from models import MLP, SEQ, D_MODEL, Block  # noqa: E402

IR_VERSION = 10


class MSELossModule(torch.nn.Module):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, target: torch.Tensor):
        return (F.mse_loss(self.net(x), target),)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> torch.Tensor:
    """F.cross_entropy(logits [N, C], labels [N], ignore_index=-100, reduction, label_smoothing)
    written out as Hugging Face's loss does: log_softmax, the -100 mask (an ignored label
    replaced by 0), gather of the label's log-probability, the sum over kept tokens [/ their
    count]; with label smoothing eps, (1 - eps) nll + eps * (the mean over classes of
    -log_softmax, masked and reduced the same way). torch 2.13's joint export of F.cross_entropy
    itself computes wrong gradients (shared/notes/training-graphs.md); this one exports right."""
    lp = torch.log_softmax(logits, -1)
    mask = labels != -100
    safe = torch.where(mask, labels, torch.zeros_like(labels))

    def reduce(per_token: torch.Tensor) -> torch.Tensor:
        return per_token.sum() if reduction == "sum" else per_token.sum() / mask.sum()

    loss = reduce(-lp.gather(1, safe[:, None]).squeeze(1) * mask)
    if label_smoothing:
        loss = ((1 - label_smoothing) * loss
                + label_smoothing * reduce(-lp.mean(-1) * mask))
    return loss


def _rename(model: onnx.ModelProto, mapping: dict[str, str]) -> None:
    g = model.graph
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.name in mapping:
            vi.name = mapping[vi.name]
    for n in g.node:
        for i, t in enumerate(n.input):
            if t in mapping:
                n.input[i] = mapping[t]
        for i, t in enumerate(n.output):
            if t in mapping:
                n.output[i] = mapping[t]


def _symbolic_joint(mod: torch.nn.Module, args: list[torch.Tensor], dynamic: list[dict | None]):
    """The joint graph with symbolic dims: torch.export.export(mod, dynamic_shapes) first, then
    (every dim at most 16, the corpus models' position tables) aot_export_module on its module
    under the export's fake mode, with the user inputs' symbolic fake tensors
    (aot_export_module on real tensors specialises every size).
    Returns (graph module, signature, the exported module, dynamic_shapes of the joint's inputs)."""
    from torch._guards import detect_fake_mode
    from torch.export import Dim

    made: dict[str, Dim] = {}
    spec = [None if d is None else {a: made.setdefault(n, Dim(n, max=16))
                                    for a, n in d.items()} for d in dynamic]
    ep = torch.export.export(mod, tuple(args), dynamic_shapes=(tuple(spec),), strict=False)
    users = set(ep.graph_signature.user_inputs)
    fake = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder" and n.name in users]
    pm = ep.module()
    # a tied parameter (a head tied to the embedding): the unlifted module reads it under each
    # name, and aot_export_module gives the names it does not keep no gradient; read it under
    # its first name only (the one aot_export_module keeps for the original module)
    aliases: dict[int, list[str]] = {}
    for n, p in mod.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    for keep, *rest in (a for a in aliases.values() if len(a) > 1):
        for node in pm.graph.nodes:
            if node.op == "get_attr" and node.target in rest:
                node.target = keep
        for n in rest:
            owner, _, leaf = n.rpartition(".")
            delattr(pm.get_submodule(owner), leaf)
    pm.recompile()
    with detect_fake_mode(fake):
        gm, sig = aot_export_module(pm, fake, trace_joint=True, output_loss_index=0)
    n_state = len(sig.parameters) + len(sig.buffers)
    return gm, sig, pm, tuple([None] * n_state + spec)


def export_joint(mod: torch.nn.Module, args: list[torch.Tensor], arg_names: list[str],
                 metadata: bool = True, optimize: bool = True,
                 dynamic: list[dict | None] | None = None) -> tuple[onnx.ModelProto, dict, set]:
    """aot_export_module(trace_joint=True) of `mod` (its forward returns (loss,)) on `args`, then
    torch.onnx.export(dynamo=True, optimize=optimize). Graph inputs are renamed to the parameter
    and buffer names (without the 'net.' prefix) and `arg_names`, outputs to 'loss' and
    '<param>_grad'; node metadata loses its stack traces (absolute build paths), or everything
    with metadata=False (FX provenance, ~2/3 of the file); ir_version 10; checked.
    Returns (model, {input name: parameter/buffer value}, names of the trainable parameters)."""
    dyn_shapes = None
    if dynamic:
        gm, sig, src, dyn_shapes = _symbolic_joint(mod, list(args), dynamic)
    else:
        gm, sig = aot_export_module(mod, list(args), trace_joint=True, output_loss_index=0)
        src = mod
    named = {**dict(src.named_parameters(remove_duplicate=False)),
             **dict(src.named_buffers(remove_duplicate=False))}  # tied weights: every name
    order = list(sig.parameters) + list(sig.buffers)
    flat = [named[n].detach().clone() for n in order] + list(args)
    with tempfile.TemporaryDirectory() as td:
        prog = torch.onnx.export(gm, tuple(flat), dynamo=True, optimize=optimize, verbose=False,
                                 dynamic_shapes=dyn_shapes)
        prog.save(str(Path(td) / "m.onnx"))
        m = onnx.load(str(Path(td) / "m.onnx"))
    g = m.graph
    in_names = [i.name for i in g.input if i.name not in {t.name for t in g.initializer}]
    assert len(in_names) == len(flat), (in_names, len(flat))
    short = [n.removeprefix("net.") for n in order]
    mapping = dict(zip(in_names, short + list(arg_names)))
    grads = sig.backward_signature.gradients_to_parameters  # grad output name -> param name
    fx_out = [n for n in sig.user_outputs] + list(grads)
    assert len(g.output) == len(fx_out), ([o.name for o in g.output], fx_out)
    mapping[g.output[0].name] = "loss"
    for o, fx in zip(list(g.output)[1:], list(grads)):
        mapping[o.name] = grads[fx].removeprefix("net.") + "_grad"
    _rename(m, mapping)
    tied = _merge_tied(m, {s: named[n] for s, n in zip(short, order)})
    for node in m.graph.node:
        keep = [(p.key, p.value) for p in node.metadata_props
                if metadata and p.key != "pkg.torch.onnx.stack_trace"]
        del node.metadata_props[:]
        for k, v in keep:
            node.metadata_props.add(key=k, value=v)
    m.ir_version = IR_VERSION
    onnx.checker.check_model(m)
    values = {s: named[n].detach().numpy() for s, n in zip(short, order) if s not in tied}
    grad = {n: p.requires_grad for n, p in mod.named_parameters()}  # ep.module() may lose it
    trainable = {n.removeprefix("net.") for n in sig.parameters if grad.get(n, True)} - tied
    return m, values, trainable


def _merge_tied(m: onnx.ModelProto, params: dict[str, torch.Tensor]) -> set[str]:
    """Tied weights (one tensor under two names: a language-model head tied to the token
    embedding): aot_export_module traces each name as its own parameter input with its own
    gradient output, each gradient only its own use's share. Make them one input (the first
    name) whose gradient is the sum of the shares, as autograd computes it. Returns the alias
    names dropped (no graph has them after this; a model without tied weights is unchanged)."""
    g = m.graph
    first: dict[int, str] = {}
    alias: dict[str, str] = {}
    for name, t in params.items():
        alias_of = first.setdefault(id(t), name)
        if alias_of != name:
            alias[name] = alias_of
    if not alias:
        return set()
    for node in g.node:
        for i, t in enumerate(node.input):
            if t in alias:
                node.input[i] = alias[t]
    for vi in [i for i in g.input if i.name in alias]:
        g.input.remove(vi)
    outs = {o.name: o for o in g.output}
    producer = {t: node for node in g.node for t in node.output}
    for a, keep in alias.items():
        ga, gk = f"{a}_grad", f"{keep}_grad"
        if ga not in outs:
            continue
        if gk not in outs:  # only the alias's use trains: its gradient is the whole one
            _rename_output(producer[ga], ga, gk)
            outs[ga].name = gk
            continue
        _rename_output(producer[ga], ga, ga + "_share")
        _rename_output(producer[gk], gk, gk + "_share")
        g.node.append(onnx.helper.make_node("Add", [gk + "_share", ga + "_share"], [gk],
                                            name=f"tied_grad_sum_{keep}"))
        g.output.remove(outs[ga])
    return set(alias)


def _rename_output(node: onnx.NodeProto, old: str, new: str) -> None:
    for i, t in enumerate(node.output):
        if t == old:
            node.output[i] = new


def build(name: str, net: torch.nn.Module, x: torch.Tensor, target: torch.Tensor, desc: str,
          out_dir: Path | None = None, metadata: bool = True) -> None:
    """out_dir None: the shipped samples; else a benchmark copy (entry in out_dir/<name>.json).
    metadata False: drop every node's metadata_props to keep the variant samples small."""
    dest = out_dir or SAMPLES
    mod = MSELossModule(net)
    m, values, pnames = export_joint(mod, [x, target], ["input", "target"], metadata)
    onnx.save(m, dest / f"{name}.onnx")
    np.savez(dest / f"{name}.params.npz", **values)
    err = verify(m, mod, x, target, values)
    specs = input_specs(m)
    for s in specs:
        n = s["name"]
        s["role"] = ("data" if n == "input" else "target" if n == "target" else
                     "parameter" if n in pnames else "frozen_parameter")
    entry = {
        "file": f"{name}.onnx", "family": "torch-joint", "runtime": "onnxruntime",
        "description": desc, "loss": "mse", "loss_output": "loss",
        "params": f"{name}.params.npz", "inputs": specs,
        "gradient_outputs": [o.name for o in m.graph.output][1:],
        "patterns": dict(net.PATTERNS), "nodes": len(m.graph.node), "ir_version": m.ir_version,
        "zero_grad_params": list(getattr(net, "ZERO_GRAD", [])),
        "max_abs_grad_err_vs_torch": float(f"{err:.3g}"),
    }
    if out_dir is not None:
        import json

        (out_dir / f"{name}.json").write_text(json.dumps(entry, indent=1))
    else:
        write_fragment(name, entry)
    print(f"{name}: {len(m.graph.node)} nodes, ir {m.ir_version}, inputs {len(specs)}, "
          f"functions {len(m.functions)}, max |grad - torch| = {err:.3g}")


def verify(m: onnx.ModelProto, mod: torch.nn.Module, x: torch.Tensor, target: torch.Tensor,
           values: dict) -> float:
    """Run the joint graph in stock onnxruntime and compare loss and grads with autograd."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {**values, "input": x.numpy(), "target": target.numpy()}
    names = [o.name for o in sess.get_outputs()]
    out = dict(zip(names, sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})))
    mod.zero_grad()
    ref = mod(x, target)[0]
    ref.backward()
    err = abs(float(out["loss"]) - float(ref))
    for n, p in mod.named_parameters():
        err = max(err, float(np.abs(out[n.removeprefix("net.") + "_grad"] - p.grad.numpy()).max()))
    return err


def main_bench(out_dir: Path, which: list[str]) -> None:
    """Benchmark-size copies of the samples (same code, bigger models) into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    B, S, D = M.BENCH_BLOCK_BATCH, M.BENCH_BLOCK["seq"], M.BENCH_BLOCK["d_model"]
    mb = M.BENCH_MLP_BATCH
    jobs = {
        "torch_mlp": lambda: build(
            "torch_mlp", MLP(**M.BENCH_MLP), torch.randn(mb, M.BENCH_MLP["inp"]),
            torch.randn(mb, M.BENCH_MLP["out"]),
            f"torch_mlp at bench size {M.BENCH_MLP}, batch {mb}", out_dir=out_dir),
        "torch_block": lambda: build(
            "torch_block", Block("mul", **M.BENCH_BLOCK), torch.randn(B, S, D),
            torch.randn(B, S, D), f"torch_block at bench size {M.BENCH_BLOCK}, batch {B}",
            out_dir=out_dir),
        "torch_llama": lambda: build(
            "torch_llama", M.LlamaStack(D), torch.randn(B, S, D), torch.randn(B, S, D),
            f"torch_llama at bench size d={D}, seq {S}, batch {B}", out_dir=out_dir),
    }
    run_jobs(jobs, which, lambda: torch.manual_seed(0))


def main(which: list[str]) -> None:
    if which[:1] == ["--bench"]:
        return main_bench(Path(which[1]), which[2:])
    SAMPLES.mkdir(exist_ok=True)
    jobs = {
        "torch_mlp": lambda: build(
            "torch_mlp", MLP(), torch.randn(2, MLP.IN), torch.randn(2, MLP.OUT),
            "MLP [B=2,16] (fixed shapes): Linear+ReLU, Linear+GELU(erf), Linear+SiLU, "
            "Linear(bias=False)+ReLU, Linear; MSE; joint forward+backward graph."),
        "torch_block": lambda: build(
            "torch_block", Block("mul"), torch.randn(2, SEQ, D_MODEL), torch.randn(2, SEQ, D_MODEL),
            "Pre-LN block [B=2,8,32] (fixed shapes), 2 heads: separate q/k/v Linears, "
            "scale as multiply (q * 16**-0.5), masked_fill(causal, -inf) mask, softmax, @v, "
            "o-proj, LayerNorms, Linear+GELU MLP, residual adds; MSE; joint graph."),
        # variants (rules/act_gelu_tanh_grad_torch.yaml, linear_gelu_tanh_torch.yaml,
        # sdpa_torch_where_div.yaml, sdpa_torch_div.yaml, sdpa_torch_plain.yaml)
        "torch_v_gelutanh": lambda: build(
            "torch_v_gelutanh", M.GeluTanhMLP(), torch.randn(2, 4, 8), torch.randn(2, 4, 8),
            "GPT-2 style MLP [B=2,4,8] (fixed shapes) with GELU(approximate='tanh'): "
            "Linear(8->32)+GELU(tanh), reshape to [8,32], Linear(32->8)+GELU(tanh), Linear(8->8), "
            "reshape back; MSE; joint graph.", metadata=False),
        "torch_v_attn": lambda: build(
            "torch_v_attn", M.AttnStack(), torch.randn(2, 4, 8), torch.randn(2, 4, 8),
            "Attention-only residual layers [B=2,4,8] (fixed shapes), 2 heads, separate q/k/v/o "
            "Linears: (1) (q@k^T) Div sqrt(4) + additive float causal mask, (2) Div scale + "
            "masked_fill(causal, -inf), (3) q * 4**-0.5 before q@k^T, no mask; MSE; joint graph.",
            metadata=False),
        "torch_llama": lambda: build(
            "torch_llama", M.LlamaStack(), torch.randn(2, SEQ, D_MODEL), torch.randn(2, SEQ, D_MODEL),
            "Llama-style pre-norm residual layers [B=2,8,32] (fixed shapes) with RMSNorm "
            "(x * rsqrt(mean(x^2) + 1e-6) * weight): x + Linear(rms(x)) five times (rsqrt with "
            "weight over the input; rsqrt with and without weight, x / sqrt(...) with and without "
            "weight), final RMSNorm; MSE; joint graph.", metadata=False),
    }
    run_jobs(jobs, which, lambda: torch.manual_seed(0))


if __name__ == "__main__":
    main(sys.argv[1:])
