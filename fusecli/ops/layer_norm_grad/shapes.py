"""LayerNormGrad's input-shape check (fusecli/ops/shapes.py): the shape guard runs it before a
fusion."""

from __future__ import annotations

from fusecli.ops.shapes import numel, show


def input_problem(attrs: dict, ins: list) -> str | None:
    """LayerNormGrad's gamma holds one value per normalised element (X's dims from axis on):
    a scalar multiplied onto dY (a loss scale) is no gamma."""
    x, gamma = ins[1], ins[2] if len(ins) > 2 else None
    if x is None or gamma is None:
        return None
    n, g = numel(x[attrs.get("axis", -1):]), numel(gamma)
    if n is not None and g is not None and n != g:
        return (f"LayerNormGrad's gamma {show(gamma)} does not have X's normalised size "
                f"{show(x[attrs.get('axis', -1):])}")
    return None
