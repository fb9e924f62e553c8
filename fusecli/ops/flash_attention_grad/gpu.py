"""FlashAttentionGrad on the GPU: its launcher called by parameter name (fusecli/ops/gpu.py),
the outputs allocated with torch, the torch reference and its timing case for
tests/gpu/bench_cuda.py."""

from __future__ import annotations

from fusecli.ops.attention_grad.gpu import fill_strides, kv_dims
from fusecli.ops.gpu import launch


def flash_attention_grad(do, q, k, v, o, lse, bias=None, scale=1.0, k_transposed=0,
                         want=(1, 1, 1)):
    """[dQ, dK, dV] (None where not wanted)."""
    import torch

    qb = tuple(q.shape[:-2])
    sq, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    sk = k.shape[-1] if k_transposed else k.shape[-2]
    b = None if bias is None else bias.contiguous()
    bs = None if b is None else fill_strides(b.shape, (*qb, sq, sk))
    dq, dk, dvv = [torch.empty_like(t) if w_ else None for t, w_ in zip((q, k, v), want)]
    launch("fusecli_launch_flash_attention_grad", dO=do, q=q, k=k, v=v, o=o, lse=lse, bias=b,
           bias_strides=bs, dq=dq, dk=dk, dv=dvv, nd=len(qb), qdims=list(qb) or [1],
           kdims=list(kv_dims(qb, k)) or [1], sq=sq, sk=sk, d=d, dv_dim=dv, scale=scale,
           k_transposed=k_transposed)
    return [dq, dk, dvv]


def ref_attention_grad(do, q, k, v, bias=None, scale=1.0):
    """(dQ, dK, dV) by torch autograd in float64 (K as [.., Sk, D], one K/V head per Q head)."""
    import torch

    qs, ks, vs = (t.double().detach().requires_grad_(True) for t in (q, k, v))
    s = scale * qs @ ks.transpose(-1, -2)
    if bias is not None:
        s = s + bias.double()
    out = torch.softmax(s, -1) @ vs
    return torch.autograd.grad(out, (qs, ks, vs), do.double())


def bench(add, r):
    """Llama-style attention backward: [1, 8, 2048, 64]."""
    from fusecli.ops.flash_attention.gpu import flash_attention

    q, k, v, do = (r(1, 8, 2048, 64) for _ in range(4))
    o, lse = flash_attention(q, k, v, None, 0.125)
    add("FlashAttentionGrad", [1, 8, 2048, 64],
        lambda: flash_attention_grad(do, q, k, v, o, lse, None, 0.125),
        lambda: ref_attention_grad(do.float(), q.float(), k.float(), v.float(), None, 0.125),
        8 * q.numel() * 4, None)
