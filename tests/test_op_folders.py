"""One fused op = one folder (fusecli/ops/<op>/), its contract.yaml the single source.

What derives from the contracts is generated (C++ op tables, attributes, launcher prototypes,
registration) or read at run time (patterns, output types, argtypes, byte floors, references).
These tests fail when what is still written by hand disagrees with a contract, and when an op
or pattern list is written out again outside the contracts (tests/test_contracts.py checks the
rest: launcher definitions, reference signatures, rule patterns, activation codes, the built
library).
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from fusecli import CANONICAL_PATTERNS
from fusecli.ops.contracts import OPS_DIR, load_contracts
from fusecli.ops.reference import reference_ops

REPO = Path(__file__).resolve().parents[1]
CONTRACTS = load_contracts()
OPS = list(CONTRACTS.ops.values())
OP_NAMES = set(CONTRACTS.ops)
PATTERNS = set(CANONICAL_PATTERNS)
CXX = ("*.cc", "*.h", "*.cu", "*.cuh")

# A literal list/tuple/set/dict holding this many op names or pattern names is a copy of the
# registry (a test that asserts a few specific results names fewer).
COPY_THRESHOLD = 4


def _op_sources(op) -> list[Path]:
    folder = OPS_DIR / op.folder
    return sorted(p for pat in CXX for p in folder.glob(pat))


def _python_files() -> list[Path]:
    skip = {".venv", ".venv-ortt", "build", ".git", "dist"}
    return sorted(p for p in REPO.rglob("*.py")
                  if not skip.intersection(p.relative_to(REPO).parts[:1]))


def test_every_op_folder_registers_through_the_generated_registry():
    """op_registry.cc (generated) calls add_<folder>_cpu_ops / add_<folder>_cuda_ops: each
    folder defines exactly those, registering a FusedOp of its kernel (its name, signature,
    in-place pairs and float16 variant come from op_tables.h)."""
    for op in OPS:
        folder = OPS_DIR / op.folder
        for file, fn in (("cpu.cc", f"add_{op.folder}_cpu_ops"),
                         ("cuda_op.cc", f"add_{op.folder}_cuda_ops")):
            text = (folder / file).read_text()
            assert re.search(rf"void {fn}\(Ort::CustomOpDomain& domain\)", text), (op.name, file)
            assert "add_op<FusedOp<" in text and "SigOp<" not in text, (op.name, file)


@pytest.mark.parametrize("op", OPS, ids=lambda c: c.name)
def test_kernels_read_attributes_through_the_contract(op):
    """No attr_int/attr_float/attr_string/attr_ints call in an op folder: the attributes,
    their types and defaults are OpAttrs<k<Op>> (op_attrs.h, generated from the contract)."""
    for path in _op_sources(op):
        calls = re.findall(r"\battr_(?:int|float|string|ints|act)\s*\(", path.read_text())
        assert not calls, f"{path.relative_to(REPO)} reads attributes by hand: {calls}"


@pytest.mark.parametrize("op", OPS, ids=lambda c: c.name)
def test_op_folder_sources_name_only_their_own_op(op):
    """An op folder's C++ uses its own op id only (k<Op> of another contract there would
    register or count the wrong op)."""
    others = {f"k{c.name}" for c in OPS if c.name != op.name}
    for path in _op_sources(op):
        used = set(re.findall(r"\bk[A-Z]\w*Grad\b", path.read_text())) & others
        assert not used, f"{path.relative_to(REPO)} uses {sorted(used)}"


@pytest.mark.parametrize("op", OPS, ids=lambda c: c.name)
def test_reference_defaults_agree_with_the_contract(op):
    """A default the NumPy reference writes for an attribute is the contract's default."""
    cls = next(r for r in reference_ops() if r.__name__ == op.name)
    params = inspect.signature(cls._run).parameters
    for name, spec in op.attributes.items():
        d = params[name].default
        if d is None or d is inspect.Parameter.empty:
            continue
        want = spec.get("default")
        if isinstance(want, str) and want in op.attributes:
            want = None  # defaults to another attribute: the reference must say None
        assert d == want, f"{op.folder}/reference.py: {name}={d!r}, contract says {want!r}"


def test_reference_registry_is_the_contract_list():
    assert [r.__name__ for r in reference_ops()] == [c.name for c in OPS]


def _literal_copies(path: Path) -> list[str]:
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        strings = {e.value for e in items if isinstance(e, ast.Constant)
                   and isinstance(e.value, str)}
        for kind, names in (("pattern", PATTERNS), ("op", OP_NAMES)):
            hit = strings & names
            if len(hit) >= min(COPY_THRESHOLD, len(names)):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {kind} names "
                             f"{sorted(hit)}")
    return found


def test_no_literal_copy_of_the_op_or_pattern_list():
    """The op list and the pattern list are written once, in the contracts
    (fusecli.CANONICAL_PATTERNS / load_contracts().ops); no Python file spells them out."""
    copies = [c for p in _python_files() for c in _literal_copies(p)]
    assert not copies, "\n".join(copies)


def test_no_literal_copy_in_yaml_or_shell():
    """Nor a YAML flow list or shell word list outside the op folders (rules name one pattern
    each; manifests count per pattern, which is data about a graph, not a list to keep)."""
    skip = {".venv", ".venv-ortt", "build", ".git", "dist", "corpus", "samples"}
    bad = []
    for path in sorted([*REPO.rglob("*.yaml"), *REPO.rglob("*.sh"), REPO / "Makefile"]):
        rel = path.relative_to(REPO)
        if skip.intersection(rel.parts[:1]) or rel.parts[:2] == ("fusecli", "ops"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            words = set(re.findall(r"[A-Za-z_]\w*", line))
            for names in (PATTERNS, OP_NAMES):
                if len(words & names) >= min(COPY_THRESHOLD, len(names)):
                    bad.append(f"{rel}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_the_checker_finds_a_copy():
    """The copy detector itself: a literal list of the patterns is found, a short one is not."""
    probe = REPO / "build" / "probe_literal_copy.py"
    probe.parent.mkdir(exist_ok=True)
    try:
        probe.write_text(f"A = {list(CANONICAL_PATTERNS)!r}\nB = {{'sdpa': 1}}\n"
                         f"C = {tuple(c.name for c in OPS)!r}\n")
        found = _literal_copies(probe)
        assert len(found) == 2 and ":1: pattern" in found[0] and ":3: op" in found[1], found
    finally:
        probe.unlink()


def _generator():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gen_op_tables", REPO / "fusecli" / "csrc" / "gen_op_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_attributes_follow_the_contracts():
    """op_attrs.h: one OpAttrs<k<Op>> per contract, reading every attribute by its name."""
    text = _generator().generate(CONTRACTS)["op_attrs.h"]
    for op in OPS:
        block = re.search(rf"struct OpAttrs<k{op.name}> \{{(.*?)\n\}};", text, re.S)
        assert block, op.name
        read = re.findall(r'attr_\w+\(info, "(\w+)"', block.group(1))
        assert read == list(op.attributes), (op.name, read)


def test_generator_refuses_an_attribute_it_cannot_type():
    contracts = load_contracts()
    op = next(c for c in OPS if c.attributes)
    bad = dict(op.attributes)
    bad["x"] = {"type": "tensor"}
    broken = type(contracts)(contracts.domain, contracts.version, contracts.activations,
                             {**contracts.ops, op.name: type(op)(**{**op.__dict__,
                                                                    "attributes": bad})})
    with pytest.raises(SystemExit, match="attribute x: type 'tensor'"):
        _generator().generate(broken)
