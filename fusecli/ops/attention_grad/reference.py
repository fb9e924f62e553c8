"""NumPy reference of AttentionGrad (the oracle for its kernels), following its contract.yaml."""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from ..reference import _fit


def attention_grad(do, q, k, v, p, scale_q=1.0, scale_k=1.0, k_transposed=0, q_scale=None,
                   k_scale=None):
    do64, q64, v64, p64 = (t.astype(np.float64) for t in (do, q, v, p))
    k64 = k.astype(np.float64)
    k_sd = np.swapaxes(k64, -1, -2) if k_transposed else k64  # [..., Sk, D]
    dv = np.swapaxes(p64, -1, -2) @ do64
    dp = do64 @ np.swapaxes(v64, -1, -2)
    ds = p64 * (dp - (dp * p64).sum(axis=-1, keepdims=True))
    if q_scale is not None:
        scale_q = scale_q * float(np.asarray(q_scale, dtype=np.float64).reshape(-1)[0])
    if k_scale is not None:
        scale_k = scale_k * float(np.asarray(k_scale, dtype=np.float64).reshape(-1)[0])
    dq = scale_q * (ds @ k_sd)
    dk = scale_k * (np.swapaxes(ds, -1, -2) @ q64)
    if k_transposed:
        dk = np.swapaxes(dk, -1, -2)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


class Reference(OpRun):

    def _run(self, do, q, k, v, p, q_scale=None, k_scale=None, scale_q=1.0, scale_k=1.0,
             k_transposed=0):
        return _fit(self, attention_grad(do, q, k, v, p, 1.0 if scale_q is None else scale_q,
                                         1.0 if scale_k is None else scale_k,
                                         k_transposed or 0, q_scale, k_scale))
