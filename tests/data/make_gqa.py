"""Regenerates the grouped-/multi-query attention fixtures in tests/data/gqa: one attention
layer (x [2, 4, 16] -> q/k/v Linears -> softmax(q k^T / sqrt(4)) v -> out Linear, MSE loss), 4
query heads of 4 over `kv` key/value heads, the K/V heads repeated to the query heads in one of
the spellings real code uses:

- expand: x[:, :, None].expand(...).reshape(...)   (transformers' repeat_kv; head h uses h // g)
- interleave: torch.repeat_interleave(x, g, dim=1) (the same grouping)
- tile: x.repeat(1, g, 1, 1)                       (ONNX Tile; head h uses kv head h % kv)
- bcast: q viewed [B, kv, g, S, D], k/v unsqueezed to [B, kv, 1, S, D]: broadcast inside the
  MatMuls (h // g)

Fine-tuning cases (torch-joint): expand with kv 2 and one projection frozen (`_frozen_q`,
`_frozen_k`, `_frozen_v`: its Linear's parameters need no gradient and x needs none, so the
backward has no dQ, dK or dV branch).

Both families, through the corpus exporters (scripts/corpus/gen.py: TorchScript +
onnxruntime-training artifacts; aot_export joint + dynamo export):
  build/venv-corpus-ortt/bin/python tests/data/make_gqa.py ort-training
  build/venv-corpus-torch/bin/python tests/data/make_gqa.py torch-joint [NAME ...]
Files: tests/data/gqa/{ortt,torch}_gqa_<spelling>_kv<kv>[_frozen_<q|k|v>].onnx (+ .params.npz);
NAMEs (without the family prefix) limit the run to those cases.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "corpus"))
import gen  # noqa: E402
from archs import Arch  # noqa: E402

B, S, E, H, D = 2, 4, 16, 4, 4
SPELLINGS = ("expand", "interleave", "tile", "bcast")
CASES = [("expand", 2, ""), ("expand", 1, ""), ("interleave", 2, ""), ("tile", 2, ""),
         ("bcast", 2, ""), ("bcast", 1, "")]
FROZEN = [("expand", 2, p) for p in "qkv"]  # torch-joint only


class GQA(nn.Module):
    def __init__(self, spelling: str, kv: int, frozen: str = "") -> None:
        super().__init__()
        self.spelling, self.kv, self.g = spelling, kv, H // kv
        self.q = nn.Linear(E, H * D)
        self.k = nn.Linear(E, kv * D)
        self.v = nn.Linear(E, kv * D)
        self.o = nn.Linear(H * D, E)
        if frozen:
            getattr(self, frozen).requires_grad_(False)

    def _rep(self, t: torch.Tensor) -> torch.Tensor:  # [B, kv, S, D] -> [B, H, S, D]
        if self.spelling == "expand":
            return t[:, :, None].expand(B, self.kv, self.g, S, D).reshape(B, H, S, D)
        if self.spelling == "interleave":
            return torch.repeat_interleave(t, self.g, dim=1)
        return t.repeat(1, self.g, 1, 1)  # tile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(B, S, H, D).transpose(1, 2)
        k = self.k(x).view(B, S, self.kv, D).transpose(1, 2)
        v = self.v(x).view(B, S, self.kv, D).transpose(1, 2)
        if self.spelling == "bcast":
            q = q.reshape(B, self.kv, self.g, S, D)
            k, v = k[:, :, None], v[:, :, None]
        else:
            k, v = self._rep(k), self._rep(v)
        p = torch.softmax(q @ k.transpose(-1, -2) / D ** 0.5, dim=-1)
        o = (p @ v).reshape(B, H, S, D).transpose(1, 2).reshape(B, S, H * D)
        return self.o(o)


def main(family: str, only: list[str]) -> None:
    dest = Path(__file__).resolve().parent / "gqa"
    dest.mkdir(exist_ok=True)
    for spelling, kv, frozen in CASES + (FROZEN if family == "torch-joint" else []):
        case = f"gqa_{spelling}_kv{kv}" + (f"_frozen_{frozen}" if frozen else "")
        if only and case not in only:
            continue
        name = f"{gen.PREFIX[family]}_{case}"
        arch = Arch(name, "test", "", lambda fam: None, lambda: {"x": torch.randn(B, S, E)})
        torch.manual_seed(0)
        model = GQA(spelling, kv, frozen).train()
        inputs = arch.inputs()
        builder = gen.build_ortt if family == "ort-training" else gen.build_torch
        res = builder(arch, model, inputs, name, dest, True)
        print(f"{name}: {len(res['model'].graph.node)} nodes, max |grad - torch| = "
              f"{res['max_abs_grad_err_vs_torch']:.3g}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
