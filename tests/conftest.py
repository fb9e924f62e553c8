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


def run_cli_json(*args) -> dict:
    proc = run_cli(*args, "--json")
    return json.loads(proc.stdout)


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


def grouped(group: str, value, *marks):
    """A parameter whose tests pytest-xdist runs on one worker (``--dist loadgroup``), so that a
    Lazy entry they share is made once."""
    return pytest.param(value, marks=[pytest.mark.xdist_group(group), *marks])
