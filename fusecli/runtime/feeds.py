"""Feeds for a training graph of either family (ort-training or torch-joint).

``plan_feeds(model, manifest_entry, seed, dims, given)`` returns a ``FeedPlan``: one array per
graph input that is not an initializer, and the POLICY that produced each one. Inputs are
recognised from the graph's dataflow (which op consumes them, at which input), not from names:

  given by the user (``--feeds FILE.npz``)         -> 'file'
  named by the sample's ``<sample>.params.npz``    -> 'params file'
  buffer an (ort-training) InPlaceAccumulator adds into       -> 'zeros (gradient buffer)'
  reset flag of an InPlaceAccumulator (``lazy_reset_grad``),
  training_mode of a Dropout                                   -> 'True (flag)'
  B of Gemm/MatMul/FusedMatMul, W of Conv (directly or
  through Transpose/Identity/Cast/Reshape/...)                 -> 'fan-in uniform': U(-b, b),
        b = 1/sqrt(fan_in), torch.nn.Linear/Conv2d's kaiming_uniform(a=sqrt(5))
  scale of a LayerNorm/BatchNorm/... (or a 1-D input multiplied in) -> 'ones (norm scale)'
  bias of a norm, Gemm/Conv bias, 1-D input added to a MatMul/Gemm/Conv output or added in
                                                               -> 'zeros (bias)'
  BatchNorm running mean / running var                         -> 'zeros (running mean)' /
                                                                  'ones (running var)'
  integer indices Gathered from an embedding table [V, ...]    -> 'token ids in [0, V)'
  integer labels of a loss (SoftmaxCrossEntropyLoss, NLL, GatherElements of log-probs)
                                                               -> 'labels in [0, C)'
  bool masks, and integer masks that flow (through Cast ...) into mask arithmetic (Sub, Mul,
  Where ...): a causal mask for square [.., S, S] masks, else a padding mask; the polarity (True = keep or True = masked out) is read from the Where it selects in,
  so that no row is fully masked and the mask is never all True or all False -> 'causal mask' /
  'padding mask'
  other integers                                               -> 'integers in [0, 2)'
  other floats (data, targets, embedding tables)               -> 'N(0,1)'

Every generated array has its own random stream (seed, input name), so a value does not depend
on the order of the inputs nor on which inputs the user gave. Symbolic dims are resolved from the
user's arrays, then ``dims``, then defaults (batch 2, sequence 8, otherwise 2).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from fusecli.errors import FuseError
from fusecli.ops.contracts import FUSED_DOMAIN
from fusecli.ops.shapes import label_classes_hook

DEFAULT_DIMS = {"batch": 2, "batch_size": 2, "b": 2, "n": 2, "seq": 8, "sequence": 8,
                "seq_len": 8, "s": 8}
_REPO_SAMPLES = Path(__file__).resolve().parents[2] / "samples"
MAX_FEED_BYTES = 4 << 30       # all generated feeds together

# ops that pass a tensor on unchanged in value (maybe re-laid out, or a part of it: Slice, as of
# a token-type buffer [1, max_positions] sliced to the sequence and expanded to the batch) on
# the way to its consumer
_PASS = {"Identity", "Cast", "Transpose", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand",
         "CastLike", "Slice", "Tile"}
_MATMUL = {"Gemm", "MatMul", "FusedMatMul", "FusedGemm", "TransposeMatMul"}
_CONV = {"Conv", "ConvTranspose", "FusedConv"}
# norm op -> {input index: policy}
_NORMS = {
    "LayerNormalization": {1: "ones (norm scale)", 2: "zeros (bias)"},
    "SimplifiedLayerNormalization": {1: "ones (norm scale)"},
    "RMSNormalization": {1: "ones (norm scale)"},
    "SkipLayerNormalization": {2: "ones (norm scale)", 3: "zeros (bias)", 4: "zeros (bias)"},
    "SkipSimplifiedLayerNormalization": {2: "ones (norm scale)", 3: "zeros (bias)"},
    "InstanceNormalization": {1: "ones (norm scale)", 2: "zeros (bias)"},
    "GroupNormalization": {1: "ones (norm scale)", 2: "zeros (bias)"},
    "BatchNormalization": {1: "ones (norm scale)", 2: "zeros (bias)", 3: "zeros (running mean)",
                           4: "ones (running var)"},
    "BatchNormInternal": {1: "ones (norm scale)", 2: "zeros (bias)", 3: "zeros (running mean)",
                          4: "ones (running var)"},
}
_ACCUMULATORS = {"InPlaceAccumulator", "InPlaceAccumulatorV2"}
# what an integer 0/1 mask flows into (after Cast/Unsqueeze/...): arithmetic and selection
_MASK_ARITH = {"Where", "Sub", "Mul", "Not", "And", "Or", "Equal", "Less", "Greater", "Add"}
_LOSSES = {"SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossInternal",
           "NegativeLogLikelihoodLoss", "SoftmaxCrossEntropy", "SparseSoftmaxCrossEntropy"}


def load_manifest(path: str | Path | None = None) -> dict[str, dict]:
    """Load samples/manifest.yaml; each entry gains 'name' and 'manifest_dir' keys."""
    import yaml

    p = Path(path) if path else _REPO_SAMPLES / "manifest.yaml"
    data = yaml.safe_load(p.read_text())
    samples = data.get("samples", data)
    out = {}
    for name, entry in samples.items():
        e = dict(entry)
        e.setdefault("name", name)
        e["manifest_dir"] = str(p.parent.resolve())
        out[name] = e
    return out


def _named_dim(key: str, dims: dict[str, int]) -> int | None:
    """A symbolic dim's size from --dim, else from its name (DEFAULT_DIMS); None: unknown."""
    if key in dims:
        return int(dims[key])
    low = key.lower()
    for k, v in DEFAULT_DIMS.items():
        if low == k or low.startswith(k + "_") or low.startswith(k):
            if k in ("b", "n", "s") and low != k:
                continue
            return v
    return None


