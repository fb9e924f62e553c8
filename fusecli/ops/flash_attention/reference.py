"""NumPy reference of FlashAttention (the oracle for its kernels), following its contract.yaml.

The reference is the plain (untiled) formula in float64: the kernels' tiling, online softmax and
tile skipping must reproduce it."""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from fusecli.ops.attention_grad.reference import _expand, attention_kv_dims
from fusecli.ops.reference import _fit


def filled_positions(mask, shape, fill_kept=1):
    """The bool mask broadcast to the scores' shape, True where a score is filled."""
    try:
        m = np.broadcast_to(np.asarray(mask).astype(bool), shape)
    except ValueError:
        raise ValueError(f"FlashAttention: mask {list(np.shape(mask))} must broadcast to the "
                         f"scores' shape {list(shape)}") from None
    return ~m if fill_kept else m


def flash_scores(q, k, scale=1.0, k_transposed=0, bias=None, mask=None, fill=-3.4028234663852886e38,
                 fill_kept=1, bias_first=0, softcap=0.0):
    """S = scale * Q K^T (soft-capped: c tanh(S / c) with softcap c > 0) (+ bias) in float64,
    [*qbatch, Sq, Sk], with K grouped as the contract says, the mask's filled scores replaced by
    `fill` (before the bias, or after it with bias_first = 1), in float32 as the graph's Where
    and Add; returns (S, q batch dims, kv batch dims)."""
    qb, sq, d = q.shape[:-2], q.shape[-2], q.shape[-1]
    sk = k.shape[-1] if k_transposed else k.shape[-2]
    kb = attention_kv_dims(qb, k.shape, sk * d, "K")
    k64 = k.astype(np.float64).reshape(*kb, *k.shape[-2:])
    k_sd = np.swapaxes(k64, -1, -2) if k_transposed else k64
    s = float(scale) * (q.astype(np.float64).reshape(*qb, sq, d)
                        @ np.swapaxes(_expand(k_sd, qb, kb), -1, -2))
    if softcap:
        s = float(softcap) * np.tanh(s / float(softcap))
    if mask is not None and not bias_first:
        s = np.where(filled_positions(mask, s.shape, fill_kept), np.float32(fill),
                     s.astype(np.float32)).astype(np.float64)
    if bias is not None:
        # the bias is added to the float32 scores in float32, as the graph's Add does: a score
        # plus finfo.min is finfo.min (a fully masked row's softmax is uniform)
        try:
            s = (s.astype(np.float32) + np.broadcast_to(bias.astype(np.float32), s.shape)
                 ).astype(np.float64)
        except ValueError:
            raise ValueError(f"FlashAttention: bias {list(bias.shape)} must broadcast to the "
                             f"scores' shape {list(s.shape)}") from None
    if mask is not None and bias_first:
        s = np.where(filled_positions(mask, s.shape, fill_kept), np.float32(fill),
                     s.astype(np.float32)).astype(np.float64)
    return s, qb, kb


def flash_attention(q, k, v, bias=None, scale=1.0, k_transposed=0, mask=None,
                    fill=-3.4028234663852886e38, fill_kept=1, bias_first=0, softcap=0.0,
                    nan_guard=0):
    """Returns (O, LSE) as the contract defines them."""
    s, qb, kb = flash_scores(q, k, scale, k_transposed, bias, mask, fill, fill_kept, bias_first,
                             softcap)
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
    if nan_guard:  # a row whose softmax is NaN (2: all -inf): P = 0 (O = 0), LSE +inf
        guarded = np.all(s == -np.inf, axis=-1) if int(nan_guard) == 2 else ~np.isfinite(lse)
        o = np.where(guarded[..., None], 0.0, o)
        lse = np.where(guarded, np.inf, lse)
    return o.astype(q.dtype), lse.astype(np.float32)


class Reference(OpRun):

    def _run(self, q, k, v, bias=None, mask=None, scale=1.0, k_transposed=0, fill=None,
             fill_kept=None, bias_first=None, softcap=None, tf32=0,  # tf32: CUDA only
             nan_guard=None):
        return _fit(self, flash_attention(
            q, k, v, bias, 1.0 if scale is None else scale, k_transposed or 0, mask,
            -3.4028234663852886e38 if fill is None else fill,
            1 if fill_kept is None else fill_kept, bias_first or 0, softcap or 0.0,
            nan_guard or 0))
