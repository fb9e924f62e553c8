"""LinearCrossEntropy's input-shape check (see fusecli/ops/shapes.py)."""

from __future__ import annotations


from fusecli.ops.shapes import numel, show


def input_problem(attrs, ins):
    h, w, bias, labels, _, _, seed = (ins + [None] * 7)[:7]
    if numel(seed) not in (None, 1):
        return f"LinearCrossEntropy: grad_seed {show(seed)} is not one value"
    if w is not None and len(w) != 2:
        return f"LinearCrossEntropy: W {show(w)} is not [V, D]"
    if h and w and isinstance(h[-1], int) and isinstance(w[1], int) and h[-1] != w[1]:
        return f"LinearCrossEntropy: H {show(h)} and W {show(w)} differ in D"
    if h and w and bias is not None and numel(bias) is not None and isinstance(w[0], int) \
            and numel(bias) != w[0]:
        return f"LinearCrossEntropy: bias {show(bias)} is not [V] of W {show(w)}"
    rows = numel(h[:-1]) if h else None
    if rows is not None and numel(labels) is not None and numel(labels) != rows:
        return (f"LinearCrossEntropy: {numel(labels)} labels for the {rows} rows of H "
                f"{show(h)}")
    return None
