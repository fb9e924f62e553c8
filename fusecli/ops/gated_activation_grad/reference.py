"""NumPy reference of GatedActivationGrad (the oracle for its kernels), following its
contract.yaml: the backward of H = act(A) * B (SwiGLU: silu, GeGLU: gelu / gelu_tanh)."""

from __future__ import annotations

import math

import numpy as np
from onnx.reference.op_run import OpRun

from fusecli.ops.reference import _fit, _s


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def activation_and_grad(v: np.ndarray, activation: str) -> tuple[np.ndarray, np.ndarray]:
    """(act(v), act'(v)) in float64."""
    if activation == "silu":
        with np.errstate(over="ignore"):
            s = 1.0 / (1.0 + np.exp(-v))
        return v * s, s * (1.0 + v * (1.0 - s))
    if activation == "gelu":
        cdf = 0.5 * (1.0 + _erf(v / math.sqrt(2.0)))
        return v * cdf, cdf + v * np.exp(-0.5 * v * v) / math.sqrt(2.0 * math.pi)
    if activation == "gelu_tanh":
        a, c = math.sqrt(2.0 / math.pi), 0.044715
        t = np.tanh(a * (v + c * v**3))
        return 0.5 * v * (1.0 + t), 0.5 * (1.0 + t + v * (1.0 - t * t) * a * (1.0 + 3.0 * c * v * v))
    raise NotImplementedError(f"activation {activation!r}")


def gated_activation_grad(dh: np.ndarray, a: np.ndarray, b: np.ndarray, activation: str,
                          alpha: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(dA, dB) of H = act(alpha A) / alpha * B."""
    d = dh.astype(np.float64)
    v = float(alpha) * a.astype(np.float64)
    f, g = activation_and_grad(v, activation)
    da = d * b.astype(np.float64) * g
    db = d * f / float(alpha)
    return da.astype(dh.dtype), db.astype(dh.dtype)


class Reference(OpRun):

    def _run(self, dh, a, b, activation=None, alpha=1.0):
        return _fit(self, gated_activation_grad(dh, a, b, _s(activation),
                                                1.0 if alpha is None else alpha))
