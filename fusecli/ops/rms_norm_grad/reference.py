"""NumPy reference of RMSNormGrad (the oracle for its kernels), following its contract.yaml."""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from fusecli.ops.reference import _fit


def rms_norm_grad(dy, x, gamma=None, inv_rms=None, dr=None, axis=-1, epsilon=1e-5):
    ax = axis % x.ndim
    n = int(np.prod(x.shape[ax:]))
    d = dy.astype(np.float64).reshape(-1, n)
    xs = x.astype(np.float64).reshape(-1, n)
    if inv_rms is None:
        r = 1.0 / np.sqrt((xs * xs).mean(axis=1, keepdims=True) + epsilon)
    else:
        r = inv_rms.astype(np.float64).reshape(-1, 1)
    xhat = xs * r
    g = d * (1.0 if gamma is None else gamma.astype(np.float64).reshape(1, n))
    dx = r * (g - xhat * (g * xhat).mean(axis=1, keepdims=True))
    if dr is not None:
        dx = dx + dr.astype(np.float64).reshape(-1, n)
    dgamma = (d * xhat).sum(axis=0).reshape(x.shape[ax:]).astype(dy.dtype)
    return dx.reshape(x.shape).astype(dy.dtype), dgamma


class Reference(OpRun):

    def _run(self, dy, x, gamma=None, inv_rms=None, dr=None, axis=-1, epsilon=1e-5):
        return _fit(self, rms_norm_grad(dy, x, gamma, inv_rms, dr, -1 if axis is None else axis,
                                        1e-5 if epsilon is None else epsilon))
