"""Regenerates tests/data/{ortt,torch}_lce_*.onnx: a tiny decoder-style model (Embedding ->
Linear + ReLU -> language-model head -> cross-entropy on logits viewed [N, V]), each checked
against torch autograd (gradients, loss):
ort-training: torch.onnx.export (training, opset 16) + generate_artifacts with onnxblock's
CrossEntropyLoss(reduction, ignore_index, weight);
torch-joint: aot_export_module(trace_joint=True) of log_softmax + gather + the -100 mask (the
mean over kept tokens, or the sum), written out as Hugging Face's loss does (torch 2.13's export
of F.cross_entropy is wrong: shared/notes/training-graphs.md).

Models (vocabulary 50, width 16, batch 2 x 7 tokens; counts from this code: one head + loss):
  lce_untied     head without bias, mean over all tokens (ort-training: no ignore_index;
                 torch-joint: the -100 mask, labels with -100 in them): 1
  lce_tied       the head's weight is the embedding's (tied): 1
  lce_bias_sum   head with bias, reduction sum, ignore_index -100: 1
  lce_frozen     the head frozen (no dW; the rest trains): 1
  lce_lora       a hand-written LoRA adapter on the frozen head (logits = h W^T + s (h A^T) B^T,
                 s = 0.5, A and B train): 0 (the adapters read the logits' gradient)
  lce_sum        no bias, reduction sum (ort-training: ignore_index -100): 1
  lce_bias       head with bias, mean (ort-training: no ignore_index): 1
  lce_frozen_sum the head frozen, reduction sum (ort-training: no ignore_index): 1
  lce_smooth     torch-joint only (onnxblock's loss has no smoothing): lce_untied with label
                 smoothing 0.1: 1 (the smoothing term, the masked mean over classes of
                 -log_softmax, reads the log-probabilities' row mean: LinearCrossEntropy's lp_row)
(Class weights: onnxblock 1.19.2's CrossEntropyLoss(weight=array) fails on `if self._weight`.)
Run with the corpus venvs (scripts/corpus/requirements-*.txt), optionally naming models:
  build/venv-corpus-ortt/bin/python tests/data/make_lce.py ort-training [NAME ...]
  build/venv-corpus-torch/bin/python tests/data/make_lce.py torch-joint [NAME ...]
"""

import io
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "scripts" / "samples"))
from gen_torch import cross_entropy  # noqa: E402
V, D, B, S = 50, 16, 2, 7


class Net(nn.Module):
    def __init__(self, tied=False, bias=False, lora=False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.fc = nn.Linear(D, D)
        self.tied = tied
        self.head = None if tied else nn.Linear(D, V, bias=bias)
        self.lora = lora
        if lora:
            self.lora_A = nn.Parameter(torch.randn(4, D) * 0.3)
            self.lora_B = nn.Parameter(torch.randn(V, 4) * 0.3)

    def forward(self, ids):
        h = torch.relu(self.fc(self.emb(ids)))
        z = F.linear(h, self.emb.weight) if self.tied else self.head(h)  # tied: one parameter
        if self.lora:
            z = z + (h @ self.lora_A.t() @ self.lora_B.t()) * 0.5
        return z.reshape(-1, V)


CASES = {  # name: (Net kwargs, reduction, ignore -100, frozen parameter names)
    "lce_untied": ({}, "mean", False, ()),
    "lce_tied": ({"tied": True}, "mean", False, ()),
    "lce_bias_sum": ({"bias": True}, "sum", True, ()),
    "lce_frozen": ({}, "mean", True, ("head.weight",)),
    "lce_lora": ({"lora": True}, "mean", True, ("head.weight",)),
    "lce_sum": ({}, "sum", True, ()),
    "lce_bias": ({"bias": True}, "mean", False, ()),
    "lce_frozen_sum": ({}, "sum", False, ("head.weight",)),
}
TORCH_ONLY = {  # name: CASES' fields + label smoothing
    "lce_smooth": ({}, "mean", True, (), 0.1),
}


def inputs(ignore):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, S), generator=g)
    lab = torch.randint(0, V, (B * S,), generator=g)
    if ignore:
        lab[:4] = -100
    return ids, lab


def torch_loss(net, ids, lab, reduction, smoothing=0.0):
    return F.cross_entropy(net(ids), lab, reduction=reduction, ignore_index=-100,
                           label_smoothing=smoothing)


