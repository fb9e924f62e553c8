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


# --- GPU bindings: fusecli/ops/gpu.py binds launchers by the contract's parameter names -----------

def _fake_library(calls: list):
    """An object with one real ctypes function per contract launcher (a CFUNCTYPE callback built
    from the contract's argtypes) that records the converted arguments and returns 0."""
    import ctypes

    from fusecli.ops.contracts import launcher_argtypes

    class Fake:
        pass

    fake = Fake()
    keep = []
    for name, argtypes in launcher_argtypes().items():
        proto = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)

        def record(*args, _name=name):
            calls.append((_name, list(args)))
            return 0

        fn = proto(record)
        keep.append(fn)
        setattr(fake, name, fn)
    fake.keep = keep
    return fake


class _FakeTensor:
    def __init__(self, address):
        self.address = address

    def data_ptr(self):
        return self.address


@pytest.fixture
def fake_cuda(monkeypatch):
    from fusecli.ops import gpu

    calls = []
    monkeypatch.setattr(gpu, "_LIB", _fake_library(calls))
    return calls


LAUNCHERS = [ln for c in OPS for ln in c.launchers]


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda ln: ln.name)
def test_every_launcher_binds_by_its_contract_names(launcher, fake_cuda):
    """launch() passes each named value to its C parameter, in the contract's order, through
    ctypes with the contract's argtypes: pointers as the tensor's address (None as NULL, a list
    as a host array), ints and floats as they were given."""
    from fusecli.ops.gpu import launch

    named, want = {}, []
    for i, (ctype, name) in enumerate(launcher.params()):
        if ctype.endswith("*"):
            named[name] = _FakeTensor(0x1000 + 64 * i)
            want.append(0x1000 + 64 * i)
        elif ctype == "float":
            named[name] = i + 0.5
            want.append(i + 0.5)
        else:
            named[name] = 3 + i
            want.append(3 + i)
    launch(launcher.name, **named)
    assert fake_cuda == [(launcher.name, want)]

    # NULL pointers and host arrays (the int64_t* dims of AttentionGrad, ...)
    fake_cuda.clear()
    host = {n: [7, 8] for t, n in launcher.params()
            if t.endswith("*") and t.replace("const", "").replace("*", "").strip() == "int64_t"}
    nulls = {n: None for t, n in launcher.params() if t.endswith("*") and n not in host}
    launch(launcher.name, **{**named, **nulls, **host})
    (name, got), = fake_cuda
    for (_, n), value in zip(launcher.params(), got):
        if n in nulls:
            assert value is None, (n, value)
        elif n in host:
            assert value, f"{n}: a host array came through as NULL"


def test_launch_refuses_names_and_values_the_contract_does_not_have(fake_cuda):
    from fusecli.ops.gpu import LaunchError, launch

    ln = LAUNCHERS[0]
    params = ln.params()
    good = {n: (None if t.endswith("*") else 1) for t, n in params}
    with pytest.raises(LaunchError, match=r"unknown parameter\(s\) bogus"):
        launch(ln.name, **good, bogus=1)
    dropped = params[-1][1]
    with pytest.raises(LaunchError, match=rf"missing parameter\(s\) {dropped}"):
        launch(ln.name, **{n: v for n, v in good.items() if n != dropped})
    scalar = next(n for t, n in params if not t.endswith("*"))
    with pytest.raises(LaunchError, match=rf"{scalar} \(.*\) takes a number"):
        launch(ln.name, **{**good, scalar: _FakeTensor(16)})
    with pytest.raises(LaunchError, match="no launcher 'fusecli_launch_nothing'"):
        launch("fusecli_launch_nothing")
    assert fake_cuda == []


