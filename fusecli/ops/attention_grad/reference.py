"""NumPy reference of AttentionGrad (the oracle for its kernels), following its contract.yaml."""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from fusecli.ops.reference import _fit


def attention_kv_dims(q_batch, kv_shape, mat_elems, what="K"):
    """The batch dims of K (or V) aligned with P's batch dims ``q_batch``: a K whose element
    count is P's batch count times ``mat_elems`` counts as P's batch dims; else AttentionGrad's
    grouping rule (right-aligned, missing leading dims 1, each equal to P's or dividing it)."""
    q_batch = tuple(int(d) for d in q_batch)
    kb = tuple(int(d) for d in kv_shape[:-2])
    if int(np.prod(kv_shape)) == int(np.prod(q_batch)) * mat_elems:
        return q_batch
    if len(kb) <= len(q_batch):
        kb_full = (1,) * (len(q_batch) - len(kb)) + kb
        if all(k == q or (k >= 1 and q % k == 0) for q, k in zip(q_batch, kb_full)):
            return kb_full
    raise ValueError(f"AttentionGrad: {what}'s batch dims {list(kb)} must equal or divide P's "
                     f"{list(q_batch)} dim by dim (grouped / multi-query attention)")


def _expand(t, q_batch, kv_batch):
    """[*kv_batch, r, c] -> [*q_batch, r, c]: query index i of dim j reads kv index
    i // (q_j / kv_j)."""
    lead = []
    for k in kv_batch:
        lead += [k, 1]
    t = t.reshape(*lead, *t.shape[-2:])
    full = []
    for q, k in zip(q_batch, kv_batch):
        full += [k, q // k if k else 0]
    return np.broadcast_to(t, (*full, *t.shape[-2:])).reshape(*q_batch, *t.shape[-2:])


def _group_sum(t, q_batch, kv_batch):
    """[*q_batch, r, c] -> [*kv_batch, r, c]: sums the query items that share a kv item."""
    split = []
    for q, k in zip(q_batch, kv_batch):
        split += [k, q // k if k else 0]
    t = t.reshape(*split, *t.shape[-2:])
    return t.sum(axis=tuple(range(1, 2 * len(q_batch), 2))).reshape(*kv_batch, *t.shape[-2:])


def attention_grad(do, q, k, v, p, scale_q=1.0, scale_k=1.0, k_transposed=0, q_scale=None,
                   k_scale=None, dropout_mask=None, dropout_ratio=0.0, nan_guard=0, fill_mask=None,
                   fill_kept=0):
    """Returns (dQ, dK, dV, dS) as the contract defines them (grouped K / V, dropout, fill
    mask: dQ and dK read dS as 0 where the forward filled the scores; dS is not zeroed)."""
    qb, (sq, sk) = p.shape[:-2], p.shape[-2:]
    d, dvd = q.shape[-1], v.shape[-1]
    kb = attention_kv_dims(qb, k.shape, sk * d, "K")
    vb = attention_kv_dims(qb, v.shape, sk * dvd, "V")
    if dropout_mask is None and dropout_ratio:
        raise ValueError("AttentionGrad: dropout_ratio needs dropout_mask")
    if dropout_mask is not None and tuple(dropout_mask.shape) != tuple(p.shape):
        raise ValueError(f"AttentionGrad: dropout_mask must have P's shape {list(p.shape)}")
    do64 = do.astype(np.float64).reshape(*qb, sq, dvd)
    q64 = q.astype(np.float64).reshape(*qb, sq, d)
    p64 = p.astype(np.float64)
    k64 = k.astype(np.float64).reshape(*kb, *k.shape[-2:])
    k_sd = np.swapaxes(k64, -1, -2) if k_transposed else k64  # [*kb, Sk, D]
    v64 = v.astype(np.float64).reshape(*vb, sk, dvd)
    if dropout_mask is None:
        keep = 1.0
    else:
        keep = dropout_mask.astype(np.float64) / (1.0 - float(dropout_ratio))
    pd = (np.where(np.isnan(p64), 0.0, p64) if nan_guard else p64) * keep  # what V saw
    dv = _group_sum(np.swapaxes(pd, -1, -2) @ do64, qb, vb)
    dp = (do64 @ np.swapaxes(_expand(v64, qb, vb), -1, -2)) * keep
    ds = p64 * (dp - (dp * p64).sum(axis=-1, keepdims=True))
    dsm = ds
    if fill_mask is not None:
        fm = np.asarray(fill_mask).astype(bool)
        try:
            fm = np.broadcast_to(fm, p.shape)
        except ValueError:
            raise ValueError(f"AttentionGrad: fill_mask {list(fm.shape)} must broadcast to P's "
                             f"shape {list(p.shape)}") from None
        dsm = np.where(~fm if fill_kept else fm, 0.0, ds)
    if q_scale is not None:
        scale_q = scale_q * float(np.asarray(q_scale, dtype=np.float64).reshape(-1)[0])
    if k_scale is not None:
        scale_k = scale_k * float(np.asarray(k_scale, dtype=np.float64).reshape(-1)[0])
    dq = scale_q * (dsm @ _expand(k_sd, qb, kb))
    dk = _group_sum(scale_k * (np.swapaxes(dsm, -1, -2) @ q64), qb, kb)
    if k_transposed:
        dk = np.swapaxes(dk, -1, -2)
    return (dq.reshape(q.shape).astype(q.dtype), dk.reshape(k.shape).astype(k.dtype),
            dv.reshape(v.shape).astype(v.dtype), ds.astype(p.dtype))


class Reference(OpRun):

    def _run(self, do, q, k, v, p, q_scale=None, k_scale=None, dropout_mask=None,
             fill_mask=None, scale_q=1.0, scale_k=1.0, k_transposed=0, dropout_ratio=0.0,
             nan_guard=0, fill_kept=0):
        return _fit(self, attention_grad(do, q, k, v, p, 1.0 if scale_q is None else scale_q,
                                         1.0 if scale_k is None else scale_k,
                                         k_transposed or 0, q_scale, k_scale, dropout_mask,
                                         dropout_ratio or 0.0, nan_guard or 0, fill_mask,
                                         fill_kept or 0))
