"""A memory budget for a training step: recompute forward tensors in the backward.

The step's saved activations (saved.py: tensors a forward node writes and a backward node
reads) live from the forward until the backward has read them, so they set the step's peak.
``apply_budget`` lowers their estimated total to a budget by *recomputation*: it picks forward
nodes whose saved outputs it drops, duplicates each such node into the backward (the
duplicate reads the same inputs: tensors that stay saved, or other duplicates), and rewires
the backward readers of its outputs to the duplicate. The forward copy then dies after its
last forward reader, and the duplicate lives only from just before its first backward reader
to its last one.

Choice: greedy, cheapest first. Classes in order: elementwise ops (and views), then norms
(LayerNorm / RMSNorm / Softmax, which also rewrite their statistics), then GEMMs (MatMul,
Gemm, FusedMatMul); inside a class the largest saving first. A node is dropped only when it
lowers the estimate: the bytes of its saved outputs exceed the bytes of its inputs that
become saved for the duplicate. Never recomputed: random ops (Dropout and the Random* family:
their mask would differ), ops with subgraphs or side effects, fused com.fusecli ops, ops not
in the allow-lists below, nodes with a graph output, and nodes whose sizes are unknown.

onnxruntime's common-subexpression elimination (ORT_ENABLE_BASIC and above) merges a node of
the ai.onnx domain with another of the same op, attributes and inputs, which would fold a
duplicate back into its original and undo the recomputation. So a duplicate whose inputs are
all original tensors (the root of a recompute chain) reads one of them through a *fence*:
``Reshape(x, [0, 0, ...])`` (allowzero 0: every dim copied), which onnxruntime does not remove,
computes as a zero-copy view, and gives the duplicate an input that CSE sees as different.
Duplicates downstream of a fenced one differ from their originals by that input already.
Every root duplicate is fenced, whatever its domain: a com.microsoft ConcatTraining duplicate
without a fence was measured to vanish from the executed graph too (onnxruntime-training
1.19.2, the 12-layer GPT-2-style ort-training decoder's profile), and with it every duplicate
downstream of it.

The node list stays topologically sorted: duplicates are emitted just before the first node
that reads them, after their own inputs.

A GEMM too: a tied LM head's weight gradient. The one fused LinearCrossEntropy op computes the
loss and every gradient in the forward, chunk by chunk; with the head tied to the token
embedding, tied.py scatters the embedding's rows into its dW at the end of the backward,
ScatterND(dW, ids, rows){add}, whose output is the table's gradient. Where that is a graph
output (torch-joint), onnxruntime allocates it apart from the planned intermediates and does
not reuse dW's buffer for it: two [V, D] tables end the step, dW held from the forward
(measured on the 12-layer GPT-2-style torch-joint decoder at S 1024: the peak 364.1 MiB, 290.5
MiB with dW written as the output itself). Deferred, the forward op writes the loss and dH
(and dB) only, and in the ScatterND's place a copy of it writes the gradient output itself, the
rows added by the op (its dw_add_index / dw_add_rows inputs): one table. The copy recomputes
the logits chunk by chunk (one more H W^T GEMM, 2 N D V FLOPs) and reads H, the labels and the
weights, which stay saved instead. It is taken only once no group is left to take (every GEMM
group comes first): per byte of the estimate it is the costliest choice (GPT-2's vocabulary at
width 384: 39.5 GFLOP for 73.6 MiB, where the decoder's 36 recomputable Gemm take 29.3 GFLOP
for ~72 MiB), and the estimate overstates what it does to the measured peak, which it lowers
only where the step's end is the peak (the 12-layer torch-joint GPT-2-style decoder with the
head taken among the GEMM groups instead, by its saving: the estimate-only 0.5x step peaked at
402.2 MiB, 1.11x the fused step's time, against 372.8 MiB, 1.00x, without it).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fusecli.engine.saved import _missing_types, _types, forward_nodes, saved_activations, tensor_size
from fusecli.errors import FuseError
from fusecli.ops.contracts import FUSED_DOMAIN, load_contracts

ELEMENTWISE, NORM, GEMM = 0, 1, 2
CLASS_NAMES = {ELEMENTWISE: "elementwise", NORM: "norm", GEMM: "gemm"}

_ONNX_ELEMENTWISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Sqrt", "Reciprocal", "Exp", "Log", "Sigmoid",
    "Tanh", "Erf", "Relu", "LeakyRelu", "Elu", "Selu", "Gelu", "Pow", "Max", "Min", "Sum",
    "Where", "Cast", "CastLike", "Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze",
    "Flatten", "Expand", "Concat", "Slice", "Split", "Gather", "Equal", "Less", "Greater",
    "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Clip", "Softplus", "HardSigmoid",
    "Mish", "Sin", "Cos", "Tile"})
_MS_ELEMENTWISE = frozenset({"Gelu", "FastGelu", "QuickGelu", "BiasGelu", "BiasFastGelu",
                             "ConcatTraining"})
_ONNX_NORM = frozenset({"LayerNormalization", "SimplifiedLayerNormalization",
                        "RMSNormalization", "Softmax", "LogSoftmax"})
_MS_NORM = frozenset({"LayerNormalization", "SimplifiedLayerNormalization",
                      "SkipLayerNormalization", "SkipSimplifiedLayerNormalization"})
_ONNX_GEMM = frozenset({"MatMul", "Gemm"})
_MS_GEMM = frozenset({"FusedMatMul"})
# ops whose two inputs commute exactly (a spare way past CSE where a fence is not possible)
_COMMUTATIVE = frozenset({"Add", "Mul", "Max", "Min", "Sum", "Equal", "And", "Or"})
_CHAIN_STEPS = 8   # a group grows backwards at most this many times ...
_CHAIN_NODES = 24  # ... and to at most this many nodes
_NORM_FLOPS = 8  # per output element of a norm or softmax (mean, variance, scale, shift)

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "k": 2**10, "m": 2**20, "g": 2**30}


def parse_size(text) -> int:
    """'512MiB', '1.5GB', '300000000' (bytes), '2G' (binary) -> bytes; FuseError otherwise."""
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = _SIZE.match(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise FuseError(f"--max-memory {text!r}: expected a size such as 512MiB, 1.5GB, "
                            "2G or a number of bytes")
        value, unit = float(m.group(1)), m.group(2).lower()
    n = int(value * _UNITS[unit])
    if n <= 0:
        raise FuseError(f"--max-memory {text!r}: the budget must be more than 0 bytes")
    return n


def mib(n: float) -> str:
    """Bytes as text: MiB from 1 MiB up, KiB from 1 KiB, else bytes."""
    if abs(n) >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB" if abs(n) >= 2**10 else f"{int(n)} B"


def op_class(node: onnx.NodeProto) -> int | None:
    """The recompute class of a node's op, or None when it is never recomputed."""
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
           for a in node.attribute):
        return None
    dom, op = node.domain or "", node.op_type
    if dom in ("", "ai.onnx"):
        if op in _ONNX_ELEMENTWISE:
            return ELEMENTWISE
        if op in _ONNX_NORM:
            return NORM
        if op in _ONNX_GEMM:
            return GEMM
    elif dom == "com.microsoft":
        if op in _MS_ELEMENTWISE:
            return ELEMENTWISE
        if op in _MS_NORM:
            return NORM
        if op in _MS_GEMM:
            return GEMM
    return None


