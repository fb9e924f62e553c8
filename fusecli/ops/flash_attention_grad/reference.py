"""NumPy reference of FlashAttentionGrad (the oracle for its kernels), following its
contract.yaml: the probabilities recomputed from the saved LSE, FlashAttention-2's formulas."""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from fusecli.ops.attention_grad.reference import _expand, _group_sum, attention_kv_dims
from fusecli.ops.flash_attention.reference import filled_positions, flash_scores
from fusecli.ops.reference import _fit

MASKED_ROW = -5e29  # kFlashMaskedRow of the kernels


def flash_attention_grad(do, q, k, v, o, lse, bias=None, scale=1.0, k_transposed=0, mask=None,
                         fill=-3.4028234663852886e38, fill_kept=1, bias_first=0, softcap=0.0,
                         nan_guard=0):
    """Returns (dQ, dK, dV) as the contract defines them."""
    s, qb, kb = flash_scores(q, k, scale, k_transposed, bias, mask, fill, fill_kept, bias_first,
                             softcap)
    sq, sk = s.shape[-2:]
    d, dvd = q.shape[-1], v.shape[-1]
    vb = attention_kv_dims(qb, v.shape, sk * dvd, "V")
    with np.errstate(invalid="ignore", over="ignore"):
        lse64 = lse.astype(np.float64).reshape(*qb, sq, 1)
        p = np.exp(s - lse64)
        # a fully masked row (LSE <= -5e29: float32 cannot hold log(l) beside it): P / rowsum
        masked = np.isfinite(lse64) & (lse64 <= MASKED_ROW)
        p = np.where(masked, p / np.where(masked, p.sum(-1, keepdims=True), 1.0), p)
        do64 = do.astype(np.float64).reshape(*qb, sq, dvd)
        drow = (do64 * o.astype(np.float64).reshape(*qb, sq, dvd)).sum(-1, keepdims=True)
        if int(nan_guard) == 1:  # a guarded row (LSE +inf): P = 0 there, its dS NaN (2: 0)
            drow = np.where(lse64 == np.inf, np.nan, drow)
        dv = _group_sum(np.swapaxes(p, -1, -2) @ do64, qb, vb)
        dp = do64 @ np.swapaxes(_expand(v.astype(np.float64).reshape(*vb, sk, dvd), qb, vb),
                                -1, -2)
        ds = p * (dp - drow)
        if mask is not None:  # Where's gradient: 0 where the forward filled (NaN too)
            ds = np.where(filled_positions(mask, ds.shape, fill_kept), 0.0, ds)
        if softcap:  # through the cap: times 1 - tanh^2 of the scaled scores
            t = flash_scores(q, k, scale, k_transposed, softcap=softcap)[0] / float(softcap)
            ds = ds * (1.0 - t * t)
        k64 = k.astype(np.float64).reshape(*kb, *k.shape[-2:])
        k_sd = np.swapaxes(k64, -1, -2) if k_transposed else k64
        dq = float(scale) * (ds @ _expand(k_sd, qb, kb))
        dk = _group_sum(float(scale) * (np.swapaxes(ds, -1, -2)
                                        @ q.astype(np.float64).reshape(*qb, sq, d)), qb, kb)
    if k_transposed:
        dk = np.swapaxes(dk, -1, -2)
    return (dq.reshape(q.shape).astype(q.dtype), dk.reshape(k.shape).astype(k.dtype),
            dv.reshape(v.shape).astype(v.dtype))


class Reference(OpRun):

    def _run(self, do, q, k, v, o, lse, bias=None, mask=None, scale=1.0, k_transposed=0,
             fill=None, fill_kept=None, bias_first=None, softcap=None,
             tf32=0, nan_guard=None):  # tf32: CUDA only
        return _fit(self, flash_attention_grad(
            do, q, k, v, o, lse, bias, 1.0 if scale is None else scale, k_transposed or 0, mask,
            -3.4028234663852886e38 if fill is None else fill,
            1 if fill_kept is None else fill_kept, bias_first or 0, softcap or 0.0,
            nan_guard or 0))
