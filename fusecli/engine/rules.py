"""Rule files: schema, safe loading and validation.

One rule per YAML file. The schema is documented in ``docs/rules.md``; every check here
reports the file, the line where known, and what is wrong.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import re
from dataclasses import dataclass, field, replace

import numpy as np
import yaml

from fusecli.ops.contracts import load_contracts
from fusecli.errors import RuleError
from fusecli.engine.safeyaml import YAML_ERRORS, BoundedComposer, yaml_problem

CANONICAL_PATTERNS = load_contracts().patterns  # each op's contract lists its patterns

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_VAR_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*\*?$")
# functions of a constant's value (elementwise, on floats or float arrays)
CONST_FUNCS = {
    "identity": lambda x: x,
    "reciprocal": lambda x: 1.0 / x,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "negate": lambda x: -x,
}
# functions of a whole constant (replace.attrs only; the tensor must be a constant of known
# shape, tensor kind `uniform`): negate_sum, minus the sum of its elements (torch's folded
# gradient of a mean over N rows, -t/N in each of N rows: the tangent t)
WHOLE_CONST_FUNCS = {
    "negate_sum": lambda arr: -float(np.sum(np.asarray(arr, np.float64))),
}
_ATTR_CONSTRAINT_KEYS = {"equals", "one_of", "absent_or", "absent", "capture", "not", "last_axis"}
_NODE_KEYS = {"id", "op", "domain", "inputs", "outputs", "attrs", "commutative", "optional",
              "keep", "repeat", "role"}
MAX_REPEAT = 8
MAX_VARIANTS = 1000           # rules one file may define (variants, crossed or listed)
_ALT_KEYS = {"op", "domain", "attrs", "value"}
# ops whose first two inputs may be swapped (`commutative: true` only ever swaps these)
COMMUTATIVE_OPS = frozenset({"Add", "Mul", "Sum", "Max", "Min", "Mean", "And", "Or", "Xor",
                             "Equal"})
_PARAM_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_WHOLE_PARAM_RE = re.compile(r"^\$([A-Za-z_][A-Za-z0-9_]*)$")
TENSOR_KINDS = ("constant", "scalar", "leading_axes", "last_axis", "last_dim_index",
                "flatten_2d", "vector_shape", "large_negative", "halves", "index_range",
                "pairs_shape", "shape", "uniform", "half_last_dim", "to_last_end",
                "second_last_axis", "lead_dims_of", "last_dim_of", "new_last_axis",
                "broadcast_axes_of", "same_shape_as", "zero_one", "zeros", "same_batch_dims_as")
# kinds that name a bound tensor ('of')
OF_KINDS = ("lead_dims_of", "last_dim_of", "broadcast_axes_of", "same_shape_as",
            "same_batch_dims_as")
# kinds of a data tensor, checked once both it and its 'of' are bound (either may be first)
DEFERRED_KINDS = ("same_shape_as", "same_batch_dims_as")
_RULE_KEYS = {"name", "pattern", "description", "order", "family", "nodes", "tensors", "replace",
              "params", "variants"}


# --- YAML with line numbers ----------------------------------------------------------------

class _LineDict(dict):
    line: int = 0
    key_lines: dict


class _LineLoader(BoundedComposer, yaml.SafeLoader):
    """SafeLoader that remembers the line of every mapping and mapping key (aliases and nesting
    bounded: see userfiles.BoundedComposer)."""


def _construct_mapping(loader, node, deep=False):
    loader.flatten_mapping(node)
    out = _LineDict()
    out.line = node.start_mark.line + 1
    out.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, str):
            raise yaml.constructor.ConstructorError(
                None, None, f"mapping keys must be strings, got {key!r}", key_node.start_mark)
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[key] = key_node.start_mark.line + 1
    return out


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

# The shipped rules (fusecli's own files, not user input) are parsed with libyaml where PyYAML
# has it: ~8x faster than the pure-Python bounded loader (0.3 s of every run). A user's rule
# file always goes through _LineLoader's bounds.
_ShippedLoader = None
if getattr(yaml, "__with_libyaml__", False):
    class _ShippedLoader(yaml.CSafeLoader):  # noqa: N801 - a Loader class
        pass

    _ShippedLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                   _construct_mapping)


def _line(obj, key=None):
    if isinstance(obj, _LineDict):
        if key is not None and key in obj.key_lines:
            return obj.key_lines[key]
        return obj.line
    return None


# --- rule model ----------------------------------------------------------------------------

@dataclass(frozen=True)
class AttrConstraint:
    equals: object = None
    has_equals: bool = False
    one_of: tuple | None = None
    absent_or: object = None
    has_absent_or: bool = False
    absent: bool = False
    capture: str | None = None
    not_: object = None
    has_not: bool = False
    # the attribute names the last axis of the tensor it indexes (matcher.check_attr): -1 or
    # rank-1 (axis), [-1] or [rank-1] (axes), with the model's opset's default when absent
    last_axis: bool = False


@dataclass(frozen=True)
class OpAlt:
    """One op alternative of a rule node, with what differs when the node is that op."""

    domains: tuple[str, ...] = ("",)
    attrs: dict = field(default_factory=dict)  # extra attribute constraints
    value: dict = field(default_factory=dict)  # variable -> CONST_FUNCS name: how it enters


@dataclass(frozen=True)
class NodeSpec:
    id: str
    ops: tuple[str, ...]
    domains: tuple[str, ...]        # every domain any alternative accepts
    inputs: tuple[str, ...]          # variable names; "_" = any; "x*" = may be absent
    outputs: tuple[str, ...]
    attrs: dict[str, AttrConstraint]
    commutative: bool
    optional: str | None            # None | "branch" | "passthrough"
    keep: bool = False              # context node: must match, is not removed
    line: int | None = None
    alts: dict = field(default_factory=dict)  # op -> OpAlt (its domains, attrs, value)
    role: str | None = None          # what the node computes, for explain ("weight gradient (dW)")

    def alt(self, op: str) -> OpAlt:
        return self.alts[op]


@dataclass(frozen=True)
class TensorSpec:
    const: object = None             # expected value (number or list), or None with a kind
    tol: float = 1e-5
    kind: str | None = None          # one of TENSOR_KINDS
    # kind index_range: integers start, start + step, ..., count of them; start and count each
    # an int or the name of a variable bound (earlier in the node list) to a one-element integer
    # constant; count None: any count (or, with `of`, the first dim of the tensor bound to that
    # variable); step an int (default 1)
    start: object = None
    count: object = None
    step: int = 1
    # kind lead_dims_of: a shape vector whose entries but the last are the recorded (or
    # inferred) dims but the last of the tensor bound to this variable (earlier in the node list);
    # last_dim_of: one number, that tensor's last dim (a class count V); broadcast_axes_of: a
    # reduction's axes, exactly the axes along which that tensor was broadcast to the reduced data
    of: str | None = None


@dataclass(frozen=True)
class Prepared:
    """A standard ONNX node the replacement adds before its fused nodes (``replace.prepare``):
    an input of a fused op computed from the pattern's tensors (an additive mask divided by the
    scale it was added before, two additive masks summed into one bias). Its outputs are fresh
    tensors (they join ``replace.new``); an identical node already in the graph (the same op,
    inputs and attributes: the same mask in every layer) is reused instead."""
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict  # name -> literal, or a Dims (ints from the bound tensors' dims, per match)


@dataclass(frozen=True)
class Dims:
    """A prepared node's attribute of integers taken from the dims of tensors the match binds
    (``{dims: "Q[:-2] + bias[-2:]"}``: Q's dims but the last two, then bias's last two), for a
    Constant holding a Reshape's target; each term (variable, start, end), start / end None
    for an open end. Evaluated per match: every dim static, or one not (written -1)."""
    terms: tuple[tuple[str, int | None, int | None], ...]
    text: str


_DIMS_TERM = re.compile(r"\s*([A-Za-z_]\w*)\s*(?:\[\s*(-?\d+)?\s*:\s*(-?\d+)?\s*\])?\s*")


def _parse_dims(src, text, where) -> Dims:
    terms = []
    for part in text.split("+") if isinstance(text, str) else [None]:
        m = _DIMS_TERM.fullmatch(part or "")
        if m is None:
            raise RuleError(src, f"replace.prepare: dims {text!r} must be terms VAR or "
                            "VAR[start:end] joined by '+' (e.g. \"Q[:-2] + bias[-2:]\")", where)
        var, lo, hi = m.groups()
        terms.append((var, None if lo is None else int(lo), None if hi is None else int(hi)))
    return Dims(tuple(terms), text)


@dataclass(frozen=True)
class Replacement:
    op: str
    domain: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict  # name -> ("literal", v) | ("attr", cap) | ("const", var, fn, default, times)
    #                   | ("if_matched", node_id, then, else)
    # further fused nodes (`replace.then`), each placed after the producers of its inputs (a
    # forward op at the forward's position, its backward op at the backward's); only on the
    # rule's top-level replacement
    then: tuple[Replacement, ...] = ()
    # variables that no pattern node binds (`replace.new`): tensors the replacement creates
    # (fresh names), written by one of its nodes and read by later ones (a saved statistic)
    new: tuple[str, ...] = ()
    # standard nodes computing fused-op inputs, added before the fused nodes (`replace.prepare`;
    # their outputs are in `new`); only on the rule's top-level replacement
    prepare: tuple[Prepared, ...] = ()

    @property
    def nodes(self) -> tuple[Replacement, ...]:
        """Every fused node of the replacement, in order (this one first)."""
        return (self, *self.then)


@dataclass
class Rule:
    name: str
    pattern: str
    order: int
    description: str
    nodes: tuple[NodeSpec, ...]
    tensors: dict[str, TensorSpec]
    replace: Replacement
    source: str
    family: str | None = None
    text: str = field(default="", repr=False)
    # the rule as the matcher reads it, pickled (see body)
    body_data: bytes = field(default=b"", repr=False, compare=False)
    # FusionPass's prefix keys of the node list (see prefix_keys), computed when parsed
    prefix: tuple[int, ...] = field(default=(), repr=False, compare=False)

    @property
    def anchor(self) -> NodeSpec:
        return self.nodes[0]

    def __getstate__(self):  # pickled without what the matcher derived (_rule_tables)
        state = dict(self.__dict__)
        state.pop("_matcher_tables", None)
        return state

    @property
    def body(self) -> dict:
        """Its file's body with the variant's parameters substituted (``fusecli rules show
        --expanded``). Kept as one pickled string: only that command reads it, and as ~60k
        small objects over the shipped rules it made loading their cache ~40% slower."""
        return pickle.loads(self.body_data) if self.body_data else {}  # noqa: S301 - our own


def var_name(token: str) -> str:
    return token[:-1] if token.endswith("*") else token


def _norm_domain(d: str) -> str:
    return "" if d in ("", "ai.onnx") else d


# --- parsing -------------------------------------------------------------------------------

def _as_list(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# attribute type (ONNX AttrType name, or a contract's lower-case name) -> (check, description)
_ATTR_VALUE_TYPES = {
    "INT": (_is_int, "an integer"),
    "FLOAT": (_is_number, "a number"),
    "STRING": (lambda v: isinstance(v, str), "a string"),
    "INTS": (lambda v: isinstance(v, list) and all(map(_is_int, v)), "a list of integers"),
    "FLOATS": (lambda v: isinstance(v, list) and all(map(_is_number, v)), "a list of numbers"),
    "STRINGS": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                "a list of strings"),
}


@functools.cache
def _onnx_attr_table() -> dict[str, dict[str, dict[str, set[str]]]]:
    """domain -> op -> attribute -> its types over every version of the op in onnx.defs (ONNX's
    own domains only; onnxruntime's com.microsoft ops are not described there). One pass over
    the schemas, the costly part of loading the rules."""
    import onnx.defs

    out: dict[str, dict[str, dict[str, set[str]]]] = {}
    for schema in onnx.defs.get_all_schemas_with_history():
        ops = out.setdefault(schema.domain, {})
        for name, attr in schema.attributes.items():
            ops.setdefault(schema.name, {}).setdefault(name, set()).add(attr.type.name)
    return out


def _onnx_attr_types(domain: str) -> dict[str, dict[str, set[str]]]:
    return _onnx_attr_table().get(domain, {})


def _short(value) -> str:
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def _check_attr_value(src, where, value, types, line) -> None:
    """RuleError unless ``value`` fits one of the attribute ``types`` (names of
    _ATTR_VALUE_TYPES; unknown kinds such as TENSOR or GRAPH are not checked)."""
    known = [t for t in types if t in _ATTR_VALUE_TYPES]
    if not known or any(_ATTR_VALUE_TYPES[t][0](value) for t in known):
        return
    want = " or ".join(sorted({_ATTR_VALUE_TYPES[t][1] for t in known}))
    raise RuleError(src, f"{where}: {_short(value)} is not {want}", line)


def _check_node_attr_types(src, nid, ops, domains, attrs, line_of) -> None:
    """Values a rule node's attribute constraints compare with must have the type the ONNX
    schema gives that attribute (for ops of ONNX's own domains)."""
    for name, c in attrs.items():
        types = set()
        for d in domains:
            schemas = _onnx_attr_types(d)
            for op in ops:
                types |= schemas.get(op, {}).get(name, set())
        if c.last_axis and types & _ATTR_VALUE_TYPES.keys() and not types & {"INT", "INTS"}:
            raise RuleError(src, f"node '{nid}' attribute '{name}' (of {'/'.join(ops)}): "
                            "last_axis needs an integer (axis) or integer list (axes) "
                            "attribute", line_of(name))
        values = ([c.equals] if c.has_equals else []) + list(c.one_of or ()) + (
            [c.absent_or] if c.has_absent_or else []) + ([c.not_] if c.has_not else [])
        for v in values:
            _check_attr_value(src, f"node '{nid}' attribute '{name}' (of {'/'.join(ops)})", v,
                              types, line_of(name))


def _parse_attr_constraint(src, node_id, name, value, line) -> AttrConstraint:
    if not isinstance(value, dict):
        return AttrConstraint(equals=value, has_equals=True)
    unknown = set(value) - _ATTR_CONSTRAINT_KEYS
    if unknown:
        raise RuleError(src, f"node '{node_id}' attribute '{name}': unknown constraint key(s) "
                        f"{sorted(unknown)}; allowed: {sorted(_ATTR_CONSTRAINT_KEYS)}", line)
    if "one_of" in value and not isinstance(value["one_of"], list):
        raise RuleError(src, f"node '{node_id}' attribute '{name}': one_of must be a list", line)
    cap = value.get("capture")
    if cap is not None and not (isinstance(cap, str) and _NAME_RE.match(cap)):
        raise RuleError(src, f"node '{node_id}' attribute '{name}': capture must be a lower-case "
                        "identifier", line)
    last = value.get("last_axis", False)
    if last is not False and last is not True:
        raise RuleError(src, f"node '{node_id}' attribute '{name}': last_axis must be true", line)
    if last and set(value) - {"last_axis", "capture"}:
        raise RuleError(src, f"node '{node_id}' attribute '{name}': last_axis combines only with "
                        "capture", line)
    return AttrConstraint(
        last_axis=last,
        equals=value.get("equals"), has_equals="equals" in value,
        one_of=tuple(value["one_of"]) if "one_of" in value else None,
        absent_or=value.get("absent_or"), has_absent_or="absent_or" in value,
        absent=bool(value.get("absent", False)), capture=cap,
        not_=value.get("not"), has_not="not" in value)


def _parse_ports(src, node_id, key, raw, line) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
        raise RuleError(src, f"node '{node_id}': {key} must be a list of tensor variable names",
                        line)
    for t in raw:
        if t != "_" and not _VAR_RE.match(t):
            raise RuleError(src, f"node '{node_id}': {key} entry {t!r} is not a variable name "
                            "(letters, digits, '_', a trailing '*' when the tensor may be absent; '_' for any)", line)
    return tuple(raw)


def _parse_node(src, raw, index) -> list[NodeSpec]:
    if not isinstance(raw, dict):
        raise RuleError(src, f"nodes[{index}] must be a mapping", None)
    line = _line(raw)
    unknown = set(raw) - _NODE_KEYS
    if unknown:
        raise RuleError(src, f"nodes[{index}]: unknown key(s) {sorted(unknown)}; allowed: "
                        f"{sorted(_NODE_KEYS)}", line)
    nid = raw.get("id")
    if not isinstance(nid, str) or not _VAR_RE.match(nid) or nid.endswith("*"):
        raise RuleError(src, f"nodes[{index}]: 'id' is required and must be an identifier", line)
    if not all(isinstance(d, str) for d in _as_list(raw.get("domain", ""))):
        raise RuleError(src, f"node '{nid}': domain must be a domain name or a list of them",
                        _line(raw, "domain"))
    domains = tuple(_norm_domain(d) for d in _as_list(raw.get("domain", "")))
    ops, alts = _parse_ops(src, nid, raw.get("op"), domains, line)
    domains = tuple(dict.fromkeys(d for a in alts.values() for d in a.domains))
    inputs = _parse_ports(src, nid, "inputs", raw.get("inputs"), _line(raw, "inputs"))
    outputs = _parse_ports(src, nid, "outputs", raw.get("outputs"), _line(raw, "outputs"))
    if not outputs:
        raise RuleError(src, f"node '{nid}': 'outputs' must list at least one tensor", line)
    attrs_raw = raw.get("attrs") or {}
    if not isinstance(attrs_raw, dict):
        raise RuleError(src, f"node '{nid}': attrs must be a mapping", _line(raw, "attrs"))
    attrs = {k: _parse_attr_constraint(src, nid, k, v, _line(attrs_raw, k))
             for k, v in attrs_raw.items()}
    _check_node_attr_types(src, nid, tuple(_as_list(ops)), domains, attrs,
                           lambda k: _line(attrs_raw, k))
    optional = raw.get("optional", False)
    if optional is True:
        optional = "branch"
    elif optional is False:
        optional = None
    elif optional != "passthrough":
        raise RuleError(src, f"node '{nid}': optional must be true, false or 'passthrough'",
                        _line(raw, "optional"))
    if optional == "passthrough":
        if not inputs or inputs[0] == "_" or not outputs or outputs[0] == "_":
            raise RuleError(src, f"node '{nid}': a passthrough node needs its first input and "
                            "its first output named (when absent, the first output is the first "
                            "input and any other output stays unbound)", line)
    if index == 0 and optional:
        raise RuleError(src, f"node '{nid}': the first node is the anchor and cannot be optional",
                        line)
    commutative = raw.get("commutative", False)
    if not isinstance(commutative, bool):
        raise RuleError(src, f"node '{nid}': commutative must be true or false", line)
    keep = raw.get("keep", False)
    if not isinstance(keep, bool) or (keep and optional == "branch"):
        raise RuleError(src, f"node '{nid}': keep must be true or false, and a kept (context) "
                        "node can only be optional as a passthrough", line)
    repeat = raw.get("repeat", 1)
    if (isinstance(repeat, bool) or not isinstance(repeat, int) or not 1 <= repeat <= MAX_REPEAT
            or (repeat > 1 and optional != "passthrough")):
        raise RuleError(src, f"node '{nid}': repeat must be an integer 1..{MAX_REPEAT}, on an "
                        "optional: passthrough node (a chain of up to that many pass-throughs)",
                        _line(raw, "repeat"))
    variables = {var_name(t) for t in inputs + outputs}
    for op, alt in alts.items():
        for v in alt.value:
            if v not in variables:
                raise RuleError(src, f"node '{nid}': alternative {op}: value names '{v}', which "
                                "is not one of the node's tensors", line)
    role = raw.get("role")
    if role is not None and not isinstance(role, str):
        raise RuleError(src, f"node '{nid}': role must be a string (what the node computes)",
                        _line(raw, "role"))
    spec = NodeSpec(nid, ops, domains, inputs, outputs, attrs, commutative, optional, keep, line,
                    alts, role)
    return _repeated(spec, repeat)


def _repeated(spec: NodeSpec, n: int) -> list[NodeSpec]:
    """``repeat: n``: n chained copies of a pass-through node, each of which may be absent, so
    `a -> [0..n pass-throughs] -> b` (ids id, id_2, ...; links b__1, b__2, ...)."""
    if n == 1:
        return [spec]
    src, dst = spec.inputs[0], spec.outputs[0]
    out = []
    for k in range(n):
        i = src if k == 0 else f"{var_name(dst)}__{k}"
        o = dst if k == n - 1 else f"{var_name(dst)}__{k + 1}"
        out.append(replace(spec, id=spec.id if k == 0 else f"{spec.id}_{k + 1}",
                           inputs=(i,) + spec.inputs[1:], outputs=(o,)))
    return out


def _parse_ops(src, nid, raw, domains, line) -> tuple[tuple[str, ...], dict]:
    """``op``: an op type, or a list of alternatives, each an op type or a mapping
    ``{op, domain, attrs, value}`` (what differs when the node is that op)."""
    want = ("'op' is required: an op type, or a list of op types and "
            "{op: T, domain: D, attrs: {...}, value: {VAR: FN}} alternatives")
    if raw is None or (isinstance(raw, list) and not raw):
        raise RuleError(src, f"node '{nid}': {want}", line)
    ops, alts = [], {}
    for item in _as_list(raw):
        if isinstance(item, str) and item:
            ops.append(item)
            alts[item] = OpAlt(domains)
            continue
        if not isinstance(item, dict) or not isinstance(item.get("op"), str) or not item["op"]:
            raise RuleError(src, f"node '{nid}': {want}", line)
        aline = _line(item) or line
        unknown = set(item) - _ALT_KEYS
        if unknown:
            raise RuleError(src, f"node '{nid}': alternative {item['op']}: unknown key(s) "
                            f"{sorted(unknown)}; allowed: {sorted(_ALT_KEYS)}", aline)
        attrs_raw = item.get("attrs") or {}
        value = item.get("value") or {}
        if not isinstance(attrs_raw, dict) or not isinstance(value, dict):
            raise RuleError(src, f"node '{nid}': alternative {item['op']}: attrs and value must "
                            "be mappings", aline)
        for var, fn in value.items():
            if not isinstance(fn, str) or fn not in CONST_FUNCS:
                raise RuleError(src, f"node '{nid}': alternative {item['op']}: value of '{var}' "
                                f"must be one of {sorted(CONST_FUNCS)}", aline)
        if not all(isinstance(d, str) for d in _as_list(item.get("domain", ""))):
            raise RuleError(src, f"node '{nid}': alternative {item['op']}: domain must be a "
                            "domain name or a list of them", aline)
        alt_domains = (tuple(_norm_domain(d) for d in _as_list(item["domain"]))
                       if "domain" in item else domains)
        attrs = {k: _parse_attr_constraint(src, nid, k, v, _line(attrs_raw, k))
                 for k, v in attrs_raw.items()}
        _check_node_attr_types(src, nid, (item["op"],), alt_domains, attrs,
                               lambda k, a=attrs_raw: _line(a, k))
        ops.append(item["op"])
        alts[item["op"]] = OpAlt(alt_domains, attrs, dict(value))
    if len(set(ops)) != len(ops):
        raise RuleError(src, f"node '{nid}': op {ops} lists an op type twice", line)
    return tuple(ops), alts


def _parse_tensors(src, raw) -> dict[str, TensorSpec]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise RuleError(src, "'tensors' must be a mapping of variable -> constraints", None)
    out = {}
    for name, spec in raw.items():
        line = _line(raw, name)
        if not isinstance(spec, dict) or ("const" in spec) == ("kind" in spec):
            raise RuleError(src, f"tensor '{name}': expected a mapping with either 'const' "
                            f"(and optional 'tol') or 'kind' (one of {list(TENSOR_KINDS)})", line)
        ranged = spec.get("kind") == "index_range"
        named = spec.get("kind") in OF_KINDS
        unknown = set(spec) - {"const", "tol", "kind"} - (
            {"start", "count", "step", "of"} if ranged else {"of"} if named else set())
        if unknown:
            raise RuleError(src, f"tensor '{name}': unknown key(s) {sorted(unknown)}", line)
        if "kind" in spec:
            if not isinstance(spec["kind"], str) or spec["kind"] not in TENSOR_KINDS:
                raise RuleError(src, f"tensor '{name}': kind must be one of {list(TENSOR_KINDS)}",
                                line)
            if ranged:
                for key in ("start", "count"):
                    v = spec.get(key)
                    if (key == "start" or v is not None) and (
                            isinstance(v, bool) or not isinstance(v, (int, str))):
                        raise RuleError(src, f"tensor '{name}': index_range needs '{key}': an "
                                        "integer or a variable name", line)
                step = spec.get("step", 1)
                if isinstance(step, bool) or not isinstance(step, int) or step < 1:
                    raise RuleError(src, f"tensor '{name}': index_range 'step' must be a "
                                    "positive integer", line)
                if "of" in spec and (not isinstance(spec["of"], str) or "count" in spec):
                    raise RuleError(src, f"tensor '{name}': index_range 'of' (a variable name: "
                                    "the count is that tensor's first dim) replaces 'count'",
                                    line)
                out[name] = TensorSpec(kind="index_range", start=spec["start"],
                                       count=spec.get("count"), step=step, of=spec.get("of"))
                continue
            if named:
                if not isinstance(spec.get("of"), str):
                    raise RuleError(src, f"tensor '{name}': {spec['kind']} needs 'of': a "
                                    "variable name", line)
                out[name] = TensorSpec(kind=spec["kind"], of=spec["of"])
                continue
            out[name] = TensorSpec(kind=spec["kind"])
            continue
        const = spec["const"]
        flat = const if isinstance(const, list) else [const]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat):
            raise RuleError(src, f"tensor '{name}': const must be a number or a list of numbers",
                            line)
        tol = spec.get("tol", 1e-5)
        if not isinstance(tol, (int, float)) or tol < 0:
            raise RuleError(src, f"tensor '{name}': tol must be a non-negative number", line)
        out[name] = TensorSpec(const, float(tol))
    return out


def _parse_replace(src, raw, captures, const_vars, top: bool = True) -> Replacement:
    if not isinstance(raw, dict):
        raise RuleError(src, "'replace' must be a mapping with op, inputs, outputs, attrs", None)
    then, new, prepare = (), (), ()
    if top:
        extra = raw.get("then") or []
        if not isinstance(extra, list) or not all(isinstance(x, dict) for x in extra):
            raise RuleError(src, "replace.then must be a list of fused nodes (op, inputs, "
                            "outputs, attrs)", _line(raw, "then"))
        then = tuple(_parse_replace(src, x, captures, const_vars, top=False) for x in extra)
        new = raw.get("new") or []
        if not isinstance(new, list) or not all(isinstance(v, str) and v for v in new):
            raise RuleError(src, "replace.new must be a list of variable names", _line(raw, "new"))
        prepare = _parse_prepare(src, raw.get("prepare"), _line(raw, "prepare"))
        new = tuple(new) + tuple(v for p in prepare for v in p.outputs)
    elif {"then", "new", "prepare"} & set(raw):
        key = next(k for k in ("then", "new", "prepare") if k in raw)
        raise RuleError(src, "replace.then: a further fused node cannot have its own 'then', "
                        "'new' or 'prepare' (list them on replace)", _line(raw, key))
    contracts = load_contracts()
    op = raw.get("op")
    if not isinstance(op, str) or op not in contracts.ops:
        raise RuleError(src, f"replace.op {op!r} is not a fused op of fusecli; known: "
                        f"{sorted(contracts.ops)} (see fusecli/ops/<op>/contract.yaml)",
                        _line(raw, "op"))
    contract = contracts.ops[op]
    ins = raw.get("inputs") or []
    outs = raw.get("outputs") or []
    for key, vals, ports in (("inputs", ins, contract.inputs), ("outputs", outs, contract.outputs)):
        if not isinstance(vals, list) or not all(isinstance(v, str) for v in vals):
            raise RuleError(src, f"replace.{key} must be a list of variable names ('' = absent)",
                            _line(raw, key))
        if len(vals) > len(ports):
            raise RuleError(src, f"replace.{key}: {op} takes at most {len(ports)} {key} "
                            f"({', '.join(p.name for p in ports)}), got {len(vals)}",
                            _line(raw, key))
        for v, port in zip(vals, ports):
            if v == "" and not port.optional:
                raise RuleError(src, f"replace.{key}: {op}'s {port.name} is required and cannot "
                                "be ''", _line(raw, key))
        for port in ports[len(vals):]:
            if not port.optional:
                raise RuleError(src, f"replace.{key}: {op}'s required {port.name} is missing",
                                _line(raw, key))
    attrs = {}
    if not isinstance(raw.get("attrs") or {}, dict):
        raise RuleError(src, "replace.attrs must be a mapping of attribute name to value",
                        _line(raw, "attrs"))
    for name, value in (raw.get("attrs") or {}).items():
        aline = _line(raw.get("attrs"), name)
        if name not in contract.attributes:
            raise RuleError(src, f"replace.attrs: {op} has no attribute {name!r}; it has "
                            f"{sorted(contract.attributes)}", aline)
        kind = str(contract.attributes[name].get("type", "")).upper()
        if isinstance(value, dict):
            if "if_matched" in value:
                if set(value) != {"if_matched", "then", "else"} or not isinstance(
                        value["if_matched"], str):
                    raise RuleError(src, f"replace.attrs.{name}: write {{if_matched: NODE_ID, "
                                    "then: VALUE, else: VALUE}", aline)
                for branch in ("then", "else"):
                    _check_attr_value(src, f"replace.attrs.{name}.{branch}", value[branch],
                                      [kind], aline)
                attrs[name] = ("if_matched", value["if_matched"], value["then"], value["else"])
            elif "attr" in value:
                if not isinstance(value["attr"], str) or value["attr"] not in captures:
                    raise RuleError(src, f"replace.attrs.{name}: no attribute captured as "
                                    f"{value['attr']!r}", aline)
                attrs[name] = ("attr", value["attr"])
            elif "const" in value:
                fn = value.get("fn", "identity")
                if set(value) - {"const", "fn", "default", "times"}:
                    raise RuleError(src, f"replace.attrs.{name}: write {{const: VAR, fn: FN, "
                                    "default: NUMBER[, times: VAR]}", aline)
                times = value.get("times")
                if times is not None and (not isinstance(times, str) or times not in const_vars
                                          or const_vars[times] == "uniform"):
                    raise RuleError(src, f"replace.attrs.{name}: times {times!r} is not a "
                                    "tensor with a 'const' or scalar constraint", aline)
                if not isinstance(value["const"], str) or value["const"] not in const_vars:
                    raise RuleError(src, f"replace.attrs.{name}: {value['const']!r} is not a "
                                    "tensor with a 'const' constraint", aline)
                if not isinstance(fn, str) or fn not in {**CONST_FUNCS, **WHOLE_CONST_FUNCS}:
                    raise RuleError(src, f"replace.attrs.{name}: fn must be one of "
                                    f"{sorted({**CONST_FUNCS, **WHOLE_CONST_FUNCS})}", aline)
                if fn in WHOLE_CONST_FUNCS and const_vars.get(value["const"]) != "uniform":
                    raise RuleError(src, f"replace.attrs.{name}: fn {fn} reads the whole "
                                    f"constant: {value['const']!r} needs kind: uniform", aline)
                default = value.get("default")
                if default is not None and (isinstance(default, bool)
                                            or not isinstance(default, (int, float))):
                    raise RuleError(src, f"replace.attrs.{name}: default must be a number (the "
                                    "value when the constant's optional node is absent)", aline)
                attrs[name] = ("const", value["const"], fn, default, times)
            else:
                raise RuleError(src, f"replace.attrs.{name}: use a literal, {{attr: NAME}}, "
                                "{const: VAR, fn: FN, default: N} or {if_matched: NODE_ID, then: V, else: V}",
                                aline)
        else:
            _check_attr_value(src, f"replace.attrs.{name}", value, [kind], aline)
            allowed = contract.attributes[name].get("values")
            if allowed is not None and value not in allowed:
                raise RuleError(src, f"replace.attrs.{name}: {value!r} is not one of {allowed}",
                                aline)
            attrs[name] = ("literal", value)
    return Replacement(op, contracts.domain, tuple(ins), tuple(outs), attrs, then, new, prepare)


def _parse_prepare(src, raw, line) -> tuple[Prepared, ...]:
    """replace.prepare: a list of {op, inputs, outputs[, attrs]}, each op a standard ONNX
    operator, its attributes literals or {dims: EXPR} (a Constant's value_ints, Dims); only a
    Constant has no inputs."""
    import onnx.defs

    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(x, dict) for x in raw):
        raise RuleError(src, "replace.prepare must be a list of standard ONNX nodes (op, "
                        "inputs, outputs[, attrs])", line)
    out = []
    for x in raw:
        op, ins, outs, attrs = x.get("op"), x.get("inputs"), x.get("outputs"), x.get("attrs", {})
        where = _line(x, "op")
        unknown = sorted(set(x) - {"op", "inputs", "outputs", "attrs"})
        if unknown:
            raise RuleError(src, f"replace.prepare: unknown keys {unknown} (a node has op, "
                            "inputs, outputs, attrs)", where)
        if not isinstance(op, str) or not onnx.defs.has(op):
            raise RuleError(src, f"replace.prepare: {op!r} is not a standard ONNX operator", where)
        if op == "Constant" and ins:
            raise RuleError(src, "replace.prepare: a Constant has no inputs (its value is an "
                            "attribute)", where)
        ports = [("outputs", outs)] if op == "Constant" else [("inputs", ins), ("outputs", outs)]
        for key, vals in ports:
            if not isinstance(vals, list) or not vals or \
                    not all(isinstance(v, str) and v for v in vals):
                raise RuleError(src, f"replace.prepare.{key} must be a non-empty list of "
                                "variable names", where)
        if not isinstance(attrs, dict) or not all(
                (isinstance(v, (int, float, str)) and not isinstance(v, bool))
                or (isinstance(v, dict) and set(v) == {"dims"}) for v in attrs.values()):
            raise RuleError(src, "replace.prepare.attrs must map attribute names to numbers, "
                            "strings or {dims: EXPR}", where)
        attrs = {k: _parse_dims(src, v["dims"], where) if isinstance(v, dict) else v
                 for k, v in attrs.items()}
        out.append(Prepared(op, tuple(ins or ()), tuple(outs), attrs))
    return tuple(out)


