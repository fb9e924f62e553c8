"""Values of tensors computed only from constants (used by ``GraphIndex.const_value``).

Exporters often leave a constant as a small subgraph instead of an initializer: a dynamo
export with ``optimize=False`` computes its scalars with ``scalar_tensor`` arithmetic, Cast and
Reshape of Constant nodes; a torch-joint graph keeps the SiLU gradient's ``1`` as an Expand of
a scalar. Rules compare such tensors by value, so the index evaluates them here, one node at a
time, with NumPy. Nothing is written back into the graph.

Large values are never materialised: a broadcast (Expand, ConstantOfShape, elementwise ops
with a broadcast operand) stays a zero-copy ``np.broadcast_to`` view of its small value; any
other result above ``MAX_ELEMENTS`` elements is not computed (the tensor is then not a
constant to the rules). A node that fails to evaluate is not a constant either; nothing raises.
"""

from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper

MAX_ELEMENTS = 1 << 16

_UNARY = {
    "Identity": lambda a: a, "Neg": np.negative, "Abs": np.abs, "Sqrt": np.sqrt,
    "Reciprocal": lambda a: np.reciprocal(a.astype(np.result_type(a, np.float32))
                                          if a.dtype.kind in "iub" else a),
    "Exp": np.exp, "Log": np.log, "Floor": np.floor, "Ceil": np.ceil, "Not": np.logical_not,
}
_BINARY = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Max": np.maximum, "Min": np.minimum,
    "Equal": np.equal, "Less": np.less, "Greater": np.greater, "LessOrEqual": np.less_equal,
    "GreaterOrEqual": np.greater_equal, "And": np.logical_and, "Or": np.logical_or,
}
_OTHER = {"Constant", "Cast", "CastLike", "Reshape", "Expand", "Shape", "Size", "Div", "Pow",
          "ConstantOfShape", "Unsqueeze", "Squeeze", "Concat", "Gather", "Range", "Transpose",
          "Slice", "Where", "Flatten"}
FOLDABLE = frozenset(_UNARY) | frozenset(_BINARY) | _OTHER
# inputs that are not read for their value: Shape and Size read only their input's static shape,
# CastLike only its second input's element type (torch's dynamo export spells `full_like` /
# `ones_like` as Expand(CastLike(c, x), Shape(x)) of a run-time x: a constant all the same)
NO_VALUE_INPUTS = {"Shape": (0,), "Size": (0,), "CastLike": (1,)}


def pending_input(node, cache) -> str | None:
    """For a node whose outputs are asked for: None when it cannot be a constant (an op that is
    not folded, or an input known not to be constant), an input name whose value must be
    computed first, or "" when every input it needs is known."""
    if node.domain != "" or node.op not in FOLDABLE:
        return None
    skip = NO_VALUE_INPUTS.get(node.op, ())
    for i, t in enumerate(node.inputs):
        if not t or i in skip:
            continue
        if t not in cache:
            return t
        if cache[t] is None:
            return None
    return ""


def compact(a: np.ndarray) -> np.ndarray:
    """The smallest array (same rank) that broadcasts to ``a``: a broadcast view's base."""
    if a.ndim == 0 or 0 not in a.strides:
        return a
    return a[tuple(slice(0, 1) if s == 0 and n > 1 else slice(None)
                   for s, n in zip(a.strides, a.shape))]


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) if len(shape) else 1


def _full(a: np.ndarray) -> np.ndarray | None:
    """``a`` as an ordinary array, if it is small enough to materialise."""
    if _size(a.shape) > MAX_ELEMENTS:
        return None
    return np.ascontiguousarray(a)


def _broadcast(small: np.ndarray, shape) -> np.ndarray:
    shape = tuple(int(d) for d in shape)
    return small if small.shape == shape else np.broadcast_to(small, shape)


def _elementwise(fn, arrays, dtype=None):
    shape = np.broadcast_shapes(*(a.shape for a in arrays))
    out = np.asarray(fn(*(compact(a) for a in arrays)))
    if dtype is not None:
        out = out.astype(dtype)
    return _broadcast(out, np.broadcast_shapes(out.shape, shape))


def _constant(node) -> np.ndarray | None:
    for key, v in node.attrs.items():
        if key == "value":
            return numpy_helper.to_array(v)
        if key == "value_float":
            return np.asarray(v, dtype=np.float32)
        if key == "value_floats":
            return np.asarray(list(v), dtype=np.float32)
        if key == "value_int":
            return np.asarray(v, dtype=np.int64)
        if key == "value_ints":
            return np.asarray(list(v), dtype=np.int64)
    return None


def _axes(node, vals, pos=1):
    if len(vals) > pos and vals[pos] is not None:
        return [int(x) for x in np.asarray(vals[pos]).reshape(-1)]
    return node.attrs.get("axes")


def _reshape(a: np.ndarray, target, allowzero: int) -> np.ndarray | None:
    target = [int(x) for x in np.asarray(target).reshape(-1)]
    shape = [a.shape[i] if d == 0 and not allowzero and i < a.ndim else d
             for i, d in enumerate(target)]
    if -1 in shape:
        known = _size([d for d in shape if d != -1])
        shape[shape.index(-1)] = _size(a.shape) // known if known else 0
    if _size(shape) != _size(a.shape):
        return None
    small = compact(a)
    if small.size == 1:
        return _broadcast(small.reshape(()), shape)
    full = _full(a)
    return None if full is None else full.reshape(shape)


