"""Regenerates tests/data/{torch,ortt}_lces_*.onnx: the loss spellings of a language-model /
classifier head + cross-entropy that real exports use (issue 36), for rules/lce_torch_loss.yaml,
rules/lce_torch_rows.yaml, rules/lce_torch_shift.yaml, rules/lce_ortt_shift.yaml and
rules/lce_ortt_gemm.yaml, with and without the logits transformed before the loss; counts,
verification and guards: tests/test_lce_spellings.py.

torch-joint (build/venv-corpus-torch: torch 2.13, transformers 4.57.6): aot_export_module(
trace_joint=True) + torch.onnx.export(dynamo=True) (scripts/samples/gen_torch.export_joint), each
graph checked against torch autograd (loss and every gradient; a tied weight's two gradient
outputs summed). A tiny decoder (Embedding -> Linear + ReLU -> head, vocabulary 50, width 16,
batch 2 x 7 tokens; `tied`: the head is F.linear(h, emb.weight)) or Hugging Face's
LlamaForCausalLM / GPT2LMHeadModel (1 layer, vocabulary 64, width 16, eager attention; GPT-2's
lm_head tied to wte), with these losses on logits viewed [N, V]:
  reducemean        (-lp.gather(1, y[:, None]).squeeze(1)).mean()                 fuses: 1
  reducemean_neg_tied  -lp.gather(1, y[:, None]).mean(), tied head (dW + the embedding's
                    gradient by an Add)                                            fuses: 1
  reducesum_const   (-lp.gather(1, y[:, None]).squeeze(1)).sum() / 2 (a constant)    fuses: 1
  masked_sum_const  Hugging Face's masked sum (the -100 mask) / 2 (a constant)      fuses: 1
  ce_sum            F.cross_entropy(z, y, reduction='sum'), labels with -100          fuses: 1
  ce_mean           F.cross_entropy(z, y), labels with -100: torch 2.13 exports its gradient
                    wrong (1 instead of 1 / count per kept token; asserted below), the fused
                    graph computes what the exported graph computes                  fuses: 1
  ce_none_mean      F.cross_entropy(z, y, reduction='none').mean(): the mean over every token,
                    ignored ones included (not the op's mean over the kept ones): the
                    op's per-token losses, the ReduceMean kept                      fuses: 1
  shift_logits      logits[:, :-1], labels[:, 1:] then Hugging Face's masked mean: the
                    slice moved onto the hidden states (the op's seq_start / seq_end)  fuses: 1
  seqlevel          per-sequence masked means, then their mean over the batch: the
                    op's per-token losses, the reductions kept                     fuses: 1
  hf_llama_items    LlamaForCausalLM(labels=y, num_items_in_batch=count): the labels shifted
                    in the graph (Pad + Slice), F.cross_entropy(reduction='sum') / count
                                                                                   fuses: 1
  hf_gpt2_mean_tied GPT2LMHeadModel logits (lm_head tied to wte: two gradient outputs),
                    -lp.gather(...).mean()                                         fuses: 1
  hf_llama_seqcls   LlamaForSequenceClassification(input_ids, labels=y).loss (5 classes, pad
                    token 0, the first sequence padded): the score Linear on every token, the
                    loss F.cross_entropy on the logits of each sequence's last non-pad token
                    (GatherND; torch 2.13's wrong mean gradient, as ce_mean)        fuses: 1
  hf_gpt2_seqcls_masked  GPT2ForSequenceClassification's pooled logits, Hugging Face's
                    written-out masked mean                                         fuses: 1
  smoothed_masked_{mean,sum}  gen_torch.cross_entropy(z, y, reduction, label_smoothing=0.1):
                    Hugging Face's masked loss written out, (1 - eps) nll + eps * the mean
                    over classes of -log_softmax, masked and reduced the same way; _mean_tied:
                    the tied head                                                  fuses: 1
  smoothed_ce_{sum,mean}  F.cross_entropy(z, y, reduction, label_smoothing=0.1) (the mean:
                    torch 2.13's wrong gradient, as ce_mean)                       fuses: 1
  shift_ce_smoothed, shift_ce_sum_tied_smoothed  shift_ce, shift_ce_sum_tied with
                    label_smoothing=0.1                                            fuses: 1
  fbias_LOSS        (FBIASED) the loss LOSS (reducemean, ce_sum, ce_mean,
                    smoothed_masked_mean) on logits with a frozen bias [1, V] added, as BART's,
                    mBART's, Marian's and Pegasus's final_logits_bias buffer       fuses: 1
  LOSS_frozen_head  (FROZEN) the loss LOSS (reducemean, reducesum_const, masked_sum_const,
                    ce_sum, ce_none_mean, shift_logits, shift_ce, seqlevel, smoothed_ce_sum,
                    smoothed_masked_mean; shift_logits / shift_ce also with _div / _mul /
                    _softcap) under a frozen head: no dW, dH only                  fuses: 1
  hf_llama_items_frozen_head, hf_gpt2_mean_tied_frozen_head  (FROZEN_HEAD) hf_llama_items,
                    hf_gpt2_mean_tied with lm_head frozen (the tied one: the embedding too)
                                                                                   fuses: 1
  hf_llama_items_lora  (LORA) hf_llama_items under peft LoRA r 4 on q_proj / v_proj (every
                    base parameter frozen, the head included; needs peft)         fuses: 1
  LOSS_T            (TRANSFORMED) the loss LOSS (shift_logits, shift_ce_sum_tied, ce_none_mean,
                    seqlevel, smoothed_masked_mean) on the logits transformed between the head and the loss
                    (TRANSFORMS): T = div (z / 4, Granite's logits / logits_scaling), mul
                    (z * 0.5, Cohere's logit_scale) or softcap (3 tanh(z / 3), Gemma 2's final
                    soft cap)                                                       fuses: 1
ort-training (build/venv-corpus-ortt: onnxruntime-training 1.19.2): torch.onnx.export
(TorchScript, training, opset 16) + generate_artifacts(loss=CrossEntropyLoss(reduction='mean'
[, ignore_index=-100])), checked against torch autograd:
  cls_mlp           Linear + ReLU -> Linear(bias) classifier (Gemm into the loss)  fuses: 1
  cls_cnn           Conv + ReLU -> Flatten -> Linear(bias) (Gemm into the loss)    fuses: 1
  cls_mlp_ii        cls_mlp with ignore_index -100 (a label -100 in the batch)     fuses: 1
  cls_matmul        h @ W.t() + b written out (MatMul + Add into the loss)         fuses: 1
  cls_mlp{,_ii}_{div,softcap}  cls_mlp with its logits divided by a temperature (4) or
                    soft-capped (3 tanh(z / 3)) before the loss                     fuses: 1
  the tiny decoder computing its own loss (generate_artifacts(loss=None)), labels with -100:
  lm_shift_ce       F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
                    (Slice before SoftmaxCrossEntropyLoss, SliceGrad in the backward)  fuses: 1
  lm_shift_ce_tied  the same with the head tied to the embedding (the head's gradient
                    Summed with the embedding's)                                    fuses: 1
  lm_shift_ce_frozen_head  the same with the head frozen (no dW)                   fuses: 1
  lm_shift_ce_div, lm_shift_ce_tied_softcap, lm_shift_ce_frozen_head_{div,softcap}  those
                    with the logits transformed before the shift (TRANSFORMS)       fuses: 1
  lm_shift_ce_fbias lm_shift_ce with a frozen bias [1, V] added to the logits (BART's
                    final_logits_bias; MatMul + Add, no bias gradient)              fuses: 1
  hf_llama_loss     LlamaForCausalLM(input_ids, labels=y).loss (transformers' ForCausalLMLoss:
                    the labels padded with -100 and shifted, Pad + Slice; the logits whole) fuses: 1
  hf_gpt2_loss_tied GPT2LMHeadModel(input_ids, labels=y).loss, lm_head tied to wte     fuses: 1
Run: build/venv-corpus-torch/bin/python scripts/make_lce_spellings.py torch-joint [NAME ...]
     build/venv-corpus-ortt/bin/python scripts/make_lce_spellings.py ort-training [NAME ...]
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

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
sys.path.insert(0, str(ROOT / "scripts" / "samples"))
V, D, B, S = 50, 16, 2, 7
HF_V, HF_S, HF_C = 64, 6, 5


# the logits transformed between the head and the loss, as real LM heads do: Granite's
# `logits / logits_scaling`, Cohere's `logits * logit_scale`, Gemma 2's final soft cap
TRANSFORMS = {"": lambda z: z, "div": lambda z: z / 4.0, "mul": lambda z: z * 0.5,
              "softcap": lambda z: 3.0 * torch.tanh(z / 3.0)}


class Net(nn.Module):
    def __init__(self, tied=False, transform="", fbias=False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.fc = nn.Linear(D, D)
        self.tied = tied
        self.head = None if tied else nn.Linear(D, V, bias=False)
        self.transform = TRANSFORMS[transform]
        # BART's (mBART's, Marian's, Pegasus's) final_logits_bias: a frozen buffer [1, V] added
        # to the head's logits
        self.fbias = fbias
        if fbias:
            self.register_buffer("final_logits_bias", torch.randn(1, V) * 0.5)

    def forward(self, ids):  # logits [B, S, V]
        h = torch.relu(self.fc(self.emb(ids)))
        z = F.linear(h, self.emb.weight) if self.tied else self.head(h)
        return self.transform(z + self.final_logits_bias if self.fbias else z)


def _lp(z):
    return torch.log_softmax(z.reshape(-1, z.shape[-1]), -1)


def _masked_nll(z, y):  # Hugging Face's written-out loss terms (gen_torch.cross_entropy)
    lp, y = _lp(z), y.reshape(-1)
    mask = y != -100
    safe = torch.where(mask, y, torch.zeros_like(y))
    return -lp.gather(1, safe[:, None]).squeeze(1) * mask, mask


def _seqlevel(z, y):
    nll, mask = _masked_nll(z, y)
    per_seq = nll.view(y.shape).sum(1) / mask.view(y.shape).sum(1)
    return per_seq.mean()


def _shift_logits(z, y):
    nll, mask = _masked_nll(z[:, :-1, :], y[:, 1:])
    return nll.sum() / mask.sum()


EPS = 0.1  # label smoothing


def _smoothed_masked(reduction):  # gen_torch.cross_entropy(label_smoothing=EPS), written out
    from gen_torch import cross_entropy

    return lambda z, y: cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1),
                                      reduction=reduction, label_smoothing=EPS)


def _smoothed_ce(reduction):  # F.cross_entropy(label_smoothing=EPS)
    return lambda z, y: F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1),
                                        reduction=reduction, label_smoothing=EPS)


def _shift_ce(reduction, label_smoothing=0.0):  # Hugging Face's older loss on the shifted logits
    return lambda z, y: F.cross_entropy(z[:, :-1, :].reshape(-1, z.shape[-1]),
                                        y[:, 1:].reshape(-1), reduction=reduction,
                                        label_smoothing=label_smoothing)


LOSSES = {  # name: (loss on logits [B, S, V] and labels [B, S], tied, labels with -100)
    "reducemean": (lambda z, y: (-_lp(z).gather(1, y.reshape(-1, 1)).squeeze(1)).mean(),
                   False, False),
    "reducemean_neg_tied": (lambda z, y: -_lp(z).gather(1, y.reshape(-1, 1)).mean(), True, False),
    "reducesum_const": (lambda z, y: (-_lp(z).gather(1, y.reshape(-1, 1)).squeeze(1)).sum() / 2,
                        False, False),
    "masked_sum_const": (lambda z, y: _masked_nll(z, y)[0].sum() / 2, False, True),
    "ce_sum": (lambda z, y: F.cross_entropy(z.reshape(-1, V), y.reshape(-1), reduction="sum"),
               False, True),
    "ce_mean": (lambda z, y: F.cross_entropy(z.reshape(-1, V), y.reshape(-1)), False, True),
    "ce_none_mean": (lambda z, y: F.cross_entropy(z.reshape(-1, V), y.reshape(-1),
                                                  reduction="none").mean(), False, True),
    "shift_logits": (_shift_logits, False, True),
    "shift_ce": (_shift_ce("mean"), False, True),
    "shift_ce_sum_tied": (_shift_ce("sum"), True, True),
    "seqlevel": (_seqlevel, False, True),
    "smoothed_masked_mean": (_smoothed_masked("mean"), False, True),
    "smoothed_masked_mean_tied": (_smoothed_masked("mean"), True, True),
    "smoothed_masked_sum": (_smoothed_masked("sum"), False, True),
    "smoothed_ce_sum": (_smoothed_ce("sum"), False, True),
    "smoothed_ce_mean": (_smoothed_ce("mean"), False, True),
    "shift_ce_smoothed": (_shift_ce("mean", EPS), False, True),
    "shift_ce_sum_tied_smoothed": (_shift_ce("sum", EPS), True, True),
}
# the same losses on logits with a frozen bias added (BART's final_logits_bias): name: loss
FBIASED = {f"fbias_{loss}": loss for loss in ("reducemean", "ce_sum", "ce_mean",
                                             "smoothed_masked_mean")}
# the same losses under a frozen head (LoRA fine-tuning, frozen embeddings: no dW), some with
# the logits transformed: name: (loss, transform)
FROZEN = {**{f"{loss}_frozen_head": (loss, "") for loss in (
    "reducemean", "reducesum_const", "masked_sum_const", "ce_sum", "ce_none_mean",
    "shift_logits", "shift_ce", "seqlevel", "smoothed_ce_sum", "smoothed_masked_mean")},
    **{f"{loss}_frozen_head_{t}": (loss, t) for loss, ts in (
        ("shift_logits", ("div", "softcap")), ("shift_ce", ("mul", "softcap")))
       for t in ts}}
# the same losses on transformed logits: name: (loss, transform)
TRANSFORMED = {f"{loss}_{t}": (loss, t) for loss, ts in (
    ("shift_logits", ("div", "softcap")), ("shift_ce_sum_tied", ("mul", "softcap")),
    ("ce_none_mean", ("mul", "softcap")), ("seqlevel", ("div", "softcap")),
    ("smoothed_masked_mean", ("softcap",))) for t in ts}
WRONG_GRADIENT = {"ce_mean", "shift_ce", "smoothed_ce_mean", "shift_ce_smoothed",
                  "fbias_ce_mean", "hf_llama_seqcls", "shift_ce_frozen_head",
                  "shift_ce_frozen_head_mul", "shift_ce_frozen_head_softcap"}  # torch 2.13's export of F.cross_entropy(reduction='mean')


class Loss(nn.Module):
    def __init__(self, net, fn):
        super().__init__()
        self.net, self.fn = net, fn

    def forward(self, ids, lab):
        return (self.fn(self.net, ids, lab),)


def _hf(arch, seqcls=False):
    # torchvision 0.28.0 is a CUDA build: with CPU torch its import (by transformers) needs
    # these schemas declared first (scripts/corpus/archs.py)
    if not hasattr(_hf, "keep"):
        lib = torch.library.Library("torchvision", "DEF")
        for schema in ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                       "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"):
            lib.define(schema)
        _hf.keep = lib
    import transformers as tf

    # (a sequence classifier: the score Linear on every token, the logits of each sequence's last
    # token before the first pad, token 0)
    cls = dict(num_labels=HF_C, pad_token_id=0) if seqcls else {}
    if arch == "llama":
        return (tf.LlamaForSequenceClassification if seqcls else tf.LlamaForCausalLM)(
            tf.LlamaConfig(vocab_size=HF_V, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                           max_position_embeddings=16, attn_implementation="eager", **cls))
    return (tf.GPT2ForSequenceClassification if seqcls else tf.GPT2LMHeadModel)(tf.GPT2Config(
        vocab_size=HF_V, n_embd=16, n_layer=1, n_head=2, n_positions=16,
        attn_implementation="eager", resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, **cls))


def _hf_items(net, ids, lab):
    return net(input_ids=ids, labels=lab, num_items_in_batch=(lab[:, 1:] != -100).sum()).loss


def _hf_mean(net, ids, lab):
    return -_lp(net(input_ids=ids).logits).gather(1, lab.reshape(-1, 1)).mean()


# (the padding's attention mask computed in the graph from the pad token; the model's own loss is
# F.cross_entropy on the pooled logits, the mean: ForSequenceClassificationLoss is not passed
# num_items_in_batch)
def _hf_cls(net, ids, lab):
    return net(input_ids=ids, attention_mask=(ids != 0).long(), labels=lab).loss


def _hf_cls_masked(net, ids, lab):  # Hugging Face's written-out masked mean, on the pooled logits
    nll, mask = _masked_nll(net(input_ids=ids, attention_mask=(ids != 0).long()).logits, lab)
    return nll.sum() / mask.sum()


HF = {"hf_llama_items": ("llama", _hf_items, True), "hf_gpt2_mean_tied": ("gpt2", _hf_mean, False),
      "hf_llama_seqcls": ("llama", _hf_cls, False),
      "hf_gpt2_seqcls_masked": ("gpt2", _hf_cls_masked, False),
      "hf_llama_items_frozen_head": ("llama", _hf_items, True),
      "hf_gpt2_mean_tied_frozen_head": ("gpt2", _hf_mean, False),
      "hf_llama_items_lora": ("llama", _hf_items, True)}
# the head frozen (frozen embeddings under a tied head, or the head alone): no dW, dH only
FROZEN_HEAD = {"hf_llama_items_frozen_head", "hf_gpt2_mean_tied_frozen_head"}
# peft LoRA (r 4 on q_proj / v_proj): every base parameter frozen, the head included
LORA = {"hf_llama_items_lora"}


def _check(m, net, mod, feeds, args):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    res = dict(zip([o.name for o in m.graph.output],
                   sess.run(None, {i.name: feeds[i.name] for i in m.graph.input})))
    net.zero_grad()
    ref = mod(*args)[0]
    ref.backward()
    grads: dict = {}
    named = dict(net.named_parameters(remove_duplicate=False))
    for o, v in res.items():  # a tied weight: one gradient output per name, summed
        if o != "loss":
            p = named[o.removesuffix("_grad")]
            grads[id(p)] = (p, grads.get(id(p), (p, 0))[1] + v)
    loss_err = abs(float(res["loss"]) - float(ref.detach()))
    grad_err = max(float(np.abs(g - p.grad.numpy()).max()) for p, g in grads.values())
    return loss_err, grad_err


def torch_joint(name):
    from gen_torch import export_joint

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name in HF:
        arch, fn, ignore = HF[name]
        net = _hf(arch, "seqcls" in name)
        if name in FROZEN_HEAD:
            net.lm_head.requires_grad_(False)
        if name in LORA:
            from peft import LoraConfig, get_peft_model

            net = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                 target_modules=["q_proj", "v_proj"]))
            net = net.base_model.model.train()
        ids = torch.randint(0, HF_V, (B, HF_S), generator=g)
        lab = ids.clone()
        if "seqcls" in name:  # classes; the first sequence padded after 4 tokens
            ids = torch.randint(1, HF_V, (B, HF_S), generator=g)
            ids[0, 4:] = 0
            lab = torch.randint(0, HF_C, (B,), generator=g)
    else:
        base, transform = TRANSFORMED.get(name, FROZEN.get(name, (FBIASED.get(name, name), "")))
        loss, tied, ignore = LOSSES[base]
        net = Net(tied, transform, fbias=name in FBIASED)
        if name in FROZEN:
            net.head.requires_grad_(False)
        ids = torch.randint(0, V, (B, S), generator=g)
        lab = torch.randint(0, V, (B, S), generator=g)
        fn = (lambda lf: lambda n, i, y: lf(n(i), y))(loss)
    if ignore:
        lab[0, :3] = -100
    mod = Loss(net, fn)
    m, values, _ = export_joint(mod, [ids, lab], ["input_ids", "labels"], metadata=False)
    onnx.save(m, DATA / f"torch_lces_{name}.onnx")
    loss_err, grad_err = _check(m, net, mod, {**values, "input_ids": ids.numpy(),
                                              "labels": lab.numpy()}, (ids, lab))
    print(f"torch_lces_{name}: {len(m.graph.node)} nodes, |loss - torch| {loss_err:.3g}, "
          f"max |grad - torch| {grad_err:.3g}")
    assert loss_err < 1e-5
    if name in WRONG_GRADIENT:
        assert grad_err > 1e-2, "torch's export of this loss's gradient is right now"
    else:
        assert grad_err < 1e-5


C = 10


class ClsMLP(nn.Module):
    def __init__(self, matmul=False, transform=""):
        super().__init__()
        self.fc = nn.Linear(12, 16)
        self.matmul = matmul
        self.transform = TRANSFORMS[transform]
        if matmul:  # h @ W^T + b written out: MatMul + Add
            self.w = nn.Parameter(torch.randn(C, 16) * 0.3)
            self.b = nn.Parameter(torch.randn(C) * 0.1)
        else:
            self.head = nn.Linear(16, C)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return self.transform(h @ self.w.t() + self.b if self.matmul else self.head(h))


class ClsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4 * 8 * 8, C)

    def forward(self, x):
        return self.head(torch.flatten(torch.relu(self.conv(x)), 1))


ORTT = {  # name: (model, input shape, ignore_index -100)
    "cls_mlp": (ClsMLP, (6, 12), False),
    "cls_cnn": (ClsCNN, (2, 3, 8, 8), False),
    "cls_mlp_ii": (ClsMLP, (6, 12), True),
    "cls_matmul": (lambda: ClsMLP(matmul=True), (6, 12), False),
    # the logits divided by a temperature, or soft-capped
    "cls_mlp_div": (lambda: ClsMLP(transform="div"), (6, 12), False),
    "cls_mlp_ii_div": (lambda: ClsMLP(transform="div"), (6, 12), True),
    "cls_mlp_softcap": (lambda: ClsMLP(transform="softcap"), (6, 12), False),
    "cls_mlp_ii_softcap": (lambda: ClsMLP(transform="softcap"), (6, 12), True),
}


class HFLoss(nn.Module):  # a Hugging Face causal LM computing its own loss from labels
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, ids, lab):
        return self.net(input_ids=ids, labels=lab).loss


class ShiftLM(nn.Module):  # a causal LM computing its own loss on the shifted logits
    def __init__(self, tied, transform="", fbias=False):
        super().__init__()
        self.net = Net(tied, transform, fbias)

    def forward(self, ids, lab):
        return _shift_ce("mean")(self.net(ids), lab)


# name: (tied, head frozen, transform, or "fbias": the logits + a frozen bias [1, V])
ORTT_LM = {"lm_shift_ce": (False, False, ""), "lm_shift_ce_tied": (True, False, ""),
           "lm_shift_ce_frozen_head": (False, True, ""),
           "lm_shift_ce_div": (False, False, "div"),
           "lm_shift_ce_tied_softcap": (True, False, "softcap"),
           "lm_shift_ce_frozen_head_div": (False, True, "div"),
           "lm_shift_ce_frozen_head_softcap": (False, True, "softcap"),
           "lm_shift_ce_fbias": (False, False, "fbias")}
ORTT_HF = {"hf_llama_loss": "llama", "hf_gpt2_loss_tied": "gpt2"}


def ortt(name):
    import onnxruntime as ort
    from onnxruntime.training import artifacts, onnxblock

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    if name in ORTT_LM or name in ORTT_HF:
        if name in ORTT_HF:
            net, v, s = HFLoss(_hf(ORTT_HF[name])), HF_V, HF_S
        else:
            tied, frozen, transform = ORTT_LM[name]
            fbias = transform == "fbias"  # BART's final_logits_bias, no transform
            net, v, s = ShiftLM(tied, "" if fbias else transform, fbias), V, S
            if frozen:
                net.net.head.weight.requires_grad_(False)
        x = torch.randint(0, v, (B, s), generator=g)
        y = torch.randint(0, v, (B, s), generator=g)
        y[0, 2:4] = -100
        args, in_names, out_name, loss = (x, y), ["input_ids", "labels"], "loss", None
    else:
        make, shape, ignore = ORTT[name]
        net = make()
        x = torch.randn(*shape, generator=g)
        y = torch.randint(0, C, (shape[0],), generator=g)
        if ignore:
            y[1] = -100
        args, in_names, out_name = (x,), ["input"], "logits"
        loss = onnxblock.loss.CrossEntropyLoss(reduction="mean",
                                               ignore_index=-100 if ignore else None)
    f = io.BytesIO()
    torch.onnx.export(net, args, f, input_names=in_names, output_names=[out_name],
                      opset_version=16, do_constant_folding=False,
                      training=torch.onnx.TrainingMode.TRAINING, dynamo=False)
    fwd = onnx.load_from_string(f.getvalue())
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    frozen = [n for n, p in net.named_parameters() if not p.requires_grad]
    with tempfile.TemporaryDirectory() as td:
        artifacts.generate_artifacts(fwd, requires_grad=trainable, frozen_params=frozen, loss=loss,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=td)
        m = onnx.load(Path(td) / "training_model.onnx")
    onnx.save(m, DATA / f"ortt_lces_{name}.onnx")
    params = {n: p.detach().numpy() for n, p in net.named_parameters()}
    feeds = {in_names[0]: x.numpy(), "labels": y.numpy(),
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
    ref = net(x, y) if len(in_names) == 2 else F.cross_entropy(net(x), y, ignore_index=-100)
    ref.backward()
    err = abs(float(out[0]) - float(ref))
    named = dict(net.named_parameters())
    for n in trainable:
        err = max(err, float(np.abs(feeds[n + "_grad.accumulation.buffer"]
                                    - named[n].grad.numpy()).max()))
    print(f"ortt_lces_{name}: {len(m.graph.node)} nodes, max |err| vs torch {err:.3g}")
    assert err < 1e-5


if __name__ == "__main__":
    fam, only = sys.argv[1], set(sys.argv[2:])
    names = ([*ORTT, *ORTT_LM, *ORTT_HF] if fam == "ort-training" else
             [*LOSSES, *FBIASED, *FROZEN, *TRANSFORMED, *HF])
    for name in names:
        if not only or name in only:
            (ortt if fam == "ort-training" else torch_joint)(name)
