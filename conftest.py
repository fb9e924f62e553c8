"""pytest set-up shared by tests/ and the op folders' tests (fusecli/ops/<op>/test_*.py): both
import their helpers from tests/ (kernel_helpers, builders)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))
