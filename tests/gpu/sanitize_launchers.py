"""The driver compute-sanitizer runs (tests/gpu/run_gpu_checks.sh): the FIRST case of every GPU
test function (fusecli/ops/*/test_*_gpu.py, tests/gpu/test_*_gpu.py: the smallest shapes come
first in their parameter lists), in one process, then the list of the contracts' launchers that
were called and of those that were not (a launcher never called is reported, and fails the run).

Usage: compute-sanitizer --tool memcheck python tests/gpu/sanitize_launchers.py"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import pytest  # noqa: E402

import fusecli.ops.gpu as gpu  # noqa: E402

CALLED: set[str] = set()
_launch = gpu.launch


def _recording_launch(name, **named):
    CALLED.add(name)
    return _launch(name, **named)


# before any op's gpu.py is imported (they bind `launch` at import time)
gpu.launch = _recording_launch


class FirstCaseOfEachTest:
    def pytest_collection_modifyitems(self, session, config, items):
        seen, keep = set(), []
        for it in items:
            key = (str(it.path), getattr(it, "originalname", it.name))
            if key not in seen:
                seen.add(key)
                keep.append(it)
        items[:] = keep


def main() -> int:
    files = sorted(str(p) for p in ROOT.glob("fusecli/ops/*/test_*_gpu.py")) + \
        sorted(str(p) for p in (ROOT / "tests" / "gpu").glob("test_*_gpu.py"))
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-m", "gpu",
                      "--rootdir", str(ROOT), *files], plugins=[FirstCaseOfEachTest()])
    every = set(gpu.launchers())
    # fusecli_read_scalar is called through lib() directly, not launch()
    missing = sorted(n for n in every - CALLED if n != "fusecli_read_scalar")
    print(f"launchers called: {len(CALLED)} of {len(every)}: {', '.join(sorted(CALLED))}")
    if missing:
        print(f"launchers NOT called (add a GPU test for them): {', '.join(missing)}")
    return int(rc) or (3 if missing else 0)


if __name__ == "__main__":
    sys.exit(main())
