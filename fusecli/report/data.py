"""What a report shows, gathered from an optimize run (the API's Result), the original model and
explain's near misses: plain data, no HTML. Every chain and near miss keeps the nodes it involves
(from the original graph, or from the fused one for a fused op a later rule matched on) with
their tensors' element types and shapes, so that the drawings need nothing else."""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field

import onnx

from fusecli.engine.fusion import FusionRecord, tensor_bytes, type_name
from fusecli.engine.graph import GraphIndex


@dataclass
class Tensor:
    name: str
    dtype: str          # "float32", "?" when unknown
    shape: str          # "[2, 16, 64]", "?" when unknown

    @property
    def label(self) -> str:
        if self.dtype == "?" and self.shape == "?":
            return "type unknown"
        return f"{self.dtype} {self.shape}"


@dataclass
class Node:
    name: str
    op: str
    domain: str
    inputs: list[str]
    outputs: list[str]
    attrs: list[str] = field(default_factory=list)   # "name=value", short
    doc: str = ""
    found: bool = True          # False: the name is not in either graph


@dataclass
class Chain:
    """One fused chain: the nodes it replaced and the fused node(s) now in their place."""

    index: int
    rule: str
    pattern: str
    replaced: list[Node]
    fused: list[Node]
    intermediates: list[str]
    intermediate_bytes: int | None
    saved: list[str]            # tensors the replaced nodes read that nothing reads any more
    saved_bytes: int | None

    @property
    def anchor(self) -> str:
        return f"chain-{self.index}"

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.fused] + [n.name for n in self.replaced]


@dataclass
class Miss:
    """One near miss (``fusecli explain``): the partial match and where it failed."""

    index: int
    rule: str
    pattern: str
    anchor_node: str
    depth: int
    bound: dict[str, Node]      # rule node id -> graph node
    failing_spec: str | None    # the rule node that failed (None: a guard of the whole match)
    candidate: Node | None      # the graph node that failed it, if any
    reason: str
    detail: str

    @property
    def anchor(self) -> str:
        return f"miss-{self.index}"

    @property
    def names(self) -> list[str]:
        out = [n.name for n in self.bound.values()]
        return out + ([self.candidate.name] if self.candidate else [])

    @property
    def shape(self) -> tuple:
        """What the partial match looks like, names aside: the same near miss in every block
        of a deep stack has the same shape (and one drawing)."""
        return (self.rule, self.failing_spec, self.reason,
                tuple((k, n.op) for k, n in self.bound.items()),
                self.candidate.op if self.candidate else None)


@dataclass
class MissGroup:
    """Near misses of one shape: drawn once (the first), each listed."""

    index: int
    misses: list[Miss]

    @property
    def anchor(self) -> str:
        return f"misses-{self.index}"

    @property
    def first(self) -> Miss:
        return self.misses[0]


@dataclass
class ReportData:
    model: str
    fused_path: str | None
    stats: dict                 # Stats.as_dict()
    chains: list[Chain]
    misses: list[Miss]
    skips: list[dict]           # Result.skipped
    tensors: dict[str, Tensor]
    verify: dict | None = None  # VerifyReport.as_dict()
    bench: dict | None = None   # api.bench's summary
    warnings: list[str] = field(default_factory=list)

    def pattern_rows(self) -> list[dict]:
        """Per pattern: detected, fused, skipped reasons, chains' intermediate/saved bytes."""
        rows = []
        for name, p in self.stats["patterns"].items():
            mine = [c for c in self.chains if c.pattern == name]
            rows.append({"pattern": name, "detected": p["detected"], "fused": p["fused"],
                         "skipped": dict(p["skipped"]),
                         "intermediate_bytes": _total(c.intermediate_bytes for c in mine),
                         "saved_bytes": _total(c.saved_bytes for c in mine),
                         "misses": sum(m.pattern == name for m in self.misses)})
        return rows

    def miss_groups(self) -> list[MissGroup]:
        """The near misses grouped by shape, in the order of their first (deepest first)."""
        groups: dict[tuple, list[Miss]] = {}
        for m in self.misses:
            groups.setdefault(m.shape, []).append(m)
        return [MissGroup(k, ms) for k, ms in enumerate(groups.values(), 1)]

    @property
    def intermediate_bytes(self) -> int | None:
        return _total(c.intermediate_bytes for c in self.chains)

    @property
    def saved_bytes(self) -> int | None:
        return _total(c.saved_bytes for c in self.chains)


