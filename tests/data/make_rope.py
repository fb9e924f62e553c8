"""Regenerates tests/data/{ortt,torch}_rope_{half,partial,interleaved,inputs,bad_concat,
bad_slice}.onnx, ortt_rope_*_symbolic.onnx and torch_rope_*_raw.onnx: one eager self-attention
layer (hidden 16, 2 heads of 8, no biases, input [2, 4, 16], MSE loss) whose Q and K go through
rotary position embeddings written like transformers' Llama (`apply_rotary_pos_emb`: q * cos +
rotate_half(q) * sin, cos/sin from LlamaRotaryEmbedding's inv_freq and the position ids, unsqueezed on the head axis):

  half         rotate-half, all 8 head dims rotated, cos/sin computed from position_ids
                                                                       2 rotations (Q, K)
  partial      rotate-half on the first 4 head dims only (GPT-NeoX / Phi partial_rotary_factor
               0.5: q_rot, q_pass split, rotated, concatenated back)   2 rotations
  interleaved  GPT-J's rotate_every_two (pairs (2i, 2i+1)), cos/sin repeat_interleave'd
                                                                       2 rotations
  inputs       rotate-half, cos and sin given as graph inputs [2, 4, 8] 2 rotations
  bad_concat   look-alike: cat(x1, -x2) instead of cat(-x2, x1) (not a rotation)   0
  bad_slice    look-alike: rotate-half split at 3 of 8 dims (not half)              0

ort-training only, `<style>_symbolic` (half, partial, bad_concat, bad_slice): the same layer
with x / position_ids exported with symbolic batch and sequence dims (dynamic_axes, as the
corpus' *_symbolic graphs), the views written with x's run-time dims. rotate_half's
`x.shape[-1] // 2` is then computed at run time (Shape -> Gather -> Div), and bad_slice splits
at `x.shape[-1] // 4` (a run-time point that is not the half)                        same counts

torch-joint only, `<style>_raw` (half, bad_concat, bad_slice): the same layer exported raw,
torch.onnx.export(dynamo=True, optimize=False), as big models are exported: every Slice reads
its own Cast/Reshape constants, each slice_scatter its own CastLike zeros        same counts

Through the corpus exporters (scripts/corpus/gen.py), each checked against torch autograd:
build/venv-corpus-ortt/bin/python tests/data/make_rope.py ort-training [STYLE ...]
build/venv-corpus-torch/bin/python tests/data/make_rope.py torch-joint
"""

import functools
import math
import shutil
import sys
import tempfile
import types
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "scripts" / "corpus"))
import gen  # noqa: E402

B, S, D, H = 2, 4, 16, 2
HD = D // H


def rotate_half(x, split=None):
    h = x.shape[-1] // 2 if split is None else split
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, style, symbolic=False):
        super().__init__()
        self.style, self.symbolic = style, symbolic
        self.rot = HD // 2 if style == "partial" else HD
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(D, D, bias=False) for _ in range(4))
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, self.rot, 2).float() / self.rot))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, position_ids):
        # LlamaRotaryEmbedding.forward
        inv = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        if self.style == "interleaved":
            emb = torch.repeat_interleave(freqs, 2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def rope(self, x, cos, sin):
        if self.style == "interleaved":
            return x * cos + rotate_every_two(x) * sin
        if self.style == "bad_concat":
            h = x.shape[-1] // 2
            return x * cos + torch.cat((x[..., :h], -x[..., h:]), dim=-1) * sin
        if self.style == "bad_slice":
            split = x.shape[-1] // 4 if self.symbolic else 3
            return x * cos + rotate_half(x, split=split) * sin
        return x * cos + rotate_half(x) * sin

    def forward(self, x, *extra):
        b, s = (x.shape[0], x.shape[1]) if self.symbolic else (B, S)
        q = self.q_proj(x).view(b, s, H, HD).transpose(1, 2)
        k = self.k_proj(x).view(b, s, H, HD).transpose(1, 2)
        v = self.v_proj(x).view(b, s, H, HD).transpose(1, 2)
        cos, sin = extra if self.style == "inputs" else self.cos_sin(extra[0])
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if self.style == "partial":
            q_rot, q_pass = q[..., :self.rot], q[..., self.rot:]
            k_rot, k_pass = k[..., :self.rot], k[..., self.rot:]
            q = torch.cat((self.rope(q_rot, cos, sin), q_pass), dim=-1)
            k = torch.cat((self.rope(k_rot, cos, sin), k_pass), dim=-1)
        else:
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        p = torch.softmax(q @ k.transpose(2, 3) / math.sqrt(HD), dim=-1)
        return self.o_proj((p @ v).transpose(1, 2).reshape(b, s, D))


STYLES = ["half", "partial", "interleaved", "inputs", "bad_concat", "bad_slice"]
SYMBOLIC = ["half_symbolic", "partial_symbolic", "bad_concat_symbolic", "bad_slice_symbolic"]
RAW = ["half_raw", "bad_concat_raw", "bad_slice_raw"]


def main(family: str, names: list[str]) -> None:
    prefix = gen.PREFIX[family]
    for style in names or STYLES + (SYMBOLIC if family == "ort-training" else RAW):
        raw = style.endswith("_raw")
        builder = (gen.build_ortt if family == "ort-training" else
                   functools.partial(gen.build_torch, optimize=not raw))
        torch.manual_seed(0)
        base = style.removesuffix("_symbolic").removesuffix("_raw")
        model = Attention(base, symbolic=style.endswith("_symbolic")).train()
        inputs = {"x": torch.randn(B, S, D)}
        pos = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
        if base == "inputs":
            cos, sin = Attention("half").cos_sin(pos)
            inputs.update(cos=cos, sin=sin)
            ranges = {}
        else:
            inputs["position_ids"] = pos
            ranges = {"position_ids": [0, S]}
        dynamic = ({k: {0: "batch", 1: "sequence"} for k in inputs} if model.symbolic
                   else None)
        arch = types.SimpleNamespace(library="torch", input_ranges=ranges)
        name = f"{prefix}_rope_{style}"
        with tempfile.TemporaryDirectory() as td:
            res = builder(arch, model, inputs, name, Path(td), True, dynamic=dynamic)
            shutil.copy(Path(td) / f"{name}.onnx", HERE / f"{name}.onnx")
        print(f"{name}.onnx: {len(res['model'].graph.node)} nodes, max |grad - torch| = "
              f"{res['max_abs_grad_err_vs_torch']:.3g}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
