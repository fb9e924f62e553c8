"""Saved activations: what a training step keeps from its forward for its backward.

Definition (both families): the forward is every node the loss depends on (the loss is the
graph's first output: onnxruntime-training and torch-joint graphs both write it first); a saved
activation is a tensor a forward node produces that a node outside the forward (the backward)
reads. Such a tensor lives from the forward until the backward has read it, so these tensors
set the step's peak memory; intermediates that live inside the forward or inside the backward
do not. A fusion removes a saved activation when the fused graph no longer keeps it for the
backward (the probabilities P under flash attention) and adds one when a fused forward op
writes a tensor for its backward op (FlashAttention's row log-sum-exp).

Sizes come from the recorded types: a static size in bytes, or, with symbolic dimensions, a
polynomial in them (``{("S", "S"): 4096}`` = 4096*S*S bytes); shapes that are not recorded are
inferred (onnx shape inference), and tensors whose size stays unknown are counted apart.
"""

from __future__ import annotations

from collections import Counter

import onnx
from onnx import helper

Size = dict  # monomial (sorted tuple of symbolic dim names) -> bytes coefficient


def forward_nodes(graph: onnx.GraphProto, io) -> set[int]:
    """Indices of the nodes the loss (graph output 0) depends on: the forward; io: the nodes'
    (inputs, outputs) in graph order."""
    producer = {t: i for i, (_, outs) in enumerate(io) for t in outs if t}
    fwd: set[int] = set()
    work = [graph.output[0].name] if graph.output else []
    while work:
        i = producer.get(work.pop())
        if i is None or i in fwd:
            continue
        fwd.add(i)
        work.extend(io[i][0])
    return fwd


def saved_activations(graph: onnx.GraphProto, io=None) -> set[str]:
    """Tensors a forward node produces that a backward node reads (see the module doc).
    io: the nodes' (inputs, outputs) in graph order when the caller has them already."""
    if io is None:
        io = [(n.input, n.output) for n in graph.node]
    fwd = forward_nodes(graph, io)
    made = {t for i in fwd for t in io[i][1] if t}
    return {t for i, (ins, _) in enumerate(io) if i not in fwd for t in ins if t in made}


def _types(graph: onnx.GraphProto, names) -> dict[str, onnx.TypeProto]:
    """Recorded types of `names` (value_info, graph inputs / outputs)."""
    return {v.name: v.type for v in (*graph.value_info, *graph.input, *graph.output)
            if v.name in names and v.type.HasField("tensor_type")}


def _constant_types(graph: onnx.GraphProto, names, io=None) -> dict[str, onnx.TypeProto]:
    """Types of those of `names` that Constant nodes with a tensor ``value`` write (a raw
    export saves its Constants' outputs for the backward and records no type for them).
    io: the nodes' (inputs, outputs) in graph order, when the caller has them."""
    out = {}
    io = io if io is not None else [(n.input, n.output) for n in graph.node]
    for i in [i for i, (_, outs) in enumerate(io) if outs and outs[0] in names]:
        n = graph.node[i]
        if n.op_type == "Constant":
            attr = next((a for a in n.attribute if a.name == "value" and a.HasField("t")), None)
            if attr is not None:
                out[n.output[0]] = helper.make_tensor_type_proto(attr.t.data_type,
                                                                 list(attr.t.dims))
    return out


def _inferred(model: onnx.ModelProto, names) -> dict[str, onnx.TypeProto]:
    """Types of `names` by onnx shape inference on a copy of the graph without initializer
    data (initializers become typed inputs), for graphs that do not record them (ort-training
    records few intermediate shapes). Ops onnx does not know leave their outputs unknown."""
    g = onnx.GraphProto()
    g.node.extend(model.graph.node)
    g.input.extend(model.graph.input)
    g.output.extend(model.graph.output)
    g.value_info.extend(model.graph.value_info)
    known = {i.name for i in g.input}
    g.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                   for t in model.graph.initializer if t.name not in known)
    m = helper.make_model(g, opset_imports=model.opset_import, ir_version=model.ir_version)
    try:
        m = onnx.shape_inference.infer_shapes(m)
    except Exception:  # noqa: BLE001 - inference is best effort; unknown stays unknown
        return {}
    return _types(m.graph, set(names))


