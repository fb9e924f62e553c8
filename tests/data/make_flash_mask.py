"""Regenerates the boolean-mask attention fixtures tests/data/{ortt,torch}_flash_where_*.onnx:
small decoder blocks whose attention masks the scores with Where (not an additive bias), as
GPT-2's eager attention (`torch.where(causal_mask, attn_weights, mask_value)`, mask_value =
finfo.min), GPT-Neo / BLOOM-style code and masked_fill do. One attention per graph, forward and
backward in the graph, nothing else reads the probabilities: flash_attention 1, layernorm 2,
linear_gelu 1 (pre-norm block: ln_1, attention, ln_2, Linear(8->16) GELU Linear(16->8)).

- where_causal: GPT-2's spelling: scores / sqrt(dh), Where(causal, scores, finfo.min) (a
  constant [S, S] bool buffer sliced to [1, 1, S, S]), softmax.
- where_causal_pad: the mask built at run time from an `attention_mask` input [B, S] (int64,
  0/1, random: rows whose keys are all padded exist): Where(causal & attention_mask[:, None,
  None, :].bool(), scores, finfo.min). A fully masked row gets the uniform softmax (forward) and
  a zero score gradient (Where's backward).
- where_gpt2_pad: GPT-2's whole spelling: Where(causal, scores, finfo.min) then + the additive
  padding mask (1 - attention_mask[:, None, None, :]) * finfo.min built at run time.
- fill_causal_pad: masked_fill(~causal, -inf) then + the additive padding mask built at run
  time (the masked_fill polarity with a bias after it).
- fill_window_ninf: masked_fill of a sliding window (keys i-2..i kept) with -inf: the
  polarity True = filled (Where(~window, -inf, scores)), the scale on q (q * dh**-0.5).

Sliding windows (W = 3: query i sees keys i-2..i, mask = (j <= i) & (i - j < W)), each a
spelling of its own:
- where_window: GPT-2's keep polarity on a window the model code builds from arange of the
  sequence length (Mistral-style eager code; the exports hold it as a folded constant [1, 1,
  S, S] bool): Where(window, scores, finfo.min).
- where_window_pad: the same window & attention_mask[:, None, None, :] (run time, random
  0/1): rows whose W keys are all padded are fully masked (batch 1: keys 0..2 padded, so
  queries 0, 1 and 2 see no key: the uniform softmax forward, a zero score gradient).
- bias_window: the window as an additive band bias, a constant [1, 1, S, S] buffer of 0 and
  finfo.min added to the scores (Hugging Face's 4-D float masks).
- bias_window_pad: the band bias built at run time, (1 - (window & attention_mask)) * finfo.min,
  added to the scores (fully masked rows as in where_window_pad).
Two more spellings (the architecture sweep's Falcon and MPT, scripts/corpus/SWEEP.md):
- alibi_fill_pad: MPT's order, the additive bias first, then the mask: scores * dh**-0.5 +
  an ALiBi bias (slopes 2^-(8 h / H) times the key position, [1, H, 1, S]), then
  masked_fill(~(causal & attention_mask), finfo.min) (a filled score is the fill alone: the
  ops' bias_first 1).
- mqa_bias_causal: Falcon's multi-query attention: K and V of one head [B, 1, S, dh], broadcast
  to the query heads by the matmuls (`q @ k.transpose(-1, -2)`, `p @ v`), scores / sqrt(dh) +
  an additive causal mask (0 / finfo.min); the gradients of K and V are summed over the heads.
Two more (heads sweep 3, scripts/corpus/SWEEP.md), each an additive bias the ops take as one
tensor that the replacement computes (`replace.prepare`):
- bias_prescale_pad: CodeGen's order, the additive mask (causal & attention_mask, 0 /
  finfo.min, built at run time) added to the raw scores, then the scale: (q k^T + mask) /
  sqrt(dh).
- bias2_causal_pad: CTRL's, two additive masks after the scale: the causal mask * -1e4 (a float
  0 / 1 buffer), then the padding mask (1 - attention_mask) * finfo.min.
- mulmask_causal (ort-training only): OpenAI GPT's, the scaled scores times a 0 / 1 float
  causal buffer plus -1e4 where it is 0, w * b + -1e4 * (1 - b) (both folded to constants by
  the exporter): the ops' bool mask (b, cast by the replacement) with fill 0, then the bias.
ort-training also exports where_causal, where_window and bias_window_pad with the forward at
opset 12 (`_opset12`, as older export scripts do: Softmax(axis=3) and com.microsoft
SoftmaxGrad, docs/rules.md `last_axis`).

Rule fixtures (tests/test_rules.py's positives), attention only (x + o(attn(x)) per layer):
- gqa_where_all: four attention layers with grouped K / V (Hugging Face's repeat_kv, 2 query
  heads on 1 kv head), one per Where spelling: Where(causal, S, finfo.min), the same + an
  additive padding mask built at run time, masked_fill(~causal, -inf), the same + the padding
  mask: flash_attention 4.
- mqa_all: eight attention layers on K / V of one head broadcast by the matmuls (Falcon's
  multi-query), one per spelling: the four above, an additive causal mask, no mask, and MPT's
  bias-then-mask (ALiBi + Where(causal & attention_mask, S, finfo.min), ALiBi +
  masked_fill(~(causal & attention_mask), finfo.min)): flash_attention 8.
- alibi_all: those two bias-then-mask spellings on full heads, then on repeat_kv's groups:
  flash_attention 4.
- bmm_all: twelve attention layers whose scores are computed on [B * H, S, dh] views of the
  heads by torch.baddbmm / bmm, then viewed to [B, H, S, S] (BLOOM's and GPT-NeoX-Japanese's
  spelling), one per combination of: the term on the view (baddbmm(ALiBi [B * H, 1, S] from
  the padded positions as BLOOM builds it, q3, k3^T, beta=1, alpha=dh**-0.5); baddbmm(zeros
  [B * H, S, S], ...), GPT-NeoX-Japanese's; bmm(q3, k3^T) * alpha alone), the additive padding
  mask after the view or none, and P V on P's and V's views, the output viewed back (BLOOM's
  bmm) or on the 4-D heads (`_v4`, GPT-NeoX-Japanese's torch.matmul): flash_attention 12.
- bmm_seqheads: one such layer whose views merge [B, S, H, dh] (the heads not moved before the
  view: another computation, each query position attending over the heads): not flash
  attention.
- sdpa_math_all (torch-joint only): sdpa_all's four layers, exported under SDPBackend.MATH
  (torch 2.13's dynamo exporter decomposes only the math backend's backward on CPU: how
  transformers' default attention exports there), which writes the scale's square root onto
  Q and K^T and torch's _safe_softmax guard Where(all(S == -inf), 0, P); then a bool mask, a
  float mask and none on repeat_kv's groups (1 kv head of 2) and on one kv head that sdpa
  broadcasts itself: flash_attention 10.
- sdpa_all (ort-training only: torch 2.13's dynamo exporter has no decomposition of sdpa's
  backward): four layers of torch.nn.functional.scaled_dot_product_attention, transformers'
  default attention, which torch.onnx writes out with the NaN guard Where(IsNaN(P), 0, P):
  is_causal=True, a bool mask (causal & attention_mask) | the diagonal (no row fully masked: there
  the export's own gradients are NaN, which gen.py refuses; the kernels' NaN rows are tested in
  fusecli/ops/flash_attention/test_nan_guard.py), the additive padding mask, no mask:
  flash_attention 4.

Through the corpus exporters (scripts/corpus/gen.py), each checked against torch autograd.
Run with the corpus venvs (torch 2.13 + onnxruntime-training 1.19.2, or + onnxscript):
build/venv-corpus-ortt/bin/python tests/data/make_flash_mask.py ort-training
build/venv-corpus-torch/bin/python tests/data/make_flash_mask.py torch-joint
"""

