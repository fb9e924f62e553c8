"""What every op folder's ``gpu.py`` uses: the C launchers its contract declares, called by
parameter NAME through ctypes, and the torch math of the domain's activations (domain.yaml).

``launch("fusecli_launch_x", dy=tensor, m=4, ...)`` looks the launcher up in the contracts
(``launchers:`` of ``fusecli/ops/<op>/contract.yaml``), maps each C parameter name of its
``args`` to a value and calls it: a torch tensor (anything with ``data_ptr()``) passes its
device pointer, None NULL, a list or tuple of numbers a host array of the pointee type, a
ctypes array or pointer itself; an int or a float fills a scalar. An unknown or a missing name
is refused; a ``void* stream`` left out is torch's current CUDA stream. A non-zero return
(a cudaError) raises RuntimeError.

The library is FUSECLI_CUDA_LIB if set, else build/gpu/libfusecli_cuda.so (launchers only, built
by tests/gpu/run_gpu_checks.sh with nvcc alone), else fusecli/lib/libfusecli_ops.so. Used by the
GPU tests (fusecli/ops/<op>/test_<op>_gpu.py) and tests/gpu/bench_cuda.py; needs only the
standard library and PyYAML (torch where a tensor is passed), never onnx.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
from pathlib import Path

from fusecli.ops.contracts import Launcher, activation_codes, launcher_argtypes, load_contracts

REPO = Path(__file__).resolve().parents[2]
ACT = activation_codes()  # activation name -> launcher code (ops/domain.yaml)
# C scalar type -> ctypes type (a pointer parameter's pointee, for host arrays)
SCALARS = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float,
           "uint8_t": ctypes.c_uint8}


class LaunchError(TypeError):
    """A launcher call whose names or values do not fit the contract's parameter list."""


def launchers() -> dict[str, Launcher]:
    """Every launcher the contracts declare, by name."""
    return {ln.name: ln for c in load_contracts().ops.values() for ln in c.launchers}


def _pointee(ctype: str) -> str:
    return ctype.replace("const", "").replace("*", "").strip()


def _value(launcher: str, ctype: str, name: str, value):
    where = f"{launcher}: {name} ({ctype})"
    if ctype.endswith("*"):
        if value is None:
            return None
        if hasattr(value, "data_ptr"):
            return ctypes.c_void_p(value.data_ptr())
        if isinstance(value, (ctypes.Array, ctypes._Pointer, ctypes.c_void_p)):
            return value
        if isinstance(value, (list, tuple)):
            base = SCALARS.get(_pointee(ctype))
            if base is None:
                raise LaunchError(f"{where}: a host array needs a typed pointer parameter")
            return (base * max(1, len(value)))(*value)
        raise LaunchError(f"{where} takes a tensor, None or a host array, "
                          f"not {type(value).__name__}")
    if ctype == "float" and isinstance(value, (int, float)):
        return float(value)
    if ctype in ("int", "int64_t") and isinstance(value, int):  # bool is an int
        return int(value)
    raise LaunchError(f"{where} takes a number, not {type(value).__name__}")


def bind(name: str, named: dict) -> list:
    """The positional ctypes arguments of launcher `name` for the values in `named` (C
    parameter name -> value), in the contract's order; LaunchError for an unknown launcher, an
    unknown or a missing parameter name, or a value that does not fit its C type."""
    ln = launchers().get(name)
    if ln is None:
        raise LaunchError(f"no launcher {name!r} in the contracts (known: "
                          f"{', '.join(sorted(launchers()))})")
    params = ln.params()
    known = [p for _, p in params]
    unknown = [k for k in named if k not in known]
    missing = [p for p in known if p not in named]
    if unknown or missing:
        raise LaunchError(f"{name}: " + "; ".join(
            ([f"unknown parameter(s) {', '.join(unknown)}"] if unknown else [])
            + ([f"missing parameter(s) {', '.join(missing)}"] if missing else []))
            + f" (the contract's parameters: {', '.join(known)})")
    return [_value(name, t, p, named[p]) for t, p in params]


