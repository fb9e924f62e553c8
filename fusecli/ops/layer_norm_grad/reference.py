"""NumPy reference of LayerNormGrad (the oracle for its kernels), following its contract.yaml."""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from fusecli.ops.reference import _fit


def layer_norm_grad(dy, x, gamma, mean, inv_std, dr=None, axis=-1):
    ax = axis % x.ndim
    n = int(np.prod(x.shape[ax:]))
    d = dy.astype(np.float64).reshape(-1, n)
    xs = x.astype(np.float64).reshape(-1, n)
    mu = mean.astype(np.float64).reshape(-1, 1)
    rs = inv_std.astype(np.float64).reshape(-1, 1)
    xhat = (xs - mu) * rs
    g = d * (1.0 if gamma is None else gamma.astype(np.float64).reshape(1, n))
    dx = rs * (g - g.mean(axis=1, keepdims=True) - xhat * (g * xhat).mean(axis=1, keepdims=True))
    if dr is not None:
        dx = dx + dr.astype(np.float64).reshape(-1, n)
    pshape = x.shape[ax:]
    dgamma = (d * xhat).sum(axis=0).reshape(pshape).astype(dy.dtype)
    dbeta = d.sum(axis=0).reshape(pshape).astype(dy.dtype)
    return dx.reshape(x.shape).astype(dy.dtype), dgamma, dbeta


class Reference(OpRun):

    def _run(self, dy, x, gamma=None, mean=None, inv_std=None, dr=None, axis=-1):
        return _fit(self, layer_norm_grad(dy, x, gamma, mean, inv_std, dr,
                                          -1 if axis is None else axis))