def _dim(d: onnx.TensorShapeProto.Dimension, dims: dict[str, int]) -> int:
    if d.HasField("dim_value") and d.dim_value >= 0:   # a static 0 too (an empty tensor)
        return int(d.dim_value)
    size = _named_dim(d.dim_param if d.HasField("dim_param") else "", dims)
    return 2 if size is None else size


def guessed_dims(model: onnx.ModelProto, dims: dict[str, int] | None = None,
                 given: set[str] = frozenset()) -> list[str]:
    """The symbolic dims of the generated graph inputs (not in ``given``) whose size neither
    --dim, the name nor the graph (``solve_dims``) gives: they were fed as 2."""
    sizes = solve_dims(model, dims or {}, given)
    return [k for k, (_, how) in sizes.items() if how == "guessed"]


_EXPR = __import__("re").compile(r"^[\w\s*+()-]+$")


def _is_expr(dim: str) -> bool:
    return bool(_EXPR.match(dim)) and any(c in dim for c in "*+-")


def _eval_expr(expr: str, known: dict[str, int]) -> int | None:
    """A dim_param that is an expression of other dims ('batch*sequence', '2*s1', 's0 + 1': the
    dynamo exporter writes derived dims so), evaluated over ``known``; None when it is not one
    or names an unknown dim."""
    import ast

    if not _is_expr(expr):
        return None
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None

    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.Name):
            return known.get(n.id)
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Mult, ast.Add, ast.Sub)):
            a, b = ev(n.left), ev(n.right)
            if a is None or b is None:
                return None
            return a * b if isinstance(n.op, ast.Mult) else a + b if isinstance(n.op, ast.Add) \
                else a - b
        return None

    v = ev(tree)
    return v if isinstance(v, int) and v > 0 else None


def _symbols_of(vi) -> list[str]:
    return [d.dim_param for d in vi.type.tensor_type.shape.dim
            if not (d.HasField("dim_value") and d.dim_value >= 0) and d.dim_param]


# elementwise ops whose inputs broadcast against each other: a dim that is not 1 on one side is
# the dim of the other side (or 1)
_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Where", "Equal", "Less", "Greater", "Pow", "Max",
                "Min", "And", "Or", "Sum", "Mean"}


# ops onnx cannot infer (onnxruntime's own, or LayerNormalization below opset 17, which
# onnxruntime runs at any opset) -> a standard op whose first output has their first output's
# shape
_STANDARD_LIKE = {"ConcatTraining": "Concat", **dict.fromkeys(
    ("BitmaskDropout", "Gelu", "FastGelu", "QuickGelu", "LayerNormalization",
     "SimplifiedLayerNormalization", "SkipLayerNormalization",
     "SkipSimplifiedLayerNormalization"), "Identity")}