def _evaluate(node, vals, shape_of, dtype_of):  # noqa: C901 - one branch per op, flat
    op, at = node.op, node.attrs
    a = vals[0] if vals else None
    if op == "Constant":
        return _constant(node)
    if op in _UNARY:
        return _elementwise(_UNARY[op], [a])
    if op in _BINARY:
        return _elementwise(_BINARY[op], vals[:2])
    if op == "Div":
        if a.dtype.kind in "iu":
            return _elementwise(lambda x, y: np.trunc(x / y), vals[:2], a.dtype)
        return _elementwise(np.divide, vals[:2])
    if op == "Pow":
        return _elementwise(np.power, vals[:2], a.dtype)
    if op == "Cast":
        dtype = helper.tensor_dtype_to_np_dtype(at["to"])
        return _broadcast(compact(a).astype(dtype), a.shape)
    if op == "CastLike":
        dtype = vals[1].dtype if vals[1] is not None else dtype_of(node.inputs[1])
        return None if dtype is None else _broadcast(compact(a).astype(dtype), a.shape)
    if op == "Where":
        return _elementwise(np.where, vals[:3])
    if op == "Shape":  # the dims it reads must be static (the others may be symbolic)
        dims = shape_of(node.inputs[0])
        if dims is None:
            return None
        dims = dims[slice(at.get("start", 0), at.get("end", len(dims)))]
        return None if None in dims else np.asarray(dims, dtype=np.int64)
    if op == "Size":
        dims = shape_of(node.inputs[0])
        return None if dims is None or None in dims else np.asarray(_size(dims), np.int64)
    if op == "Reshape":
        return _reshape(a, vals[1], at.get("allowzero", 0))
    if op == "Flatten":
        axis = at.get("axis", 1) % max(a.ndim, 1)
        return _reshape(a, [_size(a.shape[:axis]), -1], 0)
    if op == "Expand":
        target = [int(x) for x in np.asarray(vals[1]).reshape(-1)]
        return _broadcast(compact(a), np.broadcast_shapes(a.shape, tuple(target)))
    if op == "ConstantOfShape":
        value = at.get("value")
        small = (numpy_helper.to_array(value).reshape(()) if value is not None
                 else np.zeros((), np.float32))
        return _broadcast(small, [int(x) for x in np.asarray(a).reshape(-1)])
    if op == "Unsqueeze":
        axes = sorted(x % (a.ndim + len(_axes(node, vals))) for x in _axes(node, vals))
        out = a
        for ax in axes:
            out = np.expand_dims(out, ax)
        return out
    if op == "Squeeze":
        axes = _axes(node, vals)
        return np.squeeze(a, axis=None if axes is None else tuple(axes))
    if op == "Transpose":
        return np.transpose(a, at.get("perm"))
    if op == "Concat":
        parts = [_full(v) for v in vals]
        if any(p is None for p in parts) or sum(p.size for p in parts) > MAX_ELEMENTS:
            return None
        return np.concatenate(parts, axis=at.get("axis", 0))
    if op == "Gather":
        data, idx = _full(a), np.asarray(vals[1])
        if data is None or idx.size > MAX_ELEMENTS:
            return None
        out = np.take(data, idx.astype(np.int64), axis=at.get("axis", 0))
        return out if out.size <= MAX_ELEMENTS else None
    if op == "Range":
        start, limit, delta = (np.asarray(v).reshape(()) for v in vals[:3])
        n = int(max(np.ceil((limit - start) / delta), 0))
        return None if n > MAX_ELEMENTS else np.arange(start, limit, delta, dtype=start.dtype)
    if op == "Slice":
        data = a
        starts, ends = (np.asarray(v).reshape(-1) for v in vals[1:3])
        axes = (np.asarray(vals[3]).reshape(-1) if len(vals) > 3 and vals[3] is not None
                else np.arange(len(starts)))
        steps = (np.asarray(vals[4]).reshape(-1) if len(vals) > 4 and vals[4] is not None
                 else np.ones(len(starts), np.int64))
        index = [slice(None)] * data.ndim
        for s, e, ax, st in zip(starts, ends, axes, steps):
            index[int(ax) % data.ndim] = slice(int(s), int(e), int(st))
        return data[tuple(index)]
    return None


def evaluate(node, cache, shape_of, dtype_of=lambda t: None) -> list[np.ndarray | None] | None:
    """The node's output values (first output only for the folded ops), or None; call it
    under ``np.errstate(all="ignore")`` (a division by zero is a value, not a warning).
    ``shape_of(t)``: t's dims (None: rank unknown; a None dim: not static); ``dtype_of(t)``: its NumPy dtype or None."""
    vals = [cache.get(t) if t else None for t in node.inputs]
    try:  # (under the caller's np.errstate(all="ignore"): GraphIndex.const_value)
        out = _evaluate(node, vals, shape_of, dtype_of)
    except Exception:  # noqa: BLE001 - a node that does not evaluate is simply not a constant
        return None
    if out is None:
        return None
    out = np.asarray(out) if not isinstance(out, np.ndarray) else out
    if 0 not in out.strides and out.ndim and out.size > MAX_ELEMENTS:
        return None
    return [out]
