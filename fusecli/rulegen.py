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
import json
import math
import re
from collections import Counter, deque
from pathlib import Path

import click
import numpy as np
import onnx

from .errors import FuseError

MAX_CONST_ELEMENTS = 16          # constants up to this size are written out as `const:` values
FLOAT_TOL = 1.0e-6               # relative + absolute tolerance written for float constants
DRAFT_ORDER = 1000               # drafts apply after the shipped rules
COMMUTATIVE_OPS = {"Mul", "Add", "Sum", "Max", "Min"}
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_PLAIN_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
_YAML_WORDS = {"y", "yes", "n", "no", "true", "false", "on", "off", "null", "none", "~"}
_SKIPPED_ATTR_TYPES = {
    onnx.AttributeProto.GRAPH: "graph", onnx.AttributeProto.GRAPHS: "graphs",
    onnx.AttributeProto.TENSOR: "tensor", onnx.AttributeProto.TENSORS: "tensors",
    onnx.AttributeProto.SPARSE_TENSOR: "sparse tensor",
    onnx.AttributeProto.SPARSE_TENSORS: "sparse tensors",
    onnx.AttributeProto.TYPE_PROTO: "type", onnx.AttributeProto.TYPE_PROTOS: "types",
}


# --- YAML scalars ----------------------------------------------------------------------------

def _float(v: float) -> str:
    """A float as YAML 1.1 (PyYAML) reads back as the same float."""
    v = float(v)
    if math.isnan(v):
        return ".nan"
    if math.isinf(v):
        return ".inf" if v > 0 else "-.inf"
    r = repr(v)
    if "e" in r or "E" in r:
        mant, exp = r.lower().split("e")
        if "." not in mant:
            mant += ".0"
        if exp[0] not in "+-":
            exp = "+" + exp
        return f"{mant}e{exp}"
    return r if "." in r else r + ".0"


def _scalar(v) -> str:
    if isinstance(v, bytes):
        v = v.decode("utf-8", errors="replace")
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        return _float(v)
    if isinstance(v, str):
        if _PLAIN_RE.match(v) and v.lower() not in _YAML_WORDS:
            return v
        return json.dumps(v)  # a JSON string is a valid double-quoted YAML scalar
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} as a YAML scalar")


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
    from .contracts import load_contracts

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
    # fewest unused outputs; stable: file order
    fit.sort(key=lambda c: (len(c.inputs) - n_in, len(c.outputs) - n_out))
    return fit[0], fit[1:]


# --- drafting ---------------------------------------------------------------------------------

