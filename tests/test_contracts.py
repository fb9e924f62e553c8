"""The op contracts (fusecli/ops/<op>/contract.yaml) are the single source of every op fact: what
is still written by hand elsewhere (launcher definitions, reference adapters, rule patterns,
activation switches, the built library's op names) must agree with them, and the generator
refuses contracts it cannot turn into consistent C++."""

from __future__ import annotations

import ctypes
import inspect
import re
import shutil
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from fusecli import CANONICAL_PATTERNS
from fusecli.runtime import library
from fusecli.io.rulefiles import load_rules
from fusecli.ops.contracts import (OPS_DIR, activation_codes, infer_output_types, launcher_argtypes,
                               load_contracts)
from fusecli.ops.reference import reference_ops

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "fusecli" / "csrc"
CONTRACTS = load_contracts()
OPS = list(CONTRACTS.ops.values())


def _generator():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_op_tables", CSRC / "gen_op_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _c_types(params: str) -> list[str]:
    """C parameter list -> normalized types ("const float*", "int64_t", ...)."""
    out = []
    for p in params.split(","):
        p = re.sub(r"/\*.*?\*/", "", p).replace("__restrict__", "")
        words = p.replace("*", " * ").split()[:-1]  # drop the parameter name
        out.append(" ".join(words).replace(" *", "*"))
    return out


def test_every_op_folder_has_its_files():
    for c in OPS:
        folder = OPS_DIR / c.folder
        for name in ("contract.yaml", "reference.py", "cpu.cc", "cuda.cu", "cuda_op.cc",
                     f"test_{c.folder}.py"):
            assert (folder / name).is_file(), f"{c.name}: {folder / name} is missing"


@pytest.mark.parametrize("op", OPS, ids=lambda c: c.name)
def test_launcher_definitions_match_the_contract(op):
    """Each `FUSECLI_EXPORT int fusecli_...(...)` in the op's cuda.cu is a launcher its contract
    declares, with the same parameter types (nvcc also checks this against the generated
    prototypes, but only where CUDA is built)."""
    text = (OPS_DIR / op.folder / "cuda.cu").read_text()
    defined = {m.group(1): _c_types(m.group(2)) for m in
               re.finditer(r"FUSECLI_EXPORT\s+int\s+(\w+)\(([^)]*)\)\s*\{", text)}
    declared = {ln.name: _c_types(ln.args) for ln in op.launchers}
    assert defined == declared


def test_launcher_argtypes_follow_the_c_types():
    types = launcher_argtypes()
    for c in OPS:
        for ln in c.launchers:
            assert len(types[ln.name]) == len(_c_types(ln.args))
            for t, arg in zip(_c_types(ln.args), types[ln.name]):
                assert (arg is ctypes.c_void_p) == t.endswith("*"), (ln.name, t)


@pytest.mark.parametrize("op", OPS, ids=lambda c: c.name)
def test_reference_adapter_takes_the_contract_ports(op):
    """Reference._run(self, <one parameter per input, in port order>, <the attributes>)."""
    cls = next(r for r in reference_ops() if r.__name__ == op.name)
    params = list(inspect.signature(cls._run).parameters)[1:]
    n_in = len(op.inputs)
    assert len(params) == n_in + len(op.attributes)
    assert [p.lower() for p in params[:n_in]] == [p.name.lower() for p in op.inputs]
    assert set(params[n_in:]) == set(op.attributes)
    assert cls.op_domain == CONTRACTS.domain


@pytest.mark.parametrize("op", OPS, ids=lambda c: c.name)
def test_every_output_type_is_inferred(op):
    """With every input typed, each output gets a type from its `like` rules."""
    ins = [f"in_{p.name}" for p in op.inputs]
    node = helper.make_node(op.name, ins, [f"out_{p.name}" for p in op.outputs],
                            domain=CONTRACTS.domain)
    types = {n: helper.make_tensor_type_proto(TensorProto.FLOAT, [3, 5]) for n in ins}
    got = infer_output_types(node, types.get)
    assert all(isinstance(t, onnx.TypeProto) for t in got), [p.name for p, t in
                                                              zip(op.outputs, got) if t is None]


def test_shipped_rules_use_contract_pattern_names():
    """A rule's `pattern:` is one its fused op's contract lists (or, for an op that lists none,
    the op's folder name), so the pattern names live in the contracts alone."""
    rules = load_rules(REPO / "rules")   # expanded: parameterised files give one rule per variant
    assert rules
    for rule in rules:
        op = CONTRACTS.ops[rule.replace.op]
        allowed = set(op.patterns) or {op.folder}
        assert rule.pattern in allowed, f"{rule.source}: {rule.pattern!r} not in {allowed}"


