"""Regenerates tests/data/{ortt,torch}_rope_sp_<style>.onnx: rotary-embedding spellings that
make_rope.py's Llama-style layer lacks, each in one eager self-attention layer (hidden 16, 2
heads of 8, no biases, input [2, 4, 16], position ids 0..3, MSE loss), rotating Q and K with the
library's own functions where transformers 4.57 has them:

  llama        transformers' Llama apply_rotary_pos_emb (rotate-half, [b, h, s, d])   2 (Q, K)
  neox_partial transformers' GPT-NeoX apply_rotary_pos_emb with cos / sin of 4 of the 8 head
               dims (partial rotary: q_rot, q_pass = q[..., :4], q[..., 4:])          2
  gptj         transformers' GPT-J apply_rotary_pos_emb: rotate_every_two (x[:, :, :, ::2],
               x[:, :, :, 1::2], stack((-x2, x1), -1).flatten(-2)) on [b, s, h, d], sin / cos
               from create_sinusoidal_positions gathered at the position ids and
               repeat_interleave'd, as GPTJAttention does                            2
  gptj_partial the same with rotary_dim 4 of 8 (GPTJAttention's k_rot / k_pass)        2
  chunk        rotate-half written x1, x2 = x.chunk(2, dim=-1)                         2
  split        rotate-half written torch.split(x, x.shape[-1] // 2, dim=-1)            2
  sin_first    Llama's rotate_half with the sum written rotate_half(x) * sin + x * cos
               (torch-joint sums dX's terms in another order)                        2
  sin_first_hi the same with rotate-half written cat((-x[..., h:], x[..., :h]), -1) (the
               high half sliced first: dX's terms in a third order)                  2
  gptj_sin_first GPT-J's rotate_every_two with the sum written so                      2
  roformer     transformers' RoFormerSelfAttention.apply_rotary_position_embeddings: the
               pairs rotated as GPT-J's, stack((-x[..., 1::2], x[..., ::2]), -1) reshaped, on
               [b, h, s, d], cos / sin from RoFormerSinusoidalPositionalEmbedding stacked
               pairwise (an encoder's rotary; torch-joint sums dX's terms in another order)  2
  roformer_value the same with rotary_value (V rotated too)                            3
  look-alikes (not rotations the op computes; 0 each):
  gptj_swapped   stack((x2, -x1), -1).flatten(-2): the pairs rotated the other way
  gptj_perm      stack((-x2, x1), -2).flatten(-2): the even / odd halves concatenated
                 (a different permutation: neither rotate-every-two nor rotate-half)
  bad_slice      rotate-half split at 3 of 8 dims
  bad_concat     cat(x1, -x2) instead of cat(-x2, x1)

ort-training exports with opset 16 (scripts/corpus/gen.py's) and, `_opset12` (llama,
neox_partial, gptj, bad_slice, bad_concat), the forward exported at opset 12, as older export
scripts do: onnxruntime-training's GatherSliceToSplitFusion needs opset >= 13, so rotate-half's
two Slices stay Slices with static shapes and their gradient is SliceGrad (padding each half
back into Shape(x)) summed with dY * cos, where opset 16 gives Split + Concat.

Through the corpus exporters (scripts/corpus/gen.py), each checked against torch autograd:
build/venv-corpus-ortt/bin/python tests/data/make_rope_spellings.py ort-training [STYLE ...]
build/venv-corpus-torch/bin/python tests/data/make_rope_spellings.py torch-joint [STYLE ...]
"""

import math
import sys
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "scripts" / "corpus"))
import gen  # noqa: E402  (first: it sets transformers up as the corpus does)
from transformers.models.gpt_neox import modeling_gpt_neox as neox  # noqa: E402
from transformers.models.gptj import modeling_gptj as gptj  # noqa: E402
from transformers.models.llama import modeling_llama as llama  # noqa: E402
from transformers.models.roformer import modeling_roformer as roformer  # noqa: E402

B, S, D, H = 2, 4, 16, 2
HD = D // H