def draft_rule(model: onnx.ModelProto, node_names: list[str], name: str,
               fused_op: str | None = None, pattern: str | None = None) -> str:
    """A draft rule (YAML text) matching the subgraph made of the nodes ``node_names``.

    Raises FuseError (one line) for an empty, unknown, disconnected or non-convex selection, a
    bad ``name``/``pattern``, or a fused op that cannot take the selection's inputs/outputs.
    """
    from .graph import GraphIndex
    from .matcher import Matcher
    from .rules import parse_rule

    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise FuseError(f"rule name {name!r} must be lower-case letters, digits and '_', "
                        "starting with a letter")
    if pattern is not None and not _NAME_RE.match(pattern):
        raise FuseError(f"pattern {pattern!r} must be lower-case letters, digits and '_', "
                        "starting with a letter")
    index = GraphIndex(model.graph)
    picked = _resolve(index, node_names)
    order = _order(index, picked)
    _check_convex(index, picked)

    inside = {n.uid for n in picked}
    produced = {t for n in picked for t in n.outputs if t}

    def used_outside(t: str) -> bool:
        return t in index.graph_outputs or any(
            c.uid not in inside for c in index.consumers.get(t, []))

    consumed_inside = {t for n in picked for t in n.inputs if t}
    var: dict[str, str] = {}
    counters = Counter()
    ext_inputs: list[str] = []        # variables, in order of first appearance
    outputs: list[str] = []
    tensors: list[tuple[str, str, str]] = []   # (var, yaml constraint, comment)

    def new_var(prefix: str) -> str:
        v = f"{prefix}{counters[prefix]}"
        counters[prefix] += 1
        return v

    def const_var(t: str) -> str:
        v = new_var("c")
        size = _const_size(index, t)
        value = index.const_value(t) if size is not None and size <= MAX_CONST_ELEMENTS else None
        arr = np.asarray(value) if value is not None else None
        if arr is None or arr.dtype.kind not in "biuf":
            tensors.append((v, "{kind: constant}", f"{t}: {size} elements"
                            if size is not None else t))
            return v
        flat = arr.reshape(-1)
        if arr.dtype.kind == "f" and not np.all(np.isfinite(flat)):
            if flat.size == 1 and float(flat[0]) < 0:
                tensors.append((v, "{kind: large_negative}", f"{t} = {flat.tolist()}"))
            else:
                tensors.append((v, "{kind: constant}", f"{t} = {flat.tolist()}"))
            return v
        if arr.dtype.kind == "f":
            vals = [float(x) for x in flat]
            tol = FLOAT_TOL
        else:
            vals = [int(x) for x in flat]
            tol = 0
        shown = vals[0] if len(vals) == 1 else vals
        tensors.append((v, f"{{const: {_scalar(shown)}, tol: {_scalar(tol)}}}",
                        f"{t} {arr.dtype}{list(arr.shape)}"))
        return v

    node_lines: list[str] = []
    ids = Counter(_snake(n.op) for n in order)
    id_seen: Counter = Counter()
    used_ids: set[str] = set()
    attr_owners = Counter(a for n in order for a in n.attrs)
    captures: dict[str, str] = {}     # contract attribute -> capture name, filled below
    for n in order:
        base = _snake(n.op)
        if ids[base] > 1:
            id_seen[base] += 1
            nid = f"{base}_{id_seen[base]}"
        else:
            nid = base
        while nid in used_ids:
            nid += "_"
        used_ids.add(nid)
        ins = list(n.inputs)
        while ins and ins[-1] == "":
            ins.pop()
        in_toks = []
        for t in ins:
            if t == "":
                in_toks.append("_")
            elif t in produced:
                if t not in var:    # consumed before its producer is listed
                    var[t] = new_var("out" if used_outside(t) else "t")
                    if var[t].startswith("out"):
                        outputs.append(var[t])
                in_toks.append(var[t])
            elif _const_size(index, t) is None:
                if t not in var:
                    var[t] = new_var("in")
                    ext_inputs.append(var[t])
                in_toks.append(var[t])
            else:
                in_toks.append(const_var(t))
        out_toks = []
        for t in n.outputs:
            if t == "" or (t not in consumed_inside and not used_outside(t)):
                out_toks.append("_")
                continue
            if t not in var:
                var[t] = new_var("out" if used_outside(t) else "t")
                if var[t].startswith("out"):
                    outputs.append(var[t])
            out_toks.append(var[t])
        while len(out_toks) > 1 and out_toks[-1] == "_":
            out_toks.pop()
        lines = [f"  - id: {nid}  # {_comment(n.name)}", f"    op: {_scalar(n.op)}"]
        if n.domain:
            lines.append(f"    domain: {_scalar(n.domain)}")
        lines.append(f"    inputs: [{', '.join(in_toks)}]")
        if n.op in COMMUTATIVE_OPS and n.domain == "":
            lines.append("    commutative: true")
        lines.append(f"    outputs: [{', '.join(out_toks)}]")
        node_lines.append("\n".join(lines))
    # output variables follow the order their producers are listed in
    out_rank = {}
    for n in order:
        for t in n.outputs:
            if t in var and var[t] and var[t].startswith("out"):
                out_rank.setdefault(var[t], len(out_rank))
    outputs.sort(key=lambda v: out_rank.get(v, len(out_rank)))

    ins_desc = ", ".join(f"{v}={t}" for t, v in var.items() if v in ext_inputs) or "none"
    if not outputs:
        raise FuseError("nothing the selection computes is used outside it (no consumer outside "
                        "the selection, no graph output); a fused op would be dead code")
    contract, others = _choose_op(fused_op, len(ext_inputs), len(outputs), ins_desc)

    # attributes: equality constraints; a fused-op attribute of the same name is captured
    for i, n in enumerate(order):
        alines = []
        for a in n.proto.attribute:
            aname = a.name
            key = _scalar(aname)
            if a.type in _SKIPPED_ATTR_TYPES:
                alines.append(f"      # {key}: {_SKIPPED_ATTR_TYPES[a.type]} attribute, not "
                              "copied (graph/tensor attributes cannot be constrained)")
                continue
            value = onnx.helper.get_attribute_value(a)
            if isinstance(value, (list, tuple)):
                value = [x.decode("utf-8", "replace") if isinstance(x, bytes) else x
                         for x in value]
            elif isinstance(value, bytes):
                value = value.decode("utf-8", "replace")
            if (aname in contract.attributes and attr_owners[aname] == 1
                    and _NAME_RE.match(aname)):
                captures[aname] = aname
                alines.append(f"      {key}: {{equals: {_scalar(value)}, capture: {aname}}}")
            else:
                alines.append(f"      {key}: {_scalar(value)}")
        if alines:
            node_lines[i] += "\n    attrs:\n" + "\n".join(alines)

    # default `pattern:`: the op's one pattern (its contract), its folder name when it has none,
    # else (LinearActivationGrad: one pattern per activation) the draft's name
    pattern = pattern or (contract.patterns[0] if len(contract.patterns) == 1 else
                          contract.folder if not contract.patterns else name)
    to_set = [a for a in contract.attributes if a not in captures]

    def attr_hint(a):
        spec = contract.attributes[a]
        bits = [spec.get("type", "?")]
        if "values" in spec:
            bits.append("one of " + "|".join(map(str, spec["values"])))
        if "default" in spec:
            bits.append(f"default {spec['default']}")
        return f"{a} ({', '.join(bits)})"

    node_desc = ", ".join(n.name for n in sorted(picked, key=lambda n: n.key))
    graph_name = model.graph.name or "the model"
    head = [
        "# DRAFT rule written by `fusecli rules new`: review every point below before use.",
        f"# Example: {_comment(graph_name)}, nodes {_comment(node_desc)}.",
        (f"# - replace.op {contract.name} was given with --op." if fused_op else
         f"# - replace.op {contract.name} is a placeholder chosen because its port counts fit"
         + (f" (also fit: {', '.join(c.name for c in others)})" if others else "")
         + "; pick the op that computes this subgraph."),
        f"# - Contract: {_signature(contract)} (fusecli/ops/<op>/contract.yaml).",
        "# - replace.inputs/outputs list the outside inputs and the outputs in the order they",
        "#   appear in the pattern, NOT the contract's order: reorder them to the contract.",
        "#   Inputs: " + _comment(", ".join(f"{v} = {t}" for t, v in var.items()
                                           if v in ext_inputs)) + ".",
        "#   Outputs: " + _comment(", ".join(f"{v} = {t}" for t, v in var.items()
                                            if v in outputs)) + ".",
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
    body = [
        f"name: {name}",
        f"pattern: {pattern}",
        f"order: {DRAFT_ORDER}",
        "description: |",
        f"  DRAFT from nodes {_comment(node_desc)}",
        "nodes:",
        *node_lines,
    ]
    if tensors:
        body.append("tensors:")
        for v, spec, note in tensors:
            body.append(f"  {v}: {spec}  # {_comment(note)}")
    body += [
        "replace:",
        f"  op: {contract.name}",
        f"  inputs: [{', '.join(ext_inputs)}]",
        f"  outputs: [{', '.join(outputs)}]",
    ]
    if captures:
        body.append("  attrs: {" + ", ".join(f"{a}: {{attr: {c}}}" for a, c in captures.items())
                    + "}")
    text = "\n".join(head + body) + "\n"

    # self-check: the draft parses and, matched at its anchor, binds exactly the selection
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
    return text


def count_matches(model: onnx.ModelProto, text: str) -> int:
    """How many anchors of ``model`` the rule text matches (overlaps counted, nothing fused)."""
    from .graph import GraphIndex
    from .matcher import Matcher
    from .rules import parse_rule

    rule = parse_rule(text, "<draft>")
    index = GraphIndex(model.graph)
    m = Matcher(index, rule)
    spec = rule.anchor
    return sum(1 for op in spec.ops for d in spec.domains for a in index.candidates(op, d)
               if m.match_at(a).match is not None)


@click.command("new")
@click.option("--from", "model_path", required=True,
              type=click.Path(dir_okay=False, path_type=Path),
              help="ONNX model holding an example of the pattern.")
@click.option("--nodes", "nodes", required=True,
              help="Comma-separated names of the example's nodes (as in the model).")
@click.option("--name", "name", required=True, help="Rule name (lower-case, digits, '_').")
@click.option("--op", "fused_op", default=None,
              help="Fused op to replace the subgraph with (default: one whose port counts fit).")
@click.option("--pattern", "pattern", default=None,
              help="Pattern name for --only/--skip and stats (default: from the fused op).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the draft here (default: print it).")
@click.option("--force", is_flag=True, help="Overwrite -o if it exists.")
def rules_new(model_path, nodes, name, fused_op, pattern, output, force):
    """Write a DRAFT rule from an example subgraph of MODEL (--nodes N1,N2,...).

    The draft matches the example; review the points listed in its header comment (input order
    of the fused op, its attributes, constraints to relax) before adding it to a rules folder.
    """
    from .modelio import load_model

    if output is not None and output.exists() and not force:
        raise FuseError(f"{output} exists; pass --force to overwrite it")
    model = load_model(model_path)
    text = draft_rule(model, nodes.split(","), name, fused_op=fused_op, pattern=pattern)
    n = count_matches(model, text)
    if output is None:
        click.echo(text, nl=False)
    else:
        try:
            output.write_text(text)
        except OSError as exc:
            raise FuseError(f"cannot write {output}: {exc.strerror or exc}") from None
        click.echo(f"wrote {output}", err=True)
    more = f"; it also matches {n - 1} other place(s)" if n > 1 else ""
    click.echo(f"draft rule {name} matches its example in {model_path}{more}", err=True)
