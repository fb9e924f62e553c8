"""NumPy reference of LinearActivationGrad (the oracle for its kernels), following its
contract.yaml."""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from fusecli.ops.activation_grad.reference import activation_grad
from fusecli.ops.reference import _fit, _s


def linear_activation_grad(dy, x, a=None, w=None, activation: str = "relu", trans_w: int = 0,
                           trans_dw: int | None = None, alpha: float = 1.0, flat_da: int = 0):
    """(dA, dW, dB, dZ); dA is None without W, dW None without A (a frozen weight)."""
    n = dy.shape[-1]
    dz = activation_grad(dy, x, activation, alpha).astype(np.float64).reshape(-1, n)
    if w is None:
        da = None
    else:
        w64 = w.astype(np.float64)
        wnk = w64.T if trans_w else w64  # [N, K]
        # A's leading dims (a 2-D view, maybe), else dY's, or one row axis (flat_da)
        lead = a.shape[:-1] if a is not None else (-1,) if flat_da else dy.shape[:-1]
        da = (dz @ wnk).reshape(*lead, wnk.shape[1]).astype(dy.dtype)
    trans_dw = trans_w if trans_dw is None else trans_dw
    if a is None:
        dw = None
    else:
        dw_nk = dz.T @ a.astype(np.float64).reshape(-1, a.shape[-1])
        dw = (dw_nk.T if trans_dw else dw_nk).astype(a.dtype)
    db = dz.sum(axis=0).astype(dy.dtype)
    return da, dw, db, dz.reshape(dy.shape).astype(dy.dtype)


class Reference(OpRun):

    def _run(self, dy, x, a=None, w=None, activation=None, alpha=1.0, trans_w=0, trans_dw=None,
             flat_da=0):
        return _fit(self, linear_activation_grad(dy, x, a, w, _s(activation), trans_w or 0,
                                                 trans_dw, alpha, flat_da or 0))