def _graph_bindings(model: onnx.ModelProto, known: dict[str, int],
                    unknown: set[str]) -> dict[str, int]:
    """Sizes of the ``unknown`` symbols read off the graph: ONNX shape inference (with data
    propagation) on a copy whose graph inputs have the ``known`` sizes, then (1) every recorded
    shape (value_info, inputs, outputs) that names an unknown symbol where inference found a
    number, (2) an input with an unknown symbol that meets, in an elementwise op, a tensor whose
    size inference found (a loss's target against the model's flattened output)."""
    from onnx import shape_inference

    g0 = model.graph
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    del g.value_info[:]
    big = [t for t in g.initializer if int(np.prod(t.dims)) > 64]
    inits = {t.name for t in g.initializer}
    declared = {vi.name for vi in g.input}
    for t in big:  # only shapes matter: large tensors become typed inputs
        if t.name not in declared:
            g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    keep = [t for t in g.initializer if int(np.prod(t.dims)) <= 64]
    del g.initializer[:]
    g.initializer.extend(keep)
    for vi in list(g.input) + list(g.output):
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param in known:
                d.dim_value = known[d.dim_param]
    del g.output[:]
    for n in g.node:  # onnxruntime-training's stand-ins of standard ops, for onnx's inference
        if n.domain in ("", "com.microsoft") and n.op_type in _STANDARD_LIKE:
            n.op_type, n.domain = _STANDARD_LIKE[n.op_type], ""
            del n.output[1:]
            if n.op_type == "Identity":
                del n.input[1:]
                del n.attribute[:]
    try:
        inf = shape_inference.infer_shapes(m, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - a graph onnx cannot infer gives no bindings
        return {}
    shapes: dict[str, list] = {}
    for vi in list(inf.graph.value_info) + list(inf.graph.input):
        if vi.type.tensor_type.HasField("shape"):
            shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None
                               for d in vi.type.tensor_type.shape.dim]
    for t in g0.initializer:
        shapes.setdefault(t.name, list(t.dims))
    found: dict[str, int] = {}

    def bind(sym, v):
        if sym in unknown and sym not in found and isinstance(v, int) and v > 0:
            found[sym] = v

    for vi in list(g0.value_info) + list(g0.output) + list(g0.input):
        got = shapes.get(vi.name)
        if got is None or vi.name in inits:
            continue
        dims = vi.type.tensor_type.shape.dim
        if len(dims) == len(got):
            for d, v in zip(dims, got):
                if d.HasField("dim_param"):
                    bind(d.dim_param, v)
    inputs = {vi.name: vi for vi in g0.input if vi.name not in inits}
    for n in g0.node:
        if n.op_type not in _ELEMENTWISE:
            continue
        for t in n.input:
            vi = inputs.get(t)
            if vi is None or not set(_symbols_of(vi)) & unknown:
                continue
            mine = vi.type.tensor_type.shape.dim
            for o in n.input:
                other = shapes.get(o) if o != t else None
                if not other:
                    continue
                for d, v in zip(reversed(mine), reversed(other)):
                    if d.HasField("dim_param") and v not in (None, 1):
                        bind(d.dim_param, v)
    return found


def solve_dims(model: onnx.ModelProto, dims: dict[str, int] | None = None,
               given: set[str] = frozenset()) -> dict[str, tuple[int, str]]:
    """{symbolic dim of a generated graph input: (size, how it was chosen)}, sizes that agree
    with each other: --dim (or the user's arrays) first, then the dim's name (batch 2,
    sequence 8), an expression of other dims ('batch*sequence'), then the graph (a flattened
    batch x sequence dim gets the product: ``_graph_bindings``), else 2 ('guessed')."""
    dims = dict(dims or {})
    syms: dict[str, None] = {}
    for vi in _graph_inputs(model):
        if vi.name not in given:
            syms.update(dict.fromkeys(_symbols_of(vi)))
    out: dict[str, tuple[int, str]] = {}
    for k in syms:
        if k in dims:
            out[k] = (int(dims[k]), "--dim")
        elif _named_dim(k, {}) is not None and not _is_expr(k):
            out[k] = (_named_dim(k, {}), "name")
    for _ in range(4):
        todo = [k for k in syms if k not in out]
        if not todo:
            break
        known = {**{k: v for k, (v, _) in out.items()}, **dims}
        progress = False
        for k in todo:
            v = _eval_expr(k, known)
            if v is not None:
                out[k], progress = (v, "expression"), True
        todo = {k for k in syms if k not in out}
        if todo and not progress:
            got = _graph_bindings(model, {**known, **{k: v for k, (v, _) in out.items()}}, todo)
            for k, v in got.items():
                out[k], progress = (v, "from the graph"), True
        if not progress:
            break
    for k in syms:
        out.setdefault(k, (2, "guessed"))
    return {k: out[k] for k in syms}