@contextlib.contextmanager
def gc_paused():
    """The cyclic collector off while a report makes its many small objects (it frees them
    itself; on a 34k-node graph the collector's passes were 60% of building the data)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _total(values) -> int | None:
    total = 0
    for v in values:
        if v is None:
            return None
        total += v
    return total


_SHORT_ATTR = 40


def _attr_text(a: onnx.AttributeProto) -> str:
    try:
        v = onnx.helper.get_attribute_value(a)
    except Exception:  # noqa: BLE001 - an attribute we cannot read is shown by name only
        return a.name
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    if isinstance(v, (onnx.TensorProto, onnx.GraphProto)) or (
            isinstance(v, list) and v and not isinstance(v[0], (int, float, bytes, str))):
        return f"{a.name}=<{type(v).__name__}>"
    text = f"{a.name}={v}"
    return text if len(text) <= _SHORT_ATTR else text[:_SHORT_ATTR - 1] + "\u2026"


def _node(proto: onnx.NodeProto) -> Node:
    return Node(proto.name, proto.op_type, proto.domain, list(proto.input), list(proto.output),
                [_attr_text(a) for a in proto.attribute], proto.doc_string)


class _Graphs:
    """Name lookups over the original and the fused graph (built once, O(nodes))."""

    def __init__(self, original: onnx.ModelProto, fused: onnx.ModelProto,
                 absorbed: dict[str, FusionRecord]):
        self.original = original
        self.fused = fused
        self.orig_nodes = _by_name(original.graph)
        self.fused_nodes = _by_name(fused.graph)
        for name, rec in absorbed.items():      # fused, then replaced by a later fusion
            self.fused_nodes.setdefault(name, rec.node)
        self.index = GraphIndex(original.graph, original.opset_import)
        self.fused_index = GraphIndex(fused.graph, fused.opset_import)
        self.tensors: dict[str, Tensor] = {}
        fused_reads = {t for n in fused.graph.node for t in n.input if t}
        self.fused_live = fused_reads | {o.name for o in fused.graph.output}

    def node(self, name: str, in_fused: bool = False) -> Node:
        """The node called ``name`` in the original graph (``in_fused``: in the fused one) or
        else in the other graph."""
        first, then = ((self.fused_nodes, self.orig_nodes) if in_fused
                       else (self.orig_nodes, self.fused_nodes))
        proto = first.get(name) or then.get(name)
        if proto is None:
            return Node(name, "?", "", [], [], found=False)
        node = _node(proto)
        node.name = name                    # an unnamed node keeps the engine's "<Op #i>"
        for t in (*node.inputs, *node.outputs):
            self.tensor(t)
        return node

    def tensor(self, name: str) -> Tensor | None:
        if not name:
            return None
        if name not in self.tensors:
            tp = self.index.type_of(name) or self.fused_index.type_of(name)
            dtype, shape = "?", "?"
            if tp is not None and tp.HasField("tensor_type"):
                t = tp.tensor_type
                if t.elem_type:
                    dtype = type_name(t.elem_type)
                if t.HasField("shape"):
                    shape = "[" + ", ".join(
                        str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
                        for d in t.shape.dim) + "]"
            self.tensors[name] = Tensor(name, dtype, shape)
        return self.tensors[name]

    def nbytes(self, names: list[str]) -> int | None:
        total = 0
        for t in names:
            b = tensor_bytes(self.index, t)
            if b is None:
                b = tensor_bytes(self.fused_index, t)
            if b is None:
                return None
            total += b
        return total


def _by_name(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """Nodes by the name the engine reports them under: their own, or for an unnamed node
    "<Op #position>" (GraphIndex's name for it in the graph it indexed)."""
    return {n.name or f"<{n.op_type} #{i}>": n for i, n in enumerate(graph.node)}


def _chain(k: int, rec: FusionRecord, g: _Graphs) -> Chain:
    replaced = [g.node(n) for n in rec.replaced]
    fused = [g.node(p.name) for p in (rec.node, *rec.extra)]
    made = {t for n in replaced for t in n.outputs}
    # a tensor the replaced nodes read from outside the chain that the fused graph no longer
    # reads: a saved activation (or other buffer) the fused step does not keep alive
    saved = sorted({t for n in replaced for t in n.inputs
                    if t and t not in made and t not in g.fused_live
                    and t not in g.index.initializers and t not in g.index.graph_inputs})
    for t in (*rec.intermediates, *saved):
        g.tensor(t)
    return Chain(k, rec.rule, rec.pattern, replaced, fused, list(rec.intermediates),
                 g.nbytes(rec.intermediates), saved, g.nbytes(saved))


def _miss(k: int, d: dict, g: _Graphs) -> Miss:
    # explain matched on the fused graph (its earlier stages applied): names are looked up
    # there first (an unnamed node's "<Op #i>" counts positions in it)
    bound = {spec: g.node(name, in_fused=True) for spec, name in d["bound"].items()}
    cand = g.node(d["candidate"], in_fused=True) if d.get("candidate") else None
    return Miss(k, d["rule"], d["pattern"], d["anchor"], d["depth"], bound, d.get("node"), cand,
                d["reason"], d["detail"])


def build(model: str, original: onnx.ModelProto, result, misses: list[dict],
          fused_path: str | None = None, bench: dict | None = None) -> ReportData:
    """The report of ``result`` (an ``api.Result``; its model is the fused graph) for
    ``original`` (the same model before fusion) and explain's ``misses``."""
    with gc_paused():
        g = _Graphs(original, result.model, result.stats.absorbed)
        chains = [_chain(k, rec, g) for k, rec in enumerate(result.stats.fusions, 1)]
        near = [_miss(k, d, g) for k, d in enumerate(misses, 1)]
    verify = result.verify.as_dict() if result.verify is not None else None
    return ReportData(model, fused_path, result.stats.as_dict(model), chains, near,
                      result.skipped, g.tensors, verify, bench, list(result.warnings))


