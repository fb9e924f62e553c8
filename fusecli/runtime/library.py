"""Locate what fusecli runs fused models with: its onnxruntime custom-op library
(``fusecli/lib/libfusecli_ops.so``, package data) and the onnxruntime-training runtime.

The library implements every op of the ``com.fusecli`` domain (see
``fusecli/ops/<op>/contract.yaml``) on the CPU execution provider, and on the CUDA execution
provider when it was built with nvcc.
Every wheel build (and ``make lib``) builds it with ``scripts/build_lib.sh``; it is never committed.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
from importlib.resources import files
from pathlib import Path

from fusecli.errors import FuseError

LIBRARY_NAME = "libfusecli_ops.so"
LIBRARY_ENV = "FUSECLI_LIBRARY"
ORTT_PYTHON_ENV = "FUSECLI_ORTT_PYTHON"
ORTT_VENV = ".venv-ortt"


class LibraryNotBuilt(FileNotFoundError):
    """The custom-op library has not been built yet."""


def library_path() -> str:
    """Absolute path of the built custom-op library; raises :class:`LibraryNotBuilt` if missing.

    The environment variable ``FUSECLI_LIBRARY`` names another build of it (e.g. the ARM64
    library of ``make lib-arm64``, which ``make test-arm64`` runs the tests with)."""
    override = os.environ.get(LIBRARY_ENV)
    if override:
        path = Path(override).resolve()
        if not path.is_file():
            raise LibraryNotBuilt(f"{LIBRARY_ENV}={override} is not a file; name a built "
                                  f"{LIBRARY_NAME} or unset {LIBRARY_ENV}")
        return str(path)
    path = Path(str(files("fusecli") / "lib" / LIBRARY_NAME)).resolve()
    if not path.is_file():
        raise LibraryNotBuilt("fusecli's custom-op library is not built: run `make lib` in a "
                              "checkout, or reinstall fusecli with pip (its build makes it)")
    return str(path)


def training_python(override: str | None = None) -> str:
    """The Python interpreter of the onnxruntime-training runtime (it runs ort-training graphs;
    it cannot share a venv with the ``onnxruntime`` package). The first of:

    1. ``override`` (the ``--runtime-python`` option);
    2. the environment variable ``FUSECLI_ORTT_PYTHON``;
    3. ``.venv-ortt/bin/python`` in the current directory or the nearest parent that has one;
    4. ``.venv-ortt/bin/python`` beside the project, when fusecli runs from a checkout
       (an editable install: the folder above the package holds ``pyproject.toml``).

    Raises FuseError when none exists; an ``override`` or variable that names a missing file is
    an error rather than a reason to look further.
    """
    for source, value in (("--runtime-python", override),
                          (ORTT_PYTHON_ENV, os.environ.get(ORTT_PYTHON_ENV))):
        if value:
            why = _not_a_program(value)
            if why:
                raise FuseError(f"{source} {value} {why}; name the python of a venv "
                                "with onnxruntime-training installed")
            return value
    venv_python = Path(ORTT_VENV) / "bin" / "python"
    cwd = Path.cwd()
    places = [cwd, *cwd.parents]
    project = Path(__file__).resolve().parents[2]
    if (project / "pyproject.toml").is_file():
        places.append(project)
    for place in places:
        if (place / venv_python).exists():
            return str(place / venv_python)
    raise FuseError(f"this graph needs onnxruntime-training: set {ORTT_PYTHON_ENV}=PATH (the python "
                    f"of a venv with onnxruntime-training-cpu==1.19.2), pass --runtime-python PATH, "
                    f"or create {ORTT_VENV} here (`make ortt-env` in a checkout)")


def _not_a_program(path: str) -> str | None:
    """Why ``path`` cannot be run as an interpreter (None: it may be)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be used ({exc.strerror or exc})"
    if stat.S_ISDIR(st.st_mode):
        return "is a folder, not a program"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if not os.access(path, os.X_OK):
        return "is not executable"
    return None


class RuntimePythonError(FuseError):
    """The runtime interpreter did not behave as a Python running fusecli's worker (bad input:
    the user named it, or the environment did)."""

    def __init__(self, python: str, what: str):
        super().__init__(f"the runtime python {python} {what}; name the python of a venv with "
                         f"onnxruntime installed (--runtime-python PATH or {ORTT_PYTHON_ENV})")
        self.python = python


