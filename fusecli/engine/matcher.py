"""Matching one rule's pattern DAG at an anchor node, with the training-graph safety guards.

The search binds the rule's nodes in the order they are listed. Every failure is recorded with
the depth it reached, so ``explain`` can show the deepest partial match and the exact constraint
that failed; a failed check never raises.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import defs

from fusecli.ops.contracts import load_contracts
from fusecli.engine.constfold import compact
from fusecli.engine.graph import GNode, GraphIndex
from fusecli.engine.shapes import fusion_problem
from fusecli.engine.rules import (COMMUTATIVE_OPS, CONST_FUNCS, WHOLE_CONST_FUNCS, AttrConstraint,
                                  DEFERRED_KINDS, Dims, OF_KINDS, NodeSpec, Rule, var_name)

VALUE_KEY = "$value:"  # captures[VALUE_KEY + var]: how var's constant enters (a CONST_FUNCS name)


@dataclass
class Failure:
    depth: int
    bound: dict[str, str]        # spec id -> graph node name
    spec: str | None             # spec id that failed (None for guards)
    reason: str                  # short category
    detail: str                  # exact constraint
    candidate: str | None = None  # the graph node that failed the rule node, if any

    def as_dict(self) -> dict:
        return {"depth": self.depth, "bound": dict(self.bound), "node": self.spec,
                "candidate": self.candidate, "reason": self.reason, "detail": self.detail}


@dataclass
class Match:
    rule: Rule
    nodes: dict[str, GNode]              # spec id -> graph node
    tensors: dict[str, str]              # variable -> tensor name ("" = absent)
    captures: dict[str, object]
    key: float = 0.0
    intermediates: list[str] = field(default_factory=list)
    bound: frozenset = frozenset()       # every rule node id bound, kept context included
    unread: frozenset = frozenset()      # optional fused outputs nothing outside reads: left empty
    proto: onnx.NodeProto | None = None  # the fused node (ports and attributes; unnamed)
    # the replacement's further fused nodes (replace.then): (key, node) each, in order; tensors
    # of replace.new are named NEW_TENSOR + variable until FusionPass gives them fresh names
    extra: list = field(default_factory=list)
    # its standard nodes computing fused-op inputs (replace.prepare): (key, node) each, in order
    prepared: list = field(default_factory=list)
    # outside nodes moved earlier so that the fused node fits between its inputs and its
    # outputs' readers (Matcher._hoist): (node, its new key) each, applied with the match
    moves: list = field(default_factory=list)

    @property
    def protos(self) -> list:
        """Every fused node of the match, the first one first."""
        return [self.proto, *(p for _, p in self.extra)]


NEW_TENSOR = "fusecli.new:"  # placeholder prefix of a replace.new tensor inside a Match
# complete bindings of a rule that one anchor may try (each refused by a guard) before its
# search stops there. Each combination of optional nodes is a binding; where a guard refuses
# them all for one reason (an intermediate read outside the match), a rule with many optional
# views tried 122,241 (5 s on one attention of a 300-node graph). On the corpus, the tests' and
# the samples' graphs a match was found by the 7th binding at the latest.
MAX_BINDINGS = 64


@dataclass
class MatchResult:
    match: Match | None = None
    structural: bool = False             # some binding of all nodes was found
    guard_failure: Failure | None = None
    deepest: Failure | None = None
    # per graph node that fit no rule node: its most telling failure (for explain --node)
    node_failures: dict[str, Failure] = field(default_factory=dict)


# the domains onnx.defs describes (onnxruntime's com.microsoft ops and fusecli's own are not)
_ONNX_DOMAINS = frozenset({"", "ai.onnx.ml", "ai.onnx.preview", "ai.onnx.preview.training"})


# onnxruntime's gradient ops (com.microsoft, which onnx.defs does not describe) whose axis
# default the matcher needs (orttraining's gradient_schema_defs.cc): the pre-opset-13 gradients
# flatten at axis 1 by default, the _13 ones take the last axis
_MS_DEFAULTS = {("SoftmaxGrad", "axis"): 1, ("LogSoftmaxGrad", "axis"): 1,
                ("SoftmaxGrad_13", "axis"): -1, ("LogSoftmaxGrad_13", "axis"): -1}


@functools.cache
def _op_default(op: str, domain: str, attr: str, opset: int | None = None):
    """An attribute's default in the op's schema at the model's ``opset`` of its domain (None:
    the latest; Softmax's axis is 1 before opset 13, -1 from 13), None when no default is known
    (an op of another domain than onnx's and _MS_DEFAULTS'); one schema lookup per op,
    attribute and opset (the first loads onnx's schema registry, 10-25 ms: not done for the
    other domains, which it does not describe)."""
    if domain == "com.microsoft":
        return _MS_DEFAULTS.get((op, attr))
    if domain not in _ONNX_DOMAINS:
        return None
    try:
        schema = defs.get_schema(op, max_inclusive_version=opset or 10**6, domain=domain)
    except Exception:  # noqa: BLE001 - unknown op/domain: no default known
        return None
    a = schema.attributes.get(attr)
    if a is None or not a.default_value.name:
        return None
    return onnx.helper.get_attribute_value(a.default_value)


# ops whose axis k flattens the input to 2-D at k and normalises over axes k..rank-1 together:
# onnx's before opset 13 (from 13: over axis k alone), onnxruntime's pre-13 gradients always
_FLATTENS_BEFORE_13 = frozenset({"Softmax", "LogSoftmax", "Hardmax"})
_FLATTENS_MS = frozenset({"SoftmaxGrad", "LogSoftmaxGrad"})
# ops whose tensor inputs and first output all have the rank their axis indexes
_SAME_RANK = frozenset({"Softmax", "LogSoftmax", "Hardmax", "SoftmaxGrad", "SoftmaxGrad_13",
                        "LogSoftmaxGrad", "LogSoftmaxGrad_13", "Concat", "ConcatTraining"})


def _flattens(node: GNode, opset: int | None) -> bool:
    if node.domain == "com.microsoft":
        return node.op in _FLATTENS_MS
    return node.domain == "" and node.op in _FLATTENS_BEFORE_13 and opset is not None \
        and opset < 13


def _indexed_rank(node: GNode, index) -> int | None:
    """The rank of the tensor a node's axis / axes attribute indexes: its first input's
    (Unsqueeze: its output's), from the recorded shapes; for ops of _SAME_RANK any of their
    inputs or their first output may tell it."""
    if index is None:
        return None
    if node.op == "Unsqueeze" and node.domain == "":
        return index.rank(node.outputs[0]) if node.outputs else None
    names = [node.inputs[0] if node.inputs else ""]
    if node.op in _SAME_RANK:
        names += node.inputs[1:] + node.outputs[:1]
    for t in names:
        r = index.rank(t) if t else None
        if r is not None:
            return r
    return None


def _check_last_axis(node: GNode, name: str, effective, present: bool, index,
                     opset: int | None) -> str:
    """'' when ``effective`` (an attribute's value, or its default when absent) names the last
    axis of the tensor it indexes: -1 or rank-1 (an axis), [-1] or [rank-1] (axes); else why
    not, for explain."""
    rank = _indexed_rank(node, index)
    shown = _norm(effective) if present else f"absent (default {_norm(effective)!r}" + (
        f" at opset {opset})" if opset is not None else ")")
    if rank is None:
        want = "the last axis: -1 (the rank of the tensor it indexes is not recorded, so no " \
            "other value is surely the last axis)"
    else:
        want = f"the last axis: -1 or {rank - 1} (of the rank-{rank} tensor it indexes)"
    if effective is None:
        return f"attribute {name} is absent and has no known default, rule wants {want}"
    vals = effective if isinstance(effective, (list, tuple)) else [effective]
    if isinstance(effective, (list, tuple)) and len(vals) != 1:
        return f"attribute {name} = {shown}, rule wants {want}"
    v = vals[0]
    if isinstance(v, int) and (v == -1 or (rank is not None and v == rank - 1)):
        return ""
    why = ""
    if isinstance(v, int) and _flattens(node, opset) and rank is not None and \
            -rank <= v < rank - 1:
        k = v % rank
        at = f"opset {opset}" if node.domain == "" else f"{node.op}'s semantics"
        why = (f" ({at}: it flattens at axis {k} and normalises over axes {k}..{rank - 1} "
               "together)")
    return f"attribute {name} = {shown}{why}, rule wants {want}"


def _norm(v):
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    return v


def _values_equal(a, b) -> bool:
    if type(a) is type(b) and a == b:  # the common case: nothing to normalise
        return True
    a, b = _norm(a), _norm(b)
    if isinstance(a, list) or isinstance(b, list):
        if not (isinstance(a, list) and isinstance(b, list)) or len(a) != len(b):
            return False
        return all(_values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)
        except (TypeError, ValueError):
            return False
    return a == b


def check_attr(node: GNode, name: str, c: AttrConstraint, index: GraphIndex | None = None
               ) -> tuple[bool, object, str]:
    """Returns (ok, effective value, failure detail); the failure detail is only written when
    the check fails. ``index`` gives the model's opsets (an absent attribute's default) and the
    recorded shapes (``last_axis``); without it, the latest opset and no shapes."""
    present = name in node.attrs
    value = node.attrs.get(name)
    if c.absent:
        if not present:
            return True, None, ""
        return False, None, f"attribute {name} must be absent, found {_norm(value)!r}"
    if not present and c.has_absent_or:
        if c.has_not and _values_equal(c.absent_or, c.not_):
            return False, None, f"attribute {name} is absent (= {c.absent_or!r}), rule wants " \
                f"any value but {c.not_!r}"
        return True, c.absent_or, ""
    opset = index.opset(node.domain) if index is not None else None
    effective = value if present else _op_default(node.op, node.domain, name, opset)
    if c.last_axis:
        detail = _check_last_axis(node, name, effective, present, index, opset)
        if detail:
            return False, None, detail

    def shown():
        return _norm(effective) if present else f"absent (default {_norm(effective)!r})"

    if c.has_equals or c.has_absent_or:
        want = c.equals if c.has_equals else c.absent_or
        if effective is None or not _values_equal(effective, want):
            return False, None, f"attribute {name} = {shown()}, rule wants {want!r}"
    if c.one_of is not None:
        if effective is None or not any(_values_equal(effective, w) for w in c.one_of):
            return False, None, (f"attribute {name} = {shown()}, rule wants one of "
                                 f"{list(c.one_of)}")
    if c.has_not and (effective is None or _values_equal(effective, c.not_)):
        return False, None, f"attribute {name} = {shown()}, rule wants any value but {c.not_!r}"
    if c.capture and effective is None:
        return False, None, f"attribute {name} is absent and has no default to capture"
    return True, _norm(effective) if c.capture else effective, ""


def _kind_matches(arr: np.ndarray, kind: str, data_shape=None) -> tuple[bool, str]:
    if kind in ("constant", "shape"):
        return True, ""
    ok, want = _kind_check(arr, kind, data_shape)
    if ok:
        return True, ""
    flat = arr.reshape(-1)
    return False, f"is {flat[:6].tolist()}{'...' if flat.size > 6 else ''}, rule wants {want}"


def _kind_check(arr: np.ndarray, kind: str, data_shape) -> tuple[bool, str]:
    """(whether ``arr`` is of the tensor kind, what the kind wants, for the failure detail)."""
    flat = arr.reshape(-1)
    ints = arr.dtype.kind in "iu"
    if kind == "scalar":
        return arr.size == 1 and arr.dtype.kind in "iuf", "a scalar number"
    if kind == "leading_axes":
        ok = ints and arr.ndim == 1 and flat.size >= 1 and sorted(flat.tolist()) == list(
            range(flat.size))
        if ok and data_shape is not None:
            ok = len(data_shape) == flat.size + 1
        return ok, (f"every axis but the last [0, ..., k-1]"
                    f"{f' of a rank-{len(data_shape)} tensor' if data_shape else ''}")
    if kind == "last_axis":
        ok = ints and flat.size == 1 and (int(flat[0]) == -1 or (
            data_shape is not None and int(flat[0]) == len(data_shape) - 1))
        return ok, "the last axis (-1, or rank-1 of a known shape)"
    if kind == "new_last_axis":  # Unsqueeze's axes: one axis after its input's last
        ok = ints and flat.size == 1 and (int(flat[0]) == -1 or (
            data_shape is not None and int(flat[0]) == len(data_shape)))
        return ok, "one new last axis (-1, or the rank of a known input)"
    if kind == "second_last_axis":  # a Slice's axis: the sequence axis of [..., S, X]
        ok = ints and flat.size == 1 and (int(flat[0]) == -2 or (
            data_shape is not None and len(data_shape) >= 2
            and int(flat[0]) == len(data_shape) - 2))
        return ok, "the second-to-last axis (-2, or rank-2 of a known shape)"
    if kind == "last_dim_index":  # Gather's index into a Shape vector [n]: the last dim
        n = data_shape[0] if data_shape is not None and len(data_shape) == 1 else None
        ok = ints and flat.size == 1 and arr.ndim <= 1 and (
            int(flat[0]) == -1 or (isinstance(n, int) and int(flat[0]) == n - 1))
        return ok, ("the index of the last entry of a shape vector (-1, "
                    "or n-1 of a recorded length n)")
    if kind == "flatten_2d":
        ok = ints and arr.ndim == 1 and flat.size == 2 and flat[1] > 0 and flat[0] != 0
        if ok and data_shape is not None and data_shape and data_shape[-1] is not None:
            lead = data_shape[:-1]
            ok = data_shape[-1] == flat[1] and (flat[0] == -1 or (
                None not in lead and int(np.prod(lead, dtype=np.int64)) == flat[0]))
        elif ok:
            ok = flat[0] == -1  # unknown input shape: only [-1, n] is surely a flatten
        return ok, "a shape that flattens the leading dims: [-1 or M, n]"
    if kind == "large_negative":
        ok = arr.size == 1 and arr.dtype.kind == "f" and float(flat[0]) <= -1e4
        return ok, "a mask fill value <= -1e4 (or -inf)"
    if kind == "vector_shape":
        ok = ints and arr.ndim == 1 and flat.size == 1 and flat[0] > 0
        return ok, "a 1-D shape [n]"
    if kind == "pairs_shape":
        ok = (ints and arr.ndim == 1 and flat.size >= 2 and int(flat[-1]) == 2
              and data_shape is not None and bool(data_shape)
              and data_shape[-1] is not None and int(flat[-2]) * 2 == data_shape[-1])
        return ok, ("a Reshape target [..., n/2, 2] splitting the last dim n "
                    "of its input (of recorded shape) into pairs")
    if kind == "halves":
        ok = ints and arr.ndim == 1 and flat.size == 2 and flat[0] > 0 and flat[0] == flat[1]
        return ok, "split sizes [h, h] (two equal halves)"
    # a Slice's start / end on the last axis of the data it slices (its recorded static shape)
    last = (data_shape[-1] if data_shape is not None and len(data_shape) and
            isinstance(data_shape[-1], int) else None)
    if kind == "half_last_dim":
        ok = ints and flat.size == 1 and arr.ndim <= 1 and last is not None and last > 0 and (
            2 * int(flat[0]) == last)
        return ok, ("the half h of the sliced tensor's last dim (2h = its recorded static "
                    f"last dim{f' {last}' if last is not None else ', which is not recorded'})")
    if kind == "to_last_end":
        ok = ints and flat.size == 1 and arr.ndim <= 1 and (
            int(flat[0]) == np.iinfo(np.int64).max or (last is not None and int(flat[0]) >= last))
        return ok, ("the end of the sliced tensor's last dim (INT64_MAX, or >= its recorded "
                    f"static last dim{f' {last}' if last is not None else ''})")
    return False, f"unknown kind {kind}"


def uniform_matches(value: np.ndarray | None) -> tuple[bool, str]:
    """kind uniform: a float constant of known shape (not a broadcast to a run-time shape,
    whose element count is unknown) whose elements are all one number."""
    if value is None:
        return False, ("is not a constant of known shape (not an initializer, Constant node "
                       "or a tensor computed only from them)")
    arr = np.asarray(value)
    flat = arr.reshape(-1)
    if arr.dtype.kind != "f" or flat.size == 0:
        return False, f"is a constant of dtype {arr.dtype} and {flat.size} elements, rule " \
            "wants floats"
    small = compact(arr).reshape(-1)
    if np.all(small == small[0]):
        return True, ""
    return False, f"is {flat[:4].tolist()}{'...' if flat.size > 4 else ''}, rule wants one " \
        "number in every element"


def const_matches(value: np.ndarray | None, want, tol: float, kind: str | None = None,
                  data_shape=None) -> tuple[bool, str]:
    if value is None:
        return False, ("is not a constant (not an initializer, Constant node or a tensor "
                       "computed only from them)")
    value = np.asarray(value)
    if kind is not None:
        small = compact(value)
        # a broadcast of one number (Expand, ConstantOfShape) is that number
        broadcast_scalar = small.size == 1 and value.size > 1
        return _kind_matches(small.reshape(()) if broadcast_scalar else value, kind, data_shape)
    if value.dtype.kind not in "biuf":
        return False, f"is a constant of dtype {value.dtype}, rule wants a number"
    target = np.asarray(want, dtype=np.float64)
    if target.ndim == 0:
        arr = compact(value).astype(np.float64)
        if arr.size == 0:
            return False, "is an empty constant"
        with np.errstate(invalid="ignore"):  # (an infinity matches only itself)
            ok = bool(np.all((arr == target)
                             | (np.abs(arr - target) <= tol + tol * abs(float(target)))))
    else:
        arr = value.astype(np.float64) if value.size == target.size else compact(value)
        with np.errstate(invalid="ignore"):
            ok = arr.size == target.size and bool(np.all(
                (arr.reshape(-1) == target.reshape(-1))
                | (np.abs(arr.reshape(-1) - target.reshape(-1))
                   <= tol + tol * np.abs(target.reshape(-1)))))
    if ok:
        return True, ""
    shown = arr.reshape(-1)[:4].tolist()
    return False, f"has value {shown}{'...' if arr.size > 4 else ''}, rule wants {want}"


def _const_attr(index: GraphIndex, m: Match, var: str, fn: str, default):
    tensor = m.tensors.get(var)
    if not tensor:
        return float(default)
    v = index.const_value(tensor)
    if fn in WHOLE_CONST_FUNCS:  # kind uniform: a constant of known shape
        return float(WHOLE_CONST_FUNCS[fn](v))
    value = float(np.asarray(v if v is not None else index.broadcast_scalar(tensor)).flat[0])
    value = CONST_FUNCS[m.captures.get(VALUE_KEY + var, "identity")](value)
    return float(CONST_FUNCS[fn](value))


def replacement_attrs(index: GraphIndex, m: Match, rep=None) -> dict:
    """The fused node's attributes: literals, captured attributes, ``if_matched`` choices and
    values of scalar constants (as the matched op spelling enters them, e.g. the reciprocal of
    a Div's divisor, then the rule's ``fn``; the rule's ``default`` when the constant's optional
    node is absent; ``times``: multiplied by a second one's value, 1 when its node is absent)."""
    attrs = {}
    for name, spec in (rep or m.rule.replace).attrs.items():
        if spec[0] == "literal":
            attrs[name] = spec[1]
        elif spec[0] == "attr":
            attrs[name] = m.captures[spec[1]]
        elif spec[0] == "if_matched":
            attrs[name] = spec[2] if spec[1] in m.bound else spec[3]
        elif spec[2] == "identity" and _int_attr(m, rep, name):
            # an integer attribute (a Slice bound): the constant's value exactly
            v = index.const_value(m.tensors[spec[1]]) if m.tensors.get(spec[1]) else None
            attrs[name] = int(spec[3]) if v is None else int(np.asarray(v).reshape(-1)[0])
        else:
            attrs[name] = _const_attr(index, m, spec[1], spec[2], spec[3])
            if spec[4] is not None:  # times: another scalar constant's value (1 when absent)
                attrs[name] *= _const_attr(index, m, spec[4], "identity", 1.0)
    return attrs


def _int_attr(m: Match, rep, name: str) -> bool:
    """Whether the fused op's contract types attribute ``name`` an int."""
    op = (rep or m.rule.replace).op
    spec = load_contracts().ops[op].attributes.get(name, {})
    return str(spec.get("type", "")).lower() == "int"


def replacement_ports(m: Match, rep=None) -> tuple[list[str], list[str]]:
    """The fused node's input and output tensor names ("" = absent, trailing ones dropped)."""
    new = m.rule.replace.new
    rep = rep or m.rule.replace

    def name(v):
        return "" if not v else NEW_TENSOR + v if v in new else m.tensors.get(v, "")

    ins = [name(v) for v in rep.inputs]
    outs = [name(v) for v in rep.outputs]
    outs = ["" if t in m.unread else t for t in outs]
    while ins and ins[-1] == "":
        ins.pop()
    while outs and outs[-1] == "":
        outs.pop()
    return ins, outs


class _Deps:
    """What the backjumping search (Matcher._search) needs to know of a rule, as bit masks of
    rule nodes (bit i: node i). A failure at node i depends on the nodes that gave its
    variables their values, and on those that could have given them other values: every
    earlier node that names the variable (a node that names it and was bound would have bound
    it first, so such nodes were absent), through absent pass-through nodes, which make their
    output their input."""

    def __init__(self, rule: Rule):
        specs = rule.nodes
        reach: dict[str, int] = {}
        for i, s in enumerate(specs):
            for t in (*s.inputs, *s.outputs):
                if t != "_":
                    reach[var_name(t)] = reach.get(var_name(t), 0) | 1 << i
        links = [(var_name(s.inputs[0]), var_name(s.outputs[0])) for s in specs
                 if s.optional == "passthrough" and s.inputs and s.outputs]
        changed = True
        while changed:
            changed = False
            for a, b in links:
                both = reach.get(a, 0) | reach.get(b, 0)
                if reach.get(a) != both or reach.get(b) != both:
                    reach[a] = reach[b] = both
                    changed = True
        # DEFERRED_KINDS pairs (variable, of), under each of their two variables: checked when
        # the second end is bound, so a node that names one end depends on the other's too
        self.pairs: dict[str, list[tuple[str, str]]] = {}
        for w, ts in rule.tensors.items():
            if ts.kind in DEFERRED_KINDS:
                for v in (w, ts.of):
                    self.pairs.setdefault(v, []).append((w, ts.of))
        # per node i: variable -> the earlier nodes that could have bound it
        self.before: list[dict[str, int]] = []
        for i, s in enumerate(specs):
            names = {var_name(t) for t in (*s.inputs, *s.outputs) if t != "_"}
            for v in list(names):
                ts = rule.tensors.get(v)
                if ts is not None and ts.kind == "index_range":
                    names.update(r for r in (ts.start, ts.count) if isinstance(r, str))
                if ts is not None and ts.kind in OF_KINDS:
                    names.add(ts.of)
            names.update(x for v in list(names) for pair in self.pairs.get(v, ()) for x in pair)
            self.before.append({v: reach.get(v, 0) & ((1 << i) - 1) for v in names})
        self.everything = (1 << len(specs)) - 1

    def of(self, i: int, bits: dict[str, int]) -> int:
        """The nodes < i whose bindings decide what node i finds (its candidates, dataflow and
        constant checks), given ``bits``: variable -> the nodes its value depends on."""
        dep = 0
        for v, before in self.before[i].items():
            b = bits.get(v)
            dep |= before if b is None else b
        return dep

    def bound(self, i: int, v: str) -> int:
        """The nodes a variable that node i binds depends on: node i and those before it that
        could have bound it instead."""
        return 1 << i | self.before[i].get(v, 0)


def _input_orders(spec: NodeSpec, op: str) -> list[tuple[int, ...]]:
    n = len(spec.inputs)
    if not (spec.commutative and op in COMMUTATIVE_OPS):
        return [tuple(range(n))]
    if n <= 2 or op != "Sum":
        return [(0, 1) + tuple(range(2, n)), (1, 0) + tuple(range(2, n))]
    return list(itertools.permutations(range(n)))


def _rule_tables(rule: Rule) -> tuple:
    """What a Matcher reads of its rule, made once per rule (FusionPass makes a Matcher per
    rule and pass) and kept on it (not pickled: Rule.__getstate__)."""
    got = rule.__dict__.get("_matcher_tables")
    if got is not None:
        return got
    roles = {s.id: s.role for s in rule.nodes if s.role and not s.optional}
    # per rule node: (token, variable) of its listed inputs and outputs ("_": any tensor)
    ports = [(tuple((t, var_name(t)) for t in s.inputs),
              tuple((t, var_name(t)) for t in s.outputs)) for s in rule.nodes]
    # per rule node and op: the orders its inputs may bind in (commutative: both)
    orders = [{op: _input_orders(s, op) for op in s.ops} for s in rule.nodes]
    # the anchor's inputs that must hold a value (a constant or a broadcast one: every
    # tensor kind but shape, which a run-time shape computation also satisfies, and the kinds
    # of a data tensor checked against another, DEFERRED_KINDS)
    valued = [p for p, (t, v) in enumerate(ports[0][0])
              if t != "_" and v in rule.tensors
              and rule.tensors[v].kind not in ("shape", *DEFERRED_KINDS)]
    got = rule.__dict__["_matcher_tables"] = (roles, ports, _Deps(rule), orders, valued)
    return got


class Matcher:
    """Matches one rule against a GraphIndex."""

    def __init__(self, index: GraphIndex, rule: Rule, check_shapes: bool = True,
                 explain: bool = True):
        self.g = index
        self.rule = rule
        self._roles, self._ports, self._deps, self._orders, self._valued = _rule_tables(rule)
        # False (FusionPass): a node of the wrong op type is not recorded as a failure (only
        # explain reads those: MatchResult.deepest / node_failures); the match is the same
        self.explain = explain
        # False only for rule drafts, whose replacement ports are placeholders
        self.check_shapes = check_shapes

    # -- public -----------------------------------------------------------------------------
    def match_at(self, anchor: GNode) -> MatchResult:
        res = MatchResult()
        self._res = res
        self._anchor = anchor
        # graph node uid -> (rule node, why it fit none: text or a function that writes it)
        self._node_fail: dict[int, tuple] = {}
        self.reached = 0  # the furthest rule node the search tried (FusionPass's prefix skip)
        self._taken: dict[int, int] = {}  # graph node uid -> the rule node bound to it
        self._bindings = 0  # complete bindings tried (MAX_BINDINGS)
        if self._valued and not self.explain and not self._may_anchor(anchor):
            return res  # (what binding the anchor finds, without the search's set-up)
        found, _ = self._search(0, {}, {}, {}, {})
        res.match = found
        return res

    def _may_anchor(self, anchor: GNode) -> bool:
        """False when the anchor's inputs cannot bind rule node 0 in any order: an input the
        rule constrains by value holds none (most anchors of a rule that starts at a Mul by a
        constant are Muls of two run-time tensors)."""
        ins = anchor.inputs
        for order in self._orders[0].get(anchor.op, ()):
            if all(j >= len(ins) or not ins[j] or self._value(ins[j]) is not None
                   for j in (order[p] for p in self._valued)):
                return True
        return False

    def _value(self, name: str):
        """The value a tensor holds: a constant's, or the one number a broadcast of a constant
        to a run-time (symbolic) shape holds everywhere; None for a run-time tensor."""
        value = self.g.const_value(name)
        return value if value is not None else self.g.broadcast_scalar(name)

    # -- failure bookkeeping ---------------------------------------------------------------
    # at equal depth, a failure on a node of the right op type says more than a wrong op type
    _SPECIFIC = {"op_type": 0, "domain": 1, "no_candidate": 1, "inputs": 2, "outputs": 2,
                 "dataflow": 3, "attribute": 4, "constant": 4}

    def _fail(self, depth, nodes, spec, reason, detail, node: GNode | None = None):
        """Records a failure; ``detail`` is the text, or a function that writes it (the pass
        writes it only if a guard message asks for it: _why)."""
        if not self.explain:  # the pass reads only why a node fit no rule node (guard messages)
            if node is not None and reason != "op_type":
                self._node_fail[node.uid] = (spec, detail)
            return
        raw, detail = detail, self._detail(spec, detail)
        f = Failure(depth, {k: n.name for k, n in nodes.items()}, spec, reason, detail,
                    node.name if node is not None else None)
        if node is not None:
            if reason != "op_type":
                self._node_fail[node.uid] = (spec, raw)
            prev = self._res.node_failures.get(node.name)
            if prev is None or self._rank(f) > self._rank(prev):
                self._res.node_failures[node.name] = f
        d = self._res.deepest
        if d is None or self._rank(f) > self._rank(d):
            self._res.deepest = f

    def _detail(self, spec, detail) -> str:
        # a required rule node with a role names the missing piece of the chain ("no weight
        # gradient (dW) branch: ..."): a gradient the graph does not compute, or whose nodes
        # are spelled otherwise
        detail = detail() if callable(detail) else detail
        role = self._roles.get(spec)
        return f"no {role} branch: {detail}" if role else detail

    def _why(self, uid: int) -> str | None:
        """Why graph node ``uid`` fit no rule node, if it was tried."""
        failed = self._node_fail.get(uid)
        return None if failed is None else f"rule node '{failed[0]}': {self._detail(*failed)}"

    def _rank(self, f: Failure) -> tuple[int, int, int]:
        # (at equal depth and kind, a required node with a role: a missing gradient branch
        # says more than an optional pass-through that was not there)
        return f.depth, self._SPECIFIC.get(f.reason, 0), int(f.spec in self._roles)

    # -- search ----------------------------------------------------------------------------
    def _search(self, i, nodes, tensors, captures, bits) -> tuple[Match | None, int]:
        """The first match that extends the bindings of rule nodes 0..i-1 (``bits``: each bound
        variable -> the nodes its value depends on, _Deps), and on failure its conflict: a bit
        mask of the rule nodes < i whose bindings the failure depends on. When a subtree fails
        without depending on node i, no other binding of node i (another candidate, or absent)
        can do better: the search returns at once to the latest node the failure depends on
        (conflict-directed backjumping; the explain search, which records every failure, tries
        them all)."""
        specs = self.rule.nodes
        if self._bindings >= MAX_BINDINGS:
            return None, 0  # (a conflict on no node: every level returns at once)
        if i > self.reached:
            self.reached = i
        if i == len(specs):
            self._bindings += 1
            return self._finish(nodes, tensors, captures), self._deps.everything
        spec = specs[i]
        bit = 1 << i
        conflict = 0  # (what node i's own checks depend on is added on failure: _Deps.of)
        cands = self._candidates(i, spec, tensors)
        if cands is None:  # optional node whose neighbours are all absent
            m, c = self._absent(i, spec, nodes, tensors, captures, bits)
            return m, 0 if m is not None else self._deps.of(i, bits) | (c & ~bit)
        jump = not self.explain
        extra = [0]  # bindings of other nodes that refused a candidate (_bind)
        for node in cands:
            if jump and node.op not in spec.alts:  # (explain records the wrong op type)
                continue
            for nt, nc in self._bind(i, spec, node, nodes, tensors, captures, extra):
                nodes2 = dict(nodes)
                nodes2[spec.id] = node
                nb = dict(bits)
                for v in self._deps.before[i]:
                    if v not in tensors and v in nt:  # bound here
                        nb[v] = self._deps.bound(i, v)
                self._taken[node.uid] = i
                m, c = self._search(i + 1, nodes2, nt, nc, nb)
                del self._taken[node.uid]
                if m is not None:
                    return m, 0
                if jump and not c & bit:
                    return None, c
                conflict |= c
        conflict = (conflict | extra[0] | self._deps.of(i, bits)) & ~bit
        if spec.optional:
            m, c = self._absent(i, spec, nodes, tensors, captures, bits)
            return m, 0 if m is not None else conflict | (c & ~bit)
        # no candidate, or only nodes the match already took (the dK MatMul of an attention
        # whose dK is not computed: dS's only MatMul reader is dQ's)
        if self.explain and all(n.uid in self._taken for n in cands):
            self._fail(len(nodes), nodes, spec.id, "no_candidate",
                       self._no_candidate_detail(spec, tensors, nodes))
        return None, conflict

    def _absent(self, i, spec, nodes, tensors, captures, bits) -> tuple[Match | None, int]:
        t2 = dict(tensors)
        if spec.optional == "passthrough":
            src = var_name(spec.inputs[0])
            dst = var_name(spec.outputs[0])
            if src in t2:
                if dst in t2 and t2[dst] != t2[src]:
                    return None, self._deps.of(i, bits)
                if dst not in t2:
                    t2[dst] = t2[src]
                    bits = {**bits, dst: bits[src] | self._deps.bound(i, dst)}
            elif dst in t2:
                t2[src] = t2[dst]
                bits = {**bits, src: bits[dst] | self._deps.bound(i, src)}
            for w, of in (*self._deps.pairs.get(src, ()), *self._deps.pairs.get(dst, ())):
                if w in t2 and of in t2 and self._deferred(w, t2[w], t2[of], of):
                    return None, self._deps.of(i, bits)  # (this alias bound one end)
        return self._search(i + 1, nodes, t2, captures, bits)

    def _no_candidate_detail(self, spec: NodeSpec, tensors, nodes=None) -> str:
        ops = "|".join(spec.ops)
        taken = {n.uid: k for k, n in (nodes or {}).items()}
        for t in spec.inputs:
            v = var_name(t)
            if t != "_" and v in tensors and tensors[v]:
                users = [f"{n.domain + '::' if n.domain else ''}{n.op}"
                         + (f" (matched as '{taken[n.uid]}')" if n.uid in taken else "")
                         for n in self.g.consumers.get(tensors[v], [])]
                return (f"no {ops} node consumes tensor '{tensors[v]}' (bound to {v}); its "
                        f"consumers are {users or 'none'}")
        for t in spec.outputs:
            v = var_name(t)
            if t != "_" and v in tensors and tensors[v]:
                p = self.g.producer.get(tensors[v])
                return (f"tensor '{tensors[v]}' (bound to {v}) is produced by "
                        f"{p.op if p else 'a graph input/initializer'}, not {ops}")
        return f"no {ops} node"

    def _candidates(self, i, spec: NodeSpec, tensors) -> list[GNode] | None:
        if i == 0:
            return [self._anchor]
        # the node reads one of the bound tensors: the fewest consumers of one are the
        # candidates; a constant binds by value (_same_constant), so another tensor of the same
        # value may stand in its place: its consumers are candidates only when no run-time
        # tensor is bound (a raw export writes one Constant subgraph per use)
        ins, outs = self._ports[i]
        for t, v in outs:  # (a bound output: its producer alone, whatever the inputs)
            if t != "_" and tensors.get(v):
                p = self.g.producer.get(tensors[v])
                return [p] if p is not None and p.alive else []
        best, best_const = None, None
        for t, v in ins:
            if t != "_" and tensors.get(v):
                cons = self.g.consumers.get(tensors[v], [])
                if self.g.const_value(tensors[v]) is not None:
                    if best_const is None or len(cons) < len(best_const):
                        best_const = cons
                elif best is None or len(cons) < len(best):
                    best = cons
        if best is None:
            best = best_const
        if best is None:
            if spec.optional:
                return None
            return []
        # dedupe, keep graph order for determinism
        seen, out = set(), []
        for n in best:
            if n.uid not in seen and n.alive:
                seen.add(n.uid)
                out.append(n)
        return out

    def _bind(self, i, spec: NodeSpec, node: GNode, nodes, tensors, captures, extra):
        """Every way ``node`` binds rule node i (commutative inputs: both orders). ``extra[0]``
        gains the rule nodes whose bindings refused it beyond those _Deps.of names: the
        node that already took it, every earlier node when a constant enters through an
        earlier node's value function."""
        depth = len(nodes)
        if node.op not in spec.ops:
            if self.explain:
                self._fail(depth, nodes, spec.id, "op_type",
                           f"node {node.name} is {node.op}, rule wants {'|'.join(spec.ops)}",
                           node)
            return
        alt = spec.alt(node.op)
        domains = alt.domains
        if node.domain not in domains:
            self._fail(depth, nodes, spec.id, "domain",
                       f"node {node.name} is in domain '{node.domain or 'ai.onnx'}', rule wants "
                       f"{[d or 'ai.onnx' for d in domains]}", node)
            return
        taken = self._taken.get(node.uid)
        if taken is not None:  # bound to an earlier rule node
            extra[0] |= 1 << taken
            return
        caps = captures  # copied before the first change (a binding's own captures)
        if alt.value:
            caps = dict(captures)
            for var, fn in alt.value.items():
                caps[VALUE_KEY + var] = fn
        for name, c in ({**spec.attrs, **alt.attrs} if alt.attrs else spec.attrs).items():
            ok, value, detail = check_attr(node, name, c, self.g)
            if not ok:
                self._fail(depth, nodes, spec.id, "attribute",
                           lambda: f"node {node.name}: {detail}", node)
                return
            if c.capture:
                if caps is captures:
                    caps = dict(captures)
                caps[c.capture] = value
        n_in = len(spec.inputs)
        actual = list(node.inputs)
        while actual and actual[-1] == "":
            actual.pop()
        if len(actual) > n_in:
            self._fail(depth, nodes, spec.id, "inputs",
                       f"node {node.name} has {len(actual)} inputs, rule lists {n_in}", node)
            return
        actual += [""] * (n_in - len(actual))
        # outputs the rule does not list are intermediates: the guards check them
        n_out = len(spec.outputs)
        outs = (list(node.outputs) + [""] * n_out)[:n_out]
        seen = set()
        for order in self._orders[i][node.op]:
            ins = tuple(actual[j] for j in order)
            if ins in seen:
                continue
            seen.add(ins)
            t2 = dict(tensors)
            ports_in, ports_out = self._ports[i]
            ok = self._bind_ports(depth, nodes, spec, node, ports_in, ins, t2, "input", caps,
                                  alt.value, extra, i)
            ok = ok and self._bind_ports(depth, nodes, spec, node, ports_out, outs, t2, "output",
                                         caps, alt.value, extra, i)
            if ok:
                yield t2, caps

    def _same_constant(self, a: str, b: str) -> bool:
        """Two constant tensors of the same type, shape and values are the same variable (a raw
        export's Constant nodes: one per use of the same number)."""
        if not a or not b:
            return False
        va, vb = self.g.const_value(a), self.g.const_value(b)
        if va is None or vb is None:
            return False
        va, vb = np.asarray(va), np.asarray(vb)
        return va.dtype == vb.dtype and va.shape == vb.shape and np.array_equal(va, vb)

    def _bind_ports(self, depth, nodes, spec, node, ports, actual, t2, kind, caps, own, extra,
                    i) -> bool:
        """Binds the rule node's ports ((token, variable) each, Matcher._ports) to the node's
        tensor names ``actual``, into t2; False (and the failure recorded) when one refuses."""
        for pos, ((tok, v), name) in enumerate(zip(ports, actual)):
            if tok == "_":
                continue
            if name == "" and not tok.endswith("*"):
                self._fail(depth, nodes, spec.id, kind + "s",
                           f"node {node.name} has no {kind} {pos} (rule: {tok})", node)
                return False
            if v in t2:
                if t2[v] != name and not (kind == "input" and self._same_constant(t2[v], name)):
                    bound = t2[v]
                    if (kind == "input" and self.g.const_value(name) is not None
                            and self.g.const_value(bound) is not None):
                        # two constants of one variable (the forward's and the backward's
                        # scale): the values differ, which explain names as a constant
                        self._fail(depth, nodes, spec.id, "constant",
                                   lambda: f"node {node.name} {kind} {pos} is the constant "
                                   f"'{name}', not the value of {v} bound to '{bound}'", node)
                        return False
                    self._fail(depth, nodes, spec.id, "dataflow",
                               lambda: f"node {node.name} {kind} {pos} is '{name}', but {v} is "
                               f"already bound to '{bound}'", node)
                    return False
                continue
            ts = self.rule.tensors.get(v)
            if ts is not None and name:
                value = self._value(name)
                # the shape of the data a constant input describes (a Reshape's input)
                data_shape = (self._data_shape(node, actual)
                              if kind == "input" and pos and value is not None else None)
                fn = caps.get(VALUE_KEY + v)
                if fn is not None and v not in own:
                    extra[0] |= (1 << i) - 1  # set by an earlier node's op alternative
                if value is not None and fn is not None and fn != "identity":
                    with np.errstate(divide="ignore", invalid="ignore"):  # (a 0: inf, no match)
                        value = CONST_FUNCS[fn](compact(np.asarray(value)).astype(np.float64))
                if ts.kind in DEFERRED_KINDS:  # checked once both ends are bound (below)
                    ok, detail = True, ""
                elif ts.kind == "index_range":
                    ok, detail = self._index_range(value, ts, t2, name)
                elif ts.kind == "lead_dims_of":
                    ok, detail = self._lead_dims_of(value, ts, t2)
                elif ts.kind == "last_dim_of":
                    ok, detail = self._last_dim_of(value, ts, t2)
                elif ts.kind == "zero_one":
                    ok, detail = self._elements(name, lambda a: (a == 0) | (a == 1), "0 and 1",
                                                "a mask multiplied on")
                elif ts.kind == "zeros":
                    ok, detail = self._elements(name, lambda a: a == 0, "0",
                                                "a term added that changes nothing")
                elif ts.kind == "broadcast_axes_of":
                    ok, detail = self._broadcast_axes_of(value, ts, t2,
                                                         self.g.shapes.shape(actual[0]))
                elif ts.kind == "shape" and value is None and self.g.is_shape_computation(name):
                    ok, detail = True, ""  # a Reshape target of symbolic dims
                elif ts.kind == "flatten_2d" and value is None:
                    ok, detail = self._runtime_flatten(name, actual)
                elif ts.kind == "pairs_shape" and value is None:
                    ok, detail = self._runtime_pairs(name, actual)
                elif ts.kind == "uniform":
                    ok, detail = uniform_matches(self.g.const_value(name))
                else:
                    ok, detail = const_matches(value, ts.const, ts.tol, ts.kind, data_shape)
                if not ok:
                    how = f"(as {fn} of its value, {node.op} spelling) " if fn not in (
                        None, "identity") else ""
                    self._fail(depth, nodes, spec.id, "constant",
                               lambda: f"node {node.name} {kind} {pos} '{name}' ({v}) {how}"
                               f"{detail}", node)
                    return False
            t2[v] = name
            for w, of in self._deps.pairs.get(v, ()):  # DEFERRED_KINDS, both ends now bound
                why = self._deferred(w, t2.get(w), t2.get(of), of) if w in t2 and of in t2 \
                    else ""
                if why:
                    self._fail(depth, nodes, spec.id, "constant",
                               lambda: f"node {node.name} {kind} {pos}: {w} ('{t2[w]}') {why}",
                               node)
                    return False
        return True

    def _runtime_target(self, name: str, actual) -> tuple[list | None, list | None]:
        """A Reshape target computed at run time (symbolic dims): its static entries (None
        elsewhere) and the data's refined shape, each None when not known."""
        vec = self.g.shape_vector(name) if self.g.is_shape_computation(name) else None
        data = self.g.shapes.refined(actual[0]) if actual and actual[0] else None
        return vec, data

    def _runtime_flatten(self, name: str, actual) -> tuple[bool, str]:
        """A run-time Reshape target that flattens its data's leading dims: two entries, the
        first run-time, the second the data's static last dim n (a Reshape that runs then keeps
        M * n = the data's size: M is the leading dims' product), e.g. Shape(X) of the 2-D
        tensor the gradient is viewed back to."""
        vec, data = self._runtime_target(name, actual)
        ok = (vec is not None and len(vec) == 2 and vec[0] is None and isinstance(vec[1], int)
              and vec[1] > 0 and data is not None and len(data) >= 2 and data[-1] == vec[1])
        return ok, ("a shape that flattens the leading dims: [-1 or M, n] (here computed at "
                    "run time: [M, n], n the data's static last dim)")

    def _runtime_pairs(self, name: str, actual) -> tuple[bool, str]:
        """A run-time Reshape target that splits its data's last dim n into pairs: its last
        two entries static, n/2 and 2, n the data's static last dim (rotate-every-two's view of
        the gradient)."""
        vec, data = self._runtime_target(name, actual)
        ok = (vec is not None and len(vec) >= 2 and vec[-1] == 2 and isinstance(vec[-2], int)
              and data is not None and bool(data) and isinstance(data[-1], int)
              and vec[-2] * 2 == data[-1])
        return ok, ("a Reshape target [..., n/2, 2] splitting the last dim n of its input into "
                    "pairs (here computed at run time: its last two entries static, n the "
                    "data's static last dim)")

    _VIEWS = ("Slice", "Reshape", "Unsqueeze", "Squeeze", "Expand", "Identity", "Transpose")

    def _elements(self, name: str, each, values: str, why: str) -> tuple[bool, str]:
        """kinds zero_one / zeros: a constant whose every element passes ``each`` (0 or 1: a
        mask multiplied onto the scores; 0: baddbmm's zeros added to them), or a slice or view
        of one (a causal buffer sliced to the sequence at run time, too large to fold), or a
        scalar broadcast to a run-time shape (ConstantOfShape, Expand)."""
        t = name
        for _ in range(8):
            value = self._value(t)
            if value is not None:
                arr = np.asarray(value)
                if arr.size and bool(np.all(each(arr))):
                    return True, ""
                return False, f"has elements other than {values} ({why})"
            prod = self.g.producer.get(t)
            if prod is None or not prod.alive or prod.domain != "" or prod.op not in self._VIEWS:
                break
            t = prod.inputs[0]
        return False, (f"is not a constant of only {values}, nor a slice or view of one "
                       f"({why})")

    def _data_shape(self, node, actual):
        """The shape of the data a node's constant inputs describe: its first input's, except
        SliceGrad(dY, shape, starts, ends, axes, steps), whose starts / ends index the tensor
        of `shape` (its static entries, e.g. Shape(X) of X's static dims; else its rank)."""
        if node.op == "SliceGrad" and len(actual) > 1 and actual[1]:
            full = self.g.shape_vector(actual[1])  # None entries: dims not static
            if full is not None:
                return tuple(full)
            dy = self.g.shape(actual[0])
            return None if dy is None else (None,) * len(dy)
        return self.g.shape(actual[0])

    def _lead_dims_of(self, value, ts, bound) -> tuple[bool, str]:
        """kind lead_dims_of: a 1-D integer shape whose entries but the last are the dims but
        the last of the tensor bound to ``ts.of`` (recorded or inferred, every one known)."""
        if value is None:
            return False, "is not a constant"
        arr = np.asarray(value)
        other, dims = self._of_dims(ts, bound)
        known = dims is not None and all(isinstance(d, int) for d in dims)
        ok = (known and arr.dtype.kind in "iu" and arr.ndim == 1 and arr.size == len(dims)
              and arr.tolist()[:-1] == list(dims[:-1]))
        return ok, (f"is {arr.reshape(-1)[:6].tolist()}, rule wants the leading dims of "
                    f"{ts.of} ('{other}', " + (f"{list(dims)}" if known else "shape not known")
                    + ") and one more")

    def _of_dims(self, ts, bound):
        """(name, recorded or inferred dims or None) of the tensor bound to ``ts.of``."""
        other = bound.get(ts.of)
        return other, self.g.shapes.shape(other) if other else None

    def _last_dim_of(self, value, ts, bound) -> tuple[bool, str]:
        """kind last_dim_of: one number equal to the last dim of the tensor bound to ``ts.of``
        (recorded or inferred)."""
        other, dims = self._of_dims(ts, bound)
        last = dims[-1] if dims and isinstance(dims[-1], int) else None
        arr = None if value is None else np.asarray(value)
        ok = (arr is not None and last is not None and arr.size == 1
              and arr.dtype.kind in "iuf" and float(arr.reshape(-1)[0]) == last)
        shown = "not a constant" if arr is None else f"{arr.reshape(-1)[:6].tolist()}"
        return ok, (f"is {shown}, rule wants the last dim of {ts.of} ('{other}', "
                    + (f"{last}" if last is not None else "not known") + ")")

    def _broadcast_axes_of(self, value, ts, bound, data) -> tuple[bool, str]:
        """kind broadcast_axes_of: a reduction's axes that sum a broadcast back to the tensor
        bound to ``ts.of`` (`data`: the reduced input's recorded or inferred shape): right-aligned,
        every axis that tensor lacks or has as 1 where the data's is not 1, and no other (an axis
        where both are 1 may be in or out; a symbolic dim is not 1)."""
        other, dims = self._of_dims(ts, bound)
        arr = None if value is None else np.asarray(value)
        if arr is None or arr.dtype.kind not in "iu" or arr.ndim > 1 or data is None \
                or dims is None or len(dims) > len(data):
            return False, (f"is {'not a constant' if arr is None else arr.tolist()}, rule wants "
                           f"the axes along which {ts.of} ('{other}') is broadcast")
        n, lead = len(data), len(data) - len(dims)
        axes = {int(a) % n for a in arr.reshape(-1).tolist()}
        may = {i for i in range(n) if i < lead or dims[i - lead] == 1}
        must = {i for i in may if data[i] != 1}
        ok = must <= axes <= may and len(axes) == arr.size
        return ok, (f"is {arr.reshape(-1).tolist()}, rule wants the axes along which {ts.of} "
                    f"('{other}', {list(dims)}) is broadcast to {list(data)}: {sorted(must)}")

    def _index_range(self, value, ts, bound, name: str) -> tuple[bool, str]:
        """kind index_range: [start, start + step, ...] (count of them, any count when None) as
        [count] or [count, 1] integers; start / count literals or the values of bound
        one-element integer constants; with ``of``, count is the first dim of that tensor,
        and under symbolic dims the indices may be computed at run time (`_runtime_range`)."""
        if value is None and ts.of is not None and isinstance(ts.start, int):
            return self._runtime_range(name, ts, bound)
        if value is None:
            return False, "is not a constant"
        want = []
        for key in ("start", "count"):
            ref = getattr(ts, key)
            if isinstance(ref, str):
                v = self.g.const_value(bound[ref]) if ref in bound else None
                v = None if v is None else np.asarray(v)
                if v is None or v.size != 1 or v.dtype.kind not in "iu":
                    return False, f"rule wants an index range whose {key} is {ref}, which is " \
                        "not a bound integer constant"
                ref = int(v.reshape(-1)[0])
            want.append(ref)
        start, count = want
        if ts.of is not None:  # the count is the first dim of the tensor bound to `of`
            other, dims = self._of_dims(ts, bound)
            if not dims or not isinstance(dims[0], int):
                return False, (f"rule wants as many indices as the first dim of {ts.of} "
                               f"('{other}'), which is not known")
            count = dims[0]
        arr = np.asarray(value)
        flat = arr.reshape(-1)
        n = flat.size if count is None else count
        ok = (arr.dtype.kind in "iu" and arr.shape in ((n,), (n, 1))
              and flat.tolist() == list(range(start, start + ts.step * n, ts.step)))
        last = "" if count is None else f"..{start + ts.step * (count - 1)}"
        return ok, (f"is {flat[:6].tolist()}{'...' if flat.size > 6 else ''} of shape "
                    f"{list(arr.shape)}, rule wants the indices {start}, "
                    f"{start + ts.step}{last} (step {ts.step})")

    def _runtime_range(self, name: str, ts, bound) -> tuple[bool, str]:
        """index_range computed at run time: Range(start, n, step) [-> Unsqueeze to [n, 1]],
        start and step the rule's, n a dim read from a Shape (`GraphIndex.picked_dim`) that is
        the first dim of the tensor bound to ``of``: the same number, or the same symbol (the
        exporter's symbolic dims; torch.arange(B) under a symbolic batch)."""
        want = (f"rule wants the indices {ts.start}, {ts.start + ts.step}.. (step {ts.step}), "
                f"as many as the first dim of {ts.of}")
        prod = self.g.producer.get(name)
        if prod is not None and prod.op == "Unsqueeze" and prod.domain == "":
            axes = (self.g.const_value(prod.inputs[1]) if len(prod.inputs) > 1
                    else prod.attrs.get("axes"))
            if axes is None or np.asarray(axes).reshape(-1).tolist() not in ([1], [-1]):
                return False, f"is not a constant, and not a run-time range: {want}"
            prod = self.g.producer.get(prod.inputs[0])
        if prod is None or prod.op != "Range" or prod.domain != "":
            return False, f"is not a constant, and not a run-time range: {want}"
        start, step = (self.g.const_value(t) for t in (prod.inputs[0], prod.inputs[2]))
        n = self.g.picked_dim(prod.inputs[1])
        _, dims = self._of_dims(ts, bound)
        ok = (start is not None and step is not None and np.size(start) == 1
              and np.size(step) == 1 and int(np.reshape(start, -1)[0]) == ts.start
              and int(np.reshape(step, -1)[0]) == ts.step and n is not None
              and bool(dims) and dims[0] == n)
        return ok, (f"is Range({'start' if start is None else np.reshape(start, -1)[0]}, "
                    f"{n or 'a run-time limit'}, "
                    f"{'step' if step is None else np.reshape(step, -1)[0]}) computed at run "
                    f"time, {want} ({dims[0] if dims else 'not known'})")

    # -- guards ----------------------------------------------------------------------------
    def _finish(self, nodes, tensors, captures) -> Match | None:
        self._res.structural = True
        rule = self.rule
        kept = {s.id for s in rule.nodes if s.keep}
        removed = {k: n for k, n in nodes.items() if k not in kept}
        matched = {n.uid for n in removed.values()}
        reps = rule.replace.nodes
        new = set(rule.replace.new)
        rep_out = {tensors.get(v, "") for rep in reps for v in rep.outputs if v and v not in new}
        rep_out.discard("")
        for node in removed.values():
            for t in node.outputs:
                if not t or t in rep_out:
                    continue
                if t in self.g.graph_outputs:
                    return self._guard(nodes, "intermediate_is_graph_output",
                                       f"intermediate '{t}' of node {node.name} is a graph output "
                                       f"and {rule.replace.op} does not produce it")
                for c in self.g.consumers.get(t, []):
                    # a constant computed from t's type or shape alone (a raw export's
                    # new_zeros: CastLike(zeros, t)) is rewritten without t when fused
                    if c.uid not in matched and not self.g.reads_only_type(c, t):
                        why = self._why(c.uid)
                        return self._guard(nodes, "intermediate_consumed_outside",
                                           f"intermediate '{t}' of node {node.name} is also "
                                           f"consumed by {c.name} ({c.op}) outside the match"
                                           + (f" (it did not fit {why})" if why else ""))
        contracts = load_contracts()
        for rep in reps:
            for v, port in zip(rep.inputs, contracts.ops[rep.op].inputs):
                if not port.optional and not tensors.get(v) and v not in new:
                    return self._guard(nodes, "missing_required_input",
                                       f"{rep.op} needs {port.name} but '{v}' is not bound")
        # placement of each fused node, in order: after every producer of its inputs (outside
        # producers, and the replacement's earlier nodes), before every outside consumer
        first = min(n.key for n in removed.values())
        keys: list[float] = []
        written: dict[str, float] = {}  # variable -> key of the fused node that writes it
        moves: list = []
        prepared = []  # (key, node) of replace.prepare's standard nodes, before the fused ones
        for prep in rule.replace.prepare:
            lo = -math.inf
            for v in prep.inputs:
                t = tensors.get(v)
                if v not in written and not t:
                    return self._guard(nodes, "missing_required_input",
                                       f"replace.prepare's {prep.op} needs '{v}', which is "
                                       "not bound")
                p = None if v in written else self.g.producer.get(t)
                lo = max(lo, written[v] if v in written else -math.inf if p is None else p.key)
            key = first if lo < first else lo + 0.5
            attrs = dict(prep.attrs)
            for name, d in prep.attrs.items():
                if isinstance(d, Dims):
                    attrs[name] = self._dims(d, tensors)
                    if attrs[name] is None:
                        return self._guard(nodes, "dims_not_known",
                                           f"replace.prepare's {prep.op} needs the dims "
                                           f"{d.text!r}: a shape is not known, or more than "
                                           "one of them is not static")
            prepared.append((key, onnx.helper.make_node(
                prep.op, [NEW_TENSOR + v if v in written else tensors[v] for v in prep.inputs],
                [NEW_TENSOR + v for v in prep.outputs], **attrs)))
            written.update((v, key) for v in prep.outputs)
        for rep in reps:
            lo = -math.inf
            outside = []  # the outside producers of its inputs
            for v in rep.inputs:
                if v in written:
                    lo = max(lo, written[v])
                    continue
                t = tensors.get(v)
                p = self.g.producer.get(t) if t else None
                if p is not None and p.uid not in matched:
                    lo = max(lo, p.key)
                    outside.append(p)
            hi = math.inf
            for v in rep.outputs:
                t = tensors.get(v) if v and v not in new else None
                for c in self.g.consumers.get(t, []) if t else ():
                    if c.uid not in matched:
                        hi = min(hi, c.key)
            if lo >= hi and not moves and all(w < hi for w in written.values()):
                moves = self._hoist(outside, hi, matched)
                if moves:  # (the moved nodes sit after every other producer of its inputs)
                    lo = max([moves[-1][1]] + [written[v] for v in rep.inputs if v in written])
            if lo < first:
                key = first
            elif lo < hi:
                key = (lo + min(hi, lo + 1.0)) / 2.0
            else:
                return self._guard(nodes, "would_create_cycle",
                                   "an input of the fused op is produced after one of its outputs "
                                   "is consumed; fusing would create a cycle")
            keys.append(key)
            written.update((v, key) for v in rep.outputs if v)
        # an optional output whose tensor only the matched nodes read (AttentionGrad's dS when
        # no learned bias takes its gradient), or nothing reads (onnxruntime-training's
        # LayerNormalizationGrad computes dGamma/dBeta of a frozen gamma/beta all the same), is
        # left empty: the op need not compute it
        unread = frozenset(
            t for rep in reps
            for v, port in zip(rep.outputs, contracts.ops[rep.op].outputs)
            if port.optional and v not in new and (t := tensors.get(v, ""))
            and t not in self.g.graph_outputs
            and all(c.uid in matched for c in self.g.consumers.get(t, ())))
        inter = sorted({t for n in removed.values() for t in n.outputs
                        if t and (t not in rep_out or t in unread)})
        match = Match(rule, removed, dict(tensors), dict(captures), keys[0], inter,
                      frozenset(nodes), unread=unread, moves=moves)
        protos = []
        for rep in reps:
            ins, outs = replacement_ports(match, rep)
            protos.append(onnx.helper.make_node(rep.op, ins, outs, domain=rep.domain,
                                                **replacement_attrs(self.g, match, rep)))
        match.proto = protos[0]
        match.extra = list(zip(keys[1:], protos[1:]))
        match.prepared = prepared
        if not self.check_shapes:
            return match
        for proto in protos:
            why = fusion_problem(self.g.shapes, proto, set(rep_out))
            if why:
                return self._guard(nodes, "shape_mismatch", why)
        return match

    def _deferred(self, w: str, a: str | None, b: str | None, of: str) -> str:
        """A DEFERRED_KINDS check of variable w bound to a against ``of`` bound to b: "" when
        it holds, else why not."""
        if self.rule.tensors[w].kind == "same_batch_dims_as":
            return self._same_batch_dims(a, b, of)
        return self._same_shape(a, b, of)

    def _same_batch_dims(self, a: str | None, b: str | None, of: str) -> str:
        """kind same_batch_dims_as: "" when tensors a and b have the same rank and the same
        dims but the last two, recorded or inferred: equal numbers or the same symbols (BLOOM's
        ALiBi term [B * H, 1, S] added to the scores on the [B * H] view: one row per item,
        not a row broadcast over them; the scores viewed to the [B, H] of the heads the ops
        read); else why not."""
        da, db = self.g.shapes.refined(a), self.g.shapes.refined(b)
        if da is not None and db is not None and len(da) == len(db) >= 2 \
                and None not in da[:-2] and list(da[:-2]) == list(db[:-2]):
            return ""
        return (f"does not have the rank and batch dims (all but the last two) of {of} "
                f"('{b}'): {da} vs {db}")

    def _same_shape(self, a: str | None, b: str | None, of: str = "") -> str:
        """kind same_shape_as: "" when tensors a and b are one tensor, or have the same shape,
        recorded or inferred, every dim known: equal numbers or the same symbol (ONNX: one
        dim_param names one dimension), so a chain of Reshapes from one to the other is the
        identity (the round trip [B, H, S, S] -> [B * H, S, S] -> [B, H, S, S] of a symbolic
        export); else why not."""
        if not a or not b or a == b:
            return ""
        da, db = self.g.shapes.refined(a), self.g.shapes.refined(b)
        if da is not None and db is not None and None not in da and None not in db \
                and list(da) == list(db):
            return ""
        return (f"is not of the shape of {of} ('{b}'), the other end of its chain of views "
                f"({da} vs {db}; a chain of views is the identity only between equal shapes)")

    HOIST_LIMIT = 32  # outside nodes _hoist moves at most

    def _hoist(self, producers, hi: float, matched: set) -> list:
        """An input of a fused node produced after a reader of one of its outputs (a
        label-smoothed loss's gradient coefficients, computed in the backward from the token
        count and the mask alone, read by the op at the forward's place): the producers at or
        after ``hi`` and their own producers there, moved to just before ``hi`` in their order,
        when none of them is matched (an input computed from the match's own output, a loss
        scale that reads the loss, cannot move: the split variants take that) and they are at
        most HOIST_LIMIT; [(node, new key)], or [] when they cannot move. Moving a node earlier
        keeps every reader after it; its inputs are produced before ``hi`` or moved with it."""
        todo = [p for p in producers if p.key >= hi]
        seen: dict[int, GNode] = {}
        while todo:
            x = todo.pop()
            if x.uid in seen:
                continue
            if x.uid in matched or len(seen) >= self.HOIST_LIMIT:
                return []
            seen[x.uid] = x
            for t in (*x.inputs, *x.implicit):
                p = self.g.producer.get(t) if t else None
                if p is not None and p.uid in matched:
                    return []  # computed from the match: its fused output comes first
                if p is not None and p.key >= hi:
                    todo.append(p)
        if not seen:
            return []
        ordered = sorted(seen.values(), key=lambda n: n.key)
        floor = max((p.key for x in ordered for t in (*x.inputs, *x.implicit)
                     if t and (p := self.g.producer.get(t)) is not None and p.uid not in seen),
                    default=-math.inf)
        floor = max([floor] + [p.key for p in producers if p.key < hi])
        if floor == -math.inf:
            floor = hi - len(ordered) - 2.0
        step = (hi - floor) / (len(ordered) + 2)
        return [(x, floor + step * (k + 1)) for k, x in enumerate(ordered)]

    def _dims(self, d: Dims, tensors: dict) -> list[int] | None:
        """A Dims attribute's integers for this match (the bound tensors' dims; one that is
        not static written -1), or None (a shape not known, or two dims not static)."""
        out: list[int] = []
        for var, lo, hi in d.terms:
            dims = self.g.shapes.refined(tensors[var]) if tensors.get(var) else None
            if dims is None:
                return None
            out += [x if isinstance(x, int) else -1 for x in list(dims)[lo:hi]]
        return out if out.count(-1) <= 1 else None

    def _guard(self, nodes, reason, detail):
        f = Failure(len(nodes), {k: n.name for k, n in nodes.items()}, None, reason, detail)
        if self._res.guard_failure is None:
            self._res.guard_failure = f
        return None