def _check_dataflow(src, nodes: tuple[NodeSpec, ...], replace: Replacement, tensors) -> None:
    produced: dict[str, str] = {}
    kept_out: set[str] = set()
    seen: set[str] = set()
    ids = set()
    for i, n in enumerate(nodes):
        if n.id in ids:
            raise RuleError(src, f"duplicate node id '{n.id}'", n.line)
        ids.add(n.id)
        ins = {var_name(t) for t in n.inputs if t != "_"}
        outs = {var_name(t) for t in n.outputs if t != "_"}
        if i > 0 and not (ins | outs) & seen:
            raise RuleError(src, f"node '{n.id}' is not connected to any node listed before it; "
                            "list nodes so that each one shares a tensor with an earlier one",
                            n.line)
        for o in outs:
            if o in produced:
                raise RuleError(src, f"tensor '{o}' is produced by both '{produced[o]}' and "
                                f"'{n.id}'", n.line)
            produced[o] = n.id
            if n.keep:
                kept_out.add(o)
        seen |= ins | outs
    for t in tensors:
        if t not in seen:
            raise RuleError(src, f"tensors: '{t}' does not appear in any node", None)
    for v in replace.new:
        if v in seen:
            raise RuleError(src, f"replace.new: '{v}' is a pattern variable; list only tensors "
                            "that the replacement creates", None)
    written: set[str] = set()  # outputs of the replacement's earlier nodes
    for prep in replace.prepare:
        for d in (d for d in prep.attrs.values() if isinstance(d, Dims)):
            for v in {t[0] for t in d.terms} - seen:
                raise RuleError(src, f"replace.prepare ({prep.op}): dims {d.text!r} name "
                                f"'{v}', which no pattern node uses", None)
        for v in prep.inputs:
            if v not in seen and v not in written:
                raise RuleError(src, f"replace.prepare ({prep.op}) reads '{v}', which no "
                                "pattern node uses and no earlier prepare node writes", None)
            if v in produced and v not in kept_out:
                raise RuleError(src, f"replace.prepare ({prep.op}).inputs: '{v}' is produced "
                                "inside the pattern (it is removed when the match fuses)", None)
        if not any(v in rep.inputs for v in prep.outputs for rep in replace.nodes) and \
                not any(v in p.inputs for v in prep.outputs for p in replace.prepare):
            raise RuleError(src, f"replace.prepare ({prep.op}): no fused node reads its "
                            f"outputs {list(prep.outputs)}", None)
        written.update(prep.outputs)
    for k, rep in enumerate(replace.nodes):
        where = "replace" if k == 0 else f"replace.then[{k - 1}]"
        for v in rep.inputs + rep.outputs:
            if v and v not in seen and v not in replace.new:
                raise RuleError(src, f"{where} refers to '{v}', which no pattern node uses (a "
                                "tensor the replacement creates is listed in replace.new)", None)
        for v in rep.outputs:
            if v in written:
                raise RuleError(src, f"{where}.outputs: '{v}' is written by an earlier fused "
                                "node of the replacement", None)
            if v and v not in replace.new and (v not in produced or v in kept_out):
                raise RuleError(src, f"{where}.outputs: '{v}' is not produced by a (non-kept) "
                                "pattern node", None)
        for v in rep.inputs:
            if v in replace.new and v not in written:
                raise RuleError(src, f"{where}.inputs: '{v}' (replace.new) is not written by an "
                                "earlier fused node of the replacement", None)
            if v and v in produced and v not in kept_out and v not in written:
                raise RuleError(src, f"{where}.inputs: '{v}' is produced inside the pattern; a "
                                "fused op cannot consume its own intermediate", None)
        written.update(v for v in rep.outputs if v)
    for v in replace.new:
        if v not in written:
            raise RuleError(src, f"replace.new: '{v}' is not written by any fused node", None)


