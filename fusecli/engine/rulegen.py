"""`fusecli rules new`: write a DRAFT rule YAML from an example subgraph of a model.

The draft lists the selected nodes in an order the matcher accepts (anchor first, then a
breadth-first walk over shared tensors), copies op types, domains and attributes as equality
constraints, turns small constant inputs into value constraints and names a fused op whose
port counts fit. It is checked before it is returned: it parses, and matched at its anchor it
binds exactly the selected nodes. What it cannot know (the input order the fused op's contract
wants, the fused op's attributes, which constraints to relax) is listed in a comment at its top.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter, deque

import numpy as np
import onnx
import yaml

from fusecli.errors import FuseError

MAX_CONST_ELEMENTS = 16          # constants up to this size are written out as `const:` values
FLOAT_TOL = 1.0e-6               # relative + absolute tolerance written for float constants
DRAFT_ORDER = 1000               # drafts apply after the shipped rules
COMMUTATIVE_OPS = {"Mul", "Add", "Sum", "Max", "Min"}
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_SKIPPED_ATTR_TYPES = {
    onnx.AttributeProto.GRAPH: "graph", onnx.AttributeProto.GRAPHS: "graphs",
    onnx.AttributeProto.TENSOR: "tensor", onnx.AttributeProto.TENSORS: "tensors",
    onnx.AttributeProto.SPARSE_TENSOR: "sparse tensor",
    onnx.AttributeProto.SPARSE_TENSORS: "sparse tensors",
    onnx.AttributeProto.TYPE_PROTO: "type", onnx.AttributeProto.TYPE_PROTOS: "types",
}


# --- text helpers ---------------------------------------------------------------------------

def _comment(text: str) -> str:
    return " ".join(str(text).split())


def _snake(op: str) -> str:
    s = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", op).lower()
    s = re.sub(r"[^a-z0-9_]+", "_", s).strip("_")
    if not s or not s[0].isalpha():
        s = "n_" + s
    return s


# --- the selection ---------------------------------------------------------------------------

def _resolve(index, node_names: list[str]):
    names = [n.strip() for n in node_names if n and n.strip()]
    if not names:
        raise FuseError("no nodes selected; pass --nodes NAME1,NAME2,... (node names as printed "
                        "by `python scripts/samples/dump_chains.py MODEL`)")
    by_name: dict[str, list] = {}
    for n in index.nodes:
        if n.proto.name:
            by_name.setdefault(n.proto.name, []).append(n)
    picked, seen = [], set()
    for name in names:
        if name in seen:
            continue
        seen.add(name)
        found = by_name.get(name)
        if not found:
            close = difflib.get_close_matches(name, list(by_name), n=3, cutoff=0.6)
            hint = (f"; close matches: {', '.join(repr(c) for c in close)}" if close else
                    "; node names are printed by `python scripts/samples/dump_chains.py MODEL`")
            raise FuseError(f"no node named {name!r} in the model{hint}")
        if len(found) > 1:
            raise FuseError(f"{len(found)} nodes are named {name!r}; the selection must name "
                            "nodes unambiguously")
        picked.append(found[0])
    return picked


def _const_size(index, name: str) -> int | None:
    """Element count of a constant tensor (without loading it), else None (not a constant)."""
    if name in index.initializers and name not in index.graph_inputs:
        return int(np.prod(index.initializers[name].dims, dtype=np.int64))
    p = index.producer.get(name)
    if p is not None and p.op == "Constant" and p.domain == "":
        for a in p.proto.attribute:
            if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                return int(np.prod(a.t.dims, dtype=np.int64))
            if a.name in ("value_float", "value_int"):
                return 1
            if a.name == "value_floats":
                return len(a.floats)
            if a.name == "value_ints":
                return len(a.ints)
        return None
    return None


def _order(index, picked):
    """Anchor (rarest op type in the model, then graph order) + BFS over shared tensors."""
    counts = Counter((n.domain, n.op) for n in index.nodes)
    by_key = sorted(picked, key=lambda n: n.key)
    # a Constant node is a poor anchor (it says nothing about the pattern): last resort only
    anchor = min(by_key, key=lambda n: (n.op == "Constant" and n.domain == "",
                                        counts[(n.domain, n.op)], n.key))
    produced = {t for n in picked for t in n.outputs if t}
    links: dict[str, list] = {}
    for n in by_key:
        for t in set(n.inputs + n.outputs):
            # constants do not connect nodes: two uses of one constant are not a dataflow edge
            if t and (t in produced or _const_size(index, t) is None):
                links.setdefault(t, []).append(n)
    order, seen, queue = [], {anchor.uid}, deque([anchor])
    while queue:
        n = queue.popleft()
        order.append(n)
        nbrs = {m.uid: m for t in n.inputs + n.outputs if t in links for m in links[t]}
        for m in sorted(nbrs.values(), key=lambda m: m.key):
            if m.uid not in seen:
                seen.add(m.uid)
                queue.append(m)
    if len(order) != len(picked):
        rest = [n.name for n in by_key if n.uid not in seen]
        raise FuseError(f"the selection is not connected: {', '.join(rest)} share(s) no tensor "
                        f"with {anchor.name} or the nodes linked to it; select the nodes in "
                        "between too")
    return order


def _check_convex(index, picked) -> None:
    """Refuse a selection with an outside path from one of its outputs back into it."""
    inside = {n.uid for n in picked}
    wanted = {t for n in picked for t in n.inputs if t}
    frontier = deque(t for n in picked for t in n.outputs if t)
    seen_t, seen_n = set(frontier), set()
    while frontier:
        t = frontier.popleft()
        for c in index.consumers.get(t, []):
            if c.uid in inside or c.uid in seen_n:
                continue
            seen_n.add(c.uid)
            for o in c.outputs:
                if not o or o in seen_t:
                    continue
                if o in wanted:
                    raise FuseError(f"the selection is not convex: node {c.name} ({c.op}) lies "
                                    "outside it on a path from one of its outputs back into it; "
                                    "add that path's nodes to the selection or drop its end")
                seen_t.add(o)
                frontier.append(o)


# --- fused op choice -------------------------------------------------------------------------

def _fits(contract, n_in: int, n_out: int) -> bool:
    req_in = max((i + 1 for i, p in enumerate(contract.inputs) if not p.optional), default=0)
    req_out = max((i + 1 for i, p in enumerate(contract.outputs) if not p.optional), default=0)
    return req_in <= n_in <= len(contract.inputs) and req_out <= n_out <= len(contract.outputs)


def _signature(contract) -> str:
    def ports(ps):
        return ", ".join(p.name + ("?" if p.optional else "") for p in ps)
    return f"{contract.name}({ports(contract.inputs)}) -> ({ports(contract.outputs)})"


def _choose_op(fused_op: str | None, n_in: int, n_out: int, ins_desc: str):
    from fusecli.ops.contracts import load_contracts

    contracts = load_contracts()
    if fused_op is not None:
        c = contracts.ops.get(fused_op)
        if c is None:
            close = difflib.get_close_matches(fused_op, list(contracts.ops), n=1)
            raise FuseError(f"--op {fused_op!r} is not a fused op of fusecli"
                            f"{f' (did you mean {close[0]!r}?)' if close else ''}; known: "
                            f"{', '.join(sorted(contracts.ops))}")
        if not _fits(c, n_in, n_out):
            raise FuseError(f"--op {fused_op} does not fit the selection: it has {n_in} outside "
                            f"input(s) ({ins_desc}) and {n_out} output(s) used outside it, "
                            f"{_signature(c)} cannot take that; change the selection or --op")
        return c, []
    fit = [c for c in contracts.ops.values() if _fits(c, n_in, n_out)]
    if not fit:
        raise FuseError(f"no fused op of fusecli takes {n_in} input(s) and {n_out} output(s) "
                        f"like the selection ({ins_desc}); pass --op NAME with a selection "
                        "that fits it (see fusecli/ops/<op>/contract.yaml)")
    # fewest unused inputs first (inputs tell ops apart; outputs are mostly optional), then
    # the canonical pattern order of the contracts (the older, plainer ops first: a
    # Linear+activation backward before the flash forward op that has as many inputs), then
    # fewest unused outputs
    fit.sort(key=lambda c: (len(c.inputs) - n_in, 1 << 30 if c.order is None else c.order,
                            len(c.outputs) - n_out))
    return fit[0], fit[1:]


# --- the draft's tensors: variables and constant constraints ---------------------------------

class _Variables:
    """Rule variables for the selection's tensors: ``in*`` outside inputs, ``c*`` constants (one
    per use), ``t*`` intermediates, ``out*`` outputs used outside the selection."""

    def __init__(self, index, picked):
        self.index = index
        self.inside = {n.uid for n in picked}
        self.produced = {t for n in picked for t in n.outputs if t}
        self.consumed = {t for n in picked for t in n.inputs if t}
        self.var: dict[str, str] = {}                     # tensor -> variable
        self.inputs: list[str] = []                       # in* variables, first use first
        self.outputs: list[str] = []                      # out* variables
        self.constraints: dict[str, dict] = {}            # c* variable -> `tensors:` entry
        self.notes: dict[str, str] = {}                   # c* variable -> what the constant was
        self._counters: Counter = Counter()

    def _new(self, prefix: str) -> str:
        v = f"{prefix}{self._counters[prefix]}"
        self._counters[prefix] += 1
        return v

    def used_outside(self, t: str) -> bool:
        return t in self.index.graph_outputs or any(
            c.uid not in self.inside for c in self.index.consumers.get(t, []))

    def _produced_var(self, t: str) -> str:
        if t not in self.var:
            self.var[t] = self._new("out" if self.used_outside(t) else "t")
            if self.var[t].startswith("out"):
                self.outputs.append(self.var[t])
        return self.var[t]

    def input_token(self, t: str) -> str:
        if t == "":
            return "_"
        if t in self.produced:       # possibly consumed before its producer is listed
            return self._produced_var(t)
        if _const_size(self.index, t) is None:
            if t not in self.var:
                self.var[t] = self._new("in")
                self.inputs.append(self.var[t])
            return self.var[t]
        return self._constant(t)

    def output_token(self, t: str) -> str:
        if t == "" or (t not in self.consumed and not self.used_outside(t)):
            return "_"
        return self._produced_var(t)

    def _constant(self, t: str) -> str:
        v = self._new("c")
        size = _const_size(self.index, t)
        value = (self.index.const_value(t) if size is not None and size <= MAX_CONST_ELEMENTS
                 else None)
        arr = np.asarray(value) if value is not None else None
        if arr is None or arr.dtype.kind not in "biuf":
            self.constraints[v] = {"kind": "constant"}
            self.notes[v] = f"{t}: {size} elements" if size is not None else t
            return v
        flat = arr.reshape(-1)
        if arr.dtype.kind == "f" and not np.all(np.isfinite(flat)):
            negative = flat.size == 1 and float(flat[0]) < 0
            self.constraints[v] = {"kind": "large_negative" if negative else "constant"}
            self.notes[v] = f"{t} = {flat.tolist()}"
            return v
        vals = [float(x) for x in flat] if arr.dtype.kind == "f" else [int(x) for x in flat]
        self.constraints[v] = {"const": vals[0] if len(vals) == 1 else vals,
                               "tol": FLOAT_TOL if arr.dtype.kind == "f" else 0}
        self.notes[v] = f"{t} {arr.dtype}{list(arr.shape)}"
        return v

    def sort_outputs(self, order) -> None:
        """Output variables in the order their producers are listed."""
        rank: dict[str, int] = {}
        for n in order:
            for t in n.outputs:
                if self.var.get(t, "").startswith("out"):
                    rank.setdefault(self.var[t], len(rank))
        self.outputs.sort(key=lambda v: rank.get(v, len(rank)))

    def described(self, variables: list[str], sep: str = " = ") -> str:
        return ", ".join(f"{v}{sep}{t}" for t, v in self.var.items() if v in variables)


# --- the draft's nodes -----------------------------------------------------------------------

def _node_ids(order) -> list[str]:
    """One id per node: its op in snake case, numbered where an op occurs more than once."""
    ids = Counter(_snake(n.op) for n in order)
    seen: Counter = Counter()
    used: set[str] = set()
    out = []
    for n in order:
        base = _snake(n.op)
        if ids[base] > 1:
            seen[base] += 1
            nid = f"{base}_{seen[base]}"
        else:
            nid = base
        while nid in used:
            nid += "_"
        used.add(nid)
        out.append(nid)
    return out


def _passes_through(index, n) -> bool:
    """Identity, or a Reshape/Expand that keeps its input's static shape (what
    GraphIndex.bypass_passthrough takes out of FusionPass's index)."""
    if n.domain != "" or len(n.outputs) != 1 or not n.inputs or not n.inputs[0]:
        return False
    if n.op == "Identity":
        return True
    if n.op in ("Reshape", "Expand"):
        a = index._static_shape(n.inputs[0])
        return a is not None and a == index._static_shape(n.outputs[0])
    return False