@dataclass
class BudgetReport:
    """What ``apply_budget`` did (or would need)."""

    budget: int
    before: int                 # estimated saved activations before recomputation (bytes)
    after: int                  # ... after
    minimum: int | None = None  # the lowest estimate recomputation reaches (when unmet)
    met: bool = True
    recomputed: dict[str, int] = field(default_factory=dict)   # "class op_type" -> nodes
    tensors: int = 0            # saved tensors no longer saved
    fences: int = 0
    extra_flops: int = 0
    forward_flops: int = 0
    unsized: int = 0            # saved tensors of unknown size (not in the estimate)
    measured_before: int | None = None  # the fused step's measured peak (runtime.budget)
    measured_after: int | None = None   # ... of the step with the recomputation
    dims: dict[str, int] = field(default_factory=dict)

    @property
    def saved_bytes(self) -> int:
        return self.before - self.after

    def as_dict(self) -> dict:
        return {"budget_bytes": self.budget, "estimate_before_bytes": self.before,
                "estimate_after_bytes": self.after, "bytes_saved": self.saved_bytes,
                "met": self.met, "minimum_bytes": self.minimum,
                "recomputed_nodes": dict(self.recomputed),
                "recomputed_total": sum(self.recomputed.values()),
                "tensors_no_longer_saved": self.tensors, "fences": self.fences,
                "extra_flops": self.extra_flops, "forward_flops": self.forward_flops,
                "unsized_saved_tensors": self.unsized, "dims": dict(self.dims),
                "measured_peak_before_bytes": self.measured_before,
                "measured_peak_after_bytes": self.measured_after}

    def lines(self) -> list[str]:
        """What the CLI prints (stderr)."""
        if self.measured_after is not None and not self.recomputed:
            return [f"memory budget {mib(self.budget)}: the fused step's measured peak "
                    f"{mib(self.measured_after)} already fits; nothing recomputed"]
        if not self.recomputed:
            return [f"memory budget {mib(self.budget)}: estimated saved activations "
                    f"{mib(self.before)} already fit; nothing recomputed"]
        measured = ([f"measured peak {mib(self.measured_before)} -> {mib(self.measured_after)} "
                     f"(within the budget)"] if self.measured_after is not None else [])
        what = ", ".join(f"{k} {v}" for k, v in sorted(self.recomputed.items()))
        pct = (f" ({self.extra_flops / self.forward_flops:.1%} of the forward's "
               f"{self.forward_flops / 1e9:.2f} GFLOP)" if self.forward_flops else "")
        return [f"memory budget {mib(self.budget)}: estimated saved activations "
                f"{mib(self.before)} -> {mib(self.after)} ({mib(self.saved_bytes)} saved, "
                f"{self.tensors} tensors)",
                f"recomputed in the backward: {sum(self.recomputed.values())} nodes ({what}); "
                f"extra work {self.extra_flops / 1e9:.3f} GFLOP{pct}", *measured]