def _missing_types(model: onnx.ModelProto, names, types, io=None) -> dict[str, onnx.TypeProto]:
    """Types of those of `names` whose size `types` does not give: a Constant's value, else
    onnx shape inference over the whole graph (only when some are still missing)."""
    missing = {n for n in names if tensor_size(types.get(n)) is None}
    if not missing:
        return {}
    found = _constant_types(model.graph, missing, io)
    missing -= found.keys()
    if missing:
        found.update(_inferred(model, missing))
    return found


def tensor_size(tp: onnx.TypeProto | None) -> Size | None:
    """Bytes of a tensor type as {monomial: coefficient}; None without element type or shape
    (or with an unnamed unknown dimension)."""
    if tp is None:
        return None
    t = tp.tensor_type
    if not t.elem_type or not t.HasField("shape"):
        return None
    try:
        coef = helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize
    except (KeyError, TypeError):
        return None
    syms = []
    for d in t.shape.dim:
        if d.HasField("dim_value"):
            coef *= d.dim_value
        elif d.HasField("dim_param") and d.dim_param:
            syms.append(d.dim_param)
        else:
            return None
    return {tuple(sorted(syms)): coef}


def total(names, types: dict[str, onnx.TypeProto]) -> Size | None:
    """The summed size of `names`; None if any of them has no known size."""
    sized, unknown = split_total(names, types)
    return None if unknown else sized


def split_total(names, types: dict[str, onnx.TypeProto]) -> tuple[Size, list[str]]:
    """(summed size of the tensors whose size is known, the names of the others)."""
    acc: Counter = Counter()
    unknown = []
    for n in names:
        s = tensor_size(types.get(n))
        if s is None:
            unknown.append(n)
        else:
            acc.update(s)
    return {k: v for k, v in acc.items() if v}, unknown


def size_json(size: Size | None) -> int | str | None:
    """A size for --json: bytes (int) when static, the polynomial as text ('4096*S*S + 512*S')
    with symbolic dimensions, None when unknown."""
    if size is None:
        return None
    if all(not k for k in size):
        return int(sum(size.values()))
    terms = sorted(size.items(), key=lambda kv: (-len(kv[0]), kv[0]))
    return " + ".join("*".join([str(c), *k]) for k, c in terms)


class SavedDiff:
    """The saved activations of a graph before fusion against those after."""

    def __init__(self, model: onnx.ModelProto, io=None, type_of=None):
        """io: the nodes' (inputs, outputs) in graph order; type_of: a tensor's recorded type
        (GraphIndex.type_of), when the caller has them already."""
        before = model.graph
        self.before = saved_activations(before, io)
        self._types_before = (_types(before, self.before) if type_of is None else
                              {n: t for n in self.before if (t := type_of(n)) is not None
                               and t.HasField("tensor_type")})
        self._types_before.update(_missing_types(model, self.before, self._types_before, io))
        self.removed: list[str] = []
        self.added: list[str] = []
        self.removed_size: Size = {}
        self.added_size: Size = {}
        self.removed_unsized: list[str] = []     # no recorded or inferable shape
        self.added_unsized: list[str] = []

    def finish(self, model: onnx.ModelProto, io=None) -> None:
        """Compare with the graph after fusion (io: its nodes' (inputs, outputs) in graph
        order). Not called when nothing was rewritten: nothing is removed or added."""
        after = model.graph
        now = saved_activations(after, io)
        self.removed = sorted(self.before - now)
        self.added = sorted(now - self.before)
        self.removed_size, self.removed_unsized = split_total(self.removed, self._types_before)
        types = _types(after, set(self.added)) if self.added else {}
        types.update(_missing_types(model, self.added, types, io))
        self.added_size, self.added_unsized = split_total(self.added, types)

    @staticmethod
    def empty() -> dict:
        return {"removed": 0, "removed_bytes": 0, "removed_unsized": 0, "added": 0,
                "added_bytes": 0, "added_unsized": 0, "net_bytes_removed": 0}

    def as_dict(self) -> dict:
        """Counts and bytes; *_bytes sum the tensors of known size (*_unsized counts the
        others, whose shape is neither recorded nor inferable)."""
        acc = Counter(self.removed_size)
        acc.subtract(self.added_size)
        return {"removed": len(self.removed), "removed_bytes": size_json(self.removed_size),
                "removed_unsized": len(self.removed_unsized),
                "added": len(self.added), "added_bytes": size_json(self.added_size),
                "added_unsized": len(self.added_unsized),
                "net_bytes_removed": size_json({k: v for k, v in acc.items() if v})}
