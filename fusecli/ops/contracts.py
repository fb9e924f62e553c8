"""The fused-op contracts (``ops/domain.yaml`` + ``ops/<op>/contract.yaml``) as Python objects.

Every fact about a fused op is written once, in its folder's contract; this module derives
from it what Python needs (ports, patterns, output types, launcher signatures, byte models),
and ``csrc/gen_op_tables.py`` loads this same module (by file path, without the package, so
the build needs only PyYAML) to generate the C++ tables. Keep this module free of imports
beyond the standard library and PyYAML at module level.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

OPS_DIR = Path(__file__).parent
DOMAIN_FILE = OPS_DIR / "domain.yaml"
CONTRACT_NAME = "contract.yaml"
CONTRACTS_DOC = "fusecli/ops/<op>/contract.yaml"  # where a reader finds them (messages, docs)


@dataclass(frozen=True)
class Port:
    name: str
    optional: bool
    doc: str
    # an output the rewriter always names (a fresh tensor nobody reads): the op's working buffer,
    # which the runtime may place in an input's memory (the kernel's in-place pair)
    workspace: bool = False
    any_float: bool = False  # an input that is float32 or float16 whatever the op's type
    like: tuple[str, ...] = ()  # an output's type rules (see domain.yaml)
    inplace_over: tuple[str, ...] = ()  # inputs whose buffer this output may reuse
    type: str = ""  # an input's element type when it is not the op's float type (bool, int64)


@dataclass(frozen=True)
class Launcher:
    name: str
    args: str  # the C parameter list
    doc: str

    def params(self) -> list[tuple[str, str]]:
        """(C type, name) per parameter."""
        out = []
        for p in self.args.split(","):
            m = re.fullmatch(r"\s*(.*?[\s*])(\w+)\s*", p)
            if not m:
                raise ValueError(f"{self.name}: cannot read parameter {p!r}")
            out.append((" ".join(m.group(1).replace("*", " * ").split()).replace(" *", "*"),
                        m.group(2)))
        return out


@dataclass(frozen=True)
class OpContract:
    name: str
    folder: str  # fusecli/ops/<folder>/
    summary: str
    types: tuple[str, ...]
    patterns: tuple[str, ...]
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    attributes: dict
    launchers: tuple[Launcher, ...]
    floor_bytes: dict
    math: str
    order: int | None = None  # canonical position of its patterns (ascending across ops)
    replaces: str = ""  # the unfused chain it takes the place of, in words (docs/ops.md)
    # element types the CUDA kernels implement (the contract's `cuda_types`; default `types`)
    cuda_types: tuple[str, ...] = ()

    def types_for(self, provider: str) -> tuple[str, ...]:
        """Element types a fused node of this op may take for an execution provider: 'cpu' the
        CPU kernels' (`types`), 'cuda' the CUDA kernels' (`cuda_types`), 'any' those both
        implement (the fused graph may run on either)."""
        if provider == "cpu":
            return self.types
        if provider == "cuda":
            return self.cuda_types
        if provider == "any":
            return tuple(t for t in self.types if t in self.cuda_types)
        raise ValueError(f"unknown execution provider {provider!r}")

    def inplace_pairs(self) -> list[tuple[int, int]]:
        """(input index, output index) pairs, in the order the runtime should try them."""
        index = {p.name: i for i, p in enumerate(self.inputs)}
        return [(index[src], o) for o, port in enumerate(self.outputs)
                for src in port.inplace_over]


@dataclass(frozen=True)
class Contracts:
    domain: str
    version: int
    activations: tuple[str, ...]
    ops: dict[str, OpContract]

    @property
    def patterns(self) -> tuple[str, ...]:
        """Every pattern a shipped rule may produce (the canonical pattern names), in the
        canonical order: ops by their contract's `order`, each op's patterns in its list order
        (an op without `order` last, in folder order; tests/test_contracts.py requires one)."""
        big = float("inf")
        ops = sorted(self.ops.values(), key=lambda c: big if c.order is None else c.order)
        return tuple(p for c in ops for p in c.patterns)


def _as_tuple(v) -> tuple:
    return tuple(v) if isinstance(v, (list, tuple)) else (() if v is None else (v,))


def _ports(items) -> tuple[Port, ...]:
    return tuple(Port(p["name"], bool(p.get("optional", False)), p.get("doc", ""),
                      bool(p.get("workspace", False)), bool(p.get("any_float", False)),
                      _as_tuple(p.get("like")), _as_tuple(p.get("inplace_over")),
                      str(p.get("type", "")))
                 for p in items)


def _op(folder: str, spec: dict) -> OpContract:
    launchers = tuple(Launcher(x["name"], " ".join(x["args"].split()), x.get("doc", "").strip())
                      for x in spec.get("launchers") or ())
    return OpContract(spec["name"], folder, spec["summary"], tuple(spec["types"]),
                      tuple(spec.get("patterns") or ()), _ports(spec["inputs"]),
                      _ports(spec["outputs"]), dict(spec.get("attributes") or {}), launchers,
                      dict(spec.get("floor_bytes") or {}), spec["math"],
                      None if spec.get("order") is None else int(spec["order"]),
                      " ".join(str(spec.get("replaces", "")).split()),
                      tuple(spec.get("cuda_types") or spec["types"]))


@functools.cache
def load_contracts(ops_dir: Path = OPS_DIR) -> Contracts:
    """The domain file and every op folder's contract, ops in folder-name order."""
    data = yaml.safe_load((ops_dir / DOMAIN_FILE.name).read_text())
    ops = {}
    for path in sorted(ops_dir.glob(f"*/{CONTRACT_NAME}")):
        c = _op(path.parent.name, yaml.safe_load(path.read_text()))
        ops[c.name] = c
    return Contracts(data["domain"], int(data["version"]), tuple(data["activations"]), ops)


