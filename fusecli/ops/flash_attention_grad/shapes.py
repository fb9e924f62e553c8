"""FlashAttentionGrad's input-shape check (fusecli/ops/shapes.py): FlashAttention's, on the
grad's ports (dO, Q, K, V, O, LSE, bias, mask)."""

from __future__ import annotations

from fusecli.ops.flash_attention.shapes import flash_problem


def input_problem(attrs: dict, ins: list) -> str | None:
    ins = list(ins) + [None] * (8 - len(ins))
    return flash_problem("FlashAttentionGrad", attrs, *ins[1:4], ins[6], ins[7])