def _params_file(entry: dict) -> Path | None:
    ref = entry.get("params")
    if not ref:
        return None
    cands = [Path(ref)]
    if entry.get("manifest_dir"):
        cands.insert(0, Path(entry["manifest_dir"]) / ref)
    cands.append(_REPO_SAMPLES / ref)
    for c in cands:
        if c.exists():
            return c
    raise FileNotFoundError(f"parameter file {ref!r} named by the manifest entry not found")


def _input_meta(entry: dict | None) -> dict[str, dict]:
    if not entry:
        return {}
    return {i["name"]: i for i in entry.get("inputs", []) if isinstance(i, dict) and "name" in i}


# --- dataflow: what consumes an input ---------------------------------------------------------

class _Flow:
    """Consumers, producers, constants and static shapes of one graph (no external data read)."""

    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.consumers: dict[str, list[tuple[int, onnx.NodeProto, int]]] = {}
        self.producer: dict[str, onnx.NodeProto] = {}
        for pos, n in enumerate(g.node):
            for k, t in enumerate(n.input):
                if t:
                    self.consumers.setdefault(t, []).append((pos, n, k))
            for t in n.output:
                if t:
                    self.producer[t] = n
        self.shapes: dict[str, list] = {}
        for v in list(g.input) + list(g.value_info) + list(g.output):
            if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
                self.shapes[v.name] = [d.dim_value if d.HasField("dim_value") else None
                                       for d in v.type.tensor_type.shape.dim]
        for t in g.initializer:
            self.shapes[t.name] = list(t.dims)
        self.consts: dict[str, np.ndarray] = {}
        for t in g.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL and np.prod(t.dims) <= 16:
                self.consts[t.name] = onnx.numpy_helper.to_array(t)
        for n in g.node:
            if n.op_type == "Constant" and n.output:
                for a in n.attribute:
                    if a.name == "value" and np.prod(a.t.dims) <= 16:
                        self.consts[n.output[0]] = onnx.numpy_helper.to_array(a.t)
                    elif a.name in ("value_float", "value_int"):
                        self.consts[n.output[0]] = np.asarray(helper.get_attribute_value(a))

    def uses(self, name: str, depth: int = 6):
        """(position, node, input index, perm) of every non-pass-through use of ``name``,
        following pass-through ops; ``perm`` maps the use's axes to ``name``'s axes (None once a
        Reshape-like op lost track), in graph order (forward uses first)."""
        out, stack, seen = [], [(name, (), 0)], set()
        while stack:
            t, perm, d = stack.pop()
            for pos, n, k in self.consumers.get(t, []):
                if n.op_type in _PASS and k == 0 and d < depth and (id(n), t) not in seen:
                    seen.add((id(n), t))
                    if n.op_type == "Transpose" and perm is not None:
                        p = _attr(n, "perm")
                        rank = len(self.shapes.get(name) or [])
                        p = list(p) if p is not None else list(range(rank))[::-1]
                        base = list(perm) if perm else list(range(len(p)))
                        nperm = tuple(base[j] for j in p) if len(base) == len(p) else None
                    elif n.op_type in ("Identity", "Cast", "CastLike"):
                        nperm = perm
                    else:
                        nperm = None
                    stack.extend((o, nperm, d + 1) for o in n.output if o)
                else:
                    out.append((pos, n, k, perm))
        return sorted(out, key=lambda u: u[0])

    def produced_by(self, t: str, ops: set[str], depth: int = 3) -> bool:
        n = self.producer.get(t)
        while n is not None and depth > 0:
            if n.op_type in ops:
                return True
            if n.op_type not in _PASS:
                return False
            n = self.producer.get(n.input[0]) if n.input else None
            depth -= 1
        return False

    def static_dim(self, t: str, axis: int) -> int | None:
        shape = self.shapes.get(t)
        if shape and -len(shape) <= axis < len(shape) and shape[axis]:
            return int(shape[axis])
        return None

    def classes_of(self, scores: str) -> int | None:
        """The class count (axis 1) of a loss's score tensor: from its recorded shape, else
        followed up the producers (the class axis tracked as the last axis: through a Reshape
        that flattens [.., V] to [N, V], elementwise ops, a Slice of the sequence) to a recorded
        shape or the out-features of the Gemm/MatMul that produced it. An LM head's logits
        [B, S, V] flattened to [B*S, V]: V, never S (issue 33)."""
        shape = self.shapes.get(scores) or []
        if len(shape) >= 2:
            if shape[1]:
                return int(shape[1])
            if len(shape) > 2:
                return None               # [N, C, d1, ..]: C is not the last axis
        t, depth = scores, 0              # the class axis is now the last one (-1)
        while depth < 8:
            c = self.static_dim(t, -1) if len(self.shapes.get(t) or []) >= 2 else None
            if c:
                return c
            n = self.producer.get(t)
            if n is None:
                return None
            if n.op_type in ("Gemm", "MatMul", "FusedMatMul") and len(n.input) > 1:
                w = self.shapes.get(n.input[1]) or []
                tb = _attr(n, "transB") or 0
                if len(w) >= 2 and all(w[-2:]):
                    return int(w[-2] if tb else w[-1])
                wp = self.producer.get(n.input[1])
                if wp is not None and wp.op_type == "Transpose":
                    w = self.shapes.get(wp.input[0]) or []
                    if len(w) == 2 and all(w):
                        return int(w[0])
                return None
            if n.op_type not in _KEEPS_LAST_AXIS:
                return None
            t = n.input[0] if n.input else ""
            depth += 1
        return None


