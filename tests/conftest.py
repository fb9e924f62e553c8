from __future__ import annotations

import json
import subprocess
import sys
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
