"""FusionPass: apply rules to a training graph until nothing more matches.

Data flows one way: index the graph once -> match rules in their explicit order -> rewrite each
match into one fused node (in the index) -> write the node list back -> drop what became dead.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import onnx
from onnx import helper

from fusecli.ops.contracts import FUSED_DOMAIN, infer_output_types, load_contracts
from fusecli.errors import EXIT_INTERNAL, FuseError
from fusecli.engine.graph import GNode, GraphIndex
from fusecli.engine.matcher import NEW_TENSOR, Failure, Match, Matcher, MatchResult
from fusecli.engine.rules import CANONICAL_PATTERNS, Rule
from fusecli.engine.saved import SavedDiff
from fusecli.engine.shapes import fusion_problem
from fusecli.engine.tied import fold_tied_gradients, plan_embedding_gradients

MAX_ROUNDS = 16


def has_required_ops(rule: Rule, present: Callable[[str, str], bool]) -> bool:
    """False when a node the rule requires (not optional) has no op of its kind among those
    ``present(domain, op)`` says a graph has: the search could not bind it. FusionPass asks at
    each rule's turn (earlier rules create fused ops that later ones match), so that the other
    family's rules or conv rules on a transformer are not tried at all."""
    return all(any(present(d, op) for op in spec.ops for d in spec.alt(op).domains)
               for spec in rule.nodes if not spec.optional)


def prefix_keys(rule: Rule) -> tuple:
    """The rule's prefix keys (engine.rules.prefix_keys); a rule without a body (built in code)
    shares nothing."""
    return rule.prefix or tuple(f"{rule.name}#{i}" for i in range(len(rule.nodes)))


class FusionError(FuseError):
    """The pass produced a graph that would not run (a bug): nothing is written, exit 4."""

    exit_code = EXIT_INTERNAL
# A fused node's doc_string says what it is to a reader of the model (Netron shows it) and to
# fusecli (rule_of, replaced_of): "fusecli rule R, pattern P, replaced N nodes: a, b, ..."
DOC_PREFIX = "fusecli rule "
DOC_MAX_NAMES = 32      # longer lists (flash_torch replaces ~40 nodes) end with ", ... (K more)"


def fused_doc(rule: str, pattern: str, replaced: list[str]) -> str:
    names = replaced[:DOC_MAX_NAMES]
    more = len(replaced) - len(names)
    return (f"{DOC_PREFIX}{rule}, pattern {pattern}, replaced {len(replaced)} node(s): "
            + ", ".join(names) + (f", ... ({more} more)" if more else ""))


def _doc_head(node: onnx.NodeProto) -> tuple[str, str] | None:
    doc = node.doc_string
    if not doc.startswith(DOC_PREFIX):
        return None
    head, _, tail = doc[len(DOC_PREFIX):].partition(": ")
    return head, tail


def rule_of(node: onnx.NodeProto) -> str | None:
    """The rule that created a fused node, read back from its doc_string."""
    doc = _doc_head(node)
    return None if doc is None else doc[0].split(",", 1)[0]


def replaced_of(node: onnx.NodeProto) -> list[str]:
    """The names of the nodes a fused node replaced, read back from its doc_string (as far as
    it lists them: names holding ", " or lists over DOC_MAX_NAMES are not recoverable)."""
    doc = _doc_head(node)
    if doc is None or not doc[1]:
        return []
    names = doc[1].split(", ")
    return names[:-1] if names[-1].startswith("... (") else names


@dataclass
class PatternStats:
    detected: int = 0
    fused: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"detected": self.detected, "fused": self.fused, "skipped": dict(self.skipped)}


@dataclass
class RuleStats:
    pattern: str
    detected: int = 0
    fused: int = 0

    def as_dict(self) -> dict:
        return {"pattern": self.pattern, "detected": self.detected, "fused": self.fused}


