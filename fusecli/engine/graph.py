"""A mutable producer/consumer index over an ONNX graph, updated incrementally as fusions apply.

Built once per run in O(nodes + edges); removing nodes and inserting a fused node only touch the
tensors involved, so a pass over tens of thousands of nodes stays linear (onnx-graphsurgeon's
``cleanup()`` takes ~30 s on a 21k-node training graph, see docs/install.md).
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fusecli.engine import constfold
from fusecli.engine.memo import memoised


# standard ops whose output has the element type of their first input
_SAME_DTYPE = frozenset({
    "Identity", "Neg", "Abs", "Sqrt", "Reciprocal", "Exp", "Log", "Sigmoid", "Tanh", "Erf",
    "Relu", "Softmax", "LogSoftmax", "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min",
    "Reshape", "Expand", "Transpose", "Unsqueeze", "Squeeze", "Flatten", "Concat", "Slice",
    "Gather", "MatMul", "Gemm", "ReduceSum", "ReduceMean", "Dropout"})


# standard ops that only move or retype their first input's elements (a broadcast of one number
# stays that number)
_MOVES_ELEMENTS = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Cast", "CastLike"})


class GNode:
    __slots__ = ("uid", "proto", "op", "domain", "inputs", "proto_inputs", "outputs", "key",
                 "alive", "_attrs", "implicit", "has_subgraphs")

    def __init__(self, uid: int, proto: onnx.NodeProto, key: float):
        self.uid = uid
        self.proto = proto
        self.op = proto.op_type
        self.domain = "" if proto.domain in ("", "ai.onnx") else proto.domain
        # proto_inputs: what the proto reads (the index never edits a proto's inputs);
        # inputs: the dataflow the rules see, which bypass_passthrough rewrites (a new list)
        self.inputs = self.proto_inputs = list(proto.input)
        self.outputs = list(proto.output)
        self.key = key
        self.alive = True
        self._attrs = None
        self.implicit: list[str] = []  # outer-scope tensors read inside subgraph attributes
        self.has_subgraphs = False

    @property
    def name(self) -> str:
        return self.proto.name or f"<{self.op} #{self.uid}>"

    @property
    def attrs(self) -> dict:
        if self._attrs is None:
            self._attrs = {a.name: helper.get_attribute_value(a) for a in self.proto.attribute}
        return self._attrs

    def __repr__(self) -> str:
        return f"GNode({self.name}, {self.domain or 'ai.onnx'}::{self.op})"


_GRAPH_ATTRS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
# the standard ops with subgraph attributes (every other standard op's schema has none; an
# attribute its schema lacks makes onnx's checker and onnxruntime refuse the model); nodes of
# other domains are asked (com.microsoft's BeamSearch, a custom op)
_GRAPH_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})


def subgraphs(node: onnx.NodeProto):
    """(attribute name, GraphProto) of every subgraph attribute of a node (If/Loop/Scan)."""
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.name, a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            for g in a.graphs:
                yield a.name, g


def outer_names(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from enclosing scopes (its own and nested subgraphs')."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    used: set[str] = set()
    for node in graph.node:
        used.update(x for x in node.input if x)
        for _, g in subgraphs(node):
            used |= outer_names(g)
        defined.update(node.output)
    used.update(o.name for o in graph.output)
    return used - defined


# integer shape arithmetic on the way from Shape outputs to a Reshape target
_SHAPE_ARITH = {"Gather", "Slice", "Concat", "ConcatTraining", "Unsqueeze", "Squeeze", "Cast",
                "Identity", "Mul", "Div", "Add", "Sub", "Reshape", "Expand", "Abs", "Max", "Min"}


class GraphIndex:
    def __init__(self, graph: onnx.GraphProto, opset_import=None):
        self.graph = graph
        # domain -> imported opset version (the model's opset_import; "" for ai.onnx): attribute
        # defaults and meanings that changed between opsets (Softmax's axis at 13) read it
        self.opsets: dict[str, int] = {
            ("" if o.domain in ("", "ai.onnx") else o.domain): int(o.version)
            for o in (opset_import or ())}
        self.nodes: list[GNode] = []
        self.producer: dict[str, GNode] = {}
        self.consumers: dict[str, list[GNode]] = defaultdict(list)
        self.by_op: dict[tuple[str, str], dict[int, GNode]] = defaultdict(dict)
        self.graph_inputs = {i.name for i in graph.input}
        self.graph_outputs = {o.name for o in graph.output}
        self.initializers = {t.name: t for t in graph.initializer}
        self.names = set()
        self.tensor_names: set[str] = set()  # given out by unique_tensor_name
        self._all_names: set[str] | None = None
        self._const_cache: dict[str, np.ndarray | None] = {}
        self._is_const: dict[str, bool | None] = {}  # is_constant's: True or None
        self._types: dict[str, onnx.TypeProto] | None = None
        self._shapes = None
        self.bypassed: list[GNode] = []  # pass-through nodes taken out of the index
        for i, proto in enumerate(graph.node):
            self._add(proto, float(i))

    # -- mutation ------------------------------------------------------------------------
    def _add(self, proto: onnx.NodeProto, key: float) -> GNode:
        node = GNode(len(self.nodes), proto, key)
        self.nodes.append(node)
        consumers, producer = self.consumers, self.producer
        if (node.op in _GRAPH_OPS if node.domain == "" else
                any(a.type in _GRAPH_ATTRS for a in proto.attribute)):
            for _, g in subgraphs(proto):
                node.has_subgraphs = True
                node.implicit.extend(sorted(outer_names(g)))
            for t in node.implicit:
                if t:
                    consumers[t].append(node)
        for t in node.inputs:
            if t:
                consumers[t].append(node)
        for t in node.outputs:
            if t:
                producer[t] = node
        self.by_op[(node.domain, node.op)][node.uid] = node
        if proto.name:
            self.names.add(proto.name)
        return node

    def add_node(self, proto: onnx.NodeProto, key: float) -> GNode:
        return self._add(proto, key)

    def remove_node(self, node: GNode) -> None:
        node.alive = False
        for t in node.inputs + node.implicit:
            if t:
                lst = self.consumers.get(t)
                if lst is not None:
                    try:
                        lst.remove(node)
                    except ValueError:
                        pass
        for t in node.outputs:
            if t and self.producer.get(t) is node:
                del self.producer[t]
        self.by_op[(node.domain, node.op)].pop(node.uid, None)

    def reads_only_type(self, node: GNode, tensor: str) -> bool:
        """True when ``node`` reads ``tensor`` only for its element type or static shape
        (CastLike's second input, Shape, Size: torch's ``new_zeros`` / ``zeros_like`` of a raw
        export) and computes a constant: a fusion may take ``tensor`` away, and
        ``detach_type_reads`` then rewrites the node so that it no longer reads it."""
        slots = constfold.NO_VALUE_INPUTS.get(node.op, ()) if node.domain == "" else ()
        return (tensor not in node.implicit
                and all(i in slots for i, t in enumerate(node.inputs) if t == tensor)
                and all(self.const_value(o) is not None for o in node.outputs if o))

    def detach_type_reads(self, tensor: str) -> None:
        """Rewrites each consumer of ``tensor`` that reads only its type (``reads_only_type``)
        into the same computation without it: CastLike(x, t) -> Cast(x, to=t's type),
        Shape(t) / Size(t) -> a Constant of the value; in place (same key and outputs)."""
        for c in list(self.consumers.get(tensor, [])):
            if not self.reads_only_type(c, tensor):
                continue
            out = c.outputs[0]
            value = self.const_value(out)
            if c.op == "CastLike":
                proto = helper.make_node("Cast", [c.inputs[0]], [out], name=c.proto.name,
                                         to=helper.np_dtype_to_tensor_dtype(value.dtype))
            else:
                proto = helper.make_node("Constant", [], [out], name=c.proto.name,
                                         value=numpy_helper.from_array(np.asarray(value)))
            self.remove_node(c)
            self._add(proto, c.key)

    # -- pass-through nodes ----------------------------------------------------------------
    def bypass_passthrough(self) -> int:
        """Take the nodes that pass their input through unchanged out of the index: Identity
        (torch's detach/clone/alias in a raw dynamo export, onnxruntime-training's gradient
        Identity), and an Expand or Reshape whose output has its input's static shape. Their
        consumers read the input instead (in the index only: the protos are untouched), so
        rules see the dataflow without them. ``restore_bypassed`` puts back, at write-back, the
        ones whose output some node of the result still reads. A node whose output is a graph
        output or is read inside a subgraph stays. Returns the number taken out."""
        n_before = len(self.bypassed)
        for node in list(self.nodes):
            if not node.alive or node.domain != "" or len(node.outputs) != 1:
                continue
            src, out = (node.inputs or [""])[0], node.outputs[0]
            if not src or not out or src == out or out in self.graph_outputs:
                continue
            if node.op == "Identity":
                pass
            elif node.op in ("Expand", "Reshape"):
                a, b = self._static_shape(src), self._static_shape(out)
                if a is None or a != b:
                    continue
            else:
                continue
            users = self.consumers.get(out, [])
            if any(out in c.implicit for c in users):
                continue
            for c in users:
                c.inputs = [src if t == out else t for t in c.inputs]
            moved = self.consumers.pop(out, [])
            self.consumers[src].extend(moved)
            self.remove_node(node)
            self.bypassed.append(node)
        return len(self.bypassed) - n_before

    def axes_attributes_as_inputs(self) -> int:
        """A ReduceSum below opset 13 takes its axes as an attribute, from opset 13 as its
        second input (a constant, in the exports), the spelling the rules write. Here (in the
        index only: the protos are untouched, the attribute stays) such a node reads a constant
        tensor of its axes as its second input, a name no graph tensor has, so that one rule
        matches both opsets (onnxruntime-training's bias gradients of an opset-12 export).
        Returns the number of nodes changed."""
        opset = self.opset("")
        if opset is None or opset >= 13:
            return 0
        changed = 0
        for node in self.by_op.get(("", "ReduceSum"), {}).values():
            axes = node.attrs.get("axes")
            if not node.alive or axes is None or len(node.inputs) != 1 or not node.inputs[0]:
                continue
            name = self.unique_tensor_name(f"fusecli.axes_attribute:{node.name}")
            self._const_cache[name] = np.asarray(list(axes), np.int64)
            self._is_const[name] = True
            node.inputs = [node.inputs[0], name]
            self.consumers[name].append(node)
            changed += 1
        return changed

    def restore_bypassed(self, alive: list[GNode], renamable=lambda node: False
                         ) -> list[GNode]:
        """Put back the bypassed nodes whose output a node of ``alive`` (or a put-back node)
        still reads by its proto. A put-back node keeps its place unless its input's producer
        now comes later (a fused node may produce it): then it moves between that producer and
        its first reader. Where the input is an output of a ``renamable`` producer (a fused
        node) that nothing else reads, that output takes the pass-through node's output name
        instead (same value) and the node stays out. Returns the nodes put back."""
        if not self.bypassed:
            return []
        first_reader: dict[str, float] = {}  # tensor -> upper bound of its first reader's key
        for n in alive:
            for t in n.proto_inputs:
                if t and first_reader.get(t, math.inf) > n.key:
                    first_reader[t] = n.key
        back, bound = [], {}
        for node in sorted(self.bypassed, key=lambda n: -n.key):
            hi = first_reader.get(node.outputs[0])
            if hi is None:
                continue
            back.append(node)
            bound[node.uid] = hi
            for t in node.proto_inputs:
                if t and first_reader.get(t, math.inf) > hi:
                    first_reader[t] = hi
        back.reverse()  # graph order: a put-back node's producer is placed before it
        reads: dict[str, int] = {}
        for n in alive:
            for t in (*n.proto_inputs, *n.implicit):
                reads[t] = reads.get(t, 0) + 1
        for n in back:
            for t in n.proto_inputs:
                reads[t] = reads.get(t, 0) + 1
        kept = []
        for node in back:
            src, out = node.proto_inputs[0], node.outputs[0]
            p = self.producer.get(src)
            if (p is not None and p.alive and renamable(p) and reads.get(src) == 1
                    and src not in self.graph_outputs):
                i = p.outputs.index(src)
                p.outputs[i] = out
                p.proto.output[i] = out
                del self.producer[src]
                self.producer[out] = p
                continue
            kept.append(node)
        back = kept
        for node in back:
            lo = max((p.key for t in node.proto_inputs if t and (p := self.producer.get(t))),
                     default=-math.inf)
            hi = bound[node.uid]
            if not lo < node.key < hi:
                node.key = (lo + hi) / 2.0 if hi != math.inf else lo + 0.5
            node.alive = True
            node.inputs = node.proto_inputs
            for t in node.inputs:
                if t:
                    self.consumers[t].append(node)
            self.producer[node.outputs[0]] = node
            self.by_op[(node.domain, node.op)][node.uid] = node
        self.bypassed = [n for n in self.bypassed if not n.alive]
        return back

    # -- queries -------------------------------------------------------------------------
    def alive_nodes(self) -> list[GNode]:
        return sorted((n for n in self.nodes if n.alive), key=lambda n: n.key)

    def domains(self) -> tuple[str, ...]:
        return tuple(sorted({d for d, _ in self.by_op}))

    def candidates(self, op: str, domain: str) -> list[GNode]:
        return list(self.by_op.get((domain, op), {}).values())

    def const_value(self, name: str) -> np.ndarray | None:
        """Value of a tensor computed only from constants, else None.

        Initializers (not also graph inputs), ``Constant`` nodes and every tensor that a
        foldable standard op (see ``constfold.FOLDABLE``) computes from constants count. The
        value is computed lazily, once per tensor (memoised), without changing the graph. A
        broadcast (Expand, ConstantOfShape) of a small value stays a zero-copy broadcast view,
        however large its shape; other results above ``constfold.MAX_ELEMENTS`` elements are
        not computed (None).
        """
        cache = self._const_cache
        if name in cache:  # (the common case, without memoised's set-up)
            return cache[name]

        def step(t):
            if t in self.initializers and t not in self.graph_inputs:
                init = self.initializers[t]
                # weights left on disk (external data, not loaded) are never constants to check
                cache[t] = (numpy_helper.to_array(init)
                            if init.data_location != onnx.TensorProto.EXTERNAL else None)
                return None
            prod = self.producer.get(t)
            picked = self._static_dims_picked(prod)
            if picked is not None:  # Gather / Slice of static dims of a symbolic Shape
                cache[t] = picked
                return None
            pending = None if prod is None else constfold.pending_input(prod, cache)
            if pending:
                return pending
            values = (constfold.evaluate(prod, cache, self._known_dims, self._np_dtype)
                      if pending == "" else None)
            for i, out in enumerate(prod.outputs if prod is not None else ()):
                if out:
                    cache[out] = values[i] if values is not None and i < len(values) else None
            return None

        with np.errstate(all="ignore"):  # for every node constfold.evaluate folds
            return memoised(name, cache, step)

    def is_constant(self, name: str) -> bool:
        """Whether ``name`` is computed only from constants (initializers, Constant nodes) by
        foldable standard ops, as const_value sees it, without computing any value (a dead
        constant subgraph is found without evaluating it). Shape, Size, Gather and Slice,
        constant only where the dims they read are static, ask const_value."""
        cache = self._is_const  # True, or None: not a constant (what pending_input reads)
        if name in cache:
            return bool(cache[name])

        def step(t):
            prod = self.producer.get(t)
            if t in self.initializers:
                cache[t] = True if t not in self.graph_inputs else None
            elif prod is not None and (prod.op in ("Shape", "Size", "Gather")
                                       or prod.op == "Slice" and self._shape_source(prod)):
                cache[t] = True if self.const_value(t) is not None else None
            elif prod is not None:
                pending = constfold.pending_input(prod, cache)
                if pending:
                    return pending
                cache[t] = True if pending == "" else None
            return None

        return bool(memoised(name, cache, step))

    def broadcast_scalar(self, name: str) -> np.ndarray | None:
        """The one number that ``name`` holds everywhere when it is a broadcast of a constant
        to a run-time shape (Expand(c, Shape(...)), ConstantOfShape: torch's ones_like / full
        under symbolic dims; also behind a Transpose, Reshape, Squeeze, Unsqueeze, Cast or
        CastLike of one: slice_scatter's transposed zeros), else None. Only for matching a
        value: its shape is not known."""
        prod = self.producer.get(name)
        if prod is not None and prod.alive and prod.domain == "" and prod.inputs \
                and prod.op in _MOVES_ELEMENTS and prod.inputs[0]:
            v = self.broadcast_scalar(prod.inputs[0])
            if v is None or prod.op not in ("Cast", "CastLike"):
                return v
            dtype = (helper.tensor_dtype_to_np_dtype(prod.attrs["to"]) if prod.op == "Cast"
                     else self._np_dtype(prod.inputs[1]) if len(prod.inputs) > 1 else None)
            return None if dtype is None else v.astype(dtype)
        if prod is None or not prod.alive:
            return None
        if prod.op == "Expand" and prod.inputs[0]:
            v = self.const_value(prod.inputs[0])
            return None if v is None or np.asarray(v).size != 1 else np.asarray(v).reshape(())
        if prod.op == "ConstantOfShape":
            t = prod.attrs.get("value")
            v = numpy_helper.to_array(t) if t is not None else np.zeros((), np.float32)
            return v.reshape(()) if v.size == 1 else None
        return None

    def is_shape_computation(self, name: str, limit: int = 64) -> bool:
        """True when ``name`` is computed at run time only from constants and the Shape (or
        Size) of graph tensors, by integer shape arithmetic (Gather, Slice, Concat, Unsqueeze,
        Mul ...): a Reshape target of symbolic dims (dynamic-shape exports), which is a view
        of its input as a constant target would be."""
        todo, seen = [name], set()
        while todo:
            t = todo.pop()
            if t in seen or not t:
                continue
            seen.add(t)
            if len(seen) > limit:
                return False
            if self.const_value(t) is not None:
                continue
            prod = self.producer.get(t)
            if prod is None or not prod.alive:
                return False
            if prod.op in ("Shape", "Size"):
                continue
            if prod.op not in _SHAPE_ARITH or prod.domain not in ("", "com.microsoft"):
                return False
            todo.extend(prod.inputs)
        return True

    def _static_dims_picked(self, prod) -> np.ndarray | None:
        """The value of Gather(Shape(x)[start:end], constant indices), or of Slice(Shape(x)
        [start:end], constant starts, ends[, axes 0, steps 1]) (`x.size(-1)` under symbolic
        dims: TorchScript's run-time head dim), when the dims it picks are static, though
        others of x are symbolic (else None)."""
        if prod is None or prod.op not in ("Gather", "Slice"):
            return None
        picked = self._picked_dims(prod)
        if picked is None or not all(isinstance(d, int) for d in picked):
            return None
        shape = np.shape(self.const_value(prod.inputs[1])) if prod.op == "Gather" else (-1,)
        return np.asarray(picked, np.int64).reshape(shape)

    def _picked_dims(self, node) -> list | None:
        """The dims that Shape(x){start, end}, Gather(that, constant indices) on axis 0 or
        Slice(that, constant bounds) reads: x's, recorded or inferred, numbers or the exporter's
        symbols; None when not known."""
        if node is None or not node.alive or node.domain != "":
            return None
        sh = node if node.op == "Shape" else self._shape_source(node)
        dims = None if sh is None else self.shapes.refined(sh.inputs[0])
        if dims is None:
            return None
        dims = list(dims)[slice(sh.attrs.get("start", 0), sh.attrs.get("end", len(dims)))]
        if node.op == "Shape":
            return dims
        if node.op == "Slice":
            return self._sliced(node, dims)
        idx = self.const_value(node.inputs[1]) if node.op == "Gather" else None
        if idx is None or node.attrs.get("axis", 0) != 0:
            return None
        try:
            return [dims[int(i)] for i in np.asarray(idx).reshape(-1)]
        except IndexError:
            return None

    def shape_vector(self, name: str) -> list[int | None] | None:
        """A 1-D shape tensor's entries where they are static, None where they are computed at
        run time (a Reshape target built as Concat(Unsqueeze(Gather(Shape(x), i)), ..., heads,
        head size), or Shape(x) itself, under symbolic dims); None when not even its length is
        known."""
        value = self.const_value(name)
        if value is not None:
            return [int(x) for x in np.asarray(value).reshape(-1)]
        prod = self.producer.get(name)
        if prod is None or not prod.alive or prod.domain not in ("", "com.microsoft"):
            return None
        if prod.op == "Shape":
            dims = self._picked_dims(prod)
            return None if dims is None else [d if isinstance(d, int) else None for d in dims]
        if prod.op in ("Concat", "ConcatTraining") and prod.attrs.get("axis") in (0, -1) \
                and prod.outputs[0] == name:
            parts = [self.shape_vector(t) for t in prod.inputs if t]
            return None if any(p is None for p in parts) else [d for p in parts for d in p]
        dims = self.shapes.shape(name)
        if dims is not None and len(dims) == 1 and isinstance(dims[0], int) and dims[0] <= 8:
            return [None] * dims[0]   # a run-time piece of known length
        if prod.op == "Unsqueeze" and self._is_scalar(prod.inputs[0]):
            return [None]             # one run-time dim
        return None

    def picked_dim(self, name: str) -> int | str | None:
        """The dim a rank-0 tensor reads from a shape: Gather(Shape(x), i) with a scalar i, or
        Squeeze of one entry of Shape(x) (its {start, end}, a Slice or a Gather of it): x's
        dim, recorded or inferred, a number or the exporter's symbol for it; None otherwise."""
        prod = self.producer.get(name)
        if prod is not None and prod.op == "Squeeze" and prod.domain == "" and prod.alive:
            prod = self.producer.get(prod.inputs[0])
        elif prod is None or prod.op != "Gather" or not self._is_scalar(name):
            return None
        picked = self._picked_dims(prod)
        return picked[0] if picked is not None and len(picked) == 1 else None

    def _is_scalar(self, name: str) -> bool:
        """A rank-0 tensor: so recorded or inferred, or one dim picked from a shape
        (Gather(Shape(x), i) with a scalar index i)."""
        if self.shapes.shape(name) == []:
            return True
        prod = self.producer.get(name)
        if prod is None or prod.op != "Gather" or len(prod.inputs) < 2 \
                or self._shape_source(prod) is None:
            return False
        idx = self.const_value(prod.inputs[1])
        return idx is not None and np.ndim(idx) == 0

    def _shape_source(self, node):
        """The live Shape node whose output is ``node``'s first input, else None."""
        src = self.producer.get(node.inputs[0]) if node.inputs else None
        return src if src is not None and src.op == "Shape" and src.domain == "" \
            and src.alive else None

    def slice_bounds(self, node) -> tuple:
        """A Slice's starts, ends, axes and steps: each a flat array of its constant value, or
        None (absent, or computed at run time)."""
        return tuple(None if b is None else np.asarray(b).reshape(-1) for b in (
            self.const_value(t) if t else None for t in (node.inputs + [""] * 5)[1:5]))

    def _sliced(self, node, dims: list) -> list | None:
        """dims[start:end] for a Slice of one axis (0) with step 1 and constant bounds; None
        otherwise (ONNX clamps the bounds as Python's slicing does for step 1)."""
        starts, ends, axes, steps = self.slice_bounds(node)
        if starts is None or ends is None or starts.size != 1 or ends.size != 1:
            return None
        if (axes is not None and int(axes[0]) not in (0, -1)) or \
                (steps is not None and int(steps[0]) != 1):
            return None
        return dims[int(starts[0]):int(ends[0])]

    def _known_dims(self, name: str) -> list[int | None] | None:
        """A tensor's dims, None where a dim is not static (symbolic or unknown); None when
        its rank is unknown. A Shape that reads only static dims is a constant."""
        dims = self.shapes.refined(name)
        return None if dims is None else [d if isinstance(d, int) else None for d in dims]

    def _static_shape(self, name: str) -> list[int] | None:
        """Static dims of a tensor, recorded or inferred (None when any dim is not static)."""
        dims = self.shapes.shape(name)
        if dims is None or not all(isinstance(d, int) for d in dims):
            return None
        return dims

    def _np_dtype(self, name: str, depth: int = 8):
        """NumPy dtype of a tensor: recorded, else a Cast's target or the type of the first
        input of its producer (elementwise spellings keep it), a few producers back."""
        for _ in range(depth):
            t = self.type_of(name)
            elem = t.tensor_type.elem_type if t is not None else 0
            if not elem:
                prod = self.producer.get(name)
                if prod is None or not prod.inputs or not prod.inputs[0]:
                    return None
                if prod.op == "Cast" and "to" in prod.attrs:
                    elem = int(prod.attrs["to"])
                elif prod.op == "CastLike" and len(prod.inputs) > 1:
                    name = prod.inputs[1]
                    continue
                elif prod.domain == "" and prod.op in _SAME_DTYPE:
                    name = prod.inputs[0]
                    continue
                else:
                    return None
            try:
                return helper.tensor_dtype_to_np_dtype(elem)
            except (KeyError, TypeError):
                return None
        return None

    @property
    def shapes(self):
        """The graph's ShapeOracle (recorded or inferred shapes), created on first use."""
        if self._shapes is None:
            from fusecli.engine.shapes import ShapeOracle

            self._shapes = ShapeOracle(self)
        return self._shapes

    def type_of(self, name: str) -> onnx.TypeProto | None:
        """The recorded tensor type (element type and shape, symbolic dims kept) of a tensor,
        from value_info, graph inputs/outputs and initializers."""
        if self._types is None:
            g = self.graph
            self._types = {}
            for v in list(g.value_info) + list(g.input) + list(g.output):
                # (a graph output declared without a shape keeps the shape value_info records)
                if v.type.HasField("tensor_type") and (
                        v.type.tensor_type.HasField("shape") or v.name not in self._types):
                    self._types[v.name] = v.type
            for t in g.initializer:
                if t.name not in self._types:
                    self._types[t.name] = helper.make_tensor_type_proto(t.data_type, list(t.dims))
        return self._types.get(name)

    def opset(self, domain: str = "") -> int | None:
        """The opset version the model imports for ``domain`` (None: not recorded)."""
        return self.opsets.get("" if domain in ("", "ai.onnx") else domain)

    def rank(self, name: str) -> int | None:
        """A tensor's rank, if its shape is recorded (value_info, graph inputs / outputs,
        initializers)."""
        s = self.shape(name) if name else None
        return None if s is None else len(s)

    def shape(self, name: str) -> list[int | None] | None:
        """Static dims of a tensor (None for a symbolic dim), if its shape is recorded."""
        t = self.type_of(name)
        if t is None or not t.tensor_type.HasField("shape"):
            return None
        return [d.dim_value if d.HasField("dim_value") else None for d in t.tensor_type.shape.dim]

    def unique_name(self, base: str) -> str:
        """A node name not used yet, in this graph or any subgraph (reserved from now on)."""
        return _fresh(base, lambda n: n in self.names or n in self._model_names(), self.names)

    def unique_tensor_name(self, base: str) -> str:
        """A tensor name that no node, graph input/output, initializer or value_info uses, in
        this graph or any subgraph (even one fused away), reserved from now on."""
        def taken(n):
            return (n in self.producer or n in self.consumers or n in self.graph_inputs
                    or n in self.graph_outputs or n in self.initializers or n in self.tensor_names
                    or n in self._model_names())

        return _fresh(base, taken, self.tensor_names)

    def _model_names(self) -> set[str]:
        """Every tensor and node name the graph held when indexed, subgraphs included."""
        if self._all_names is None:
            # the main graph's node and tensor names from the index (every node ever indexed:
            # a bypassed node's consumers read its input now, its output is among its outputs),
            # not read again from the protos; subgraphs walked from their nodes
            g = self.graph
            names = set(self.names)
            for n in self.nodes:
                names.update(n.inputs)
                names.update(n.outputs)
            names.update(v.name for v in (*g.input, *g.output, *g.value_info))
            names.update(t.name for t in g.initializer)
            names.update(t.values.name for t in g.sparse_initializer)
            self._all_names = names
            stack = [sub for n in self.nodes if n.has_subgraphs for _, sub in subgraphs(n.proto)]
            while stack:
                g = stack.pop()
                self._all_names.update(v.name for v in (*g.input, *g.output, *g.value_info))
                self._all_names.update(t.name for t in g.initializer)
                self._all_names.update(t.values.name for t in g.sparse_initializer)
                for n in g.node:
                    self._all_names.update((n.name, *n.input, *n.output))
                    stack.extend(sub for _, sub in subgraphs(n))
        return self._all_names



def _fresh(base: str, taken, reserve: set[str]) -> str:
    """base, else base_2, base_3, ...: the first name `taken` does not claim; added to `reserve`."""
    name, i = base, 1
    while taken(name):
        i += 1
        name = f"{base}_{i}"
    reserve.add(name)
    return name