def test_canonical_pattern_order_comes_from_the_contracts():
    """Each op that lists patterns has its own `order` (the canonical order of statistics,
    --json and the CI gate is by it); pattern names are unique across ops."""
    with_patterns = [c for c in OPS if c.patterns]
    assert all(isinstance(c.order, int) for c in with_patterns), \
        [c.name for c in with_patterns if c.order is None]
    orders = [c.order for c in with_patterns]
    assert len(set(orders)) == len(orders), orders
    listed = [p for c in OPS for p in c.patterns]
    assert len(set(listed)) == len(listed), listed
    by_order = sorted(with_patterns, key=lambda c: c.order)
    assert CONTRACTS.patterns == tuple(p for c in by_order for p in c.patterns)
    assert CANONICAL_PATTERNS == CONTRACTS.patterns


def test_activations_are_the_domain_codes_everywhere():
    codes = activation_codes()
    assert list(codes.values()) == list(range(len(codes)))
    for c in OPS:
        values = (c.attributes.get("activation") or {}).get("values") or []
        assert set(values) <= set(codes), c.name
    cpu = (CSRC / "cpu_activation.cc").read_text()
    cuda = (CSRC / "cuda_common.cuh").read_text()
    gen = _generator()
    for a in codes:
        assert f"Act::k{gen.camel(a)}" in cpu, f"cpu_activation.cc has no case for {a}"
        assert f"k{gen.camel(a)} = FUSECLI_ACT_{a.upper()}" in cuda, f"cuda_common.cuh: {a}"


def test_built_library_registers_every_contract_op():
    """The built .so counts calls of exactly the contracts' ops, and (CUDA build) exports
    exactly the contracts' launchers."""
    library.reset_kernel_calls()
    for c in OPS:
        assert library.kernel_calls(c.name) == 0, c.name
    lib = ctypes.CDLL(library.library_path())
    lib.fusecli_has_cuda.restype = ctypes.c_int
    if lib.fusecli_has_cuda():
        for name in launcher_argtypes():
            assert hasattr(lib, name), name


def _broken_copy(tmp_path, op_folder, edit):
    ops = tmp_path / "ops"
    shutil.copytree(OPS_DIR, ops, ignore=shutil.ignore_patterns("*.py", "*.cc", "*.cu", "*.h",
                                                                "__pycache__"))
    path = ops / op_folder / "contract.yaml"
    path.write_text(edit(path.read_text()))
    return load_contracts.__wrapped__(ops)


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.replace("inplace_over: [dY]", "inplace_over: [dQ]"), "not an input"),
    (lambda s: s.replace("values: [relu, gelu, gelu_tanh, silu]",
                         "values: [relu, gelu, gelu_tanh, silu, mish]"), "not in domain.yaml"),
    (lambda s: s.replace("types: [float32, float16]\n", "types: [float32, float16, bfloat16]\n"),
     "types lists bfloat16"),
    (lambda s: s.replace("cuda_types: [float32, float16, bfloat16]",
                         "cuda_types: [float16, bfloat16]"), "must list float32"),
    (lambda s: s.replace("cuda_types: [float32, float16, bfloat16]",
                         "cuda_types: [float32, float8]"), "must list float32"),
])
def test_generator_refuses_inconsistent_contracts(tmp_path, edit, message):
    contracts = _broken_copy(tmp_path, "activation_grad", edit)
    with pytest.raises(SystemExit, match=message):
        _generator().generate(contracts)


def test_generator_output_follows_the_contracts():
    """The generated tables list the ops in contract order with their port counts and pairs."""
    files = _generator().generate(CONTRACTS)
    tables = files["op_tables.h"]
    names = re.search(r"kOpNames\[kNumOps\] = \{(.*?)\};", tables).group(1)
    assert names == ", ".join(f'"{c.name}"' for c in OPS)
    for c in OPS:
        assert f"{{{len(c.inputs)}, {len(c.outputs)}, " in tables
        registry = files["op_registry.cc"]
        assert f"void add_{c.folder}_cpu_ops(Ort::CustomOpDomain& domain);" in registry
        for ln in c.launchers:
            assert f"int {ln.name}({ln.args});" in files["op_launchers.h"]
    bits = {"float32": 1, "float16": 2, "bfloat16": 4}
    for table, key in (("kOpCpuTypes", "types"), ("kOpCudaTypes", "cuda_types")):
        row = re.search(rf"{table}\[kNumOps\] = \{{(.*?)\}};", tables).group(1)
        want = ", ".join(f"{sum(bits[t] for t in getattr(c, key))}u /* {c.name} */" for c in OPS)
        assert row == want, table
