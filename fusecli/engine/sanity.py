"""Graph sanity checks run on every loaded model before fusion.

``check_graph(model)`` returns a list of warnings (one line each) and raises
:class:`~fusecli.errors.ModelError` (exit 2) for problems that make rewriting unsafe or
ambiguous:

- a tensor stored in the file (initializer, tensor attribute) of an undefined element type or
  whose data does not fit its dims and element type;
- a default-domain opset that the installed onnx does not know (future, e.g. 99) or that is
  not a positive version;
- two producers of one tensor (two node outputs, or a node output that is also a graph input
  or initializer): a rewrite could not tell which one a consumer reads;
- a node input, subgraph outer reference or graph output that nothing provides (dangling);
- a cycle, or nodes that are not in topological order (the ONNX spec requires sorted nodes, and
  the fusion pass places fused nodes by their position in the node list).

Duplicate node *names* are only a warning: names are labels, the pass never looks nodes up by
name and gives every fused node a fresh unique name.

Everything is one pass over the nodes plus dictionary look-ups, O(nodes + edges): a 40k-node
graph takes well under a second. Subgraphs (If/Loop/Scan bodies) are checked recursively with
the enclosing scopes' names visible.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque

import onnx

from fusecli.errors import ModelError
from fusecli.engine.graph import outer_names, subgraphs

_DEFAULT_DOMAINS = ("", "ai.onnx")
_MAX_LISTED = 3


_DEFINED_TYPES = frozenset(v for v in onnx.TensorProto.DataType.values()
                           if v != onnx.TensorProto.UNDEFINED)


_PER_VALUE = {onnx.TensorProto.COMPLEX64: 2, onnx.TensorProto.COMPLEX128: 2}
_PACKED_4BIT = {getattr(onnx.TensorProto, k) for k in ("INT4", "UINT4", "FLOAT4E2M1")
                if hasattr(onnx.TensorProto, k)}


def _check_stored(t: onnx.TensorProto, what: str) -> None:
    """A tensor stored in the file holds a defined element type and exactly the data its dims
    call for (numpy_helper would otherwise fail deep inside a rule that reads the constant).
    Tensors left on disk are checked against their dims when the model is loaded."""
    if t.data_type not in _DEFINED_TYPES:
        raise ModelError(f"{what} '{t.name}' has element type {t.data_type}, which is not a "
                         "defined ONNX tensor type; the file is damaged or was written wrongly "
                         "(re-export the model)")
    if t.data_location == onnx.TensorProto.EXTERNAL or t.HasField("segment"):
        return
    dims = list(t.dims)
    if any(d < 0 for d in dims):
        raise ModelError(f"{what} '{t.name}' has a negative dimension {dims}; the file is "
                         "damaged (re-export the model)")
    n = math.prod(dims)
    if t.data_type == onnx.TensorProto.STRING:
        have, want, unit = (len(t.string_data), n, "strings") if not t.raw_data else (
            len(t.raw_data), 0, "raw bytes")
    elif t.raw_data:
        item = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        have, unit = len(t.raw_data), "bytes"
        want = (n + 1) // 2 if t.data_type in _PACKED_4BIT else n * item
    else:
        have = len(getattr(t, onnx.helper.tensor_dtype_to_field(t.data_type)))
        unit = "values"
        want = (n + 1) // 2 if t.data_type in _PACKED_4BIT else n * _PER_VALUE.get(t.data_type, 1)
    if have != want:
        raise ModelError(f"{what} '{t.name}' holds {have} {unit} but its element type "
                         f"{onnx.TensorProto.DataType.Name(t.data_type)} and dims {dims} call for "
                         f"{want}; the file is damaged or was written wrongly (re-export the "
                         "model)")


def _node_label(node: onnx.NodeProto, index: int) -> str:
    return f"node '{node.name}' ({node.op_type})" if node.name else f"node #{index} ({node.op_type})"


def check_opsets(model: onnx.ModelProto) -> list[str]:
    """Raise for an unknown default-domain opset; warn for a newer IR version."""
    warnings: list[str] = []
    known = onnx.defs.onnx_opset_version()
    seen_default = False
    for op in model.opset_import:
        if op.domain not in _DEFAULT_DOMAINS:
            continue
        seen_default = True
        if op.version < 1:
            raise ModelError(f"the model imports opset {op.version} of the default ONNX domain, "
                             "which is not a valid version; re-export the model")
        if op.version > known:
            raise ModelError(f"the model imports opset {op.version} of the default ONNX domain, "
                             f"but the installed onnx {onnx.__version__} knows opsets up to "
                             f"{known}; re-export with opset <= {known} or upgrade onnx "
                             "(pip install -U onnx)")
    if not seen_default and any(n.domain in _DEFAULT_DOMAINS for n in model.graph.node):
        warnings.append("the model has no opset_import for the default ONNX domain; attribute "
                        "defaults are taken from the newest opset onnx knows")
    if model.ir_version > onnx.IR_VERSION:
        warnings.append(f"the model's IR version {model.ir_version} is newer than the installed "
                        f"onnx {onnx.__version__} supports ({onnx.IR_VERSION}); fields it does not "
                        "know are kept but not checked")
    return warnings


def _check_one_graph(graph: onnx.GraphProto, outer: set[str], where: str,
                     warnings: list[str]) -> None:
    nodes = graph.node
    # -- producers ------------------------------------------------------------------------
    provided: dict[str, str] = {}          # tensor -> what provides it (for messages)
    for vi in graph.input:
        if vi.name:
            provided[vi.name] = "a graph input"
    for t in graph.initializer:
        provided.setdefault(t.name, "an initializer")
        _check_stored(t, f"{where}initializer")
    for st in graph.sparse_initializer:
        provided.setdefault(st.values.name, "a sparse initializer")
    producer: dict[str, int] = {}
    dup_producers: list[str] = []
    names: dict[str, int] = {}
    dup_names: list[str] = []
    for i, node in enumerate(nodes):
        for a in node.attribute:
            for t in [a.t] if a.type == onnx.AttributeProto.TENSOR else a.tensors:
                _check_stored(t, f"{where}tensor attribute '{a.name}' of {_node_label(node, i)}:")
        for t in node.output:
            if not t:
                continue
            if t in producer:
                j = producer[t]
                dup_producers.append(f"'{t}' by {_node_label(nodes[j], j)} and "
                                     f"{_node_label(node, i)}")
            elif t in provided:
                dup_producers.append(f"'{t}' by {provided[t]} and {_node_label(node, i)}")
            else:
                producer[t] = i
        if node.name:
            if node.name in names:
                dup_names.append(node.name)
            else:
                names[node.name] = i
    if dup_producers:
        more = len(dup_producers) - _MAX_LISTED
        raise ModelError(f"{where}tensor produced twice: {'; '.join(dup_producers[:_MAX_LISTED])}"
                         f"{f' (and {more} more)' if more > 0 else ''}; every tensor must have "
                         "exactly one producer (rename the duplicate outputs)")
    if dup_names:
        uniq = sorted(set(dup_names))
        more = len(uniq) - _MAX_LISTED
        warnings.append(f"{where}duplicate node names {uniq[:_MAX_LISTED]}"
                        f"{f' (and {more} more)' if more > 0 else ''}; fusion reports may be "
                        "ambiguous about which node they mean")
    # -- ordering, dangling inputs, cycles ------------------------------------------------
    available = set(provided) | outer
    out_of_order: tuple[int, str, int] | None = None
    implicit: dict[int, list[str]] = {}
    for i, node in enumerate(nodes):
        reads = [x for x in node.input if x]
        subs = list(subgraphs(node))
        if subs:
            refs: set[str] = set()
            for _, g in subs:
                refs |= outer_names(g)
            implicit[i] = sorted(refs)
            reads += implicit[i]
        for t in reads:
            if t in available:
                continue
            j = producer.get(t)
            if j is None:
                kind = "reads" if t in node.input else "has a subgraph that reads"
                raise ModelError(f"{where}{_node_label(node, i)} {kind} tensor '{t}', which no "
                                 "node, graph input or initializer provides (dangling input); "
                                 "the model is incomplete")
            if out_of_order is None:
                out_of_order = (i, t, j)
        available.update(x for x in node.output if x)
    for o in graph.output:
        if o.name not in available:
            raise ModelError(f"{where}graph output '{o.name}' is not produced by any node, graph "
                             "input or initializer (dangling output); the model is incomplete")
    if out_of_order is not None:
        cyc = _find_cycle(nodes, producer, implicit)
        if cyc is not None:
            path = " -> ".join(_node_label(nodes[k], k) for k in cyc[:6])
            raise ModelError(f"{where}the graph has a cycle ({path}{' -> ...' if len(cyc) > 6 else ''}"
                             "); an ONNX graph must be acyclic")
        i, t, j = out_of_order
        raise ModelError(f"{where}nodes are not in topological order: {_node_label(nodes[i], i)} "
                         f"reads '{t}', produced later by {_node_label(nodes[j], j)}; re-export "
                         "the model or sort its nodes (ONNX requires topological order)")
    # -- subgraphs -------------------------------------------------------------------------
    scope = available
    for i, node in enumerate(nodes):
        for attr, g in subgraphs(node):
            _check_one_graph(g, scope, f"{where}subgraph '{attr}' of {_node_label(node, i)}: ",
                             warnings)


def _find_cycle(nodes, producer: dict[str, int], implicit: dict[int, list[str]]):
    """Kahn's algorithm; returns the node indices of one cycle, or None if acyclic."""
    n = len(nodes)
    indeg = [0] * n
    succ: dict[int, list[int]] = defaultdict(list)
    for i, node in enumerate(nodes):
        for t in {x for x in node.input if x} | set(implicit.get(i, ())):
            j = producer.get(t)
            if j is not None:
                succ[j].append(i)
                indeg[i] += 1
    q = deque(i for i in range(n) if indeg[i] == 0)
    seen = 0
    while q:
        k = q.popleft()
        seen += 1
        for s in succ.get(k, ()):
            indeg[s] -= 1
            if indeg[s] == 0:
                q.append(s)
    if seen == n:
        return None
    # walk predecessors inside the remaining (cyclic) part until a node repeats
    rest = {i for i in range(n) if indeg[i] > 0}
    preds: dict[int, int] = {}
    for j, ss in succ.items():
        for s in ss:
            if j in rest and s in rest:
                preds.setdefault(s, j)
    start = min(rest)
    order, pos = [], {}
    k = start
    while k not in pos:
        pos[k] = len(order)
        order.append(k)
        k = preds[k]
    cyc = order[pos[k]:]
    cyc.reverse()                           # producer -> consumer order
    return cyc + [cyc[0]]


def check_graph(model: onnx.ModelProto) -> list[str]:
    """Sanity-check a loaded model; return warnings, raise ModelError for fatal problems."""
    warnings = check_opsets(model)
    _check_one_graph(model.graph, set(), "", warnings)
    return warnings
