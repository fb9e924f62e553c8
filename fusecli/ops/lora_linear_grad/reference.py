"""NumPy reference of LoraLinearGrad (the oracle for its kernels), following its contract.yaml."""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from fusecli.ops.activation_grad.reference import activation_grad
from fusecli.ops.reference import _fit, _s


def lora_linear_grad(dy, x, a, w, la, lb, h, xd=None, activation: str = "identity",
                     alpha: float = 1.0, scale: float = 1.0, trans_w: int = 0,
                     split_dx: int = 0):
    """Returns (dX, dXa, dLa, dLb, dW, dB, dZ); dX is None without W."""
    n, k, r = dy.shape[-1], a.shape[-1], la.shape[0]
    if activation == "identity":
        dz = dy.astype(np.float64).reshape(-1, n)
    else:
        dz = activation_grad(dy, x, activation, alpha).astype(np.float64).reshape(-1, n)
    a2 = a.astype(np.float64).reshape(-1, k)
    xd2 = a2 if xd is None else xd.astype(np.float64).reshape(-1, k)
    h2 = h.astype(np.float64).reshape(-1, r)
    la64, lb64 = la.astype(np.float64), lb.astype(np.float64)
    g = scale * (dz @ lb64)
    adapter = g @ la64
    lead = (*a.shape[:-1], k)
    dx = None
    if w is not None:
        w64 = w.astype(np.float64)
        base = dz @ (w64.T if trans_w else w64)
        dx = (base if split_dx else base + adapter).reshape(lead).astype(a.dtype)
    dxa = adapter.reshape(lead).astype(a.dtype)
    dla = (g.T @ xd2).astype(la.dtype)
    dlb = (scale * (dz.T @ h2)).astype(lb.dtype)
    dw = (dz.T @ a2).astype(a.dtype)
    db = dz.sum(axis=0).astype(dy.dtype)
    return dx, dxa, dla, dlb, dw, db, dz.reshape(dy.shape).astype(dy.dtype)


class Reference(OpRun):

    def _run(self, dy, x, a, w, la, lb, h, xd=None, activation=None, alpha=1.0, scale=1.0,
             trans_w=0, split_dx=0):
        return _fit(self, lora_linear_grad(dy, x, a, w, la, lb, h, xd, _s(activation), alpha,
                                           scale, trans_w or 0, split_dx or 0))
