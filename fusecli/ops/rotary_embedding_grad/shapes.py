"""RotaryEmbeddingGrad's input-shape check (fusecli/ops/shapes.py): the shape guard runs it
before a fusion."""

from __future__ import annotations

from fusecli.ops.shapes import show


def input_problem(attrs: dict, ins: list) -> str | None:
    """The rotated width D (dY's last dim) is split in two halves, so it is even; cos / sin
    have D as their last dim (rope_ortt_symbolic binds the halves of whatever D is, at
    Shape(X)[-1] / 2, which for an odd D are not halves)."""
    dy = ins[0]
    if not dy or not isinstance(dy[-1], int):
        return None
    if dy[-1] % 2:
        return f"RotaryEmbeddingGrad's rotated width (dY {show(dy)}'s last dim) is odd"
    for name, cs in zip(("cos", "sin"), ins[1:3]):
        if cs and isinstance(cs[-1], int) and cs[-1] != dy[-1]:
            return (f"RotaryEmbeddingGrad's {name} {show(cs)} does not have dY {show(dy)}'s "
                    "last dim (the rotated width)")
    return None
