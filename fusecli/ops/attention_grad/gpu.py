"""AttentionGrad on the GPU: its launchers called by parameter name (fusecli/ops/gpu.py), the
outputs allocated with torch, the unfused torch reference (grouped / multi-query attention,
dropout, fill masks) and its timing cases for tests/gpu/bench_cuda.py."""

from __future__ import annotations

import math

from fusecli.ops.gpu import launch


def kv_dims(q_batch, t):
    """K's (or V's) batch dims right-aligned with P's, missing leading ones 1."""
    kb = tuple(t.shape[:-2])
    return (1,) * (len(q_batch) - len(kb)) + kb


def fill_strides(shape, pshape):
    """The fill mask's element strides over P's dims (right-aligned, 0 where broadcast)."""
    st, out = 1, [0] * len(pshape)
    for i, n in enumerate(reversed(shape)):
        out[len(pshape) - 1 - i] = 0 if n == 1 else st
        st *= n
    return out


def attention_grad(do, q, k, v, p, scale_q=1.0, scale_k=1.0, k_transposed=0, want=(1, 1, 1),
                   mask=None, ratio=0.0, nan_guard=0, fill=None, fill_kept=0):
    """want: dQ, dK, dV (and dS when it has 4 items); mask: bool tensor of P's shape or None;
    nan_guard: the contract's attribute (dV reads P's NaN entries as 0); fill: a bool fill
    mask broadcastable to P's shape (fill_kept: its polarity), dQ and dK read dS as 0 there.
    K and V may have fewer batch rows than P (grouped / multi-query attention)."""
    import torch

    qb = tuple(p.shape[:-2])
    outs = [torch.empty_like(t) if w_ else None for t, w_ in zip((q, k, v, p), want)]
    outs += [None] * (4 - len(outs))
    m = None if mask is None else mask.to(torch.bool).contiguous()
    f = None if fill is None else fill.to(torch.bool).contiguous()
    launch("fusecli_launch_attention_grad", dO=do, q=q, k=k, v=v, p=p, mask=m,
           dq=outs[0], dk=outs[1], dv=outs[2], ds=outs[3], nd=len(qb), qdims=qb,
           kdims=kv_dims(qb, k), vdims=kv_dims(qb, v), sq=p.shape[-2], sk=p.shape[-1],
           d=q.shape[-1], dv_dim=v.shape[-1], scale_q=scale_q, scale_k=scale_k,
           keep=1.0 / (1.0 - ratio), k_transposed=k_transposed, nan_guard=nan_guard, fill=f,
           fill_strides=None if f is None else fill_strides(f.shape, p.shape),
           fill_kept=fill_kept)
    return outs[:len(want)]


def read_scalar(t) -> float:
    """One float of device memory (a run-time scale tensor), as the CUDA kernel reads it."""
    import ctypes

    out = (ctypes.c_float * 1)()
    launch("fusecli_read_scalar", p=t, out=out)
    return out[0]


def ref_attention(do, q, k, v, p, sq_, sk_, kt, mask=None, ratio=0.0, nan_guard=0, fill=None,
                  fill_kept=0):
    """AttentionGrad's contract in torch: K / V expanded to P's batch dims (query index i of a
    dim reads kv index i // (Hq / Hkv)), dK / dV summed back over each group; the fill mask
    zeroes the dS dQ and dK read (not the dS output); (dQ, dK, dV, dS)."""
    qb = tuple(p.shape[:-2])

    def split(tb):
        return [x for qd, kd in zip(qb, tb) for x in (kd, qd // kd)]

    def expand(t):
        tb = kv_dims(qb, t)
        t = t.reshape(*[x for kd in tb for x in (kd, 1)], *t.shape[-2:])
        return t.expand(*split(tb), *t.shape[-2:]).reshape(*qb, *t.shape[-2:])

    def group_sum(t, like):
        tb = kv_dims(qb, like)
        if qb:  # (torch sums over every dim for an empty dim tuple)
            t = t.reshape(*split(tb), *t.shape[-2:]).sum(tuple(range(1, 2 * len(qb), 2)))
        return t.reshape(like.shape[:-2] + t.shape[-2:])

    keep = 1.0 if mask is None else mask.to(p.dtype) / (1.0 - ratio)
    k_sd = expand(k.transpose(-1, -2) if kt else k)
    pg = p.nan_to_num(nan=0.0, posinf=float("inf"), neginf=float("-inf")) if nan_guard else p
    dv = group_sum((pg * keep).transpose(-1, -2) @ do, v)
    dp = (do @ expand(v).transpose(-1, -2)) * keep
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dsm = ds
    if fill is not None:
        filled = (~fill if fill_kept else fill).bool().expand(p.shape)
        dsm = ds.masked_fill(filled, 0.0)
    dq = sq_ * (dsm @ k_sd)
    dk = group_sum(sk_ * (dsm.transpose(-1, -2) @ q), k.transpose(-1, -2) if kt else k)
    return dq, (dk.transpose(-1, -2) if kt else dk), dv, ds


def bench(add, r):
    _bench_heads(add, r)
    _bench_gqa_dropout(add, r)


def _bench_heads(add, r):
    """B*H=64, S=1024, D=64."""
    import torch

    b, s, d = 64, 1024, 64
    do, q, k_, v = r(b, s, d), r(b, s, d), r(b, s, d), r(b, s, d)
    p = torch.softmax(r(b, s, s), -1)
    sc = 1 / math.sqrt(d)
    add("AttentionGrad", [b, s, s, d], lambda: attention_grad(do, q, k_, v, p, sc, sc),
        lambda: ref_attention(do, q, k_, v, p, sc, sc, 0), flops=4 * 2 * b * s * s * d,
        tf32=lambda: ref_attention(do, q, k_, v, p, sc, sc, 0))


def _bench_gqa_dropout(add, r):
    """Llama-style grouped-query attention with dropout: 2 x 32 query heads on 8 kv heads,
    S=1024, D=128 (the unfused reference expands K / V and sums dK / dV back)."""
    import torch

    qb, kb, s, d = (2, 32), (2, 8), 1024, 128
    do, q, k_, v = r(*qb, s, d), r(*qb, s, d), r(*kb, s, d), r(*kb, s, d)
    p = torch.softmax(r(*qb, s, s), -1)
    mask = torch.rand(*qb, s, s, device="cuda") >= 0.1
    sc = 1 / math.sqrt(d)
    add("AttentionGrad[gqa,dropout]", [*qb, s, s, d],
        lambda: attention_grad(do, q, k_, v, p, sc, sc, 0, (1, 1, 1), mask, 0.1),
        lambda: ref_attention(do, q, k_, v, p, sc, sc, 0, mask, 0.1))
