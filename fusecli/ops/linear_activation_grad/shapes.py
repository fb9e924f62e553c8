"""LinearActivationGrad's input-shape check (fusecli/ops/shapes.py): the shape guard runs it
before a fusion."""

from __future__ import annotations

from fusecli.ops.shapes import show


def input_problem(attrs: dict, ins: list) -> str | None:
    """LinearActivationGrad's W is one [N, K] matrix (trans_w: [K, N]): a batched right operand
    of the input-gradient MatMul (which a frozen-weight rule binds without a weight gradient to
    prove it) is no weight."""
    dy, w = ins[0], ins[3] if len(ins) > 3 else None
    if w is None:
        return None
    if len(w) != 2:
        return f"LinearActivationGrad's W {show(w)} is not a 2-D weight"
    n = w[0 if not attrs.get("trans_w", 0) else 1]
    if dy and isinstance(dy[-1], int) and isinstance(n, int) and dy[-1] != n:
        return (f"LinearActivationGrad's W {show(w)} does not fit dY {show(dy)} "
                f"(trans_w={attrs.get('trans_w', 0)})")
    return None
