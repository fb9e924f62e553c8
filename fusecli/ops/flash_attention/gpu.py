"""FlashAttention on the GPU: its launcher called by parameter name (fusecli/ops/gpu.py), the
outputs allocated with torch, the torch reference and its timing case for
tests/gpu/bench_cuda.py."""

from __future__ import annotations

from fusecli.ops.attention_grad.gpu import fill_strides, kv_dims
from fusecli.ops.gpu import launch


def flash_attention(q, k, v, bias=None, scale=1.0, k_transposed=0):
    """(O, LSE); bias: float, broadcastable to the scores."""
    import torch

    qb = tuple(q.shape[:-2])
    sq, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    sk = k.shape[-1] if k_transposed else k.shape[-2]
    b = None if bias is None else bias.contiguous()
    bs = None if b is None else fill_strides(b.shape, (*qb, sq, sk))
    o = torch.empty(*qb, sq, dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(*qb, sq, device=q.device, dtype=torch.float32)
    launch("fusecli_launch_flash_attention", q=q, k=k, v=v, bias=b, bias_strides=bs, o=o,
           lse=lse, nd=len(qb), qdims=list(qb) or [1], kdims=list(kv_dims(qb, k)) or [1], sq=sq,
           sk=sk, d=d, dv=dv, scale=scale, k_transposed=k_transposed)
    return o, lse


def ref_attention(q, k, v, bias=None, scale=1.0, k_transposed=0):
    """(O, LSE) in float64 with K/V repeated over grouped heads."""
    import torch

    kk = k.transpose(-1, -2) if k_transposed else k
    rep = q.shape[-3] // kk.shape[-3] if q.dim() >= 3 and kk.dim() >= 3 else 1
    if rep > 1:
        kk, v = kk.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    s = scale * q.double() @ kk.double().transpose(-1, -2)
    if bias is not None:
        s = s + bias.double()
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


def bench(add, r):
    """Llama-style attention: [1, 8, 2048, 64]."""
    q, k, v = r(1, 8, 2048, 64), r(1, 8, 2048, 64), r(1, 8, 2048, 64)
    add("FlashAttention", [1, 8, 2048, 64], lambda: flash_attention(q, k, v, None, 0.125),
        lambda: ref_attention(q.float(), k.float(), v.float(), None, 0.125),
        4 * q.numel() * 4, None)