# ops whose output's last axis is their first input's last axis (a Reshape as a loss input
# flattens [.., V] to [N, V]; a Slice shifts the sequence of an LM head's logits)
_KEEPS_LAST_AXIS = {"Reshape", "Flatten", "Identity", "Cast", "Add", "Sub", "Mul", "Div",
                    "LogSoftmax", "Softmax", "Slice", "Squeeze", "Unsqueeze", "Dropout"}


def _attr(node: onnx.NodeProto, name: str):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return None


def _label_classes(flow: _Flow, n: onnx.NodeProto, k: int, depth: int = 2) -> int | None:
    """The class count where input k of node n is a loss's labels: a loss, a GatherElements of
    the log-probabilities (axis 1), or a Where that picks the label or a stand-in for the ignored
    ones (torch-joint's Where(label != -100, label, 0) before its gather) followed to those, or
    a fused op reading labels (no logits left: its op folder's shapes.label_classes)."""
    if n.op_type in _LOSSES and k == 1:
        return flow.classes_of(n.input[0])
    if n.domain == FUSED_DOMAIN:  # the op folder says (its shapes.label_classes)
        hook = label_classes_hook(n.op_type)
        return hook(k, [flow.shapes.get(t) for t in n.input]) if hook else None
    if n.op_type == "GatherElements" and k == 1:
        axis = _attr(n, "axis") or 0
        return flow.static_dim(n.input[0], axis) or (flow.classes_of(n.input[0])
                                                     if axis in (1, -1) else None)
    if n.op_type == "Where" and k in (1, 2) and depth > 0:
        for _, u, j, _ in flow.uses(n.output[0]):
            c = _label_classes(flow, u, j, depth - 1)
            if c:
                return c
    return None


def _fan_in(shape: tuple[int, ...], contracted: int | None) -> int:
    if contracted is not None and shape:
        return max(int(shape[contracted]), 1)
    if len(shape) >= 2:  # torch's convention: [out, in, *kernel]
        return max(int(np.prod(shape[1:])), 1)
    return max(int(shape[0]) if shape else 1, 1)


def _is_big_negative(flow: _Flow, t: str) -> bool | None:
    v = flow.consts.get(t)
    if v is None or v.dtype.kind != "f" or v.size == 0:
        return None
    return bool(np.all(v <= -1e4))