def library_file() -> str:
    env = os.environ.get("FUSECLI_CUDA_LIB")
    if env:
        return env
    for cand in (REPO / "build" / "gpu" / "libfusecli_cuda.so",
                 REPO / "fusecli" / "lib" / "libfusecli_ops.so"):
        if cand.exists():
            return str(cand)
    raise FileNotFoundError("no fusecli CUDA library: run tests/gpu/run_gpu_checks.sh or `make lib`")


_LIB = None


def lib():
    """The CUDA library, every contract launcher's argtypes set (ctypes converts and checks each
    argument against the contract's C types)."""
    global _LIB
    if _LIB is None:
        handle = ctypes.CDLL(library_file())
        for name, args in launcher_argtypes().items():
            f = getattr(handle, name)
            f.argtypes = args
            f.restype = ctypes.c_int
        _LIB = handle
    return _LIB


def current_stream():
    import torch

    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def launch(launcher_name: str, **named) -> None:
    """Call a contract launcher with its parameters by name (see the module docstring)."""
    ln = launchers().get(launcher_name)
    if ln is not None and "stream" not in named and ("void*", "stream") in ln.params():
        named["stream"] = current_stream()
    args = bind(launcher_name, named)
    err = getattr(lib(), launcher_name)(*args)
    if err != 0:
        raise RuntimeError(f"{launcher_name} returned cudaError {err}")


@contextlib.contextmanager
def kernel_path(env: str, value: str | None):
    """A launcher environment switch (e.g. FUSECLI_MEMK_PATH=vec) set for the calls inside;
    None: unset. The launchers read it at every launch."""
    old = os.environ.get(env)
    if value is None:
        os.environ.pop(env, None)
    else:
        os.environ[env] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = old


def memk_paths(add):
    """A bench `add` that times each case on both memory-bound kernel paths: the default
    (scalar) kernels, and the vectorised ones (FUSECLI_MEMK_PATH=vec, rows named `[vec]`)."""
    def both(op, shape, fused, unfused, *rest, **kw):
        with kernel_path("FUSECLI_MEMK_PATH", None):
            add(op, shape, fused, unfused, *rest, **kw)
        with kernel_path("FUSECLI_MEMK_PATH", "vec"):
            add(op + "[vec]", shape, fused, unfused, *rest, **kw)
    return both


def workspace(dy, mode):
    """(dY to pass, workspace output) for an op's dY-shaped workspace output (dZ, dC): mode None
    (not requested), "out" (a separate tensor) or "inplace" (a copy of dY that the op
    overwrites, as onnxruntime's in-place plan does)."""
    import torch

    if mode == "inplace":
        dy = dy.clone()
        return dy, dy
    return dy, (torch.empty_like(dy) if mode == "out" else None)


# --- torch math of the domain's activations (unfused) --------------------------------------------

def ref_act_grad(dy, x, act):
    """dY * act'(X) for an activation of domain.yaml, in torch."""
    import torch

    if act == "identity":
        return dy
    if act == "relu":
        return dy * (x > 0)
    if act == "gelu":
        return dy * (0.5 * (1 + torch.erf(x / math.sqrt(2)))
                     + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi))
    if act == "gelu_tanh":
        a, c = math.sqrt(2 / math.pi), 0.044715
        t = torch.tanh(a * (x + c * x ** 3))
        return dy * 0.5 * (1 + t + x * (1 - t * t) * a * (1 + 3 * c * x * x))
    if act == "silu":
        s = torch.sigmoid(x)
        return dy * s * (1 + x * (1 - s))
    if act == "relu6":  # Clip(x, 0, 6): the bounds kept, as onnxruntime-training's Clip gradient
        return dy * ((x >= 0) & (x <= 6))
    if act == "hardswish":  # x relu6(x + 3) / 6: (relu6(a) + x [0 <= a <= 6]) / 6, a = x + 3
        a = x + 3
        return dy * (a.clamp(0, 6) + torch.where((a >= 0) & (a <= 6), x, torch.zeros_like(x))) / 6
    raise ValueError(f"ref_act_grad: activation {act!r} is not one of domain.yaml's "
                     f"{', '.join(ACT)}: add its torch math here")


def quick_gelu_grad(dy, x, alpha):
    """dY * d/dx [x sigmoid(alpha x)] by torch autograd: independent of the formula."""
    import torch

    xg = x.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(xg * torch.sigmoid(alpha * xg), xg, dy)
    return g
