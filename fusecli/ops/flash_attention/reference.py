"""NumPy reference of FlashAttention (the oracle for its kernels), following its contract.yaml.

The reference is the plain (untiled) formula in float64: the kernels' tiling, online softmax and
tile skipping must reproduce it."""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from fusecli.ops.attention_grad.reference import _expand, attention_kv_dims
from fusecli.ops.reference import _fit


def flash_scores(q, k, scale=1.0, k_transposed=0, bias=None):
    """S = scale * Q K^T (+ bias) in float64, [*qbatch, Sq, Sk], with K grouped as the
    contract says; returns (S, q batch dims, kv batch dims)."""
    qb, sq, d = q.shape[:-2], q.shape[-2], q.shape[-1]
    sk = k.shape[-1] if k_transposed else k.shape[-2]
    kb = attention_kv_dims(qb, k.shape, sk * d, "K")
    k64 = k.astype(np.float64).reshape(*kb, *k.shape[-2:])
    k_sd = np.swapaxes(k64, -1, -2) if k_transposed else k64
    s = float(scale) * (q.astype(np.float64).reshape(*qb, sq, d)
                        @ np.swapaxes(_expand(k_sd, qb, kb), -1, -2))
    if bias is not None:
        # the bias is added to the float32 scores in float32, as the graph's Add does: a score
        # plus finfo.min is finfo.min (a fully masked row's softmax is uniform)
        try:
            s = (s.astype(np.float32) + np.broadcast_to(bias.astype(np.float32), s.shape)
                 ).astype(np.float64)
        except ValueError:
            raise ValueError(f"FlashAttention: bias {list(bias.shape)} must broadcast to the "
                             f"scores' shape {list(s.shape)}") from None
    return s, qb, kb


def flash_attention(q, k, v, bias=None, scale=1.0, k_transposed=0):
    """Returns (O, LSE) as the contract defines them."""
    s, qb, kb = flash_scores(q, k, scale, k_transposed, bias)
    sk, dv = s.shape[-1], v.shape[-1]
    vb = attention_kv_dims(qb, v.shape, sk * dv, "V")
    if tuple(vb) != tuple(kb):
        raise ValueError("FlashAttention: V's batch dims must be K's")
    with np.errstate(invalid="ignore", over="ignore"):
        m = s.max(axis=-1, keepdims=True)
        e = np.exp(s - m)          # an all -inf row: -inf - -inf = NaN, as Softmax gives
        lsum = e.sum(axis=-1, keepdims=True)
        o = (e / lsum) @ _expand(v.astype(np.float64).reshape(*vb, sk, dv), qb, vb)
        lse = (m + np.log(lsum))[..., 0]
    return o.astype(q.dtype), lse.astype(np.float32)


class Reference(OpRun):

    def _run(self, q, k, v, bias=None, scale=1.0, k_transposed=0, tf32=0):  # tf32: CUDA only
        return _fit(self, flash_attention(q, k, v, bias, 1.0 if scale is None else scale,
                                          k_transposed or 0))