def ortt(name, kw, reduction, ignore, frozen):
    from onnxruntime.training import artifacts, onnxblock
    import onnxruntime as ort

    torch.manual_seed(0)
    net = Net(**kw)
    for n, p in net.named_parameters():
        p.requires_grad_(n not in frozen)
    ids, lab = inputs(ignore)
    f = io.BytesIO()
    torch.onnx.export(net, (ids,), f, input_names=["input_ids"], output_names=["output"],
                      opset_version=16, do_constant_folding=False,
                      training=torch.onnx.TrainingMode.TRAINING, dynamo=False)
    fwd = onnx.load_from_string(f.getvalue())
    inits = {i.name for i in fwd.graph.initializer}
    trainable = [n for n, p in net.named_parameters() if p.requires_grad and n in inits]
    loss = onnxblock.loss.CrossEntropyLoss(reduction=reduction,
                                           ignore_index=-100 if ignore else None)
    with tempfile.TemporaryDirectory() as td:
        artifacts.generate_artifacts(fwd, requires_grad=trainable,
                                     frozen_params=[n for n in inits if n not in trainable],
                                     loss=loss, optimizer=artifacts.OptimType.AdamW,
                                     artifact_directory=td)
        m = onnx.load(Path(td) / "training_model.onnx")
    onnx.save(m, HERE / f"ortt_{name}.onnx")
    # check against torch autograd
    params = {n: p.detach().numpy() for n, p in net.named_parameters()}
    feeds = {"input_ids": ids.numpy(), "labels": lab.numpy(),
             "lazy_reset_grad": np.ones([1], np.bool_)}
    names = {i.name for i in m.graph.input}
    for n in names:
        if n in params:
            feeds[n] = params[n].copy()
        elif n.endswith("_grad.accumulation.buffer"):
            feeds[n] = np.zeros_like(params[n.removesuffix("_grad.accumulation.buffer")])
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    out = sess.run([m.graph.output[0].name], {k: v for k, v in feeds.items() if k in names})
    net.zero_grad()
    tl = torch_loss(net, ids, lab, reduction)
    tl.backward()
    err = abs(float(out[0]) - float(tl))
    for n, p in net.named_parameters():
        if p.requires_grad:
            err = max(err, float(np.abs(feeds[n + "_grad.accumulation.buffer"]
                                        - p.grad.numpy()).max()))
    print(f"ortt_{name}: {len(m.graph.node)} nodes, max |err| vs torch {err:.3g}")
    assert err < 1e-5


class Loss(nn.Module):
    """Hugging Face's loss written out (gen_torch.cross_entropy): log_softmax, the -100 mask,
    gather, mean over kept tokens (or sum) [, label smoothing]."""

    def __init__(self, net, reduction, smoothing=0.0):
        super().__init__()
        self.net, self.reduction, self.smoothing = net, reduction, smoothing

    def forward(self, ids, lab):
        return (cross_entropy(self.net(ids), lab, self.reduction, self.smoothing),)


def torch_joint(name, kw, reduction, ignore, frozen, smoothing=0.0):
    from gen_torch import export_joint

    torch.manual_seed(0)
    net = Net(**kw)
    for n, p in net.named_parameters():
        p.requires_grad_(n not in frozen)
    ids, lab = inputs(True)  # the mask is in the graph either way: use it
    mod = Loss(net, reduction, smoothing)
    m, values, trainable = export_joint(mod, [ids, lab], ["input_ids", "labels"], metadata=False)
    onnx.save(m, HERE / f"torch_{name}.onnx")
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {**values, "input_ids": ids.numpy(), "labels": lab.numpy()}
    res = dict(zip([o.name for o in m.graph.output],
                   sess.run(None, {i.name: feeds[i.name] for i in m.graph.input})))
    net.zero_grad()
    tl = torch_loss(net, ids, lab, reduction, smoothing)
    tl.backward()
    err = abs(float(res["loss"]) - float(tl))
    grads = {}
    for o, v in res.items():  # a tied weight has one gradient output per name: sum them
        if o != "loss":
            k = o.removesuffix("_grad")
            grads[k] = grads.get(k, 0) + v
    named = dict(net.named_parameters())
    for k, g in grads.items():
        ref = named[k].grad if k in named else named["emb.weight"].grad
        err = max(err, float(np.abs(g - ref.numpy()).max()))
    print(f"torch_{name}: {len(m.graph.node)} nodes, max |err| vs torch {err:.3g}")
    assert err < 1e-5


if __name__ == "__main__":
    fam, only = sys.argv[1], set(sys.argv[2:])
    cases = CASES if fam == "ort-training" else {**CASES, **TORCH_ONLY}
    for name, case in cases.items():
        if not only or name in only:
            (ortt if fam == "ort-training" else torch_joint)(name, *case)