class _Sizes:
    """Static sizes in bytes and shapes of a graph's tensors (recorded, Constant values, or
    inferred), with symbolic dims taken from ``dims``."""

    def __init__(self, model: onnx.ModelProto, names, dims: dict[str, int], io):
        names = set(names)
        graph = model.graph
        syms = {d.dim_param for v in graph.input for d in v.type.tensor_type.shape.dim
                if d.dim_param}
        missing = sorted(syms - dims.keys())
        if missing:
            raise FuseError(
                f"--max-memory: the saved activations' sizes depend on the symbolic "
                f"dimension(s) {', '.join(missing)} of the graph's inputs; give their values, "
                f"e.g. --dim {missing[0]}=1024")
        if syms:  # a copy with the values written in, so that inference propagates them
            model = _with_dims(model, dims)
        types = _types(model.graph, names)
        types.update({t.name: helper.make_tensor_type_proto(t.data_type, list(t.dims))
                      for t in model.graph.initializer if t.name in names})
        types.update(_missing_types(model, names, types, io))
        types.update(_ort_types(model.graph, names, types))
        self.types = types
        self.dims = dims

    def shape(self, name: str) -> list[int] | None:
        tp = self.types.get(name)
        if tp is None or not tp.tensor_type.HasField("shape"):
            return None
        out = []
        for d in tp.tensor_type.shape.dim:
            if d.HasField("dim_value"):
                out.append(d.dim_value)
            elif d.dim_param and d.dim_param in self.dims:
                out.append(self.dims[d.dim_param])
            else:
                return None
        return out

    def rank(self, name: str) -> int | None:
        tp = self.types.get(name)
        if tp is None or not tp.tensor_type.HasField("shape"):
            return None
        return len(tp.tensor_type.shape.dim)

    def bytes(self, name: str) -> int | None:
        size = tensor_size(self.types.get(name))
        if size is None:
            return None
        total = 0
        for mono, coef in size.items():
            v = coef
            for d in mono:
                if d not in self.dims:  # a dim inference could not name (unk__N)
                    return None
                v *= self.dims[d]
            total += v
        return int(total)


_STAT_NORMS = frozenset({"LayerNormalization", "SimplifiedLayerNormalization",
                         "RMSNormalization"})
# norms whose output is (x - mean) * inv_std * scale + bias from the statistics they write:
# op -> (domains, indices of mean and inv_std among its outputs (mean None: RMS), per channel)
_STAT_NORM_OUTPUTS = {
    "LayerNormalization": (("", "ai.onnx", "com.microsoft"), (1, 2), False),
    "SimplifiedLayerNormalization": (("", "ai.onnx", "com.microsoft"), (None, 1), False),
    # onnxruntime-training's BatchNormalization in training mode: Y, running mean / var,
    # saved mean, saved inv_std ([C], over N and the spatial dims)
    "BatchNormInternal": (("com.microsoft",), (3, 4), True),
}


def _from_statistics(n: onnx.NodeProto, sizes: _Sizes, bwd_reads) -> bool:
    """Whether norm ``n``'s output can be recomputed from its input and the statistics it
    wrote, elementwise: an onnx / onnxruntime LayerNormalization or
    SimplifiedLayerNormalization, or onnxruntime-training's BatchNormInternal in training
    mode, whose statistics outputs the backward reads (so they stay saved anyway: [rows, 1]
    or [C] each), whose input, scale (and bias) have the statistics' type (float or double:
    the stash type; half inputs keep the whole-norm duplicate) and whose input's rank is
    known (the statistics broadcast against it)."""
    spec = _STAT_NORM_OUTPUTS.get(n.op_type)
    if spec is None or n.domain not in spec[0]:
        return False
    stat_at = [k for k in spec[1] if k is not None]
    if len(n.output) <= max(stat_at) or not all(
            n.output[k] and n.output[k] in bwd_reads for k in stat_at):
        return False
    inputs = n.input[:3] if spec[2] else n.input
    if len(inputs) < (3 if spec[2] else 2) or not all(inputs[:2]) or (spec[2] and not inputs[2]):
        return False
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    if spec[2] and attrs.get("training_mode", 1) != 1:
        return False
    stash = attrs.get("stash_type", onnx.TensorProto.FLOAT)
    if stash not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE):
        return False
    elems = [sizes.types.get(t) for t in inputs if t]
    if any(e is None or e.tensor_type.elem_type != stash for e in elems):
        return False
    rank = sizes.rank(n.input[0])
    return rank is not None and (not spec[2] or rank >= 2)