def _mask_polarity(flow: _Flow, name: str) -> bool:
    """True when a True entry means 'masked out' (Where(mask, -inf, x), masked_fill), False when
    it means 'keep' (Where(mask, x, -inf); the HF / SDPA convention and the default)."""
    for _, n, _k, _ in flow.uses(name):
        flip = False
        cur = n
        if cur.op_type == "Not":
            flip = True
            outs = [u for u in flow.uses(cur.output[0]) if u[1].op_type == "Where" and u[2] == 0]
            if not outs:
                continue
            cur = outs[0][1]
        if cur.op_type == "Where" and len(cur.input) == 3:
            x_neg, y_neg = _is_big_negative(flow, cur.input[1]), _is_big_negative(flow, cur.input[2])
            if x_neg or y_neg:
                return bool(x_neg) != flip
    return False


def _mask(shape: tuple[int, ...], true_means_masked: bool) -> tuple[np.ndarray, str]:
    if len(shape) >= 2 and shape[-1] == shape[-2] and shape[-1] > 1:
        keep = np.broadcast_to(np.tril(np.ones(shape[-2:], dtype=bool)), shape)
        kind = "causal mask"
    else:
        keep = np.ones(shape, dtype=bool)
        if len(shape) >= 1 and shape[-1] > 1:
            s = shape[-1]
            pad = max(1, s // 4)
            rows = keep.reshape(-1, s)
            rows[1::2, s - pad:] = False  # every other row pads its last quarter
            if rows.shape[0] == 1:
                rows[0, s - pad:] = False
        kind = "padding mask"
    m = ~keep if true_means_masked else keep
    return np.ascontiguousarray(m), kind + (" (True = masked)" if true_means_masked else
                                            " (True = keep)")


def _policy_for(flow: _Flow, name: str, shape: tuple[int, ...], dtype: np.dtype,
                meta: dict, entry: dict) -> tuple[str, dict]:
    """(policy kind, parameters) of one generated input, from how the graph consumes it."""
    uses = flow.uses(name)
    direct = [(n, k) for _, n, k, p in uses]
    role = meta.get("role", "")
    if any(n.op_type in _ACCUMULATORS and k == 0 for n, k in direct) \
            or name.endswith("accumulation.buffer") or role == "grad_buffer":
        return "zeros (gradient buffer)", {}
    if dtype == np.bool_:
        if any((n.op_type in _ACCUMULATORS and k == 2) or (n.op_type == "Dropout" and k == 2)
               for n, k in direct) or name == "lazy_reset_grad" or role == "flag":
            return "True (flag)", {}
        return "mask", {"masked": _mask_polarity(flow, name)}
    if np.issubdtype(dtype, np.integer):
        if meta.get("range"):
            kind = "labels" if meta.get("role") == "labels" else "integers in range"
            return kind, {"lo": int(meta["range"][0]), "hi": int(meta["range"][1])}
        for _, n, k, _ in uses:
            if n.op_type == "Gather" and k == 1:
                axis = _attr(n, "axis") or 0
                v = flow.static_dim(n.input[0], axis)
                if v:
                    return "token ids", {"hi": v}
            c = _label_classes(flow, n, k)
            if c:
                return "labels", {"hi": c}
        if entry.get("num_classes"):
            return "labels", {"hi": int(entry["num_classes"])}
        if uses and uses[0][1].op_type in _MASK_ARITH:  # an 0/1 attention mask (HF style)
            return "mask", {"masked": _mask_polarity(flow, name)}
        return "integers in range", {"lo": 0, "hi": 2}
    if not np.issubdtype(dtype, np.floating):
        raise NotImplementedError(f"input {name!r}: unsupported element type {dtype}")
    for _, n, k, perm in uses:
        norm = _NORMS.get(n.op_type)
        if norm and k in norm:
            return norm[k], {}
        if n.op_type in _MATMUL and k == 1:
            if n.op_type == "Gemm":
                axis = 1 if _attr(n, "transB") else 0
            elif n.op_type in ("FusedMatMul", "TransposeMatMul"):
                axis = -1 if _attr(n, "transB") else -2
            else:
                axis = -2 if len(shape) >= 2 else 0
            contracted = None
            if perm is not None and len(shape) >= 1:
                base = list(perm) if perm else list(range(len(shape)))
                contracted = base[axis]
            return "fan-in uniform", {"fan_in": _fan_in(shape, contracted)}
        if n.op_type in _CONV and k == 1:
            return "fan-in uniform", {"fan_in": _fan_in(shape, None)}
        if (n.op_type in ("Gemm",) + tuple(_CONV) and k == 2) or (
                n.op_type == "Add" and len(shape) <= 1
                and any(flow.produced_by(i, _MATMUL | _CONV) for i in n.input if i != name)):
            return "zeros (bias)", {}
        if n.op_type == "Gather" and k == 0:
            return "N(0,1)", {}
        if len(shape) == 1 and n.op_type == "Mul":
            return "ones (norm scale)", {}
        if len(shape) == 1 and n.op_type == "Add":
            return "zeros (bias)", {}
        break  # the first real use decides
    if role == "frozen_parameter" and "var" in name:
        return "ones (running var)", {}
    return "N(0,1)", {}


def _generate(kind: str, params: dict, shape: tuple[int, ...], dtype: np.dtype,
              rng: np.random.Generator) -> tuple[np.ndarray, str]:
    if kind == "fan-in uniform":
        b = 1.0 / np.sqrt(params["fan_in"])
        return (rng.uniform(-b, b, size=shape).astype(dtype),
                "fan-in uniform U(+-1/sqrt(fan_in))")
    if kind.startswith("zeros"):
        return np.zeros(shape, dtype=dtype), kind
    if kind.startswith("ones") or kind == "True (flag)":
        return np.ones(shape, dtype=dtype), kind
    if kind == "mask":
        m, label = _mask(shape, params["masked"])
        return m.astype(dtype), label
    if kind in ("token ids", "labels", "integers in range"):
        lo, hi = params.get("lo", 0), params["hi"]
        label = {"token ids": "token ids", "labels": "labels"}.get(kind, "integers")
        return rng.integers(lo, hi, size=shape).astype(dtype), f"{label} in [{lo}, {hi})"
    return rng.standard_normal(shape).astype(dtype), "N(0,1)"


@dataclass
class FeedPlan:
    """One array per graph input (not an initializer) and the policy that produced it."""

    feeds: dict[str, np.ndarray]
    policy: dict[str, str] = field(default_factory=dict)
    dims: dict[str, tuple[int, str]] = field(default_factory=dict)  # solve_dims' answer

    def groups(self) -> dict[str, list[str]]:
        """{policy: [input names]} in first-seen order."""
        out: dict[str, list[str]] = {}
        for name, pol in self.policy.items():
            out.setdefault(pol, []).append(name)
        return out

    def lines(self, limit: int = 6) -> list[str]:
        out = []
        if self.dims:  # one line: the sizes chosen for the symbolic dims, and how
            out.append("symbolic dims " + ", ".join(f"{k}={v} ({how})"
                                                    for k, (v, how) in self.dims.items()))
        for pol, names in self.groups().items():
            shown = ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)"
                                                if len(names) > limit else "")
            out.append(f"{pol}: {shown}")
        return out