def parse_rules(text: str, source: str, shipped: bool = False,
                fragments: dict[str, list] | None = None) -> list[Rule]:
    """Every rule a rule file defines: one, or one per entry of its ``variants``.
    ``shipped``: one of fusecli's own rule files (parsed with libyaml where available);
    ``fragments``: the variant lists a ``cross`` may include, by name (``parse_fragment``)."""
    raw = _load_yaml(text, source, shipped)
    return [_build_rule(body, source, text) for body in _expand(raw, source, fragments or {})]


def parse_fragment(text: str, source: str, shipped: bool = False) -> list:
    """A fragment file (``_NAME.yaml`` beside the rule files): one list of variants (mappings
    parameter -> value) that several rule files' ``variants: {cross: [...]}`` include by name,
    ``- include: NAME``, so that a spelling they share is written once."""
    raw = _yaml(text, source, shipped)
    if not isinstance(raw, list) or not raw or not all(isinstance(v, dict) for v in raw):
        raise RuleError(source, "a fragment file must be a non-empty YAML list of variants "
                        "(mappings parameter -> value)", 1)
    return raw


def parse_rule(text: str, source: str) -> Rule:
    """The one rule of a file without variants."""
    rules = parse_rules(text, source)
    if len(rules) != 1:
        raise RuleError(source, f"defines {len(rules)} rules (variants); expected one")
    return rules[0]


