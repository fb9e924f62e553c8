"""The installed tool: a wheel built from a clean clone of this repository (HEAD), installed into
a fresh venv, fuses and verifies samples with the clone deleted - rules, contracts and the
custom-op library come from the installed package, the onnxruntime-training runtime from
FUSECLI_ORTT_PYTHON, nothing from a checkout. And the sdist holds everything a wheel build
needs (the build scripts and every tracked file of the package), and no binary.

The wheel is built CPU-only (FUSECLI_CUDA=0) to keep this test short: the CUDA kernels are
compiled by `make lib` (the same scripts/build_lib.sh, run before the tests) and run by
tests/gpu/ on a GPU machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections import Counter

import onnx
import pytest

from conftest import ORTT_PYTHON, REPO, SAMPLES
from fusecli.errors import FuseError
from fusecli.runtime.library import training_python


def _run(cmd, rc: int = 0, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert proc.returncode == rc, (cmd, proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def _fused_ops(path) -> Counter:
    return Counter(n.op_type for n in onnx.load(path).graph.node if n.domain == "com.fusecli")


def _kernels_executed(verify_stdout: str) -> Counter:
    m = re.search(r"^\s*fused kernels executed: (.+)$", verify_stdout, re.M)
    assert m, verify_stdout
    return Counter({op: int(k) for op, k in re.findall(r"(\w+) x(\d+)", m.group(1))})


def _clean_clone(tmp_path):
    head = _run(["git", "-C", REPO, "rev-parse", "HEAD"]).stdout.strip()
    clone = tmp_path / "clone"
    _run(["git", "clone", "-q", "--no-checkout", REPO, clone])
    _run(["git", "-C", clone, "checkout", "-q", head])
    assert not (clone / "build").exists() and not list(clone.glob("fusecli/lib/*.so"))
    return clone


def test_sdist_holds_what_a_wheel_build_needs(tmp_path):
    clone = _clean_clone(tmp_path)
    build_venv = tmp_path / "build-venv"     # the build backend the sdist declares
    _run([sys.executable, "-m", "venv", build_venv])
    _run([build_venv / "bin" / "python", "-m", "pip", "install", "-q", "setuptools>=70.1"])
    _run([build_venv / "bin" / "python", "-c",
          "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])",
          tmp_path / "dist"], cwd=clone)
    (sdist,) = (tmp_path / "dist").glob("fusecli-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    tracked = _run(["git", "-C", clone, "ls-files"]).stdout.split()
    needed = {"setup.py", "pyproject.toml", "scripts/build_lib.sh", "scripts/fetch_deps.sh"}
    needed |= {f for f in tracked if f.startswith(("fusecli/", "rules/"))}
    needed -= {"fusecli/shipped_rules"}          # the link: its files are in the sdist, below
    needed |= {f"fusecli/shipped_rules/{f.removeprefix('rules/')}" for f in tracked
               if f.startswith("rules/")}
    assert not needed - names, sorted(needed - names)
    assert not [n for n in names if n.endswith(".so") or n.startswith("build/")]


def test_wheel_from_clean_clone_works_with_the_clone_deleted(tmp_path):
    clone = _clean_clone(tmp_path)

    build_env = dict(os.environ, FUSECLI_CUDA="0", FUSECLI_NATIVE="0")
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels, clone],
         env=build_env, cwd=tmp_path)
    (wheel,) = wheels.glob("fusecli-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q",
          "-c", REPO / "scripts" / "constraints.txt", wheel], cwd=tmp_path)
    shutil.rmtree(clone)

    work = tmp_path / "work"      # the models alone: no manifest, no parameters, no checkout
    work.mkdir()
    for name in ("torch_mlp", "ortt_mlp"):
        shutil.copy(SAMPLES / f"{name}.onnx", work)
    env = {k: v for k, v in os.environ.items() if k != "FUSECLI_ORTT_PYTHON"}
    fusecli = venv / "bin" / "fusecli"

    lib = _run([fusecli, "library-path"], cwd=work, env=env).stdout.strip()
    assert lib.startswith(str(venv)) and os.path.isfile(lib)
    assert "linear_gelu_torch" in _run([fusecli, "rules", "list"], cwd=work, env=env).stdout
    assert "LayerNormGrad" in _run([fusecli, "ops"], cwd=work, env=env).stdout

    for name, run_env in (("torch_mlp", env),
                          ("ortt_mlp", dict(env, FUSECLI_ORTT_PYTHON=str(ORTT_PYTHON)))):
        fused = work / f"{name}.fused.onnx"
        report = json.loads(_run([fusecli, "optimize", f"{name}.onnx", "-o", fused, "--json"],
                                 cwd=work, env=env).stdout)
        ops = _fused_ops(fused)
        assert report["total_fused"] > 0 and sum(ops.values()) == report["total_fused"]
        proc = _run([fusecli, "verify", f"{name}.onnx", fused], cwd=work, env=run_env)
        assert "PASS" in proc.stdout, proc.stdout
        assert _kernels_executed(proc.stdout) == ops, proc.stdout

    # without FUSECLI_ORTT_PYTHON, and with no .venv-ortt beside the work folder, the installed
    # tool says where it looks instead of reaching into a checkout
    proc = _run([fusecli, "verify", "ortt_mlp.onnx", "ortt_mlp.fused.onnx"], rc=2, cwd=work,
                env=env)
    assert "FUSECLI_ORTT_PYTHON" in proc.stderr and "Traceback" not in proc.stderr


def test_training_runtime_lookup_order(tmp_path, monkeypatch):
    def fake_venv(folder):
        py = folder / ".venv-ortt" / "bin" / "python"
        py.parent.mkdir(parents=True)
        py.write_text("")
        py.chmod(0o755)                              # an interpreter is executable
        return str(py)

    outer = fake_venv(tmp_path)                      # a .venv-ortt in a parent folder
    inner_dir = tmp_path / "project" / "sub"
    inner_dir.mkdir(parents=True)
    monkeypatch.chdir(inner_dir)
    monkeypatch.delenv("FUSECLI_ORTT_PYTHON", raising=False)
    assert training_python() == outer
    inner = fake_venv(inner_dir)                     # the current folder wins over parents
    assert training_python() == inner
    env = fake_venv(tmp_path / "elsewhere")
    monkeypatch.setenv("FUSECLI_ORTT_PYTHON", env)   # the variable wins over folders
    assert training_python() == env
    assert training_python(outer) == outer           # --runtime-python wins over everything
    missing = str(tmp_path / "nope")                 # a wrong setting is an error, not a skip
    with pytest.raises(FuseError, match="--runtime-python .* does not exist"):
        training_python(missing)
    monkeypatch.setenv("FUSECLI_ORTT_PYTHON", missing)
    with pytest.raises(FuseError, match="FUSECLI_ORTT_PYTHON .* does not exist"):
        training_python()
