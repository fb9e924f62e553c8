"""LinearCrossEntropy's input-shape check (see fusecli/ops/shapes.py)."""

from __future__ import annotations


from fusecli.ops.shapes import numel, show

INT64_MAX = 2 ** 63 - 1


def label_classes(k, ins):
    """The labels (input 3) are classes of W [V, D]: V of them."""
    w = ins[1] if len(ins) > 1 else None
    return w[0] if k == 3 and w and isinstance(w[0], int) else None


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
    start, end = int(attrs.get("seq_start", 0)), int(attrs.get("seq_end", INT64_MAX))
    rows = numel(h[:-1]) if h else None
    index = ins[10] if len(ins) > 10 else None
    if index is not None:  # one row of each of G sequences (H's rows split in G)
        if (start, end) != (0, INT64_MAX):
            return "LinearCrossEntropy: seq_index does not combine with seq_start / seq_end"
        g = numel(index)
        if g is not None and rows is not None and ((rows % g or not rows) if g else rows):
            return (f"LinearCrossEntropy: seq_index {show(index)} does not split the {rows} "
                    f"rows of H {show(h)} into sequences of equal length")
        rows = g
    elif (start, end) != (0, INT64_MAX):  # the rows start:end of each sequence (H [..., S, D])
        if h is not None and len(h) < 3:
            return f"LinearCrossEntropy: seq_start / seq_end need H [..., S, D], not {show(h)}"
        s = h[-2] if h else None
        rows = (numel(h[:-2]) * len(range(s)[start:end])
                if isinstance(s, int) and numel(h[:-2]) is not None else None)
    if rows is not None and numel(labels) is not None and numel(labels) != rows:
        return (f"LinearCrossEntropy: {numel(labels)} labels for the {rows} rows of H "
                f"{show(h)}")
    return None