def _yaml(text: str, source: str, shipped: bool = False):
    loader = _ShippedLoader if shipped and _ShippedLoader is not None else _LineLoader
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506 - SafeLoader subclasses
    except yaml.constructor.ConstructorError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else None
        raise RuleError(source, f"not allowed in a rule file: {exc.problem} (rules are plain "
                        "YAML; tags that construct objects are refused)", line) from None
    except YAML_ERRORS as exc:
        problem, line = yaml_problem(exc)
        raise RuleError(source, f"not valid YAML: {problem}", line) from None


def _load_yaml(text: str, source: str, shipped: bool = False):
    raw = _yaml(text, source, shipped)
    if raw is None:
        raise RuleError(source, "empty rule file; a rule needs name, pattern, order, nodes, "
                        "replace")
    if not isinstance(raw, dict):
        raise RuleError(source, "a rule file must be a YAML mapping (name, pattern, order, nodes,"
                        " replace)", 1)
    unknown = set(raw) - _RULE_KEYS
    if unknown:
        k = sorted(unknown)[0]
        raise RuleError(source, f"unknown key(s) {sorted(unknown)}; allowed: {sorted(_RULE_KEYS)}",
                        _line(raw, k))
    return raw


def _substitute(obj, values: dict, src: str, line, used: set, within: tuple = ()):
    """``obj`` with every ``$name`` string replaced by the parameter's value (any YAML value;
    as a list item, a list value is spliced in and null is dropped; as a mapping value, null
    drops the key) and every ``${name}`` inside a string by the value's text. A value may
    itself use parameters (set by another list of a cross, say); ``within``: the parameters
    being substituted, to refuse a value that uses itself."""
    def lookup(name):
        if name not in values:
            raise RuleError(src, f"unknown parameter '{name}'; this file's parameters are "
                            f"{sorted(values)} (set them in params: or in every variant)", line)
        if name in within:
            raise RuleError(src, f"parameter '{name}' uses itself (through "
                            f"{' -> '.join(within + (name,))})", line)
        used.add(name)
        return _substitute(values[name], values, src, line, used, within + (name,))

    if isinstance(obj, str):
        if "$" not in obj:
            return obj
        whole = _WHOLE_PARAM_RE.match(obj)
        if whole:
            return lookup(whole.group(1))
        return _PARAM_RE.sub(lambda m: str(lookup(m.group(1))), obj)
    if isinstance(obj, dict):
        out = _LineDict()
        out.line, out.key_lines = _line(obj), dict(getattr(obj, "key_lines", {}))
        for k, v in obj.items():
            sv = _substitute(v, values, src, _line(obj, k), used, within)
            if sv is None and isinstance(v, str) and _WHOLE_PARAM_RE.match(v):
                continue  # `key: $p` with p null: the key is left out
            out[k] = sv
        return out
    if isinstance(obj, list):
        out = []
        for raw in obj:
            v = _substitute(raw, values, src, _line(raw) or line, used, within)
            if isinstance(raw, str) and _WHOLE_PARAM_RE.match(raw) and (
                    v is None or isinstance(v, list)):
                out.extend(v or [])  # a list item `$p`: p's items spliced in, null dropped
            else:
                out.append(v)
        return out
    return obj