import shutil
import sys
import tempfile
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from contextlib import nullcontext
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "scripts" / "corpus"))
import gen  # noqa: E402

S = 8
WINDOW = 3


class WhereBlock(torch.nn.Module):
    """Pre-norm block, 2 heads of 4, attention masked by Where (see the module docstring)."""

    def __init__(self, kind, d=8, heads=2):
        super().__init__()
        self.kind, self.h, self.dh = kind, heads, d // heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)
        with torch.no_grad():
            for ln in (self.ln1, self.ln2):
                ln.weight.add_(0.1 * torch.randn(d))
                ln.bias.add_(0.1 * torch.randn(d))
        self.register_buffer("causal", torch.tril(torch.ones(S, S, dtype=torch.bool))
                             .view(1, 1, S, S), persistent=False)
        idx = torch.arange(S)
        self.register_buffer("window", (idx[None, :] <= idx[:, None])
                             & (idx[None, :] >= idx[:, None] - 2), persistent=False)
        band = torch.zeros(S, S).masked_fill(
            ~((idx[None, :] <= idx[:, None]) & (idx[:, None] - idx[None, :] < WINDOW)),
            torch.finfo(torch.float32).min)
        self.register_buffer("band", band.view(1, 1, S, S), persistent=False)

    def window_mask(self, s, attention_mask=None):
        """(j <= i) & (i - j < W) for W = 3 [1 or B, 1, s, s], & the padding mask if given."""
        i = torch.arange(s, device=self.causal.device)
        keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < WINDOW)
        keep = keep[None, None]
        if attention_mask is not None:
            keep = keep & attention_mask[:, None, None, :].bool()
        return keep

    def attention(self, q, k, v, attention_mask):
        s = q.shape[-2]
        fmin = torch.finfo(q.dtype).min
        if self.kind == "alibi_fill_pad":
            slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / self.h) for h in range(self.h)])
            alibi = (slopes[:, None] * torch.arange(s, dtype=q.dtype)[None, :]).view(1, self.h, 1, s)
            w = q @ k.transpose(-2, -1) * self.dh ** -0.5 + alibi
            keep = self.causal[:, :, :s, :s] & attention_mask[:, None, None, :].bool()
            return torch.softmax(w.masked_fill(~keep, fmin), dim=-1) @ v
        if self.kind == "mqa_bias_causal":
            k, v = k[:, :1], v[:, :1]  # one kv head, broadcast by the matmuls
            causal = torch.zeros(s, s).masked_fill(~self.causal[0, 0, :s, :s], fmin)
            w = q @ k.transpose(-1, -2) / self.dh ** 0.5
            return torch.softmax(w + causal, dim=-1) @ v
        if self.kind.startswith(("where_window", "bias_window")):
            w = q @ k.transpose(-2, -1) / self.dh ** 0.5
            fmin = torch.finfo(w.dtype).min
            if self.kind == "bias_window":
                w = w + self.band[:, :, :s, :s]
            elif self.kind == "bias_window_pad":
                keep = self.window_mask(s, attention_mask)
                w = w + (1.0 - keep.to(w.dtype)) * fmin
            else:
                pad = attention_mask if self.kind == "where_window_pad" else None
                w = torch.where(self.window_mask(s, pad), w, torch.full([], fmin, dtype=w.dtype))
            return torch.softmax(w, dim=-1) @ v
        if self.kind == "bias_prescale_pad":
            # CodeGen's order: the additive mask (causal and padding, 0 / finfo.min, built at
            # run time) added to the raw scores, then the scale
            keep = self.causal[:, :, :s, :s] & attention_mask[:, None, None, :].bool()
            mask = (1.0 - keep.to(q.dtype)) * fmin
            return torch.softmax((q @ k.transpose(-2, -1) + mask) / self.dh ** 0.5, dim=-1) @ v
        if self.kind == "mulmask_causal":
            # OpenAI GPT's: the scaled scores times a 0 / 1 causal buffer, plus -1e4 where it
            # is 0 (w * b + -1e4 * (1 - b))
            w = q @ k.transpose(-2, -1) / self.dh ** 0.5
            b = self.causal[:, :, :s, :s].to(w.dtype)
            return torch.softmax(w * b + -1e4 * (1 - b), dim=-1) @ v
        if self.kind == "bias2_causal_pad":
            # CTRL's: scaled scores + the causal mask * -1e4 (a float [S, S] buffer of 0 / 1)
            # + the additive padding mask built at run time
            w = q @ k.transpose(-2, -1) / self.dh ** 0.5
            w = w + (~self.causal[0, 0, :s, :s]).to(w.dtype) * -1e4
            return torch.softmax(w + (1.0 - attention_mask[:, None, None, :].to(w.dtype)) * fmin,
                                 dim=-1) @ v
        if self.kind == "fill_causal_pad":
            w = q @ k.transpose(-2, -1) / self.dh ** 0.5
            w = w.masked_fill(~self.causal[:, :, :s, :s], float("-inf"))
            w = w + (1.0 - attention_mask[:, None, None, :].to(w.dtype)) * torch.finfo(w.dtype).min
            return torch.softmax(w, dim=-1) @ v
        if self.kind == "fill_window_ninf":
            w = (q * self.dh ** -0.5) @ k.transpose(-2, -1)
            w = w.masked_fill(~self.window[:s, :s], float("-inf"))
            return torch.softmax(w, dim=-1) @ v
        w = q @ k.transpose(-2, -1) / self.dh ** 0.5
        causal = self.causal[:, :, :s, :s]
        fill = torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype)
        if self.kind == "where_causal_pad":
            causal = causal & attention_mask[:, None, None, :].bool()
        w = torch.where(causal, w, fill)
        if self.kind == "where_gpt2_pad":
            w = w + (1.0 - attention_mask[:, None, None, :].to(w.dtype)) * torch.finfo(w.dtype).min
        return torch.softmax(w, dim=-1) @ v

    def forward(self, x, attention_mask=None):
        b, s, d = x.shape
        h = self.ln1(x)

        def heads(t):
            return t.view(b, s, self.h, self.dh).transpose(1, 2)

        a = self.attention(heads(self.q(h)), heads(self.k(h)), heads(self.v(h)), attention_mask)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class AttnLayers(torch.nn.Module):
    """Attention-only residual layers (d 8, 2 heads of 4), one per spelling (module docstring).
    kv: "repeat" (transformers' repeat_kv where kv_heads < heads) or "bcast" (K / V of
    kv_heads = 1 broadcast to the query heads by the matmuls, Falcon's multi-query)."""

    def __init__(self, spellings, kv_heads=2, d=8, heads=2, kv="repeat"):
        super().__init__()
        self.spellings, self.h, self.hk, self.dh, self.kv = spellings, heads, kv_heads, d // heads, kv
        n = len(spellings)
        self.q = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))
        self.k = torch.nn.ModuleList(torch.nn.Linear(d, kv_heads * self.dh) for _ in range(n))
        self.v = torch.nn.ModuleList(torch.nn.Linear(d, kv_heads * self.dh) for _ in range(n))
        self.o = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))
        self.register_buffer("causal", torch.tril(torch.ones(S, S, dtype=torch.bool)),
                             persistent=False)
        self.register_buffer("diag", torch.eye(S, dtype=torch.bool), persistent=False)
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])
        self.register_buffer("alibi", (slopes[:, None] * torch.arange(S)[None, :])
                             .view(1, heads, 1, S), persistent=False)
        self.register_buffer("slopes", slopes, persistent=False)

    def bmm_attention(self, sp, q, k, v, attention_mask):
        """Scores on [B * H, S, dh] views (module docstring's bmm_all), the heads merged back to
        [B, S, H * dh]."""
        b, h, s, dh = q.shape
        if sp == "bmm_seqheads":  # [B, S, H, dh] merged: not the heads' view
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q3, v3 = q.reshape(b * h, s, dh), v.reshape(b * h, s, dh)
        k3t = k.reshape(b * h, s, dh).transpose(-1, -2)
        if "_alibi" in sp:  # BLOOM's build_alibi_tensor: slopes x kept positions
            pos = ((attention_mask.cumsum(-1) - 1) * attention_mask)[:, None, :].to(q.dtype)
            alibi = (self.slopes[..., None] * pos).reshape(b * h, 1, s)
            w3 = torch.baddbmm(alibi, q3, k3t, beta=1.0, alpha=dh ** -0.5)
        elif "_zeros" in sp:
            w3 = torch.baddbmm(torch.zeros(b * h, s, s, dtype=q.dtype), q3, k3t, beta=1.0,
                               alpha=dh ** -0.5)
        else:
            w3 = torch.bmm(q3, k3t) * dh ** -0.5
        w = w3.view(b, h, s, s)
        if "_pad" in sp or sp == "bmm_seqheads":
            keep = self.causal[:s, :s] & attention_mask[:, None, None, :].bool()
            w = w + (1.0 - keep.to(w.dtype)) * torch.finfo(w.dtype).min
        p = torch.softmax(w, dim=-1)
        if sp.endswith("_v4"):  # GPT-NeoX-Japanese: P @ V on the 4-D heads
            a = p @ v
        else:  # BLOOM: bmm on the views, then the heads' view back
            a = torch.bmm(p.view(b * h, s, s), v3).view(b, h, s, dh)
        return a.transpose(1, 2).reshape(b, s, h * dh)

    def forward(self, x, attention_mask):
        b, s, d = x.shape
        fmin = torch.finfo(x.dtype).min
        pad = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * fmin
        for i, sp in enumerate(self.spellings):
            q = self.q[i](x).view(b, s, self.h, self.dh).transpose(1, 2)
            k = self.k[i](x).view(b, s, self.hk, self.dh).transpose(1, 2)
            v = self.v[i](x).view(b, s, self.hk, self.dh).transpose(1, 2)
            if self.hk != self.h and self.kv == "repeat":  # transformers' repeat_kv
                rep = self.h // self.hk
                k = k[:, :, None].expand(b, self.hk, rep, s, self.dh).reshape(b, self.h, s, self.dh)
                v = v[:, :, None].expand(b, self.hk, rep, s, self.dh).reshape(b, self.h, s, self.dh)
            causal = self.causal[:s, :s]
            if sp.startswith("bmm"):  # BLOOM's / GPT-NeoX-Japanese's [B * H] views
                x = x + self.o[i](self.bmm_attention(sp, q, k, v, attention_mask))
                continue
            if sp.startswith("sdpa"):  # torch's fused attention (transformers' default)
                # (the diagonal kept: a fully masked row's NaN softmax makes the export's
                # gradients NaN, which gen.py's check against torch refuses)
                keep = (causal & attention_mask[:, None, None, :].bool()) | self.diag[:s, :s]
                a = (F.scaled_dot_product_attention(q, k, v, is_causal=True) if sp == "sdpa_causal"
                     else F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
                     if sp == "sdpa_bool" else
                     F.scaled_dot_product_attention(q, k, v, attn_mask=pad)
                     if sp == "sdpa_float" else F.scaled_dot_product_attention(q, k, v))
                x = x + self.o[i](a.transpose(1, 2).reshape(b, s, d))
                continue
            w = q @ k.transpose(-2, -1) / self.dh ** 0.5
            if sp.startswith("alibi"):  # MPT: the bias, then the mask
                w = w + self.alibi[..., :s]
                keep = causal & attention_mask[:, None, None, :].bool()
                w = (torch.where(keep, w, torch.full([], fmin, dtype=w.dtype))
                     if sp == "alibi_keep" else w.masked_fill(~keep, fmin))
            elif sp == "bias":
                w = w + torch.zeros(s, s).masked_fill(~causal, fmin)
            elif sp.startswith("keep"):
                w = torch.where(causal, w, torch.full([], fmin, dtype=w.dtype))
            elif sp.startswith("fill"):
                w = w.masked_fill(~causal, float("-inf"))
            if sp.endswith("_pad"):
                w = w + pad
            p = torch.softmax(w, dim=-1)
            x = x + self.o[i]((p @ v).transpose(1, 2).reshape(b, s, d))
        return x


