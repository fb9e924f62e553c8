"""pytest set-up shared by tests/ and the op folders' tests (fusecli/ops/<op>/test_*.py): both
import their helpers from tests/ (kernel_helpers, builders, gpu_helpers).

The op folders' GPU tests (test_*_gpu.py, marked gpu) skip their module where torch.cuda is
unavailable; so that a CPU run reports that once, not once per op folder, only the first GPU
test file met is collected there (a file named on the command line is always collected)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))

_gpu_files_seen = []


def pytest_ignore_collect(collection_path, config):
    name = collection_path.name
    if not (name.startswith("test_") and name.endswith("_gpu.py")):
        return None
    from gpu_helpers import cuda_available

    if cuda_available():
        return None
    _gpu_files_seen.append(collection_path)
    return True if len(_gpu_files_seen) > 1 else None