def _cross(source: str, lists, line, fragments: dict[str, list]) -> list:
    """``variants: {cross: [LIST, LIST, ...]}``: every combination, one entry of each list
    merged (later lists win on a shared parameter). A LIST may be ``{include: NAME}``: the
    fragment file ``_NAME.yaml`` beside the rule file (``parse_fragment``)."""
    if isinstance(lists, list):
        lists = [_included(source, li, line, fragments) for li in lists]
    if not isinstance(lists, list) or not lists or not all(
            isinstance(li, list) and li and all(isinstance(v, dict) for v in li) for li in lists):
        raise RuleError(source, "variants: {cross: [...]} takes a list of non-empty lists of "
                        "mappings", line)
    if _product(len(li) for li in lists) > MAX_VARIANTS:
        raise RuleError(source, f"variants: {{cross: [...]}} makes more than {MAX_VARIANTS} "
                        "rules; split the file", line)
    out = [{}]
    for li in lists:
        out = [{**a, **b} for a in out for b in li]
    return out


def _excluded(source: str, combos: list, exclude, line) -> list:
    """``variants: {cross: [...], exclude: [MAPPING, ...]}``: the combinations that set every
    parameter of an exclude mapping to its value are dropped (a spelling that no model writes
    with another one); a mapping that drops none is an error (a misspelt parameter)."""
    if not isinstance(exclude, list) or not all(isinstance(e, dict) and e for e in exclude):
        raise RuleError(source, "variants: exclude takes a list of non-empty mappings "
                        "parameter -> value", line)
    for e in exclude:
        if not any(all(k in c and c[k] == v for k, v in e.items()) for c in combos):
            raise RuleError(source, f"variants: exclude {dict(e)} matches no combination of "
                            "the cross", line)
    out = [c for c in combos
           if not any(all(k in c and c[k] == v for k, v in e.items()) for e in exclude)]
    if not out:
        raise RuleError(source, "variants: exclude drops every combination", line)
    return out


