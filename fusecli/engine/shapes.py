"""Tensor shapes where they are known or can be inferred, and the shape guard of a fusion.

A dim is an int (static), a str (a symbolic dim of the graph, equal to itself only) or None
(unknown). ``ShapeOracle.shape(t)`` is the recorded shape (value_info, graph inputs/outputs,
initializers, constant values) or, failing that, the shape inferred from the producer for the
ops that backward chains are made of (MatMul, FusedMatMul, Gemm, Transpose, Reshape,
ReduceSum, elementwise ops with broadcasting, the gradient ops that keep their input's shape).
``ShapeOracle.refined(t)`` also infers Concat, Slice, Split (SplitTraining), Unsqueeze, Squeeze
and the outputs of fusecli's fused ops (their contracts' ``like`` rules), broadcasts a static dim
against a symbolic one as the static one, reads the static entries of a Reshape target computed
at run time (``GraphIndex.shape_vector``), and replaces a recorded symbolic dim that inference
finds static.
Computed lazily, memoised, iteratively (no recursion limit on deep graphs).

``fusion_problem`` is the guard every match passes before it is fused: the fused op's outputs
must have the shapes of the tensors they replace (catches a rule that binds a gradient the
graph still sums afterwards, e.g. dK/dV of multi-query attention computed at the full head
count), and its inputs must fit the op (``input_problem``).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx

from fusecli.ops.contracts import FUSED_DOMAIN, infer_output_shapes, load_contracts
from fusecli.ops.shapes import input_check
from fusecli.ops.shapes import show as _show
from fusecli.engine.memo import memoised

_SAME_AS_INPUT0 = {
    "Identity", "Cast", "CastLike", "Neg", "Sqrt", "Reciprocal", "Relu", "Erf", "Tanh", "Sigmoid", "Exp",
    "Log", "Abs", "Softmax", "LogSoftmax", "Gelu", "FastGelu", "QuickGelu", "Dropout",
    "ReluGrad", "GeluGrad", "FastGeluGrad", "QuickGeluGrad", "TanhGrad", "SigmoidGrad",
    "SoftmaxGrad_13", "SoftmaxGrad",
} | {  # fused ops whose first output has their first input's shape (contract: `like: <input 0>`)
    c.name for c in load_contracts().ops.values()
    if c.outputs and c.outputs[0].like[:1] == (c.inputs[0].name,)
}
_BROADCAST = {"Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min", "Equal", "Less",
              "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Sum"}
_INFERRED = _SAME_AS_INPUT0 | _BROADCAST | {
    "Constant", "Shape", "MatMul", "FusedMatMul", "Gemm", "Transpose", "Reshape", "ReduceSum",
    "ReduceMean", "Expand", "Concat", "ConcatTraining"}


def broadcast(a, b, static_wins: bool = False):
    """Numpy broadcasting of two shapes with unknown/symbolic dims; None when impossible to
    tell (rank unknown). ``static_wins`` (ShapeOracle.refined): a static dim n > 1 against a
    symbolic or unknown one is n (the other can only be 1 or n where the graph runs)."""
    if a is None or b is None:
        return None
    n = max(len(a), len(b))
    a = [1] * (n - len(a)) + list(a)
    b = [1] * (n - len(b)) + list(b)
    out = []
    for x, y in zip(a, b):
        if x == 1:
            out.append(y)
        elif y == 1 or x == y:
            out.append(x)
        elif static_wins and (isinstance(x, int) or isinstance(y, int)):
            out.append(x if isinstance(x, int) else y)
        elif x is None or y is None:
            out.append(None)
        else:
            out.append(None if isinstance(x, str) or isinstance(y, str) else max(x, y))
    return out


_INPUTS_READ = 8   # the inputs whose shapes _infer reads (Concat: its pieces)
_FUSED_OPS = frozenset(load_contracts().ops)
# inferred by ShapeOracle.refined only (a symbolic export's split heads joined back, the pairs
# of a rotate-every-two rotation, a fused op's outputs that the exporter recorded by name
# only): inferring every Concat of a 20k-node onnxruntime-training graph cost its optimiser
# run ~5%
_REFINED_ONLY = frozenset({"Concat", "ConcatTraining", "Slice", "Unsqueeze", "Squeeze", "Split",
                           "SplitTraining"}) | _FUSED_OPS
_INFERRED_BY = {False: _INFERRED - _REFINED_ONLY, True: _INFERRED | _REFINED_ONLY}  # by refine


def _refined(recorded, inferred):
    """The recorded shape with the inferred static dims in place of its symbolic / unknown
    ones (a recorded static dim stays); the inferred shape where nothing is recorded."""
    if recorded is None or inferred is None or len(recorded) != len(inferred):
        return recorded if recorded is not None else inferred
    return [r if isinstance(r, int) or not isinstance(i, int) else i
            for r, i in zip(recorded, inferred)]


def _matmul(a, b, trans_a=False, trans_b=False):
    if a is None or b is None or len(a) < 2 or len(b) < 2:
        return None
    m = a[-1] if trans_a else a[-2]
    n = b[-2] if trans_b else b[-1]
    batch = broadcast(a[:-2], b[:-2])
    return None if batch is None else batch + [m, n]


class ShapeOracle:
    def __init__(self, index):
        self.g = index
        self._cache: dict[str, list | None] = {}
        self._refined: dict[str, list | None] = {}

    def recorded(self, name: str):
        t = self.g.type_of(name)
        if t is not None and t.tensor_type.HasField("shape"):
            return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in t.tensor_type.shape.dim]
        return None

    def shape(self, name: str):
        return self._walk(name, self._cache, refine=False)

    def refined(self, name: str):
        """``shape(name)`` with the symbolic / unknown dims that inference finds static
        replaced by them. TorchScript under dynamic axes records a dim it could not compute
        as a made-up name, e.g. the heads and head size of a view whose target is built at run
        time; those are what a Shape of the tensor reads, so the constant folding of shapes
        asks here (on demand: refining every tensor of a large graph costs a full inference
        pass)."""
        return self._walk(name, self._refined, refine=True)

    def _walk(self, name: str, cache: dict, refine: bool):
        """Memoised, iterative: the recorded shape, inferred where none is recorded; with
        ``refine`` also where it is not all static (the inferred static dims replace the
        others: ``_refined``), Concat included."""
        if not name:
            return None
        if name in cache:  # (the common case, without memoised's set-up)
            return cache[name]

        def step(t):
            rec = self.shape(t) if refine else self.recorded(t)
            prod = self.g.producer.get(t)
            wanted = rec is None or (refine and not all(isinstance(d, int) for d in rec))
            if wanted and prod is not None and prod.alive and prod.op in _INFERRED_BY[refine]:
                missing = [i for i in prod.inputs[:_INPUTS_READ] if i and i not in cache]
                if missing:
                    return missing[0]
                try:
                    inferred = self._infer(prod, t, cache, refine)
                except Exception:  # noqa: BLE001 - a shape that cannot be inferred is unknown
                    inferred = None
                rec = _refined(rec, inferred)
            cache[t] = rec
            return None

        return memoised(name, cache, step)

    def _infer(self, node, out_name, cache, refine=False):
        ins = [cache.get(i) if i else None for i in node.inputs]
        op, at = node.op, node.attrs
        if refine and op in _FUSED_OPS and node.domain == FUSED_DOMAIN:  # its contract's like
            view = SimpleNamespace(op_type=op, input=node.inputs, output=node.outputs,
                                   attribute=node.proto.attribute)
            shapes = infer_output_shapes(view, cache.get)
            return shapes[node.outputs.index(out_name)]
        if op in ("Split", "SplitTraining"):
            return self._split(node, out_name, ins[0])
        if node.outputs[0] != out_name:
            return None
        value = self.g.const_value(out_name) if op in ("Constant", "Shape") else None
        if value is not None:
            return list(np.shape(value))
        if op in _SAME_AS_INPUT0:
            return ins[0]
        if op in _BROADCAST:
            out = ins[0]
            for s in ins[1:]:
                out = broadcast(out, s, static_wins=refine)
            return out
        if op == "MatMul":
            return _matmul(ins[0], ins[1])
        if op == "FusedMatMul":
            if at.get("transBatchA", 0) or at.get("transBatchB", 0):
                return None
            return _matmul(ins[0], ins[1], at.get("transA", 0), at.get("transB", 0))
        if op == "Gemm":
            return _matmul(ins[0], ins[1], at.get("transA", 0), at.get("transB", 0))
        if op == "Transpose" and ins[0] is not None:
            perm = at.get("perm") or list(range(len(ins[0])))[::-1]
            return [ins[0][p] for p in perm]
        if op == "Reshape":
            if refine:  # a target computed at run time: its static entries, None elsewhere
                target = self.g.shape_vector(node.inputs[1])
            else:
                value = self.g.const_value(node.inputs[1])
                target = None if value is None else [int(x) for x in np.asarray(value).ravel()]
            if target is None:
                return None
            src = ins[0]
            dims = [src[i] if d == 0 and src is not None and i < len(src) else
                    (None if d in (0, -1, None) else d) for i, d in enumerate(target)]
            if -1 in target and None not in target and src is not None \
                    and all(isinstance(d, int) for d in src):
                known = [d for d in dims if d is not None]
                if len(known) == len(dims) - 1 and all(isinstance(d, int) for d in known):
                    dims[target.index(-1)] = int(np.prod(src)) // max(int(np.prod(known)), 1)
            return dims
        if op in ("ReduceSum", "ReduceMean") and ins[0] is not None:
            axes = (self.g.const_value(node.inputs[1]) if len(node.inputs) > 1
                    and node.inputs[1] else at.get("axes"))
            if axes is None:
                return None
            rank = len(ins[0])
            axes = {int(a) % rank for a in np.asarray(axes).reshape(-1)}
            keep = at.get("keepdims", 1)
            return [1 if i in axes else d for i, d in enumerate(ins[0])
                    if keep or i not in axes]
        if op in ("Unsqueeze", "Squeeze") and ins[0] is not None:
            axes = (self.g.const_value(node.inputs[1]) if len(node.inputs) > 1
                    and node.inputs[1] else at.get("axes"))
            if axes is None:
                return None
            rank = len(ins[0]) + (np.size(axes) if op == "Unsqueeze" else 0)
            axes = {int(a) % rank for a in np.asarray(axes).reshape(-1)}
            if op == "Squeeze":
                return [d for i, d in enumerate(ins[0]) if i not in axes]
            rest = iter(ins[0])
            return [1 if i in axes else next(rest) for i in range(rank)]
        if op == "Slice" and ins[0] is not None:
            return self._sliced(node, list(ins[0]))
        if op == "Expand":
            target = self.g.const_value(node.inputs[1])
            return None if target is None else broadcast(
                ins[0], [int(x) for x in np.asarray(target).reshape(-1)])
        if op in ("Concat", "ConcatTraining") and ins and all(s is not None for s in ins) \
                and len({len(s) for s in ins}) == 1 and "axis" in at:
            axis = at["axis"] % len(ins[0])
            sizes = [s[axis] for s in ins]
            total = sum(sizes) if all(isinstance(d, int) for d in sizes) else None
            others = ins[0]
            for s in ins[1:]:
                others = [a if a == b else None for a, b in zip(others, s)]
            return [total if i == axis else d for i, d in enumerate(others)]
        return None

    def _split(self, node, out_name: str, dims) -> list | None:
        """One output of a Split (or onnxruntime-training's SplitTraining, a Concat's
        gradient): its input's dims, the split axis sized by the constant split sizes (input 1,
        or the attribute below opset 13), by the static lengths of the forward ConcatTraining's
        inputs where its per-input lengths are the sizes, or by an equal share of a static
        dim."""
        axis = node.attrs.get("axis", 0)
        if dims is None or not -len(dims) <= axis < len(dims):
            return None
        axis %= len(dims)
        k = node.outputs.index(out_name)
        sizes = (self.g.const_value(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1]
                 else node.attrs.get("split"))
        if sizes is not None:
            sizes = [int(x) for x in np.asarray(sizes).reshape(-1)]
        elif len(node.inputs) > 1 and node.inputs[1]:  # a ConcatTraining's per-input lengths
            cat = self.g.producer.get(node.inputs[1])
            if cat is not None and cat.op == "ConcatTraining" and cat.outputs[1:2] == [
                    node.inputs[1]] and cat.attrs.get("axis", 0) % len(dims) == axis:
                parts = [self.refined(t) for t in cat.inputs]
                if all(p is not None and len(p) == len(dims) and isinstance(p[axis], int)
                       for p in parts):
                    sizes = [p[axis] for p in parts]
        elif isinstance(dims[axis], int) and dims[axis] % len(node.outputs) == 0:
            sizes = [dims[axis] // len(node.outputs)] * len(node.outputs)
        if sizes is None or len(sizes) != len(node.outputs):
            return None
        return [sizes[k] if i == axis else d for i, d in enumerate(dims)]

    def _sliced(self, node, dims: list) -> list | None:
        """A Slice's output dims from constant bounds: a sliced dim is known where it is
        static (ONNX clamps the bounds as Python's slicing does)."""
        starts, ends, axes, steps = self.g.slice_bounds(node)
        if starts is None or ends is None:
            return None
        axes = range(len(starts)) if axes is None else axes
        steps = [1] * len(starts) if steps is None else steps
        for a, lo, hi, step in zip(axes, starts, ends, steps):
            a = int(a) % len(dims)
            n = dims[a]
            dims[a] = len(range(*slice(int(lo), int(hi), int(step)).indices(n))) \
                if isinstance(n, int) and int(step) != 0 else None
        return dims


def same_shape(a, b) -> bool | None:
    """False when the two shapes surely differ, True when surely equal, None when unknown."""
    if a is None or b is None:
        return None
    if len(a) != len(b):
        return False
    sure = True
    for x, y in zip(a, b):
        if x is None or y is None:
            sure = False
        elif x != y:
            if isinstance(x, int) and isinstance(y, int):
                return False
            sure = False
    return True if sure else None


def input_problem(op: str, attrs: dict, ins: list, names: list) -> str | None:
    """Why the fused op could not run on inputs of these shapes (None: fine or unknown): its
    op folder's ``shapes.input_problem`` (fusecli/ops/shapes.py), when it has one."""
    check = input_check(op)
    return None if check is None else check(attrs, ins)


def fusion_problem(oracle: ShapeOracle, node: onnx.NodeProto, replaced: dict) -> str | None:
    """Why fusing into ``node`` would not compute the tensors it replaces (None: fine).

    ``replaced``: fused output tensor name -> the tensor it stands for (the same name)."""
    if input_check(node.op_type) is not None:
        ins = [oracle.shape(t) if t else None for t in node.input]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        why = input_problem(node.op_type, attrs, ins, list(node.input))
        if why:
            return why

    have = {out: oracle.shape(out) for out in node.output if out and out in replaced}
    if all(v is None for v in have.values()):
        return None
    for out, want in zip(node.output, infer_output_shapes(node, oracle.shape)):
        if want is None or have.get(out) is None:
            continue
        if same_shape(want, have[out]) is False:
            return (f"{node.op_type} would write '{out}' as {_show(want)}, but the tensor it "
                    f"replaces is {_show(have[out])} (a broadcast or reduction the rule does not "
                    "cover)")
    return None
