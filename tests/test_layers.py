"""The package's plan (docs/architecture.md): every module's fusecli imports respect the layers,
imports run one way (no cycle), and the engine touches neither onnxruntime nor files.

Layers, lowest first; a module may import its own layer and any layer below it:
  errors -> ops (contracts, references) -> engine -> io -> runtime -> api -> report
  -> commands / bench
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "fusecli"
LAYERS = ["errors", "ops", "engine", "io", "runtime", "api", "report", "commands"]
RANK = {name: i for i, name in enumerate(LAYERS)}
RANK["bench"] = RANK["commands"]       # the benchmark suite (make bench) sits beside the commands
RANK["__main__"] = RANK["commands"]    # python -m fusecli
# modules that must not import these, wherever the import sits (module level or in a function)
FORBIDDEN = {
    "engine": {"onnxruntime", "subprocess", "click"},
    "io": {"onnxruntime", "subprocess", "click"},
    "ops": {"onnxruntime", "click"},
    "runtime": {"click"},
    "api": {"click"},
    "report": {"click"},
}
# scripts run by another interpreter (.venv-ortt): stdlib, numpy and onnxruntime only
STANDALONE = {"fusecli.runtime.runtime_worker", "fusecli.runtime.bench_worker"}


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG.parent).with_suffix("")
        if "csrc" in rel.parts or rel.name.startswith("test_"):
            continue            # the op-table generator (build time) and the op folders' tests
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None     # "fusecli" itself: the lazy facade


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, absolute."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import (write it absolute)"
            base = node.module or ""
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append((full if full in MODULES else base, node.lineno))
    return out


def test_every_module_is_in_a_layer():
    for module in MODULES:
        layer = _layer(module)
        assert layer is None or layer in RANK, f"{module}: not in a layer {sorted(RANK)}"


def _violations(module: str, path: Path) -> list[str]:
    """What in ``path`` (the source of ``module``) imports against the layers."""
    layer, out = _layer(module), []
    for imported, line in _imports(path):
        top = imported.split(".")[0]
        if top in FORBIDDEN.get(layer, ()):
            out.append(f"{module}:{line} imports {imported}: the {layer} layer must not")
        if module in STANDALONE:
            if top == "fusecli" and imported != "fusecli.runtime.runtime_worker":
                out.append(f"{module}:{line}: a standalone worker imports {imported}")
            continue
        if top != "fusecli":
            continue
        target = _layer(imported)
        if target is None:
            out.append(f"{module}:{line} imports the facade `fusecli`; import the module")
        elif RANK[target] > RANK[layer]:
            out.append(f"{module}:{line} imports {imported}: {layer} may not import {target} "
                       f"(layers: {LAYERS})")
    return out


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m)))
def test_imports_respect_the_layers(module):
    assert _violations(module, MODULES[module]) == []


def test_no_import_cycle():
    graph = {m: {i for i, _ in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}
    graph["fusecli"] = set()            # the facade imports lazily, by name
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_the_checker_catches_a_wrong_way_import(tmp_path):
    """The check above is not vacuous: an engine module importing the runtime, onnxruntime or
    the facade is reported, line by line."""
    bad = tmp_path / "bad.py"
    bad.write_text("from fusecli.runtime.library import library_path\nimport onnxruntime\n"
                   "from fusecli import optimize\n")
    found = _violations("fusecli.engine.bad", bad)
    assert [v.split(" ")[0] for v in found] == ["fusecli.engine.bad:1", "fusecli.engine.bad:2",
                                                "fusecli.engine.bad:3"], found
    assert _violations("fusecli.commands.bad", bad) == [
        "fusecli.commands.bad:3 imports the facade `fusecli`; import the module"]


def test_version_needs_no_onnx():
    """`fusecli --version` and `--help` import neither onnx nor numpy (start-up time)."""
    code = ("import sys\nfrom fusecli.commands.main import cli\n"
            "bad = sorted(m for m in ('onnx', 'numpy', 'onnxruntime', 'yaml') if m in sys.modules)\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing the CLI pulled in {out.stdout.strip()}"