def _included(source: str, li, line, fragments: dict[str, list]):
    if not (isinstance(li, dict) and set(li) == {"include"}):
        return li
    name = li["include"]
    if name not in fragments:
        known = f"; fragments there: {sorted(fragments)}" if fragments else ""
        raise RuleError(source, f"include: {name!r}: no fragment file _{name}.yaml beside this "
                        f"rule file{known}", _line(li) or line)
    return fragments[name]


def _product(lengths) -> int:
    n = 1
    for k in lengths:
        n *= k
        if n > MAX_VARIANTS:       # stop early: a product of many lists is astronomically big
            break
    return n


def _expand(raw, source: str, fragments: dict[str, list]) -> list:
    """One rule body per variant: ``params`` (defaults) updated by each ``variants`` entry,
    substituted into everything else."""
    if "params" not in raw and "variants" not in raw:
        return [raw]
    params = raw.get("params") or {}
    variants = raw.get("variants", [{}])
    if isinstance(variants, dict) and set(variants) in ({"cross"}, {"cross", "exclude"}):
        variants = _excluded(source, _cross(source, variants["cross"], _line(raw, "variants"),
                                            fragments), variants.get("exclude", []),
                             _line(variants, "exclude") or _line(raw, "variants"))
    if not isinstance(params, dict):
        raise RuleError(source, "params must be a mapping of parameter -> default value",
                        _line(raw, "params"))
    if not isinstance(variants, list) or not variants or not all(
            isinstance(v, dict) for v in variants):
        raise RuleError(source, "variants must be a non-empty list of mappings parameter -> "
                        "value (one rule per entry)", _line(raw, "variants"))
    if len(variants) > MAX_VARIANTS:
        raise RuleError(source, f"variants makes {len(variants)} rules, more than "
                        f"{MAX_VARIANTS}; split the file", _line(raw, "variants"))
    body = {k: v for k, v in raw.items() if k not in ("params", "variants")}
    out = []
    for i, variant in enumerate(variants):
        values, used = {**params, **variant}, set()
        rule = _LineDict(_substitute(body, values, source, _line(variant), used))
        rule.line, rule.key_lines = raw.line, raw.key_lines
        unused = sorted(set(variant) - used)
        if unused:
            raise RuleError(source, f"variants[{i}] sets {unused}, which the rule never uses "
                            "($name or ${name})", _line(variant))
        out.append(rule)
    return out