def _node_entry(n, nid: str, tensors: _Variables) -> dict:
    ins = list(n.inputs)
    while ins and ins[-1] == "":
        ins.pop()
    in_toks = [tensors.input_token(t) for t in ins]
    out_toks = [tensors.output_token(t) for t in n.outputs]
    while len(out_toks) > 1 and out_toks[-1] == "_":
        out_toks.pop()
    entry: dict = {"id": nid, "op": n.op}
    if n.domain:
        entry["domain"] = n.domain
    entry["inputs"] = in_toks
    if n.op in COMMUTATIVE_OPS and n.domain == "":
        entry["commutative"] = True
    entry["outputs"] = out_toks
    return entry


def _attribute_value(a: onnx.AttributeProto):
    value = onnx.helper.get_attribute_value(a)
    if isinstance(value, (list, tuple)):
        return [x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def _add_attributes(entries: list[dict], order, contract, notes: dict[str, str]) -> dict:
    """Copy each node's attributes into its entry as equality constraints; an attribute the
    fused op also has, on one node only, is captured. Returns {fused-op attribute: capture}."""
    owners = Counter(a for n in order for a in n.attrs)
    captures: dict[str, str] = {}
    for entry, n in zip(entries, order):
        attrs = {}
        for a in n.proto.attribute:
            if a.type in _SKIPPED_ATTR_TYPES:
                notes[entry["id"]] += (f"; {a.name}: {_SKIPPED_ATTR_TYPES[a.type]} attribute, "
                                       "not copied (graph/tensor attributes cannot be constrained)")
                continue
            value = _attribute_value(a)
            if a.name in contract.attributes and owners[a.name] == 1 and _NAME_RE.match(a.name):
                captures[a.name] = a.name
                attrs[a.name] = {"equals": value, "capture": a.name}
            else:
                attrs[a.name] = value
        if attrs:
            entry["attrs"] = attrs
    return captures


# --- writing ---------------------------------------------------------------------------------

class _Dumper(yaml.SafeDumper):
    """Block style with indented lists (as the shipped rules), no aliases."""

    def increase_indent(self, flow=False, indentless=False):
        return super().increase_indent(flow, False)

    def ignore_aliases(self, data):
        return True


def _plain(obj):
    """numpy scalars -> Python scalars, recursively (the safe dumper only writes plain types)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    return obj.item() if isinstance(obj, np.generic) else obj


def _to_yaml(rule: dict, node_notes: dict[str, str], tensor_notes: dict[str, str]) -> str:
    """The rule as YAML (one line per node key and per tensor constraint), each node and
    constant followed by a comment naming what it was in the example."""
    text = yaml.dump(_plain(rule), Dumper=_Dumper, sort_keys=False, default_flow_style=None,
                     width=1 << 16, allow_unicode=True)
    lines, section = [], ""
    for line in text.splitlines():
        if line and not line[0].isspace():
            section = line.split(":", 1)[0]
        stripped = line.strip()
        note = None
        if section == "nodes" and stripped.startswith("- id: "):
            note = node_notes.get(stripped[len("- id: "):])
        elif section == "tensors" and line.startswith("  ") and not line.startswith("   "):
            note = tensor_notes.get(stripped.split(":", 1)[0])
        lines.append(f"{line}  # {_comment(note)}" if note else line)
    return "\n".join(lines) + "\n"


def _header(graph_name: str, node_desc: str, contract, others, given: bool,
            tensors: _Variables, to_set: list[str]) -> list[str]:
    def attr_hint(a):
        spec = contract.attributes[a]
        bits = [spec.get("type", "?")]
        if "values" in spec:
            bits.append("one of " + "|".join(map(str, spec["values"])))
        if "default" in spec:
            bits.append(f"default {spec['default']}")
        return f"{a} ({', '.join(bits)})"

    return [
        "# DRAFT rule written by `fusecli rules new`: review every point below before use.",
        f"# Example: {_comment(graph_name)}, nodes {_comment(node_desc)}.",
        (f"# - replace.op {contract.name} was given with --op." if given else
         f"# - replace.op {contract.name} is a placeholder chosen because its port counts fit"
         + (f" (also fit: {', '.join(c.name for c in others)})" if others else "")
         + "; pick the op that computes this subgraph."),
        f"# - Contract: {_signature(contract)} (fusecli/ops/<op>/contract.yaml).",
        "# - replace.inputs/outputs list the outside inputs and the outputs in the order they",
        "#   appear in the pattern, NOT the contract's order: reorder them to the contract.",
        "#   Inputs: " + _comment(tensors.described(tensors.inputs)) + ".",
        "#   Outputs: " + _comment(tensors.described(tensors.outputs)) + ".",
        ("# - Fused-op attributes to compute or set in replace.attrs: "
         + ", ".join(attr_hint(a) for a in to_set) + "." if to_set else
         "# - Every fused-op attribute is captured from the pattern; check the values."),
        "# - Attribute and constant constraints copy the example exactly: relax them (one_of,",
        "#   absent_or, capture, tol, kind) where other instances of the pattern differ, and mark",
        "#   nodes optional where the pattern may lack them.",
        "# - Variables: in* outside inputs, c* constants, t* intermediates, out* outputs used",
        "#   outside the pattern; '_' is an input/output the draft does not constrain.",
        f"# - order: {DRAFT_ORDER} applies the draft after the shipped rules; set it.",
    ]


def _self_check(text: str, name: str, index, order, inside: set) -> None:
    """The draft parses and, matched at its anchor, binds exactly the selection."""
    from fusecli.engine.matcher import Matcher
    from fusecli.engine.rules import parse_rule

    rule = parse_rule(text, f"<draft {name}>")
    res = Matcher(index, rule, check_shapes=False).match_at(order[0])  # ports: placeholders
    if res.match is None:
        why = res.guard_failure or res.deepest
        detail = f": {why.reason}: {why.detail}" if why is not None else ""
        raise FuseError(f"internal: the draft does not match its own example at "
                        f"{order[0].name}{detail}; please report this with the model")
    got = {n.uid for n in res.match.nodes.values()}
    if got != inside:
        other = sorted(n.name for n in res.match.nodes.values() if n.uid not in inside)
        raise FuseError(f"the example is ambiguous: matched at {order[0].name}, the draft binds "
                        f"{', '.join(other)} (outside the selection, same op and attributes) "
                        "instead of the selected node(s); select more nodes to tell them apart")


# --- drafting ---------------------------------------------------------------------------------

def _default_pattern(contract, name: str) -> str:
    """The op's one pattern (its contract), its folder name when it has none, else
    (LinearActivationGrad: one pattern per activation) the draft's name."""
    if len(contract.patterns) == 1:
        return contract.patterns[0]
    return contract.folder if not contract.patterns else name


def _check_name(value: str, what: str) -> None:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise FuseError(f"{what} {value!r} must be lower-case letters, digits and '_', "
                        "starting with a letter")


def draft_rule(model: onnx.ModelProto, node_names: list[str], name: str,
               fused_op: str | None = None, pattern: str | None = None) -> str:
    """A draft rule (YAML text) matching the subgraph made of the nodes ``node_names``.

    Raises FuseError (one line) for an empty, unknown, disconnected or non-convex selection, a
    bad ``name``/``pattern``, or a fused op that cannot take the selection's inputs/outputs.
    """
    from fusecli.engine.graph import GraphIndex

    _check_name(name, "rule name")
    if pattern is not None:
        _check_name(pattern, "pattern")
    index = GraphIndex(model.graph, model.opset_import)
    picked = _resolve(index, node_names)
    order = _order(index, picked)
    _check_convex(index, picked)

    tensors = _Variables(index, picked)
    entries = [_node_entry(n, nid, tensors) for n, nid in zip(order, _node_ids(order))]
    for e, n in zip(entries[1:], order[1:]):
        # FusionPass takes pass-through nodes out of its index (graph.bypass_passthrough): the
        # draft lists them as optional pass-throughs, so it matches with or without them
        if _passes_through(index, n) and n.inputs[0] in tensors.produced:
            e["optional"] = "passthrough"
    tensors.sort_outputs(order)
    if not tensors.outputs:
        raise FuseError("nothing the selection computes is used outside it (no consumer outside "
                        "the selection, no graph output); a fused op would be dead code")
    contract, others = _choose_op(fused_op, len(tensors.inputs), len(tensors.outputs),
                                  tensors.described(tensors.inputs, "=") or "none")
    node_notes = {e["id"]: n.name for e, n in zip(entries, order)}
    captures = _add_attributes(entries, order, contract, node_notes)

    node_desc = ", ".join(n.name for n in sorted(picked, key=lambda n: n.key))
    rule: dict = {"name": name,
                  "pattern": pattern or _default_pattern(contract, name),
                  "order": DRAFT_ORDER,
                  "description": f"DRAFT from nodes {_comment(node_desc)}",
                  "nodes": entries}
    if tensors.constraints:
        rule["tensors"] = tensors.constraints
    rule["replace"] = {"op": contract.name, "inputs": tensors.inputs, "outputs": tensors.outputs}
    if captures:
        rule["replace"]["attrs"] = {a: {"attr": c} for a, c in captures.items()}

    head = _header(model.graph.name or "the model", node_desc, contract, others,
                   fused_op is not None, tensors,
                   [a for a in contract.attributes if a not in captures])
    text = "\n".join(head) + "\n" + _to_yaml(rule, node_notes, tensors.notes)
    _self_check(text, name, index, order, tensors.inside)
    return text


def count_matches(model: onnx.ModelProto, text: str) -> int:
    """How many anchors of ``model`` the rule text matches (overlaps counted, nothing fused)."""
    from fusecli.engine.graph import GraphIndex
    from fusecli.engine.matcher import Matcher
    from fusecli.engine.rules import parse_rule

    rule = parse_rule(text, "<draft>")
    index = GraphIndex(model.graph, model.opset_import)
    m = Matcher(index, rule)
    spec = rule.anchor
    return sum(1 for op in spec.ops for d in spec.domains for a in index.candidates(op, d)
               if m.match_at(a).match is not None)
