"""NumPy reference of ActivationGrad (the oracle for its kernels), following its contract.yaml."""

from __future__ import annotations

import math

import numpy as np
from onnx.reference.op_run import OpRun

from fusecli.ops.reference import _fit, _s


_SQRT1_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _erf(x: np.ndarray) -> np.ndarray:
    # numpy has no erf; math.erf vectorised is exact to double precision.
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def activation_grad(dy: np.ndarray, x: np.ndarray, activation: str,
                    alpha: float = 1.0) -> np.ndarray:
    """dY * act'(alpha X): the gradient of the activation at input scale alpha,
    act(alpha x) / alpha (silu at alpha = 1.702 is QuickGELU, x sigmoid(1.702 x))."""
    d = dy.astype(np.float64)
    v = float(alpha) * x.astype(np.float64)
    if activation == "relu":
        out = d * (v > 0)
    elif activation == "gelu":
        out = d * (0.5 * (1.0 + _erf(v * _SQRT1_2)) + v * np.exp(-0.5 * v * v) * _INV_SQRT_2PI)
    elif activation == "gelu_tanh":
        a = math.sqrt(2.0 / math.pi)
        t = np.tanh(a * (v + 0.044715 * v**3))
        out = d * 0.5 * (1.0 + t + v * (1.0 - t * t) * a * (1.0 + 3.0 * 0.044715 * v * v))
    elif activation == "silu":
        s = 1.0 / (1.0 + np.exp(-v))
        out = d * s * (1.0 + v * (1.0 - s))
    elif activation == "identity":
        out = d
    else:
        raise NotImplementedError(f"activation {activation!r}")
    return out.astype(dy.dtype)


class Reference(OpRun):

    def _run(self, dy, x, activation=None, alpha=1.0):
        return _fit(self, (activation_grad(dy, x, _s(activation), alpha),))
