"""AttentionGrad's input-shape check (fusecli/ops/shapes.py): the shape guard runs it before a
fusion."""

from __future__ import annotations

from fusecli.ops.shapes import numel, show


def input_problem(attrs: dict, ins: list) -> str | None:
    """Q, dO, K and V fit P (rows, columns, batch dims or their groups); the fill mask
    broadcasts to P."""
    if len(ins) < 5:
        return None
    dO, q, k, v, p = ins[:5]
    if p is None or len(p) < 2:
        return None
    sq, sk = p[-2], p[-1]
    if k is not None and len(k) >= 2:
        k = k[:-2] + [k[-1], k[-2]] if attrs.get("k_transposed", 0) else k
    wants = (("Q", q, -2, sq), ("dO", dO, -2, sq), ("K", k, -2, sk), ("V", v, -2, sk))
    for label, s, axis, want in wants:
        if s is None or len(s) < 2:
            continue
        if isinstance(s[axis], int) and isinstance(want, int) and s[axis] != want:
            return (f"AttentionGrad's {label} is {show(s)}, but P {show(p)} needs "
                    f"{want} rows/columns there")
    # Q and dO share P's batch dims; K's and V's (right-aligned, missing leading dims count as
    # 1) each equal P's or divide it (grouped / multi-query attention; the op sums the group)
    # (a tensor whose batch element count equals P's is P's batch dims viewed: Q [B*H, S, D]
    # with P [B, H, S, S], as the torch-joint rules bind them)
    pb = p[:-2]
    batch = numel(pb)
    for label, s, grouped in (("Q", q, False), ("dO", dO, False), ("K", k, True),
                              ("V", v, True)):
        if s is None or len(s) < 2 or len(s) - 2 > len(pb):
            continue
        if batch is not None and numel(s[:-2]) == batch:
            continue
        sb = [1] * (len(pb) - (len(s) - 2)) + list(s[:-2])
        for x, y in zip(sb, pb):
            if not (isinstance(x, int) and isinstance(y, int)) or x == y:
                continue
            if not grouped or x == 0 or y % x:
                return (f"AttentionGrad's {label} {show(s)} has batch dims that "
                        f"{'neither equal nor divide' if grouped else 'differ from'} P's "
                        f"{show(p)}")
    fill = ins[8] if len(ins) > 8 else None  # the fill mask broadcasts to P's shape
    if fill is not None:
        if len(fill) > len(p):
            return f"AttentionGrad's fill_mask {show(fill)} has more dims than P {show(p)}"
        for x, y in zip(fill[::-1], p[::-1]):
            if isinstance(x, int) and isinstance(y, int) and x not in (1, y):
                return (f"AttentionGrad's fill_mask {show(fill)} does not broadcast to P's "
                        f"shape {show(p)}")
    return None
