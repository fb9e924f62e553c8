"""FlashAttention's input-shape check (fusecli/ops/shapes.py): the shape guard runs it before a
fusion. FlashAttentionGrad's (fusecli/ops/flash_attention_grad/shapes.py) is the same check on
its ports. Both mirror flash_inputs.cc, which refuses the same shapes at run time."""

from __future__ import annotations

from fusecli.ops.shapes import show


def _known(x, y) -> bool:
    return isinstance(x, int) and isinstance(y, int)


def flash_problem(op: str, attrs: dict, q, k, v, bias=None, mask=None) -> str | None:
    """Q [..., Sq, D], K [..., Sk, D] (or [..., D, Sk] with k_transposed), V [..., Sk, Dv] with
    K's batch dims, which are no more than Q's and (right-aligned, missing ones 1) equal or
    divide them dim by dim; bias and mask broadcast (right-aligned) to [Q's batch dims, Sq, Sk].
    None: fine or unknown."""
    if q is None or k is None or len(q) < 2 or len(k) < 2:
        return None
    nd, nk = len(q) - 2, len(k) - 2
    kt = attrs.get("k_transposed", 0)
    sk, kd = (k[-1], k[-2]) if kt else (k[-2], k[-1])
    if _known(kd, q[-1]) and kd != q[-1]:
        return f"{op}'s K {show(k)} does not have Q's head dim {q[-1]} ({show(q)})"
    if nk > nd:
        return f"{op}'s K {show(k)} has more batch dims than Q {show(q)}"
    for j in range(nd):
        x, y = (1 if j + nk < nd else k[j + nk - nd]), q[j]
        if _known(x, y) and not (x == y or (x >= 1 and y % x == 0)):
            return (f"{op}'s K {show(k)} has batch dims that neither equal nor divide Q's "
                    f"{show(q)} (grouped / multi-query attention)")
    if v is not None and len(v) >= 2:
        if len(v) != len(k) or any(_known(x, y) and x != y for x, y in zip(v[:-2], k[:-2])):
            return f"{op}'s V {show(v)} does not have K's batch dims ({show(k)})"
        if _known(v[-2], sk) and v[-2] != sk:
            return f"{op}'s V {show(v)} does not have K's {sk} keys ({show(k)})"
    full = [*q[:-1], sk]
    for label, t in (("bias", bias), ("mask", mask)):
        if t is None:
            continue
        if len(t) > len(full) or any(_known(x, y) and x not in (1, y)
                                     for x, y in zip(t[::-1], full[::-1])):
            return f"{op}'s {label} {show(t)} does not broadcast to the scores {show(full)}"
    return None


def input_problem(attrs: dict, ins: list) -> str | None:
    """FlashAttention(Q, K, V, bias, mask)."""
    ins = list(ins) + [None] * (5 - len(ins))
    return flash_problem("FlashAttention", attrs, *ins[:5])