KINDS = ["where_causal", "where_causal_pad", "where_gpt2_pad", "fill_causal_pad", "fill_window_ninf",
         "gqa_where_all", "where_window", "where_window_pad", "bias_window", "bias_window_pad",
         "alibi_fill_pad", "mqa_bias_causal", "mqa_all", "alibi_all", "sdpa_all", "sdpa_math_all",
         "bias_prescale_pad", "bias2_causal_pad", "mulmask_causal", "bmm_all", "bmm_seqheads"]
PADDED = {"where_causal_pad", "where_gpt2_pad", "fill_causal_pad", "gqa_where_all",
          "bias_prescale_pad", "bias2_causal_pad",
          "where_window_pad", "bias_window_pad", "alibi_fill_pad", "mqa_all", "alibi_all",
          "sdpa_all", "sdpa_math_all", "bmm_all", "bmm_seqheads"}
# torch-joint only: exported under SDPBackend.MATH (the only sdpa backend whose backward torch
# 2.13's exporter decomposes on CPU)
TORCH_ONLY = {"sdpa_math_all"}
# (mulmask_causal: torch-joint feeds the buffer as a graph input, whose 0s and 1s no rule can
# check, so it stays unfused there)
ORTT_ONLY = {"sdpa_all", "mulmask_causal"}
# kinds whose padding leaves whole windows padded (fully masked query rows)
WINDOW_PADDED = {"where_window_pad", "bias_window_pad"}
# ort-training kinds also exported with the forward at opset 12 (`<kind>_opset12`)
OPSET12 = ["where_causal", "where_window", "bias_window_pad"]
class Stack(torch.nn.Module):
    """AttnLayers models one after the other on (x, attention_mask)."""

    def __init__(self, *parts):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, x, attention_mask):
        for p in self.parts:
            x = p(x, attention_mask)
        return x