@dataclass
class FusionRecord:
    """One fusion: the rule, the fused node's name and the node names it replaced."""

    rule: str
    pattern: str
    fused_node: str
    replaced: list[str]
    intermediates: list[str]
    node: onnx.NodeProto                 # the fused node as inserted
    nodes: dict[str, str]                # rule node id -> replaced node name
    tensors: dict[str, str]              # rule variable -> tensor name
    extra: list[onnx.NodeProto] = field(default_factory=list)  # replace.then's fused nodes

    def as_dict(self) -> dict:
        return {"rule": self.rule, "pattern": self.pattern, "fused_node": self.fused_node,
                "replaced": self.replaced, "intermediates": self.intermediates}


@dataclass
class Skip:
    rule: str
    pattern: str
    anchor: str
    failure: Failure
    node_failures: dict[str, Failure] = field(default_factory=dict)


class Stats:
    """Per-pattern and per-rule counters of one run (zeroed at the start of every run)."""

    def __init__(self, rules: Iterable[Rule] = ()):
        self.patterns: dict[str, PatternStats] = {p: PatternStats() for p in CANONICAL_PATTERNS}
        self.rules: dict[str, RuleStats] = {}
        for r in rules:
            self.rules[r.name] = RuleStats(r.pattern)
            self.patterns.setdefault(r.pattern, PatternStats())
        self.nodes_before = 0
        self.nodes_after = 0
        self.buffers_eliminated = 0
        self.bytes_eliminated: int | None = 0
        self.fusions: list[FusionRecord] = []
        # fusions a later rule replaced again (an ActivationGrad inside a LinearActivationGrad
        # match), by fused node name: what the later fusion's ``replaced`` names refer to
        self.absorbed: dict[str, FusionRecord] = {}
        self.skips: list[Skip] = []
        self.saved: SavedDiff | None = None   # saved activations before vs after (saved.py)
        # tied heads whose embedding gradient was scattered into the fused dW (tied.py)
        self.tied_folded: list[str] = []
        # embedding gradients written with a static shape, planned with the step's buffers
        self.embedding_planned: list[str] = []

    @property
    def total_fused(self) -> int:
        return sum(p.fused for p in self.patterns.values())

    def as_dict(self, model: str = "") -> dict:
        return {
            "model": model,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "total_fused": self.total_fused,
            "patterns": {k: v.as_dict() for k, v in self.patterns.items()},
            "rules": {k: v.as_dict() for k, v in self.rules.items()},
            "buffers_eliminated": self.buffers_eliminated,
            "bytes_eliminated": self.bytes_eliminated,
            "saved_activations": self.saved_dict(),
            "tied_gradients_folded": list(self.tied_folded),
            "embedding_gradients_planned": list(self.embedding_planned),
        }

    def saved_dict(self) -> dict:
        """The saved-activation figures (saved.py), empty ones before a pass has run."""
        return self.saved.as_dict() if self.saved is not None else SavedDiff.empty()


def tensor_bytes(index: GraphIndex, name: str) -> int | None:
    """Static byte size of a tensor whose element type and shape are recorded and fully known
    (value_info, graph inputs/outputs), else None. Looked up per tensor (only the fused chains'
    intermediates are ever asked for), not for the whole graph up front."""
    tp = index.type_of(name)
    if tp is None:
        return None
    t = tp.tensor_type
    if not t.elem_type or not t.HasField("shape"):
        return None
    size = _itemsize(t.elem_type)
    for d in t.shape.dim:
        if not d.HasField("dim_value") or size is None:
            return None
        size *= d.dim_value
    return size


@functools.cache
def _itemsize(elem: int) -> int | None:
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(elem).itemsize
    except (KeyError, TypeError):
        return None


_TYPE_NAMES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.DOUBLE: "float64"}


def type_name(elem: int) -> str:
    """An ONNX element type as the contracts spell it (float32, float16, bfloat16, ...)."""
    try:
        return _TYPE_NAMES.get(elem) or onnx.TensorProto.DataType.Name(elem).lower()
    except ValueError:
        return f"element type {elem}"