def _launch_calls(path: Path) -> list[tuple[int, str | None, set[str], bool]]:
    """(line, launcher name or None when not a literal, keyword names, has **kwargs) of every
    launch(...) call in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "launch":
            first = node.args[0] if node.args else None
            name = first.value if isinstance(first, ast.Constant) else None
            out.append((node.lineno, name, {k.arg for k in node.keywords if k.arg},
                        any(k.arg is None for k in node.keywords)))
    return out


def _binding_problems(op, path: Path) -> list[str]:
    """What in an op's gpu.py disagrees with its contract's launchers."""
    declared = {ln.name: [n for _, n in ln.params()] for ln in op.launchers}
    problems, used = [], set()
    for line, name, keywords, star in _launch_calls(path):
        where = f"{path.relative_to(REPO)}:{line}"
        if name not in declared:
            problems.append(f"{where}: launch({name!r}) is not a launcher of {op.name}'s "
                            f"contract ({', '.join(declared)})")
            continue
        used.add(name)
        if star:
            problems.append(f"{where}: {name} called with **kwargs (name each parameter)")
        params = declared[name]
        extra = sorted(keywords - set(params))
        missing = [p for p in params if p not in keywords and p != "stream"]
        if extra:
            problems.append(f"{where}: {name} has no parameter(s) {', '.join(extra)}")
        if missing:
            problems.append(f"{where}: {name} misses parameter(s) {', '.join(missing)}")
    problems += [f"{path.relative_to(REPO)}: launcher {n} of the contract is never launched"
                 for n in declared if n not in used]
    return problems


@pytest.mark.parametrize("op", OPS, ids=lambda c: c.name)
def test_gpu_wrappers_launch_every_contract_launcher_by_its_names(op):
    """fusecli/ops/<op>/gpu.py launches each launcher its contract declares, naming exactly the
    contract's parameters (stream may be left to torch's current stream); the folder has its
    GPU tests and a bench(add, r) for tests/gpu/bench_cuda.py. (An op without launchers needs
    no gpu.py.)"""
    folder = OPS_DIR / op.folder
    gpu_py = folder / "gpu.py"
    if not op.launchers and not gpu_py.exists():
        return
    assert gpu_py.exists(), f"{op.folder}/gpu.py is missing (its contract declares launchers)"
    assert not _binding_problems(op, gpu_py), "\n".join(_binding_problems(op, gpu_py))
    assert (folder / f"test_{op.folder}_gpu.py").exists(), op.folder
    tree = ast.parse(gpu_py.read_text())
    assert "bench" in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}, op.folder


def test_the_binding_checker_finds_a_wrong_name(tmp_path):
    op = next(c for c in OPS if c.launchers)
    ln = op.launchers[0]
    names = [n for _, n in ln.params() if n != "stream"]
    probe = REPO / "build" / "probe_gpu_binding.py"
    probe.parent.mkdir(exist_ok=True)
    try:
        kw = ", ".join(f"{n}=0" for n in names[1:])
        probe.write_text(f"launch({ln.name!r}, bogus=1, {kw})\nlaunch('fusecli_other', **k)\n")
        found = _binding_problems(op, probe)
        assert any("no parameter(s) bogus" in p for p in found), found
        assert any(f"misses parameter(s) {names[0]}" in p for p in found), found
        assert any("launch('fusecli_other') is not a launcher" in p for p in found), found
        if len(op.launchers) > 1:
            assert any("never launched" in p for p in found), found
    finally:
        probe.unlink()


# --- op names in code outside the op folders ------------------------------------------------------

# The benchmark's per-op measurement code still names ops (section (a)'s GEMM/memory parts per
# op, the synthetic cases of bench/shapes.py, the nested ActivationGrad fusion of the sample
# records); moving it into the op folders is open work (issue 20). Nothing else may name one.
OP_NAMING_EXEMPT = {"fusecli/bench/ops.py": "section (a)'s per-op parts",
                    "fusecli/bench/shapes.py": "the synthetic per-op cases (e, f)",
                    "fusecli/bench/samples.py": "the nested ActivationGrad fusion records"}


def _op_names_in_code(path: Path) -> list[str]:
    """String constants (docstrings aside) that are an op name or start with `<op>/` (a kernel
    counter), with their line."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    return [f"{path.relative_to(REPO)}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
            and (n.value in OP_NAMES or n.value.split("/")[0] in OP_NAMES)]