MQA_ALL = ["keep", "keep_pad", "fill", "fill_pad", "bias", "plain", "alibi_keep", "alibi_fill"]
LAYERS = {"gqa_where_all": lambda: AttnLayers(["keep", "keep_pad", "fill", "fill_pad"], 1),
          "mqa_all": lambda: AttnLayers(MQA_ALL, 1, kv="bcast"),
          # the bias-then-mask spellings on full heads and on repeat_kv's groups
          "sdpa_all": lambda: AttnLayers(["sdpa_causal", "sdpa_bool", "sdpa_float", "sdpa_none"]),
          # the same four on full heads, then a bool mask, a float mask and none on repeat_kv's
          # groups and on one kv head broadcast by sdpa itself
          "sdpa_math_all": lambda: Stack(
              AttnLayers(["sdpa_causal", "sdpa_bool", "sdpa_float", "sdpa_none"]),
              AttnLayers(["sdpa_bool", "sdpa_float", "sdpa_none"], 1),
              AttnLayers(["sdpa_bool", "sdpa_float", "sdpa_none"], 1, kv="bcast")),
          "bmm_all": lambda: AttnLayers([f"bmm_{a}{p}{v}" for a in ("alibi", "zeros", "none")
                                         for p in ("_pad", "") for v in ("", "_v4")]),
          "bmm_seqheads": lambda: AttnLayers(["bmm_seqheads"]),
          "alibi_all": lambda: Stack(AttnLayers(["alibi_keep", "alibi_fill"], 2),
                                     AttnLayers(["alibi_keep", "alibi_fill"], 1))}