def _statistics_nodes(n: onnx.NodeProto, d: onnx.NodeProto, fresh, rank: int,
                      column) -> list[onnx.NodeProto]:
    """Elementwise nodes writing the output of ``d`` (norm ``n``'s duplicate, its inputs and
    output renamed for the backward) from d's input and the statistics ``n`` wrote:
    (x - mean) * inv_std * scale (+ bias); RMS x * inv_std * scale. Per-channel statistics and
    parameters ([C], BatchNormInternal) are first reshaped to [C, 1, ...] against x of
    ``rank`` (``column(rank)``: the name of that shape constant)."""
    _, (mean_at, inv_at), per_channel = _STAT_NORM_OUTPUTS[n.op_type]
    out: list[onnx.NodeProto] = []
    x, y = d.input[0], d.output[0]

    def node(kind: str, ins: list[str], last: bool = False) -> str:
        t = y if last else fresh(f"{y}.{kind.lower()}")
        name = fresh(f"{n.name or n.op_type}/{kind.lower()}{len(out)}/recompute")
        out.append(helper.make_node(kind, ins, [t], name=name))
        return t

    def chan(t: str) -> str:
        return node("Reshape", [t, column(rank)]) if per_channel else t

    bias = d.input[2] if len(d.input) > 2 and d.input[2] else None
    h = x if mean_at is None else node("Sub", [x, chan(n.output[mean_at])])
    h = node("Mul", [h, chan(n.output[inv_at])])
    h = node("Mul", [h, chan(d.input[1])], last=bias is None)
    if bias is not None:
        node("Add", [h, chan(bias)], last=True)
    return out


def _ort_types(graph: onnx.GraphProto, names, types) -> dict[str, onnx.TypeProto]:
    """Types that neither the graph records nor onnx infers, of onnxruntime's ops that onnx
    does not know: ConcatTraining's output (a Concat), and a norm's statistics outputs
    (mean, inverse std; SimplifiedLayerNormalization is not an onnx op):
    the input's shape with every dim from ``axis`` on set to 1, in the stash type (float
    unless ``stash_type`` says otherwise; the ONNX and onnxruntime definitions)."""
    out = {}
    for n in graph.node:
        if n.op_type == "ConcatTraining" and n.output and n.output[0] in names:
            t = None if tensor_size(types.get(n.output[0])) else _concat_type(n, types)
            if t is not None:
                out[n.output[0]] = t
            if len(n.output) > 1 and n.output[1]:  # per_input_length: int64 [inputs]
                out[n.output[1]] = helper.make_tensor_type_proto(
                    onnx.TensorProto.INT64, [len(n.input)])
            continue
        if n.op_type not in _STAT_NORMS or n.domain not in ("", "ai.onnx", "com.microsoft"):
            continue
        want = [t for t in n.output[1:] if t and t in names and tensor_size(types.get(t)) is None]
        x = types.get(n.input[0]) if n.input else None
        if not want or x is None or not x.tensor_type.HasField("shape"):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        dims = list(x.tensor_type.shape.dim)
        axis = attrs.get("axis", -1)
        axis = axis + len(dims) if axis < 0 else axis
        if not 0 <= axis < len(dims):
            continue
        stash = attrs.get("stash_type", onnx.TensorProto.FLOAT)
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                 for d in dims[:axis]] + [1] * (len(dims) - axis)
        if any(d is None for d in shape):
            continue
        for t in want:
            out[t] = helper.make_tensor_type_proto(stash, shape)
    return out


def _concat_type(n: onnx.NodeProto, types) -> onnx.TypeProto | None:
    """The output type of onnxruntime's ConcatTraining (a Concat along ``axis`` that also
    writes the inputs' lengths), from its inputs' recorded or inferred types."""
    ins = [types.get(t) for t in n.input if t]
    if not ins or any(t is None or not t.tensor_type.HasField("shape") for t in ins):
        return None
    shapes = [[d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
               for d in t.tensor_type.shape.dim] for t in ins]
    rank = len(shapes[0])
    if any(len(sh) != rank for sh in shapes) or rank == 0:
        return None
    axis = {a.name: helper.get_attribute_value(a) for a in n.attribute}.get("axis", 0)
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank or any(not isinstance(sh[axis], int) for sh in shapes):
        return None
    shape = list(shapes[0])
    shape[axis] = sum(sh[axis] for sh in shapes)
    if any(d is None for d in shape):
        return None
    return helper.make_tensor_type_proto(ins[0].tensor_type.elem_type, shape)


def _with_dims(model: onnx.ModelProto, dims: dict[str, int]) -> onnx.ModelProto:
    """A copy of the model's graph (no initializer data) with the symbolic dims in ``dims``
    written as values in its inputs, outputs and value_info."""
    g = onnx.GraphProto()
    g.node.extend(model.graph.node)
    for coll, src in ((g.input, model.graph.input), (g.output, model.graph.output),
                      (g.value_info, model.graph.value_info)):
        coll.extend(src)
        for v in coll:
            for d in v.type.tensor_type.shape.dim:
                if d.dim_param in dims:
                    d.dim_value = dims[d.dim_param]
    known = {i.name for i in g.input}
    g.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                   for t in model.graph.initializer if t.name not in known)
    m = helper.make_model(g, opset_imports=model.opset_import, ir_version=model.ir_version)
    return m


def _numel(name: str, sizes: _Sizes) -> int:
    """Elements of tensor ``name``; 0 where its shape is unknown."""
    shape = sizes.shape(name) if name else None
    return int(np.prod(shape)) if shape is not None else 0