def _code_outside_op_folders() -> list[Path]:
    """The package's modules outside the op folders, the test helpers (tests/*.py that are not
    test modules: shared by every op's tests) and the scripts."""
    folders = {OPS_DIR / c.folder for c in OPS}
    return sorted([p for p in (REPO / "fusecli").rglob("*.py")
                   if not folders.intersection(p.parents)]
                  + [p for p in (REPO / "tests").glob("*.py") if not p.name.startswith("test_")]
                  + list((REPO / "scripts").rglob("*.py")) + [REPO / "conftest.py"])


def test_no_op_named_in_code_outside_its_folder():
    """Which op does what is in its folder (contract, kernels, reference, shapes.py, gpu.py, its
    own test helpers): no package module outside the op folders, no shared test helper and no
    script compares or builds by an op's name (except the benchmark's listed modules), so adding
    or removing an op changes no such copy."""
    found = [hit for p in _code_outside_op_folders()
             if str(p.relative_to(REPO)) not in OP_NAMING_EXEMPT for hit in _op_names_in_code(p)]
    assert not found, "\n".join(found)
    for rel in OP_NAMING_EXEMPT:  # the exemptions are still needed (none goes stale)
        assert _op_names_in_code(REPO / rel), f"{rel} names no op any more: drop its exemption"


def test_the_op_name_checker_finds_a_name(tmp_path):
    op = OPS[0].name
    probe = REPO / "build" / "probe_op_name.py"
    probe.parent.mkdir(exist_ok=True)
    try:
        probe.write_text(f'"""{op} in a docstring is fine."""\n\nif x == {op!r}:\n    pass\n'
                         f'y = "{op}/counter"\n')
        found = _op_names_in_code(probe)
        assert sorted(h.split(":")[1] for h in found) == ["3", "5"], found
    finally:
        probe.unlink()


def test_input_shape_checks_are_the_op_folders():
    """The shape guard's input checks are each folder's shapes.input_problem (found through the
    contracts), and an op without one has none."""
    import importlib

    from fusecli.engine.shapes import input_problem
    from fusecli.ops.shapes import input_check

    with_check = [c for c in OPS if (OPS_DIR / c.folder / "shapes.py").exists()]
    assert with_check, "no op folder has a shapes.py"
    for c in OPS:
        mod = f"fusecli.ops.{c.folder}.shapes"
        want = importlib.import_module(mod).input_problem if c in with_check else None
        assert input_check(c.name) is want, c.name
    assert input_check("NotAnOp") is None and input_problem("NotAnOp", {}, [[1]], []) is None


# --- onnxruntime-training tests are marked `ortt` (make test-arm64 deselects them) ------------

def _ortt_unmarked(source: str) -> list[str]:
    """Test functions that call run_in_ortt (onnxruntime-training, x86-64 only) without the
    `ortt` mark."""
    bad = []
    for fn in ast.parse(source).body:
        if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")):
            continue
        calls = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                    and n.func.id == "run_in_ortt" for n in ast.walk(fn))
        marked = any(isinstance(d, ast.Attribute) and d.attr == "ortt"
                     for d in fn.decorator_list)
        if calls and not marked:
            bad.append(fn.name)
    return bad


@pytest.mark.parametrize("path", sorted(OPS_DIR.glob("*/test_*.py")), ids=lambda p: p.name)
def test_ortt_kernel_tests_are_marked(path):
    assert _ortt_unmarked(path.read_text()) == []


def test_the_ortt_mark_checker_finds_an_unmarked_test():
    src = ("import pytest\n"
           "@pytest.mark.ortt\ndef test_a():\n    run_in_ortt([])\n"
           "def test_b():\n    check(lambda j: run_in_ortt(j))\n"
           "def test_c():\n    run_fused()\n")
    assert _ortt_unmarked(src) == ["test_b"]