def _build_rule(raw, source: str, text: str) -> Rule:
    for key in ("name", "pattern", "order", "nodes", "replace"):
        if key not in raw:
            raise RuleError(source, f"missing required key '{key}'", 1)
    name, pattern, order = raw["name"], raw["pattern"], raw["order"]
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise RuleError(source, "name must be lower-case letters, digits and '_'",
                        _line(raw, "name"))
    if not isinstance(pattern, str) or not _NAME_RE.match(pattern):
        raise RuleError(source, "pattern must be one of the canonical names "
                        f"{list(CANONICAL_PATTERNS)} or a new lower-case name",
                        _line(raw, "pattern"))
    if not isinstance(order, int) or isinstance(order, bool):
        raise RuleError(source, "order must be an integer (rules apply in ascending order)",
                        _line(raw, "order"))
    if not isinstance(raw["nodes"], list) or not raw["nodes"]:
        raise RuleError(source, "nodes must be a non-empty list", _line(raw, "nodes"))
    nodes = tuple(spec for i, n in enumerate(raw["nodes"]) for spec in _parse_node(source, n, i))
    tensors = _parse_tensors(source, raw.get("tensors"))
    captures = {c.capture for n in nodes for c in n.attrs.values() if c.capture}
    for n in nodes:  # captured by every op alternative of a node
        alt_caps = [{c.capture for c in a.attrs.values() if c.capture} for a in n.alts.values()]
        if alt_caps:
            captures |= set.intersection(*alt_caps)
    replace = _parse_replace(source, raw["replace"], captures,
                             {k: t.kind for k, t in tensors.items()})
    _check_dataflow(source, nodes, replace, tensors)
    optional_ids = {n.id for n in nodes if n.optional}
    for attr, spec in (kv for rep in replace.nodes for kv in rep.attrs.items()):
        if spec[0] == "if_matched" and spec[1] not in optional_ids:
            raise RuleError(source, f"replace.attrs.{attr}: if_matched names '{spec[1]}', which "
                            "is not an optional rule node")
    body = _plain(raw)
    return Rule(name, pattern, order, str(raw.get("description", "")).strip(), nodes, tensors,
                replace, source, raw.get("family"), text,
                pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL), prefix_keys(body, nodes))