def _flops(node: onnx.NodeProto, sizes: _Sizes) -> int:
    """Rough work of one node: 2*M*N*K for a GEMM, _NORM_FLOPS per output element for a
    norm, else one per output element (fused ops too: a lower bound); 0 where the shapes are
    unknown."""
    numel = _numel(node.output[0], sizes) if node.output else 0
    op = node.op_type
    if op in ("MatMul", "FusedMatMul", "Gemm"):
        a = sizes.shape(node.input[0])
        if not a or sizes.shape(node.output[0]) is None:
            return 0
        attrs = {x.name: helper.get_attribute_value(x) for x in node.attribute}
        k = a[0] if (op == "Gemm" and attrs.get("transA")) else (
            a[-2] if (op == "FusedMatMul" and attrs.get("transA") and len(a) > 1) else a[-1])
        return 2 * numel * k
    c = op_class(node)
    return numel * (_NORM_FLOPS if c == NORM else 1)


def apply_budget(model: onnx.ModelProto, budget: int, dims: dict[str, int] | None = None,
                 strict: bool = True) -> BudgetReport:
    """Rewrite ``model`` (in place) so that its estimated saved activations fit ``budget``
    bytes, recomputing the cheapest forward nodes in the backward (module doc). With
    ``strict`` an unreachable budget raises FuseError (the model is left unchanged); without
    it the model gets the lowest estimate reachable and the report says ``met=False``."""
    dims = dict(dims or {})
    graph = model.graph
    nodes = list(graph.node)
    io = [(n.input, n.output) for n in nodes]
    producer = {t: i for i, n in enumerate(nodes) for t in n.output if t}
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for t in n.input:
            if t:
                consumers.setdefault(t, []).append(i)
    fwd = forward_nodes(graph, io)
    saved0 = saved_activations(graph, io)
    fwd_tensors = {t for i in fwd for t in nodes[i].output if t}
    sizes = _Sizes(model, fwd_tensors | {t for i in fwd for t in nodes[i].input if t}
                   | {t for n in nodes if n.op_type == "ScatterND" for t in n.input[1:2]},
                   dims, io)   # (and the index of a tied embedding's scatter: _tied_scatter)
    nbytes = {t: sizes.bytes(t) for t in fwd_tensors}
    unsized = [t for t in saved0 if nbytes.get(t) is None]
    before = sum(nbytes[t] for t in saved0 if nbytes.get(t) is not None)
    report = BudgetReport(budget, before, before, unsized=len(unsized), dims=dims)
    report.forward_flops = sum(_flops(nodes[i], sizes) for i in fwd)
    if before <= budget:
        return report

    outputs = {o.name for o in graph.output}
    bwd_reads = {t for t in fwd_tensors
                 if any(c not in fwd for c in consumers.get(t, ()))}
    inits = {t.name for t in graph.initializer}
    dropped: set[int] = set()
    late_dw: set[str] = set()      # tied heads' weight gradients deferred (a GEMM each)
    late_reads: set[str] = set()   # ... and what their backward copies read
    # norms recomputed elementwise from their input and statistics: the statistics stay saved
    stats = {i for i in fwd if _from_statistics(nodes[i], sizes, bwd_reads)}
    kept = {t for i in stats for t in nodes[i].output[1:] if t}   # and the running stats

    def klass(i: int) -> int | None:
        return ELEMENTWISE if i in stats else op_class(nodes[i])

    def rewired(i: int):
        """The outputs whose backward readers a duplicate of node i would take over."""
        return nodes[i].output[:1] if i in stats else nodes[i].output

    def is_saved(t: str) -> bool:
        p = producer.get(t)
        if p is None or p not in fwd or (p in dropped and t not in kept) or t in late_dw:
            return False
        return (t in bwd_reads or t in late_reads
                or any(c in dropped for c in consumers.get(t, ())))

    def fenceable(i: int, group=frozenset()) -> bool:
        n = nodes[i]
        if any(t and (producer.get(t) in dropped or producer.get(t) in group)
               for t in n.input):
            return True  # reads a duplicate already (may change later: checked again)
        if any(t and t not in inits and sizes.rank(t) is not None for t in n.input):
            return True
        return (n.op_type in _COMMUTATIVE and len(n.input) == 2
                and n.input[0] != n.input[1])

    def new_inputs(group) -> set[str]:
        """Forward tensors the group's duplicates read that would become saved."""
        return {t for i in group for t in nodes[i].input if t and producer.get(t) in fwd
                and producer[t] not in dropped and producer[t] not in group
                and not is_saved(t)}

    def gain(group) -> int | None:
        """Bytes the estimate drops by when every node of ``group`` is recomputed: its saved
        outputs minus the inputs that become saved for its duplicates; None when a size
        involved is unknown."""
        out = [t for i in group for t in nodes[i].output
               if t and t not in kept and is_saved(t)]
        if not out or any(nbytes.get(t) is None for t in out):
            return None
        new = new_inputs(group)
        if any(nbytes.get(t) is None for t in new):
            return None
        return sum(nbytes[t] for t in out) - sum(nbytes[t] for t in new)

    def recomputable(i: int) -> bool:
        return (i in fwd and i not in dropped and klass(i) is not None
                and not any(t in outputs for t in rewired(i)))

    bwd_read = {t for t in fwd_tensors if t in bwd_reads}
    emit_cache: dict = {}

    def emits(drop) -> dict[int, float]:
        """Where each duplicate of ``drop`` is computed: the position of the first backward
        node that reads it, or of the first duplicate that reads it (nodes are in
        topological order, so readers come later)."""
        e: dict[int, float] = {}
        for j in sorted(drop, reverse=True):
            best = float("inf")
            for t in nodes[j].output:
                for c in () if t in kept else consumers.get(t, ()):
                    if c not in fwd:
                        best = min(best, c)
                    elif c in drop:
                        best = min(best, e[c])
            e[j] = best
        return e

    def hoisted(group) -> int:
        """Bytes of duplicates already chosen that ``group``'s duplicates would make compute
        earlier (they read them) and that are computed from a GEMM's or a norm's duplicate:
        such a duplicate then lives from there to its backward readers, as a saved tensor
        would over that span, so it is counted against the group. Without it, a recomputed
        layer would read the previous layer's recomputed tensors, those the layer's before,
        and so on down to the first layer, all recomputed at the start of the backward and
        alive together. Moving a duplicate computed from saved tensors through views and
        elementwise ops only is free (the moves inside one layer's backward)."""
        key = frozenset(dropped)
        if emit_cache.get("key") != key:
            emit_cache.clear()
            emit_cache.update(key=key, old=emits(dropped))
        old = emit_cache["old"]
        drop = dropped | set(group)
        new = emits(drop)
        heavy: dict[int, bool] = {}   # computed from a GEMM's or norm's duplicate
        for j in sorted(drop):
            heavy[j] = any(p in drop and (klass(p) != ELEMENTWISE or heavy[p])
                           for u in nodes[j].input if u and (p := producer.get(u)) is not None)
        return sum(nbytes.get(t) or 0 for j in dropped if new[j] < old[j] and heavy[j]
                   for t in nodes[j].output if t in bwd_read)

    def chain(i: int):
        """The smallest group found around candidate ``i`` that lowers the estimate: ``i``
        alone, else ``i`` with the producers of the inputs that would become saved for it,
        grown backwards (the cheapest class on the frontier first) until the group pays
        (its saved outputs outweigh the new saved inputs and the duplicates it moves, see
        ``hoisted``) or it cannot grow. (group, gain) or None."""
        group = {i}
        for _ in range(_CHAIN_STEPS):
            g = gain(group)
            if g is None:
                return None
            if g > 0:
                g -= hoisted(group)
                ok = g > 0 and all(fenceable(j, group) for j in group)
                return (group, g) if ok else None
            # inputs that must stay saved (a fused op's, a random op's, a constant's CSE
            # would merge) stay new saved inputs; the others' producers may join
            front = {j for t in new_inputs(group) if recomputable(j := producer[t])
                     and fenceable(j, group)}
            if not front:
                return None
            low = min(klass(j) for j in front)
            group |= {j for j in front if klass(j) == low}
            if len(group) > _CHAIN_NODES:
                return None
        return None

    def head_gain(i: int) -> int | None:
        """Bytes the estimate drops by when head i's dW is computed in the backward: dW minus
        the forward tensors its backward copy reads that would become saved; None when it is
        deferred already or a size is unknown."""
        dw = nodes[i].output[heads[i].dw]
        new = {t for t in nodes[i].input if t and producer.get(t) in fwd and not is_saved(t)}
        if dw in late_dw or any(nbytes.get(t) is None for t in new):
            return None
        return nbytes[dw] - sum(nbytes[t] for t in new)

    heads = {i: ports for i in fwd if (ports := _deferrable_head(
        nodes[i], saved0, outputs, nbytes, consumers, nodes, sizes)) is not None}
    cands = [i for i in fwd if klass(i) is not None
             and not any(t in outputs for t in rewired(i))
             and any(t in saved0 for t in nodes[i].output)]
    est = before
    changed = True
    while est > budget and changed:
        changed = False
        scored = []
        for i in cands:
            if i in dropped:
                continue
            found = chain(i)
            if found is not None:
                group, g = found
                cls = max(klass(j) for j in group)
                scored.append((cls, -g, len(group), i, tuple(sorted(group))))
        scored.sort()
        for *_, group in scored:
            if est <= budget:
                break
            group = {j for j in group if j not in dropped}
            g = gain(group) if group else None  # earlier drops in this round change it
            g = g - hoisted(group) if g is not None and g > 0 else None
            if g is None or g <= 0 or not all(fenceable(j, group) for j in group):
                continue
            dropped.update(group)
            est -= g
            changed = True
        # a tied head's dW, a GEMM and the costliest per byte: once no group is left
        for i in () if changed else sorted(heads, key=lambda i: -(head_gain(i) or 0)):
            g = head_gain(i)
            if est > budget and g is not None and g > 0:
                late_dw.add(nodes[i].output[heads[i].dw])
                late_reads.update(t for t in nodes[i].input if t)
                est -= g
                changed = True
    if est > budget:
        if strict:
            raise FuseError(
                f"--max-memory {mib(budget)} is unreachable: the step's estimated saved "
                f"activations are {mib(before)}, and recomputation brings them down to "
                f"{mib(est)} at least; give a budget of at least {mib(est)} (nothing written)")
        report.met = False
        report.minimum = est
    _rewrite(model, nodes, fwd, dropped, stats, producer, sizes, inits, report)
    _defer_head_grads(model, {nodes[i].output[p.dw]: p for i, p in heads.items()
                              if nodes[i].output[p.dw] in late_dw}, sizes, report)
    report.after = sum(nbytes[t] for t in saved_activations(graph) if nbytes.get(t))
    report.tensors = len(saved0 - saved_activations(graph))
    return report


