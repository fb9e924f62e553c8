from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "samples"
FUSECLI = Path(sys.executable).parent / "fusecli"
ORTT_PYTHON = REPO / ".venv-ortt" / "bin" / "python"


def run_cli(*args, check_rc: int | None = 0, **kw) -> subprocess.CompletedProcess:
    """Run the real `fusecli` console script."""
    proc = subprocess.run([str(FUSECLI), *map(str, args)], capture_output=True, text=True, **kw)
    if check_rc is not None:
        assert proc.returncode == check_rc, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def cli_in_process(*argv) -> tuple[int, str]:
    """fusecli's main() in-process (the console script's entry point, without a process start:
    a few dozen runs take seconds): (exit code, stderr). Signal handlers are restored after."""
    import contextlib
    import io
    import signal

    from fusecli.commands.main import main

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main([str(a) for a in argv])
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    return rc, err.getvalue()


def exit_0_or_one_line(rc: int, err: str) -> None:
    """A run ended in exit 0, or in exit 2 with ONE 'fusecli: error:' line (no traceback)."""
    assert rc in (0, 2), (rc, err)
    if rc == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("fusecli: error: "), err


def run_cli_json(*args) -> dict:
    proc = run_cli(*args, "--json")
    return json.loads(proc.stdout)


# --- property tests (hypothesis): the same examples on every run, unless exploring -------------
# `make test` runs the profile "ci": derandomized (the examples are a function of the test's
# code, so one commit draws the same set on every run and machine) and no example database
# (nothing carries over from an earlier run). `make fuzz` runs "fuzz": a random seed, and
# FUSECLI_FUZZ_EXAMPLES examples per property (fuzz_examples). docs/testing.md.
def _hypothesis_profiles() -> None:
    try:
        from hypothesis import settings
    except ImportError:        # only the property tests need it
        return
    settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
    settings.register_profile("fuzz", derandomize=False, database=None, print_blob=True)
    settings.load_profile(os.environ.get("FUSECLI_HYPOTHESIS_PROFILE", "ci"))


_hypothesis_profiles()


def fuzz_examples(ci: int) -> int:
    """A property test's example count: ``ci`` under `make test`, FUSECLI_FUZZ_EXAMPLES under
    `make fuzz` (the profile "fuzz")."""
    if os.environ.get("FUSECLI_HYPOTHESIS_PROFILE") == "fuzz":
        return int(os.environ.get("FUSECLI_FUZZ_EXAMPLES", "2000"))
    return ci


@pytest.fixture(scope="session")
def manifest() -> dict:
    from fusecli.runtime.feeds import load_manifest

    return load_manifest()


@pytest.fixture(scope="session")
def ortt_python() -> str:
    if not ORTT_PYTHON.exists():
        pytest.fail("the onnxruntime-training environment is missing: run `make ortt-env`")
    return str(ORTT_PYTHON)


# --- CPU time per test (FUSECLI_TEST_CPU=FILE): user + system seconds of the test's process and
# of the child processes it waited for, appended as JSON lines. Unlike --durations' wall times
# it does not grow when the machine is shared, which is what sizing the suite for CI needs.
_CPU_LOG = os.environ.get("FUSECLI_TEST_CPU")


def _cpu_now() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


if _CPU_LOG:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        t0, w0 = _cpu_now(), time.perf_counter()
        yield
        with open(_CPU_LOG, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "cpu_s": round(_cpu_now() - t0, 3),
                                "wall_s": round(time.perf_counter() - w0, 3)}) + "\n")


class Lazy(dict):
    """A dict that computes a missing key's value on first use: a module fixture that prepares
    one entry per parametrized case (a fused corpus graph, ...) prepares, in each pytest-xdist
    worker, only the cases that worker runs."""

    def __init__(self, make):
        super().__init__()
        self._make = make

    def __missing__(self, key):
        value = self[key] = self._make(key)
        return value


def fused_corpus(out_dir: Path, corpus: Path, manifest: dict) -> Lazy:
    """{graph: (fused path, stats)}: one in-process FusionPass per graph of ``manifest`` (files
    under ``corpus``), saved under ``out_dir``, made when a test first asks for that graph."""
    import onnx

    from fusecli import FusionPass

    def fuse(name):
        e = manifest[name]
        m = onnx.load(corpus / e["file"])
        fp = FusionPass()
        fp.run(m)
        path = out_dir / e["file"]
        onnx.save(m, path)
        return path, fp.stats

    return Lazy(fuse)


def grouped(group: str, value, *marks):
    """A parameter whose tests pytest-xdist runs on one worker (``--dist loadgroup``), so that a
    Lazy entry they share is made once."""
    return pytest.param(value, marks=[pytest.mark.xdist_group(group), *marks])