def _graph_inputs(model: onnx.ModelProto):
    inits = {i.name for i in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in inits]


def _dtype_of(vi) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))


def plan_feeds(model: onnx.ModelProto, manifest_entry: dict | None = None, seed: int = 0,
               dims: dict[str, int] | None = None,
               given: dict[str, np.ndarray] | None = None) -> FeedPlan:
    """Feeds for every graph input that is not an initializer, with the policy of each."""
    dims = dict(dims or {})
    given = dict(given or {})
    for vi in _graph_inputs(model):  # symbolic dims the user's arrays already fix
        if vi.name in given:
            for d, n in zip(vi.type.tensor_type.shape.dim, given[vi.name].shape):
                if d.HasField("dim_param") and d.dim_param and d.dim_param not in dims:
                    dims[d.dim_param] = int(n)
    solved = solve_dims(model, dims, set(given))
    dims.update({k: v for k, (v, _) in solved.items()})
    entry = manifest_entry or {}
    meta = _input_meta(entry)
    params: dict[str, np.ndarray] = {}
    pf = _params_file(entry) if entry else None
    if pf is not None:
        with np.load(pf, allow_pickle=False) as z:
            params = {k: z[k] for k in z.files}
    flow = _Flow(model)
    plan = FeedPlan({}, dims=solved)
    total = 0
    for vi in _graph_inputs(model):
        name = vi.name
        dtype = _dtype_of(vi)
        shape = tuple(_dim(d, dims) for d in vi.type.tensor_type.shape.dim)
        if name in given:
            plan.feeds[name], plan.policy[name] = given[name], "file"
            continue
        total += int(np.prod(shape, dtype=object)) * dtype.itemsize
        if total > MAX_FEED_BYTES:     # checked before anything is allocated
            raise FuseError(f"the feeds would take over {MAX_FEED_BYTES >> 30} GiB (input "
                            f"{name!r} has shape {list(shape)}); pass smaller --dim values")
        if name in params:
            v = params[name]
            plan.feeds[name] = np.array(v, dtype=dtype, copy=True).reshape(shape or v.shape)
            plan.policy[name] = "params file"
            continue
        kind, kp = _policy_for(flow, name, shape, dtype, meta.get(name, {}), entry)
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        plan.feeds[name], plan.policy[name] = _generate(kind, kp, shape, dtype, rng)
    return plan