@dataclass(frozen=True)
class _HeadPorts:
    """Where a fused op that can write its weight gradient with rows added (its contract's
    dw_add_index / dw_add_rows inputs) has them: output and input positions."""
    loss: int
    dw: int
    h: int
    w: int
    index: int
    rows: int


@functools.cache
def _head_ports() -> dict[str, _HeadPorts]:
    """The fused ops whose dW a tied embedding's rows can be added into, by op name: those
    whose contract has the inputs dw_add_index and dw_add_rows (and H, W; outputs loss, dW)."""
    found = {}
    for c in load_contracts().ops.values():
        ins, outs = [p.name for p in c.inputs], [p.name for p in c.outputs]
        if {"H", "W", "dw_add_index", "dw_add_rows"} <= set(ins) and {"loss", "dW"} <= set(outs):
            found[c.name] = _HeadPorts(outs.index("loss"), outs.index("dW"), ins.index("H"),
                                       ins.index("W"), ins.index("dw_add_index"),
                                       ins.index("dw_add_rows"))
    return found


def _tied_scatter(dw: str, consumers, nodes, outputs, sizes) -> onnx.NodeProto | None:
    """The one reader of ``dw`` when it is ScatterND(dw, index [..., 1], rows){add} writing a
    graph output (tied.py's fold of a tied embedding's gradient), else None."""
    readers = consumers.get(dw, [])
    if len(readers) != 1:
        return None
    n = nodes[readers[0]]
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    index = sizes.shape(n.input[1]) if len(n.input) == 3 else None
    ok = (n.op_type == "ScatterND" and (n.domain or "") in ("", "ai.onnx")
          and attrs.get("reduction") == b"add" and list(n.input).count(dw) == 1
          and n.input[0] == dw and n.output[0] in outputs and bool(index) and index[-1] == 1)
    return n if ok else None