def share_specs(rules: list[Rule]) -> None:
    """Make the rules' equal node and tensor specs one object each (a file's variants repeat
    most of them). The cache of the shipped rules then pickles each once: loading it makes ~5x
    fewer objects (0.046 -> 0.009 s for 477 rules). Specs are frozen; nothing mutates them."""
    seen: dict[bytes, object] = {}

    def one(spec):
        return seen.setdefault(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL), spec)

    for rule in rules:
        rule.nodes = tuple(map(one, rule.nodes))
        rule.tensors = {k: one(t) for k, t in rule.tensors.items()}


def prefix_keys(body: dict, nodes: tuple[NodeSpec, ...]) -> tuple[int, ...]:
    """keys[i] identifies the rule's first i + 1 nodes as the matcher reads them: their text in
    the rule's body (repr of the parsed YAML, the variant's parameters substituted; a
    ``repeat`` node gives one spec per copy) and the tensor constraints of the variables they
    name. Two rules with the same keys[i] search an anchor alike up to node i (FusionPass skips
    the second where the first got no further). A digest, not hash(): the same in every
    process, so keys of cached and freshly parsed rules compare."""
    raw_nodes = body.get("nodes") or []
    texts = [repr(n) for n in raw_nodes
             for _ in range(n.get("repeat", 1) if isinstance(n, dict) else 1)]
    if len(texts) != len(nodes):
        return ()
    tensors = body.get("tensors") or {}
    keys, h = [], hashlib.blake2b(digest_size=8)
    for text, spec in zip(texts, nodes):
        names = sorted({var_name(t) for t in spec.inputs + spec.outputs if t != "_"})
        h.update(f"{text}\0{[tensors.get(v) for v in names]!r}\0".encode())
        keys.append(int.from_bytes(h.copy().digest(), "little"))
    return tuple(keys)


def _plain(obj):
    """``obj`` as plain dicts and lists (the loader's line-tracking mappings dropped)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def expanded_text(rule: Rule) -> str:
    """The concrete pattern the matcher uses for ``rule`` (variants and parameters expanded),
    as YAML."""
    lines = []
    for key, value in _plain(rule.body).items():
        if key == "description":
            text = str(value).strip().replace("\n", "\n  ")
            lines.append(f"{key}: |\n  {text}")
        elif key == "nodes":            # one node per line, as the rule files write them
            lines.append("nodes:")
            lines += ["  - " + yaml.safe_dump(n, default_flow_style=True, sort_keys=False,
                                              width=1 << 16).strip() for n in value]
        elif isinstance(value, (dict, list)):
            lines.append(yaml.safe_dump({key: value}, default_flow_style=None, sort_keys=False,
                                        width=100).rstrip())
        else:
            lines.append(f"{key}: {yaml.safe_dump(value).splitlines()[0]}")
    return "\n".join(lines) + "\n"