def main(family: str, only: list[str]) -> None:
    prefix = gen.PREFIX[family]
    builder = gen.build_ortt if family == "ort-training" else gen.build_torch
    styles = KINDS + ([f"{k}_opset12" for k in OPSET12] if family == "ort-training" else [])
    for style in styles:
        if (only and style not in only) or style in (
                ORTT_ONLY if family == "torch-joint" else TORCH_ONLY):
            continue
        kind = style.removesuffix("_opset12")
        kw = {"opset": 12} if style.endswith("_opset12") else {}
        torch.manual_seed(0)
        inputs = {"x": torch.randn(2, S, 8)}
        ranges = {}
        if kind in WINDOW_PADDED:
            # batch 0: the last two keys padded (every row keeps a key); batch 1: keys 0..2
            # padded (queries 0, 1, 2 see only padded keys in their window: fully masked)
            inputs["attention_mask"] = torch.tensor([[1] * 6 + [0] * 2, [0] * 3 + [1] * 5])
            ranges["attention_mask"] = [0, 2]
        elif kind in PADDED:
            # batch 0: the last three keys padded (rows 0..4 partly kept); batch 1: key 0 padded
            # (row 0 fully masked under the causal mask)
            inputs["attention_mask"] = torch.tensor([[1] * 5 + [0] * 3, [0] + [1] * 7])
            ranges["attention_mask"] = [0, 2]
        arch = types.SimpleNamespace(library="torch", input_ranges=ranges)
        name = f"{prefix}_flash_{style}"
        with tempfile.TemporaryDirectory() as td, (
                sdpa_kernel([SDPBackend.MATH]) if kind in TORCH_ONLY else nullcontext()):
            model = (LAYERS[kind]() if kind in LAYERS else WhereBlock(kind)).train()
            res = builder(arch, model, inputs, name, Path(td), True, **kw)
            shutil.copy(Path(td) / f"{name}.onnx", HERE / f"{name}.onnx")
        print(f"{name}: max |grad - torch| {res['max_abs_grad_err_vs_torch']:.3g}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