def _deferrable_head(n: onnx.NodeProto, saved0, outputs, nbytes, consumers, nodes,
                     sizes) -> _HeadPorts | None:
    """The ports of a fused head (_head_ports) that writes its loss and its dW in the forward,
    dW a saved activation of known size whose one reader is a tied embedding's scatter into a
    graph output (_tied_scatter); else None."""
    p = _head_ports().get(n.op_type) if n.domain == FUSED_DOMAIN else None
    if p is None or len(n.output) <= max(p.dw, p.loss) or not n.output[p.loss]:
        return None
    dw = n.output[p.dw]
    ok = (dw in saved0 and nbytes.get(dw) is not None and sizes.rank(n.input[p.h]) is not None
          and _tied_scatter(dw, consumers, nodes, outputs, sizes) is not None)
    return p if ok else None


def _defer_head_grads(model: onnx.ModelProto, late: dict[str, _HeadPorts], sizes,
                      report) -> None:
    """Each head whose dW is in ``late`` (with its op's ports): the forward op stops writing dW;
    a copy of it in place of the tied scatter that reads dW writes the scatter's output, the
    scattered rows added by the op (dw_add_index / dw_add_rows), its H read through a fence
    (module doc: onnxruntime's CSE)."""
    graph = model.graph
    fresh = _namer(graph, graph.node)
    for dw, p in sorted(late.items()):
        nodes = list(graph.node)
        i = next(k for k, n in enumerate(nodes) if len(n.output) > p.dw and n.output[p.dw] == dw)
        n = nodes[i]
        j = next(k for k in range(i + 1, len(nodes)) if dw in nodes[k].input)
        scatter = nodes[j]
        d = onnx.NodeProto()
        d.CopyFrom(n)
        d.name = fresh(f"{n.name or n.op_type}/weight_gradient")
        ins = list(d.input) + [""] * (max(p.index, p.rows) + 1 - len(d.input))
        ins[p.index], ins[p.rows] = scatter.input[1], scatter.input[2]
        outs = [""] * (p.dw + 1)
        outs[p.dw] = scatter.output[0]
        del d.input[:], d.output[:]
        d.input.extend(ins)
        d.output.extend(outs)
        n.output[p.dw] = ""
        h = n.input[p.h]
        shape = fresh("fusecli.recompute.head_fence")
        graph.initializer.append(numpy_helper.from_array(np.zeros(sizes.rank(h), np.int64),
                                                         shape))
        d.input[p.h] = fresh(f"{h}.fence")
        fence = helper.make_node("Reshape", [h, shape], [d.input[p.h]],
                                 name=fresh(f"{d.name}/fence"))
        report.fences += 1
        nodes[j:j + 1] = [fence, d]
        del graph.node[:]
        graph.node.extend(nodes)
        w = sizes.shape(n.input[p.w])
        report.extra_flops += 2 * _numel(h, sizes) * (w[0] if w else 0)
        key = f"{CLASS_NAMES[GEMM]} {n.op_type} (weight gradient in the backward)"
        report.recomputed[key] = report.recomputed.get(key, 0) + 1


