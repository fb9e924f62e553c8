"""FlashAttention on the GPU: its launchers called by parameter name (fusecli/ops/gpu.py), the
outputs allocated with torch, the torch reference and its timing cases for
tests/gpu/bench_cuda.py (the issue's five shapes, forward + backward: see
fusecli/ops/flash_attention_grad/gpu.py's bench, which times the pair)."""

from __future__ import annotations

from fusecli.ops.attention_grad.gpu import fill_strides, kv_dims
from fusecli.ops.gpu import launch


FMIN = -3.4028234663852886e38


def mask_args(mask, qb, sq, sk):
    """The float32 launchers' (mask, mask_strides) (mask: a bool tensor or None)."""
    m = None if mask is None else mask.to(dtype=__import__("torch").bool).contiguous()
    return m, None if m is None else fill_strides(m.shape, (*qb, sq, sk))


def flash_attention(q, k, v, bias=None, scale=1.0, k_transposed=0, tf32=0, mask=None,
                    fill=FMIN, fill_kept=1, bias_first=0, softcap=0.0, nan_guard=0):
    """(O, LSE) for float32, float16 or bfloat16 Q, K, V (and bias) of one type; LSE float32.
    tf32 (float32 only): one TF32 product per multiply instead of split TF32. mask, softcap
    (float32 only): the bool mask with fill / fill_kept / bias_first, the scores' soft cap (the
    contract's attributes); nan_guard (float32 only): as the contract's."""
    import torch

    qb = tuple(q.shape[:-2])
    sq, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    sk = k.shape[-1] if k_transposed else k.shape[-2]
    b = None if bias is None else bias.to(q.dtype).contiguous()
    bs = None if b is None else fill_strides(b.shape, (*qb, sq, sk))
    o = torch.empty(*qb, sq, dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(*qb, sq, device=q.device, dtype=torch.float32)
    nd, qd, kd = len(qb), list(qb) or [1], list(kv_dims(qb, k)) or [1]
    if mask is not None and q.dtype != torch.float32:
        raise ValueError("flash_attention: the mask input is float32 only")
    mk, ms = mask_args(mask, qb, sq, sk)
    if q.dtype == torch.float16:
        launch("fusecli_launch_flash_attention_f16", q=q, k=k, v=v, bias=b, bias_strides=bs, o=o,
               lse=lse, nd=nd, qdims=qd, kdims=kd, sq=sq, sk=sk, d=d, dv=dv, scale=scale,
               k_transposed=k_transposed)
    elif q.dtype == torch.bfloat16:
        launch("fusecli_launch_flash_attention_bf16", q=q, k=k, v=v, bias=b, bias_strides=bs,
               o=o, lse=lse, nd=nd, qdims=qd, kdims=kd, sq=sq, sk=sk, d=d, dv=dv, scale=scale,
               k_transposed=k_transposed)
    else:
        launch("fusecli_launch_flash_attention", q=q, k=k, v=v, bias=b, bias_strides=bs, o=o,
               lse=lse, nd=nd, qdims=qd, kdims=kd, sq=sq, sk=sk, d=d, dv=dv, scale=scale,
               k_transposed=k_transposed, tf32=tf32,
               mask=mk, mask_strides=ms, fill=float(fill), fill_kept=int(fill_kept),
               bias_first=int(bias_first), softcap=float(softcap), nan_guard=int(nan_guard))
    return o, lse


def ref_attention(q, k, v, bias=None, scale=1.0, k_transposed=0, mask=None, fill=FMIN,
                  fill_kept=1, bias_first=0, softcap=0.0):
    """(O, LSE) in float64 with K/V repeated over grouped heads (the mask's fill as the
    contract: in float32, as the graph's Where and Add; softcap: c tanh(s / c) first)."""
    import torch

    kk = k.transpose(-1, -2) if k_transposed else k
    rep = q.shape[-3] // kk.shape[-3] if q.dim() >= 3 and kk.dim() >= 3 else 1
    if rep > 1:
        kk, v = kk.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    s = scale * q.double() @ kk.double().transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = masked_scores(s, bias, mask, fill, fill_kept, bias_first)
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


def masked_scores(s, bias, mask, fill, fill_kept, bias_first):
    """The scores with the additive bias and the mask's fill applied as the contract says."""
    import torch

    if mask is None:
        return s if bias is None else s + bias.double()
    filled = ~mask.bool() if fill_kept else mask.bool()
    s = s.float()
    if bias is not None and bias_first:
        s = s + bias.float()
    s = torch.where(filled, torch.tensor(fill, dtype=torch.float32, device=s.device), s)
    if bias is not None and not bias_first:
        s = s + bias.float()
    return s.double()


def bench(add, r):
    """Forward only, Llama-style attention [1, 8, 2048, 64] (the forward + backward rows of the
    issue's shapes are in flash_attention_grad/gpu.py)."""
    q, k, v = r(1, 8, 2048, 64), r(1, 8, 2048, 64), r(1, 8, 2048, 64)
    add("FlashAttention", [1, 8, 2048, 64], lambda: flash_attention(q, k, v, None, 0.125),
        lambda: ref_attention(q.float(), k.float(), v.float(), None, 0.125),
        4 * q.numel() * 4, None)