def rotate_half_chunk(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_split(x):
    x1, x2 = torch.split(x, x.shape[-1] // 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_at_3(x):
    return torch.cat((-x[..., 3:], x[..., :3]), dim=-1)


def rotate_half_hi_first(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def not_a_rotation(x):
    h = x.shape[-1] // 2
    return torch.cat((x[..., :h], -x[..., h:]), dim=-1)


def every_two_swapped(x):
    x1, x2 = x[:, :, :, ::2], x[:, :, :, 1::2]
    return torch.stack((x2, -x1), dim=-1).flatten(-2)


def every_two_perm(x):
    x1, x2 = x[:, :, :, ::2], x[:, :, :, 1::2]
    return torch.stack((-x2, x1), dim=-2).flatten(-2)


HALF_BY = {"chunk": rotate_half_chunk, "split": rotate_half_split, "bad_slice": rotate_half_at_3,
           "bad_concat": not_a_rotation}
EVERY_TWO_BY = {"gptj_swapped": every_two_swapped, "gptj_perm": every_two_perm,
                "gptj_sin_first": gptj.rotate_every_two}
# rotations from the model code: Q and K, once each (the look-alikes: none)
EXPECTED = {"llama": 2, "neox_partial": 2, "gptj": 2, "gptj_partial": 2, "chunk": 2, "split": 2,
            "sin_first": 2, "sin_first_hi": 2, "gptj_sin_first": 2, "roformer": 2,
            "roformer_value": 3,
            "gptj_swapped": 0, "gptj_perm": 0, "bad_slice": 0, "bad_concat": 0}
OPSET12 = ["llama", "neox_partial", "gptj", "bad_slice", "bad_concat"]


class Attention(nn.Module):
    def __init__(self, style):
        super().__init__()
        self.style = style
        self.rot = HD // 2 if style.endswith("_partial") else HD
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(D, D, bias=False) for _ in range(4))
        # GPTJAttention's table: [max positions, rot] = cat(sin, cos)
        self.register_buffer("embed_positions", gptj.create_sinusoidal_positions(16, self.rot),
                             persistent=False)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, self.rot, 2).float() / self.rot))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.sinusoidal = roformer.RoFormerSinusoidalPositionalEmbedding(16, HD)
        self.sinusoidal._init_weight()  # as RoFormerPreTrainedModel does: a frozen table

    def gptj_rope(self, q, k, position_ids):
        """GPTJAttention.forward's rotary part on q, k [b, s, h, d]."""
        fn = EVERY_TWO_BY.get(self.style)
        ep = self.embed_positions.repeat(position_ids.shape[0], 1, 1)
        rp = position_ids.unsqueeze(-1).repeat(1, 1, ep.shape[-1])
        sincos = torch.gather(ep, 1, rp)
        sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)

        def rope(t):
            if fn is None:
                return gptj.apply_rotary_pos_emb(t, sin, cos)
            s2 = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
            c2 = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
            if self.style == "gptj_sin_first":
                return fn(t) * s2 + t * c2
            return t * c2 + fn(t) * s2

        if self.rot < HD:
            q = torch.cat([rope(q[:, :, :, :self.rot]), q[:, :, :, self.rot:]], dim=-1)
            k = torch.cat([rope(k[:, :, :, :self.rot]), k[:, :, :, self.rot:]], dim=-1)
            return q, k
        return rope(q), rope(k)

    def cos_sin(self, position_ids):
        # LlamaRotaryEmbedding.forward
        inv = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, x, position_ids):
        q = self.q_proj(x).view(B, S, H, HD)
        k = self.k_proj(x).view(B, S, H, HD)
        v = self.v_proj(x).view(B, S, H, HD).transpose(1, 2)
        if self.style.startswith("roformer"):  # RoFormerSelfAttention on [b, h, s, d]
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            pos = self.sinusoidal(torch.Size([B, S]))[None, None, :, :]
            rotate = roformer.RoFormerSelfAttention.apply_rotary_position_embeddings
            if self.style == "roformer_value":
                q, k, v = rotate(pos, q, k, v)
            else:
                q, k = rotate(pos, q, k)
        elif self.style.startswith("gptj"):
            q, k = self.gptj_rope(q, k, position_ids)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        else:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            cos, sin = self.cos_sin(position_ids)
            if self.style == "llama":
                q, k = llama.apply_rotary_pos_emb(q, k, cos, sin)
            elif self.style.startswith("sin_first"):
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
                rot = llama.rotate_half if self.style == "sin_first" else rotate_half_hi_first
                q, k = rot(q) * sin + q * cos, rot(k) * sin + k * cos
            elif self.style == "neox_partial":
                q, k = neox.apply_rotary_pos_emb(q, k, cos, sin)
            else:
                rot = HALF_BY[self.style]
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
                q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        p = torch.softmax(q @ k.transpose(2, 3) / math.sqrt(HD), dim=-1)
        return self.o_proj((p @ v).transpose(1, 2).reshape(B, S, D))


def main(family: str, names: list[str]) -> None:
    default = list(EXPECTED) + ([f"{s}_opset12" for s in OPSET12]
                                if family == "ort-training" else [])
    for style in names or default:
        base = style.removesuffix("_opset12")
        kw = {"opset": 12} if style.endswith("_opset12") else {}
        torch.manual_seed(0)
        model = Attention(base).train()
        inputs = {"x": torch.randn(B, S, D),
                  "position_ids": torch.arange(S).unsqueeze(0).expand(B, S).contiguous()}
        gen.write_fixture(family, model, inputs, f"rope_sp_{style}", HERE,
                          input_ranges={"position_ids": [0, S]}, **kw)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
