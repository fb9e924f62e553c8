"""The numeric judgement of ``fusecli verify``: one tensor of the fused model against the
original's, within max(tolerance, NOISE_FACTOR x its noise floor), the noise floor being how far
the tensor moves when the original is re-run on inputs moved by one unit in the last place;
a tensor too ill-conditioned for that (NOISE_LIMIT) is not judged. Pure NumPy."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

# Whole-model judgement: a tensor may differ by NOISE_FACTOR times what a one-ulp change of the
# inputs moves it by; a graph output that moves by more than NOISE_LIMIT (relative to its
# largest value) under that change is too ill-conditioned to judge on the whole model.
NOISE_FACTOR = 8.0
NOISE_LIMIT = 1e-3


@dataclass
class OutputDiff:
    name: str
    max_abs: float
    max_ref: float
    ok: bool
    upstream_fused: list[str] = field(default_factory=list)
    noise: float = 0.0          # max |original - original on 1-ulp-perturbed inputs|
    limit: float = 0.0          # the max_abs allowed: max(atol + rtol * max_ref, noise term)
    status: str = "ok"          # ok | MISMATCH | zero | non-finite | not judged (noise)

    @property
    def rel(self) -> float:
        return self.max_abs / self.max_ref if self.max_ref > 0 else float(self.max_abs > 0)

    @property
    def noise_rel(self) -> float:
        return self.noise / self.max_ref if self.max_ref > 0 else 0.0

    def as_dict(self) -> dict:
        return {"name": self.name, "max_abs": self.max_abs, "max_rel": self.rel,
                "max_ref": self.max_ref, "ok": self.ok, "status": self.status,
                "noise_floor": self.noise, "noise_floor_rel": self.noise_rel,
                "allowed_abs": self.limit, "upstream_fused": self.upstream_fused}


def compare(ref: np.ndarray, got: np.ndarray, rtol: float, atol: float) -> tuple[float, float, bool]:
    ref = np.asarray(ref)
    got = np.asarray(got)
    if ref.shape != got.shape:
        return float("inf"), 0.0, False
    if ref.dtype.kind not in "fc":
        same = bool(np.array_equal(ref, got))
        return (0.0 if same else 1.0), 1.0, same
    r = ref.astype(np.float64)
    g = got.astype(np.float64)
    if not np.array_equal(np.isfinite(r), np.isfinite(g)):
        return float("inf"), 0.0, False
    diff = np.abs(np.where(np.isfinite(r), r - g, 0.0))
    max_abs = float(diff.max()) if diff.size else 0.0
    finite = np.isfinite(r)
    max_ref = float(np.abs(r[finite]).max()) if finite.any() else 0.0
    return max_abs, max_ref, max_abs <= atol + rtol * max_ref


# Significant bits (the implicit one included) of the float element types verify judges, and
# how the tolerances widen for the narrow ones (a unit in the last place, EPS = 2**(1 - bits)):
# rtol at least HALF_RTOL_ULPS ulps, the noise limit at least HALF_NOISE_ULPS ulps.
SIGNIFICANT_BITS = {onnx.TensorProto.FLOAT: 24, onnx.TensorProto.DOUBLE: 53,
                    onnx.TensorProto.FLOAT16: 11, onnx.TensorProto.BFLOAT16: 8}
HALF_RTOL_ULPS = 4
HALF_NOISE_ULPS = 32


def type_limits(elem, rtol: float, atol: float) -> tuple[float, float, float]:
    """(rtol, atol, noise limit) for a tensor of element type ``elem`` (an onnx TensorProto
    type or a numpy dtype): as given for float32 and wider; for float16 (11 significant bits)
    and bfloat16 (8) rtol is at least HALF_RTOL_ULPS and the noise limit at least
    HALF_NOISE_ULPS units in the last place of the type (one ulp of float16 is 2**-10 of the
    value, of bfloat16 2**-7: a right fusion in half precision differs by a few of them)."""
    if not isinstance(elem, int):
        try:
            elem = helper.np_dtype_to_tensor_dtype(np.dtype(elem))
        except (KeyError, TypeError, ValueError):
            return rtol, atol, NOISE_LIMIT
    bits = SIGNIFICANT_BITS.get(elem)
    if bits is None or bits >= 24:
        return rtol, atol, NOISE_LIMIT
    eps = 2.0 ** (1 - bits)
    return max(rtol, HALF_RTOL_ULPS * eps), atol, max(NOISE_LIMIT, HALF_NOISE_ULPS * eps)


def judge(name: str, ref: np.ndarray, got: np.ndarray | None, perturbed: np.ndarray | None,
          rtol: float, atol: float, base: np.ndarray | None = None) -> OutputDiff:
    """One tensor's verdict against max(atol + rtol * max|ref|, NOISE_FACTOR * noise floor);
    the noise floor is max |perturbed - base| (``base`` defaults to ``ref``: the same
    computation on unperturbed inputs). Tolerances and the noise limit follow the tensor's
    element type (``type_limits``)."""
    if got is None:
        return OutputDiff(name, float("inf"), 0.0, False, status="MISMATCH")
    rtol, atol, noise_limit = type_limits(np.asarray(ref).dtype, rtol, atol)
    max_abs, max_ref, ok = compare(ref, got, rtol, atol)
    d = OutputDiff(name, max_abs, max_ref, ok, limit=atol + rtol * max_ref)
    ref = np.asarray(ref)
    if ref.dtype.kind not in "fc":
        d.status = "ok" if ok else "MISMATCH"
        return d
    if ref.size and not np.isfinite(ref).all():  # no verdict on NaN/Inf: inconclusive
        d.status, d.ok = "non-finite", True
        return d
    if perturbed is not None:
        d.noise, _, _ = compare(ref if base is None else base, perturbed, 0.0, 0.0)
        if not math.isfinite(d.noise):
            d.noise = float("inf")
        d.limit = max(d.limit, NOISE_FACTOR * d.noise)
    if max_ref > atol and d.noise > noise_limit * max_ref:  # (numerically zero: atol judges)
        d.ok = math.isfinite(max_abs)
        d.status = "not judged (noise)" if d.ok else "MISMATCH"
        return d
    d.ok = max_abs <= d.limit
    d.status = "MISMATCH" if not d.ok else ("zero" if max_ref <= atol else "ok")
    return d