def run_worker(cmd: list[str], python: str, prog: str,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run a worker script (``cmd[0]`` is ``python``). An interpreter that cannot be started,
    or that exits non-zero without the worker's one-line error (``PROG: error: ...``, exit 2)
    raises RuntimePythonError; a worker that reported an error or was killed by a signal is
    returned as it is (its model failed). TimeoutExpired propagates."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                              timeout=timeout, errors="backslashreplace")
    except OSError as exc:
        raise RuntimePythonError(python, f"cannot be run ({exc.strerror or exc})") from None
    if proc.returncode > 0 and not _reported(proc, prog):
        last = _last_line(proc.stderr)
        raise RuntimePythonError(python, f"exited with code {proc.returncode} without running "
                                 f"fusecli's {prog}" + (f" (it said: {last[:200]})" if last
                                                        else " (it printed nothing)"))
    return proc


def _reported(proc: subprocess.CompletedProcess, prog: str) -> bool:
    return any(ln.startswith(f"{prog}: error: ") for ln in proc.stderr.splitlines())


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def worker_failure(proc: subprocess.CompletedProcess, python: str) -> str:
    """The one-line reason a worker failed: its error line, or the signal that killed it."""
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        return f"the runtime ({python}) was killed by {name}"
    return _last_line(proc.stderr) or f"exit code {proc.returncode}"


def worker_result(proc: subprocess.CompletedProcess, python: str, prog: str,
                  key: str | None = None) -> dict:
    """The JSON object a worker that exited 0 printed as its last stdout line (with ``key``
    present); RuntimePythonError where it printed something else."""
    line = _last_line(proc.stdout)
    if not line:
        raise RuntimePythonError(python, f"exited 0 but printed no result (it did not run "
                                 f"fusecli's {prog})")
    try:
        res = json.loads(line)
    except ValueError:
        res = None
    if not isinstance(res, dict) or (key is not None and key not in res):
        raise RuntimePythonError(python, f"printed {line[:80]!r} instead of the result of "
                                 f"fusecli's {prog}")
    return res


def session_options(threads: int | None = None, opt_level=None):
    """``onnxruntime.SessionOptions`` with fusecli's custom-op library registered.

    ``threads`` sets the intra-op thread count (None: onnxruntime's default); ``opt_level`` is an
    ``onnxruntime.GraphOptimizationLevel`` (None: ORT_ENABLE_ALL). Intra-op spinning is turned
    off (it distorts timings and wastes cores on small machines).
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.register_custom_ops_library(library_path())
    if threads is not None:
        so.intra_op_num_threads = int(threads)
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if opt_level is None else opt_level)
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return so


def kernel_calls(op_name: str) -> int:
    """How many times the library's kernel for ``op_name`` ran in this process (-1: unknown op).

    Also ``"Op/inplace"`` (calls whose in-place output onnxruntime had put in the input's own
    buffer) and ``"AttentionGrad/softmax_ns"`` (nanoseconds spent in the CPU kernel's softmax
    backward, between its GEMMs).

    Loads the same .so that onnxruntime dlopens (same absolute path, so the same handle and the
    same counters).
    """
    return int(_cdll().fusecli_kernel_calls(op_name.encode()))


def reset_kernel_calls() -> None:
    _cdll().fusecli_reset_kernel_calls()


def has_cuda() -> bool:
    """Whether the built library contains the CUDA kernels."""
    return bool(_cdll().fusecli_has_cuda())


_CDLL = None


def _cdll():
    global _CDLL
    if _CDLL is None:
        import ctypes

        lib = ctypes.CDLL(library_path(), mode=os.RTLD_NOW | getattr(os, "RTLD_GLOBAL", 0))
        lib.fusecli_kernel_calls.argtypes = [ctypes.c_char_p]
        lib.fusecli_kernel_calls.restype = ctypes.c_int64
        lib.fusecli_reset_kernel_calls.argtypes = []
        lib.fusecli_reset_kernel_calls.restype = None
        lib.fusecli_has_cuda.argtypes = []
        lib.fusecli_has_cuda.restype = ctypes.c_int
        _CDLL = lib
    return _CDLL


def kernel_ops(provider: str) -> set[str]:
    """Fused ops with a kernel for ``provider`` ('cpu' or 'cuda') in the built library."""
    from fusecli.ops.contracts import load_contracts

    ops = set(load_contracts().ops)
    if provider == "cpu":
        return ops
    if provider == "cuda":
        try:
            return ops if has_cuda() else set()
        except (LibraryNotBuilt, OSError):
            return set()
    raise ValueError(f"unknown execution provider {provider!r}")
