"""A mutable producer/consumer index over an ONNX graph, updated incrementally as fusions apply.

Built once per run in O(nodes + edges); removing nodes and inserting a fused node only touch the
tensors involved, so a pass over tens of thousands of nodes stays linear (onnx-graphsurgeon's
``cleanup()`` takes ~30 s on a 21k-node training graph, see README).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import constfold


class GNode:
    __slots__ = ("uid", "proto", "op", "domain", "inputs", "outputs", "key", "alive", "_attrs",
                 "implicit")

    def __init__(self, uid: int, proto: onnx.NodeProto, key: float):
        self.uid = uid
        self.proto = proto
        self.op = proto.op_type
        self.domain = "" if proto.domain in ("", "ai.onnx") else proto.domain
        self.inputs = list(proto.input)
        self.outputs = list(proto.output)
        self.key = key
        self.alive = True
        self._attrs = None
        self.implicit: list[str] = []  # outer-scope tensors read inside subgraph attributes

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


class GraphIndex:
    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
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
        self._types: dict[str, onnx.TypeProto] | None = None
        self._shapes = None
        for i, proto in enumerate(graph.node):
            self._add(proto, float(i))

    # -- mutation ------------------------------------------------------------------------
    def _add(self, proto: onnx.NodeProto, key: float) -> GNode:
        node = GNode(len(self.nodes), proto, key)
        self.nodes.append(node)
        for _, g in subgraphs(proto):
            node.implicit.extend(sorted(outer_names(g)))
        for t in node.inputs + node.implicit:
            if t:
                self.consumers[t].append(node)
        for t in node.outputs:
            if t:
                self.producer[t] = node
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

        def step(t):
            if t in self.initializers and t not in self.graph_inputs:
                init = self.initializers[t]
                # weights left on disk (external data, not loaded) are never constants to check
                cache[t] = (numpy_helper.to_array(init)
                            if init.data_location != onnx.TensorProto.EXTERNAL else None)
                return None
            prod = self.producer.get(t)
            pending = None if prod is None else constfold.pending_input(prod, cache)
            if pending:
                return pending
            values = constfold.evaluate(prod, cache, self.shape) if pending == "" else None
            for i, out in enumerate(prod.outputs if prod is not None else ()):
                if out:
                    cache[out] = values[i] if values is not None and i < len(values) else None
            return None

        return memoised(name, cache, step)

    @property
    def shapes(self):
        """The graph's ShapeOracle (recorded or inferred shapes), created on first use."""
        if self._shapes is None:
            from .shapes import ShapeOracle

            self._shapes = ShapeOracle(self)
        return self._shapes

    def type_of(self, name: str) -> onnx.TypeProto | None:
        """The recorded tensor type (element type and shape, symbolic dims kept) of a tensor,
        from value_info, graph inputs/outputs and initializers."""
        if self._types is None:
            g = self.graph
            self._types = {v.name: v.type for v in list(g.value_info) + list(g.input)
                           + list(g.output) if v.type.HasField("tensor_type")}
            for t in g.initializer:
                if t.name not in self._types:
                    self._types[t.name] = helper.make_tensor_type_proto(t.data_type, list(t.dims))
        return self._types.get(name)

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
            self._all_names = set()
            stack = [self.graph]
            while stack:
                g = stack.pop()
                self._all_names.update(v.name for v in (*g.input, *g.output, *g.value_info))
                self._all_names.update(t.name for t in g.initializer)
                self._all_names.update(t.values.name for t in g.sparse_initializer)
                for n in g.node:
                    self._all_names.update((n.name, *n.input, *n.output))
                    stack.extend(sub for _, sub in subgraphs(n))
        return self._all_names


def memoised(name: str, cache: dict, step):
    """The value of ``name`` in ``cache``, computed over producers without recursion (graphs
    are deep): ``step(t)`` either names a tensor whose value must be computed first, or stores
    what it can into ``cache`` and returns None (t itself then defaults to None)."""
    stack = [name]
    while stack:
        t = stack[-1]
        if t in cache:
            stack.pop()
            continue
        need = step(t)
        if need:
            stack.append(need)
        else:
            stack.pop()
            cache.setdefault(t, None)
    return cache[name]


def _fresh(base: str, taken, reserve: set[str]) -> str:
    """base, else base_2, base_3, ...: the first name `taken` does not claim; added to `reserve`."""
    name, i = base, 1
    while taken(name):
        i += 1
        name = f"{base}_{i}"
    reserve.add(name)
    return name