def _namer(graph: onnx.GraphProto, nodes):
    """fresh(base): a tensor or node name no node, input, output, value_info or initializer of
    the graph uses yet (base, else base_2, base_3, ...), taken once returned."""
    taken = {t for n in nodes for t in (*n.input, *n.output)} | {n.name for n in nodes}
    taken |= {v.name for v in (*graph.input, *graph.output, *graph.value_info)}
    taken |= {t.name for t in graph.initializer}

    def fresh(base: str) -> str:
        name, k = base, 1
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        taken.add(name)
        return name

    return fresh


def _rewrite(model, nodes, fwd, dropped, stats, producer, sizes, inits, report) -> None:
    graph = model.graph
    fresh = _namer(graph, nodes)

    ren = {t: fresh(f"{t}.recompute") for i in dropped
           for t in nodes[i].output[:1 if i in stats else None] if t}
    vi = {v.name: v for v in (*graph.value_info, *graph.output)}
    new_vi = []
    dups: dict[int, list[onnx.NodeProto]] = {}
    zeros: dict[int, str] = {}
    columns: dict[int, str] = {}

    def column(rank: int) -> str:
        """[-1, 1, ...] (rank - 1 ones): a [C] tensor as a column against [N, C, ...]."""
        if rank not in columns:
            columns[rank] = fresh(f"fusecli.recompute.column{rank}")
            graph.initializer.append(numpy_helper.from_array(
                np.array([-1] + [1] * (rank - 2), np.int64), columns[rank]))
        return columns[rank]

    for i in sorted(dropped):
        n = nodes[i]
        d = onnx.NodeProto()
        d.CopyFrom(n)
        d.name = fresh(f"{n.name or n.op_type}/recompute")
        for k, t in enumerate(d.output):
            if t in ren:
                d.output[k] = ren[t]
                if t in vi:
                    v = onnx.ValueInfoProto()
                    v.CopyFrom(vi[t])
                    v.name = ren[t]
                    new_vi.append(v)
        for k, t in enumerate(d.input):
            if t in ren:
                d.input[k] = ren[t]
        pre: list[onnx.NodeProto] = []
        if not any(t in ren.values() for t in d.input):
            k = next((k for k, t in enumerate(d.input) if t and t not in inits
                      and sizes.rank(t) is not None), None)
            if k is not None:
                r = sizes.rank(d.input[k])
                if r not in zeros:
                    zeros[r] = fresh(f"fusecli.recompute.fence{r}")
                    graph.initializer.append(numpy_helper.from_array(
                        np.zeros(r, np.int64), zeros[r]))
                out = fresh(f"{d.input[k]}.fence")
                pre.append(helper.make_node("Reshape", [d.input[k], zeros[r]], [out],
                                            name=fresh(f"{d.name}/fence")))
                d.input[k] = out
                report.fences += 1
            else:  # a commutative pair (fenceable checked it)
                a, b = d.input[0], d.input[1]
                d.input[0], d.input[1] = b, a
        if i in stats:
            made = _statistics_nodes(n, d, fresh, sizes.rank(n.input[0]), column)
            dups[i] = pre + made
            key = f"{CLASS_NAMES[ELEMENTWISE]} {n.op_type} (from its statistics)"
            report.extra_flops += sum(m.op_type != "Reshape" for m in made) * \
                _numel(n.output[0], sizes)
        else:
            dups[i] = pre + [d]
            key = f"{CLASS_NAMES[op_class(n)]} {n.op_type}"
            report.extra_flops += _flops(n, sizes)
        report.recomputed[key] = report.recomputed.get(key, 0) + 1
    # rewire the backward readers, then emit each duplicate just before its first reader
    emitted: set[int] = set()
    order: list[onnx.NodeProto] = []

    def emit(i: int) -> None:
        if i in emitted:
            return
        emitted.add(i)
        for t in nodes[i].input:
            if t in ren:
                emit(producer[t])
        order.extend(dups[i])

    for j, n in enumerate(nodes):
        if j not in fwd:
            for t in n.input:
                if t in ren:
                    emit(producer[t])
        c = onnx.NodeProto()
        c.CopyFrom(n)
        if j not in fwd:
            for k, t in enumerate(c.input):
                if t in ren:
                    c.input[k] = ren[t]
        order.append(c)
    del graph.node[:]
    graph.node.extend(order)
    graph.value_info.extend(new_vi)