def elem_type(index: GraphIndex, tensor: str, depth: int = 8) -> int | None:
    """A tensor's element type: recorded (value_info, inputs, initializers), else that of its
    producer's first typed input (a Cast: its target), up to ``depth`` producers back."""
    for _ in range(depth):
        tp = index.type_of(tensor)
        if tp is not None and tp.tensor_type.elem_type:
            return tp.tensor_type.elem_type
        prod = index.producer.get(tensor)
        if prod is None:
            return None
        if prod.op == "Cast" and "to" in prod.attrs:
            return int(prod.attrs["to"])
        typed = [t for t in prod.inputs if t and index.type_of(t) is not None]
        if not prod.inputs or not prod.inputs[0]:
            return None
        tensor = typed[0] if typed else prod.inputs[0]
    return None


class FusionPass:
    """Rewrites matched backward chains into fused ops.

    ``rules`` are parsed ``Rule`` objects (the engine reads no files: ``fusecli.FusionPass`` and
    ``fusecli.load_rules`` load rule files). ``run(model)`` rewrites the ModelProto in place and
    returns the number of fused nodes in the result; ``stats`` holds that run's counters.
    """

    def __init__(self, rules: Iterable[Rule], only: Iterable[str] = (), skip: Iterable[str] = (),
                 progress: Callable[[str], None] | None = None,
                 kernels: Iterable[str] | None = None, provider: str = "any"):
        rules = list(rules)
        if not all(isinstance(r, Rule) for r in rules):
            raise TypeError("FusionPass takes parsed Rule objects; load rule files with "
                            "fusecli.load_rules(paths)")
        only, skip = set(only), set(skip)
        self.all_rules: list[Rule] = list(rules)
        self.rules = [r for r in self.all_rules
                      if (not only or r.pattern in only or r.name in only)
                      and r.pattern not in skip and r.name not in skip]
        self.progress = progress
        # fused ops that have a kernel for the chosen execution provider (None: all of them);
        # a match whose fused op has none is skipped with reason missing_kernel
        self.kernels = None if kernels is None else set(kernels)
        # whose element types a fused op may take: the contract's types for this provider
        # ("cpu": types, "cuda": cuda_types, "any": those both implement; OpContract.types_for)
        self.provider = provider
        self.stats = Stats(self.all_rules)

    # -- public ----------------------------------------------------------------------------
    def run(self, model: onnx.ModelProto) -> int:
        # The pass makes hundreds of thousands of small objects (index entries, bindings) and
        # frees them itself; the cyclic collector's passes over them were ~15% of a run.
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(model)
        finally:
            if enabled:
                gc.enable()

    def _run(self, model: onnx.ModelProto) -> int:
        self.stats = stats = Stats(self.all_rules)
        graph = model.graph
        stats.nodes_before = len(graph.node)
        index = GraphIndex(graph, model.opset_import)
        stats.saved = SavedDiff(model, [(n.inputs, n.outputs) for n in index.nodes],
                                index.type_of)
        index.bypass_passthrough()
        index.axes_attributes_as_inputs()
        credit: dict[int, FusionRecord] = {}  # fused node uid -> its record (absorbed: popped)
        detected: set[tuple[str, int]] = set()
        detected_chains: set[tuple[str, int]] = set()
        fused_chains: set[tuple[str, int]] = set()
        skipped: dict[tuple[str, int], tuple[Rule, Failure]] = {}
        removed_inputs: set[str] = set()
        dirty = None                          # None: examine every anchor
        # anchor uid -> prefix keys (see prefix_keys) of rules whose search at that anchor never
        # got past the prefix's last node: a rule that starts with the same nodes fails there
        # too (variants of one file share their first nodes). Valid until the graph changes.
        dead_ends: dict[int, set[int]] = {}
        for _round in range(MAX_ROUNDS):
            touched: set[int] = set()
            for rule in self.rules:
                if not has_required_ops(rule, lambda d, op: bool(index.by_op.get((d, op)))):
                    continue
                spec = rule.anchor
                anchors = [n for op in spec.ops for d in spec.alt(op).domains
                           for n in index.candidates(op, d)]
                anchors.sort(key=lambda n: n.key)
                matcher = Matcher(index, rule, explain=False)
                keys = self._keys(rule)
                for anchor in anchors:
                    if not anchor.alive or (dirty is not None and anchor.uid not in dirty):
                        continue
                    ends = dead_ends.get(anchor.uid)
                    if ends is not None and not ends.isdisjoint(keys):
                        continue
                    res = matcher.match_at(anchor)
                    if not res.structural and matcher.reached < len(keys):
                        dead_ends.setdefault(anchor.uid, set()).add(keys[matcher.reached])
                    k = (rule.name, anchor.uid)
                    if res.structural and k not in detected:
                        detected.add(k)
                        stats.rules[rule.name].detected += 1
                        # a chain reached by several variants of a pattern counts once
                        if (rule.pattern, anchor.uid) not in detected_chains:
                            detected_chains.add((rule.pattern, anchor.uid))
                            stats.patterns[rule.pattern].detected += 1
                    self.check_kernel(res, index)
                    if res.match is None:
                        if res.structural and res.guard_failure is not None:
                            skipped[k] = (rule, res.guard_failure)
                        continue
                    skipped.pop(k, None)
                    fused_chains.add((rule.pattern, anchor.uid))
                    fused = self._apply(index, res.match, credit, stats, removed_inputs)
                    dead_ends.clear()
                    touched.update(self._neighbourhood(index, fused))
            if not touched:
                break
            dirty = touched
        # a chain several variants failed on counts once, with the reason of the variant that
        # would have replaced the most nodes (a full-training variant's, not that of a variant
        # for fewer gradients, which only sees the other gradients as outside readers)
        def weight(rule: Rule, failure: Failure) -> int:
            keep = {s.id for s in rule.nodes if s.keep}
            return sum(1 for k in failure.bound if k not in keep)

        deepest: dict[tuple[str, int], tuple[Rule, Failure, int]] = {}
        for (_, uid), (rule, failure) in skipped.items():
            chain = (rule.pattern, uid)
            if chain in fused_chains:  # another variant of the pattern fused this chain
                continue
            w = weight(rule, failure)
            if chain not in deepest or w > deepest[chain][2]:
                deepest[chain] = (rule, failure, w)
        for (pattern, uid), (rule, failure, _) in deepest.items():
            ps = stats.patterns[pattern]
            ps.skipped[failure.reason] = ps.skipped.get(failure.reason, 0) + 1
            stats.skips.append(Skip(rule.name, rule.pattern, index.nodes[uid].name, failure))
        self._check_fused(index, credit)
        stats.fusions = list(credit.values())  # fusions that survive in the output graph
        for rec in stats.fusions:
            stats.patterns[rec.pattern].fused += 1
        if credit:
            alive = self._write_back(model, index, removed_inputs)
            stats.saved.finish(model, io=[(n.proto_inputs, n.outputs) for n in alive])
            stats.tied_folded = fold_tied_gradients(model)
            stats.embedding_planned = plan_embedding_gradients(model)
        stats.nodes_after = len(graph.node)
        return stats.total_fused

    @staticmethod
    def _keys(rule: Rule) -> list[int]:
        return prefix_keys(rule)

    def check_kernel(self, res: MatchResult, index: GraphIndex) -> None:
        """Turn a match into a skip when its fused op has no kernel for the chosen provider, or
        its kernels do not implement an input's element type (the contract's ``types`` on the CPU,
        ``cuda_types`` on CUDA, both for ``any``)."""
        m = res.match
        why = None if m is None else self._kernel_refusal(m, index)
        if why is not None:
            res.guard_failure = Failure(len(m.nodes), {k: n.name for k, n in m.nodes.items()},
                                        None, *why)
            res.match = None

    def _kernel_refusal(self, m: Match, index: GraphIndex) -> tuple[str, str] | None:
        for rep, proto in zip(m.rule.replace.nodes, m.protos):
            op = rep.op
            if self.kernels is not None and op not in self.kernels:
                return "missing_kernel", f"{op} has no kernel for the chosen execution provider"
            contract = load_contracts().ops[op]
            ins = list(proto.input) if proto is not None else []
            for port, tensor in zip(contract.inputs, ins):
                elem = (elem_type(index, tensor)
                        if tensor and not tensor.startswith(NEW_TENSOR) else None)
                # a port with its own element type (AttentionGrad's bool dropout_mask) takes that
                wants = (port.type,) if port.type else contract.types_for(self.provider)
                if elem is not None and type_name(elem) not in wants:
                    return "unsupported_type", (f"{port.name} ('{tensor}') is "
                                                f"{type_name(elem)}; {op} implements "
                                                f"{', '.join(wants)}")
        return None

    @staticmethod
    def _check_fused(index: GraphIndex, credit: dict[int, FusionRecord]) -> None:
        """Last line of defence before anything is written: every fused node's inputs must fit
        its op and its outputs must have the shapes of the tensors they replace (where shapes
        are known or inferable). The match guard checks this too; a failure here is a bug."""
        for rec, node in ((r, n) for r in credit.values() for n in (r.node, *r.extra)):
            why = fusion_problem(index.shapes, node, set(node.output))
            if why:
                raise FusionError(f"internal: fused node {rec.fused_node} (rule {rec.rule}) "
                                  f"would not run: {why}; nothing was written. Please report "
                                  f"this; --skip {rec.rule} avoids it")

    # -- rewriting -------------------------------------------------------------------------
    @staticmethod
    def _neighbourhood(index: GraphIndex, node: GNode) -> set[int]:
        out = {node.uid}
        for t in node.inputs:
            p = index.producer.get(t)
            if p is not None:
                out.add(p.uid)
            out.update(c.uid for c in index.consumers.get(t, []))
        for t in node.outputs:
            out.update(c.uid for c in index.consumers.get(t, []))
        return out

    def _apply(self, index: GraphIndex, m: Match, credit, stats: Stats,
               removed_inputs: set[str]) -> GNode:
        rule = m.rule
        proto = m.proto  # ports and attributes, made by the matcher
        ordered = sorted(m.nodes.values(), key=lambda n: n.key)
        first = ordered[0]
        name = index.unique_name(f"{first.proto.name or first.op}/fused_{rule.pattern}")
        replaced = [n.name for n in ordered]
        contracts = load_contracts()
        fresh: dict[str, str] = {}  # replace.new placeholder -> its fresh tensor name
        extra = list(m.extra)  # (key, node) of the nodes added besides the fused node
        for key, node in m.prepared:  # replace.prepare's standard nodes, in order
            node.input[:] = [fresh.get(t, t) for t in node.input]
            same = self._same_node(index, node, m.key)
            if same is not None:    # (the same mask in every layer: one node computes it)
                fresh.update(zip(node.output, same.outputs))
                continue
            node.name = index.unique_name(f"{name}/{node.op_type}")
            for i, t in enumerate(node.output):
                fresh[t] = node.output[i] = index.unique_tensor_name(
                    f"{name}/{t[len(NEW_TENSOR):]}")
            extra.append((key, node))
        for k, (rep, node) in enumerate(zip(rule.replace.nodes, m.protos)):
            outs = node.output
            node.name = name if k == 0 else index.unique_name(f"{name}/{rep.op}")
            for i, port in enumerate(contracts.ops[rep.op].outputs):
                if port.workspace and (i >= len(outs) or not outs[i]):
                    outs.extend([""] * (i + 1 - len(outs)))
                    outs[i] = index.unique_tensor_name(f"{node.name}/{port.name}")
                elif i < len(outs) and outs[i].startswith(NEW_TENSOR):
                    fresh[outs[i]] = outs[i] = index.unique_tensor_name(
                        f"{node.name}/{outs[i][len(NEW_TENSOR):]}")
            for i, t in enumerate(node.input):
                if t in fresh:
                    node.input[i] = fresh[t]
            node.doc_string = fused_doc(rule.name, rule.pattern, replaced)
            for t in node.output:  # their shapes as the replaced nodes make them (_check_fused)
                if t and t not in fresh.values():
                    index.shapes.shape(t)
        for n in ordered:
            index.remove_node(n)
            removed_inputs.update(t for t in n.inputs if t)
            absorbed = credit.pop(n.uid, None)  # a fused node absorbed by a later rule
            if absorbed is not None:
                stats.absorbed[absorbed.fused_node] = absorbed
        for t in m.intermediates:  # outside readers of its type alone (the guard let them)
            index.detach_type_reads(t)
        for node, key in m.moves:  # outside nodes moved before the fused node's readers
            node.key = key
        fused = index.add_node(proto, m.key)
        for key, node in extra:
            index.add_node(node, key)
        credit[fused.uid] = FusionRecord(rule.name, rule.pattern, name, replaced,
                                         list(m.intermediates), proto,
                                         {k: n.name for k, n in m.nodes.items()}, dict(m.tensors),
                                         [node for _, node in extra])
        stats.rules[rule.name].fused += 1
        stats.buffers_eliminated += len(m.intermediates)
        if stats.bytes_eliminated is not None:
            for t in m.intermediates:
                b = tensor_bytes(index, t)
                if b is None:
                    stats.bytes_eliminated = None
                    break
                stats.bytes_eliminated += b
        if self.progress is not None:
            applied = sum(r.fused for r in stats.rules.values())
            if applied % 100 == 0:
                self.progress(f"{applied} fusions")
        return fused

    @staticmethod
    def _same_node(index: GraphIndex, node: onnx.NodeProto, before: float) -> GNode | None:
        """A live standard node placed before ``before`` that computes what ``node`` computes
        (the same op, inputs and attributes), or None."""
        for c in (index.consumers.get(node.input[0], ()) if node.input
                  else index.candidates(node.op_type, "")):
            if c.alive and c.domain == "" and c.op == node.op_type and c.key < before \
                    and c.inputs == list(node.input) and len(c.outputs) == len(node.output) \
                    and list(c.proto.attribute) == list(node.attribute):
                return c
        return None

    @staticmethod
    def _write_back(model: onnx.ModelProto, index: GraphIndex, removed_inputs: set[str]
                    ) -> list[GNode]:
        """Writes the index's nodes back into the model; returns them, in graph order."""
        graph = model.graph
        # pass-through nodes (bypassed in the index) that the result still reads come back;
        # the others go, and their inputs may be dead constants now
        index.restore_bypassed(index.alive_nodes(),
                               renamable=lambda n: n.domain == FUSED_DOMAIN)
        for n in index.bypassed:
            removed_inputs.update(t for t in n.proto_inputs if t)
        # Nodes that computed a constant (a Constant node or a constant subgraph) whose only
        # consumers were fused away are dead now, and so, in turn, are their constant inputs.
        work = sorted(removed_inputs)
        while work:
            p = index.producer.get(work.pop())
            if (p is None or not p.alive or p.domain != "" or p.implicit
                    or any(index.consumers.get(o) or o in index.graph_outputs
                           for o in p.outputs if o)
                    or not all(index.is_constant(o) for o in p.outputs if o)):
                continue
            index.remove_node(p)
            work.extend(t for t in p.inputs if t)
            removed_inputs.update(t for t in p.inputs if t)
        alive = index.alive_nodes()
        used = {t for n in alive for t in (*n.proto_inputs, *n.implicit) if t} | index.graph_outputs
        produced = {t for n in alive for t in n.outputs if t}
        del graph.node[:]
        graph.node.extend(n.proto for n in alive)
        keep_init = [t for t in graph.initializer
                     if t.name in used or t.name not in removed_inputs
                     or t.name in index.graph_inputs]
        if len(keep_init) != len(graph.initializer):
            del graph.initializer[:]
            graph.initializer.extend(keep_init)
        existing = produced | index.graph_inputs | {t.name for t in graph.initializer}
        keep_vi = [vi for vi in graph.value_info if vi.name in existing]
        if len(keep_vi) != len(graph.value_info):
            del graph.value_info[:]
            graph.value_info.extend(keep_vi)
        # record the fused outputs' types so that memory can be planned for them
        recorded = {vi.name for vi in graph.value_info} | index.graph_outputs
        for n in alive:
            if n.domain != FUSED_DOMAIN:
                continue
            for name, tp in zip(n.outputs, infer_output_types(n.proto, index.type_of)):
                if name and tp is not None and name not in recorded:
                    vi = graph.value_info.add()
                    vi.name = name
                    vi.type.CopyFrom(tp)
                    recorded.add(name)
        contracts = load_contracts()
        if not any(o.domain == FUSED_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(FUSED_DOMAIN, contracts.version))
        return alive