FUSED_DOMAIN = load_contracts().domain


def activation_codes() -> dict[str, int]:
    """The activation codes of the C launchers: name -> position in domain.yaml's list."""
    return {a: i for i, a in enumerate(load_contracts().activations)}


def launcher_argtypes() -> dict[str, list]:
    """ctypes argument types of every op's C launchers (pointers as c_void_p)."""
    import ctypes

    scalar = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}
    return {ln.name: [ctypes.c_void_p if t.endswith("*") else scalar[t] for t, _ in ln.params()]
            for c in load_contracts().ops.values() for ln in c.launchers}


def floor_bytes(node, size_of) -> int:
    """Byte floor of a fused node's memory-bound part (its contract's ``floor_bytes``, float32):
    ``size_of(name)`` gives a tensor's element count (0 when unknown)."""
    c = load_contracts().ops.get(node.op_type)
    if c is None:
        return 0
    ins = list(node.input)
    index = {p.name: i for i, p in enumerate(c.inputs)}
    return 4 * sum(k * (size_of(ins[index[p]]) if index[p] < len(ins) and ins[index[p]] else 0)
                   for p, k in c.floor_bytes.items())


# --- output types -----------------------------------------------------------------------------

_TERM = re.compile(r"(\w+)(\^T)?(?:\[(-?\w+)?:(-?\w+)?\])?")
_COND = re.compile(r"(\w+)\s*(==|!=)\s*(\w+)")


def _attr_value(contract: OpContract, attrs: dict, name: str):
    if name in attrs:  # (a string attribute as onnx reads it: bytes)
        v = attrs[name]
        return v.decode() if isinstance(v, bytes) else v
    if name not in contract.attributes:
        return int(name) if name.lstrip("-").isdigit() else name
    d = contract.attributes[name].get("default")
    if isinstance(d, str) and d in contract.attributes:  # defaults to another attribute
        return _attr_value(contract, attrs, d)
    return d


def _eval_like(contract: OpContract, rule: str, attrs: dict, dims_of_port):
    """One ``like`` rule: the output's (element type, dims) from its inputs', or None; a rule
    that names one port alone returns what ``dims_of_port`` gave for it, as it is.
    ``dims_of_port(port)``: the port's (element type, list of dims, ...) or None; a dim is kept
    as given (a TensorShapeProto.Dimension, or an int / str / None)."""
    expr, _, cond = rule.partition(" if ")
    for part in cond.split(" and ") if cond else ():
        a, op, b = _COND.fullmatch(part.strip()).groups()
        va, vb = _attr_value(contract, attrs, a), _attr_value(contract, attrs, b)
        if (va == vb) != (op == "=="):
            return None
    terms = expr.split("+")
    dims, elem = [], None
    for term in terms:
        port, transpose, start, end = _TERM.fullmatch(term.strip()).groups()
        t = dims_of_port(port)
        sliced = start is not None or end is not None
        if t is None or (not sliced and not transpose and len(terms) == 1):
            return t
        d = list(t[1])
        if transpose:
            if len(d) != 2:
                return None
            d = d[::-1]
        if sliced:
            if not d:
                return None
            lo = None if start is None else int(_attr_value(contract, attrs, start))
            hi = None if end is None else int(_attr_value(contract, attrs, end))
            d = d[lo:hi]
        dims += d
        elem = elem or t[0]
    return elem, dims


def _infer_outputs(node, dims_of) -> list:
    """Per output of a fused node: (element type, dims) by its contract's ``like`` rules from
    ``dims_of(input name)``, or None."""
    import onnx

    contract = load_contracts().ops.get(node.op_type)
    if contract is None:
        return [None] * len(node.output)
    ins = list(node.input)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    index = {p.name: i for i, p in enumerate(contract.inputs)}

    def dims_of_port(port):
        i = index[port]
        return dims_of(ins[i]) if i < len(ins) and ins[i] else None

    out = []
    for i in range(len(node.output)):
        t = None
        for rule in contract.outputs[i].like if i < len(contract.outputs) else ():
            t = _eval_like(contract, rule, attrs, dims_of_port)
            if t is not None:
                break
        out.append(t)
    return out


def infer_output_types(node, type_of) -> list:
    """Tensor types of a fused node's outputs, derived from its inputs' recorded types by the
    outputs' ``like`` rules in its contract.

    ``type_of(name)`` returns an ``onnx.TypeProto`` or None. Returns one TypeProto or None per
    output. Used to record value_info for fused outputs, so that runtimes that plan memory
    from static shapes (onnxruntime-training) can plan the fused op's outputs.
    """
    import onnx

    def dims_of(name):  # (a like rule that names a port alone returns it whole: its TypeProto)
        t = type_of(name)
        return None if t is None else (t.tensor_type.elem_type, t.tensor_type.shape.dim, t)

    out = []
    for t in _infer_outputs(node, dims_of):
        if t is None or len(t) == 3:
            out.append(None if t is None else t[2])
            continue
        tp = onnx.TypeProto()
        tp.tensor_type.elem_type = t[0]
        for dim in t[1]:
            tp.tensor_type.shape.dim.add().CopyFrom(dim)
        out.append(tp)
    return out


def infer_output_shapes(node, shape_of) -> list:
    """The dims of a fused node's outputs (each a list of int / str / None, or None), by the
    same ``like`` rules, from ``shape_of(name)`` (the inputs' dims, or None)."""
    def dims_of(name):
        s = shape_of(name)
        return None if s is None else (0, s)

    return [None if t is None else list(t[1]) for t in _infer_outputs(node, dims_of)]