def make_feeds(model: onnx.ModelProto, manifest_entry: dict | None = None, seed: int = 0,
               dims: dict[str, int] | None = None,
               given: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Return {input name: array} for every graph input that is not an initializer."""
    return plan_feeds(model, manifest_entry, seed, dims, given).feeds


def read_feeds_file(path: str | Path, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """``--feeds FILE.npz``: arrays keyed by graph input name, checked against the graph (name,
    dtype, rank, static dims, symbolic dims consistent across arrays); a one-line FuseError."""
    import zipfile

    p = Path(path)
    label = f"--feeds {p}"
    if not p.is_file():
        raise FuseError(f"{label}: no such file")
    try:
        with np.load(p, allow_pickle=False) as z:
            if not hasattr(z, "files"):
                raise ValueError("a single array, not an archive")
            arrays = {k: np.asarray(z[k]) for k in z.files}
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise FuseError(f"{label}: not a NumPy .npz archive of arrays ({' '.join(str(exc).split())}"
                        "); write it with numpy.savez(path, **{input_name: array})") from None
    inputs = {vi.name: vi for vi in _graph_inputs(model)}
    inits = {i.name for i in model.graph.initializer}
    seen_dims: dict[str, tuple[int, str]] = {}
    for name, arr in arrays.items():
        if name not in inputs:
            what = "an initializer, not a graph input" if name in inits else "not an input"
            names = ", ".join(list(inputs)[:8]) + (" ..." if len(inputs) > 8 else "")
            raise FuseError(f"{label}: '{name}' is {what} of the model (graph inputs: {names})")
        vi = inputs[name]
        want = _dtype_of(vi)
        if arr.dtype != want:
            raise FuseError(f"{label}: '{name}' is {arr.dtype}, the graph wants {want}; "
                            f"convert it with .astype(numpy.{want.name})")
        gdims = vi.type.tensor_type.shape.dim
        spec = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in gdims]
        if vi.type.tensor_type.HasField("shape") and len(gdims) != arr.ndim:
            raise FuseError(f"{label}: '{name}' has shape {list(arr.shape)}, the graph wants "
                            f"{spec} (rank {len(gdims)})")
        for d, n in zip(gdims, arr.shape):
            if d.HasField("dim_value") and d.dim_value >= 0 and d.dim_value != n:
                raise FuseError(f"{label}: '{name}' has shape {list(arr.shape)}, the graph "
                                f"wants {spec}")
            if d.HasField("dim_param") and d.dim_param:
                prev = seen_dims.setdefault(d.dim_param, (int(n), name))
                if prev[0] != n:
                    raise FuseError(f"{label}: dimension '{d.dim_param}' is {prev[0]} in "
                                    f"'{prev[1]}' but {n} in '{name}'")
    return arrays


def parse_dims(items) -> dict[str, int]:
    """`--dim NAME=VALUE` options as {name: positive int}; a one-line FuseError otherwise."""
    dims: dict[str, int] = {}
    for item in items or ():
        name, sep, value = str(item).partition("=")
        if not sep or not name.strip():
            raise FuseError(f"--dim {item!r}: expected NAME=VALUE, e.g. --dim batch=4")
        try:
            v = int(value)
        except ValueError:
            raise FuseError(f"--dim {item!r}: VALUE must be a positive integer") from None
        if v <= 0:
            raise FuseError(f"--dim {item!r}: VALUE must be a positive integer")
        dims[name.strip()] = v
    return dims
