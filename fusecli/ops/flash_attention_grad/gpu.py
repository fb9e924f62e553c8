"""FlashAttentionGrad on the GPU: its launchers called by parameter name (fusecli/ops/gpu.py),
the outputs allocated with torch, the torch reference and its timing cases for
tests/gpu/bench_cuda.py: the issue's five shapes, FlashAttention + FlashAttentionGrad (causal
mask as an additive [S, S] bias) against torch SDPA (memory-efficient and math kernels in
float32 with TF32 off; the flash kernel in bfloat16). bench() also writes
$OUT/flash_bench.{json,md} (default build/gpu) with TFLOP/s (causal counted as half the
work) and peak memory."""

from __future__ import annotations

from fusecli.ops.attention_grad.gpu import fill_strides, kv_dims
from fusecli.ops.flash_attention.gpu import FMIN, mask_args
from fusecli.ops.gpu import launch

SHAPES = [(1, 8, 256, 64), (4, 8, 512, 64), (1, 8, 2048, 64), (2, 16, 1024, 128),
          (1, 32, 4096, 128)]


def flash_attention_grad(do, q, k, v, o, lse, bias=None, scale=1.0, k_transposed=0,
                         want=(1, 1, 1), tf32=0, mask=None, fill=FMIN, fill_kept=1,
                         bias_first=0, softcap=0.0, nan_guard=0):
    """[dQ, dK, dV] (None where not wanted); float32, float16 or bfloat16 tensors of one type
    (LSE float32). tf32 (float32 only): one TF32 product per multiply. mask, softcap (float32
    only), nan_guard (float32 only): as FlashAttention's."""
    import torch

    qb = tuple(q.shape[:-2])
    sq, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    sk = k.shape[-1] if k_transposed else k.shape[-2]
    b = None if bias is None else bias.to(q.dtype).contiguous()
    bs = None if b is None else fill_strides(b.shape, (*qb, sq, sk))
    dq, dk, dvv = [torch.empty_like(t) if w_ else None for t, w_ in zip((q, k, v), want)]
    nd, qd, kd = len(qb), list(qb) or [1], list(kv_dims(qb, k)) or [1]
    if mask is not None and q.dtype != torch.float32:
        raise ValueError("flash_attention_grad: the mask input is float32 only")
    mk, ms = mask_args(mask, qb, sq, sk)
    if q.dtype == torch.float16:
        launch("fusecli_launch_flash_attention_grad_f16", dO=do, q=q, k=k, v=v, o=o, lse=lse,
               bias=b, bias_strides=bs, dq=dq, dk=dk, dv=dvv, nd=nd, qdims=qd, kdims=kd, sq=sq,
               sk=sk, d=d, dv_dim=dv, scale=scale, k_transposed=k_transposed)
    elif q.dtype == torch.bfloat16:
        launch("fusecli_launch_flash_attention_grad_bf16", dO=do, q=q, k=k, v=v, o=o, lse=lse,
               bias=b, bias_strides=bs, dq=dq, dk=dk, dv=dvv, nd=nd, qdims=qd, kdims=kd, sq=sq,
               sk=sk, d=d, dv_dim=dv, scale=scale, k_transposed=k_transposed)
    else:
        launch("fusecli_launch_flash_attention_grad", dO=do, q=q, k=k, v=v, o=o, lse=lse, bias=b,
               bias_strides=bs, dq=dq, dk=dk, dv=dvv, nd=nd, qdims=qd, kdims=kd, sq=sq, sk=sk,
               d=d, dv_dim=dv, scale=scale, k_transposed=k_transposed, tf32=tf32,
               mask=mk, mask_strides=ms, fill=float(fill), fill_kept=int(fill_kept),
               bias_first=int(bias_first), softcap=float(softcap), nan_guard=int(nan_guard))
    return [dq, dk, dvv]


def ref_attention_grad(do, q, k, v, bias=None, scale=1.0, mask=None, fill=FMIN, fill_kept=1,
                       softcap=0.0):
    """(dQ, dK, dV) by torch autograd in float64 (K as [.., Sk, D]; K/V repeated over grouped
    heads, their gradients summed back over each group); with mask: Where(kept, S, fill)
    [+ bias], whose autograd gradient is Where's (0 at filled positions); softcap: the scores
    c tanh(S / c) first."""
    import torch

    qs, ks, vs = (t.double().detach().requires_grad_(True) for t in (q, k, v))
    kk, vv = ks, vs
    rep = q.shape[-3] // k.shape[-3] if q.dim() >= 3 and k.dim() >= 3 else 1
    if rep > 1:
        kk, vv = ks.repeat_interleave(rep, -3), vs.repeat_interleave(rep, -3)
    s = scale * qs @ kk.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        kept = mask.bool() if fill_kept else ~mask.bool()
        s = torch.where(kept, s, torch.tensor(fill, dtype=torch.float64, device=s.device))
    if bias is not None:
        s = s + bias.double()
    out = torch.softmax(s, -1) @ vv
    return torch.autograd.grad(out, (qs, ks, vs), do.double())


def _fused_step(q, k, v, do, bias, scale, tf32=0):
    from fusecli.ops.flash_attention.gpu import flash_attention

    o, lse = flash_attention(q, k, v, bias, scale, tf32=tf32)
    return flash_attention_grad(do, q, k, v, o, lse, bias, scale, tf32=tf32)


def _torch_step(backend, q, k, v, do, scale):
    """torch SDPA forward + backward (is_causal) on one backend."""
    import torch
    from torch.nn.attention import sdpa_kernel

    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    with sdpa_kernel(backend):
        o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                                             scale=scale)
    o.backward(do)
    return qq.grad


def _peak_mib(fn):
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench(add, r):
    """The issue's shapes, forward + backward, causal: float32 (split TF32; and one TF32
    product) against torch's float32 memory-efficient and math SDPA, bfloat16 against torch's
    bfloat16 flash kernel."""
    import json
    import os
    import statistics
    from pathlib import Path

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    def ms(fn, iters=10):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        return statistics.median(ts)

    rows = []
    for shape in SHAPES:
        for dt in (torch.float32, torch.bfloat16):
            rows.append(_bench_one(add, r, ms, shape, dt))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", "build/gpu"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "flash_bench.json").write_text(json.dumps(rows, indent=1))
    lines = ["| shape | type | fusecli ms | fusecli TF32 ms | torch ms (kernel) | fusecli TFLOP/s "
             "| torch TFLOP/s | fusecli peak MiB | torch peak MiB |", "|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        lines.append(f"| {x['shape']} | {x['dtype']} | {x['fused_ms']} | {x.get('fused_tf32_ms', '')} "
                     f"| {x['torch_ms']} ({x['torch_kernel']}) | {x['fused_tflops']} "
                     f"| {x['torch_tflops']} | {x['fused_peak_mib']} | {x['torch_peak_mib']} |")
    (out / "flash_bench.md").write_text("\n".join(lines) + "\n")


def _bench_one(add, r, ms, shape, dt):
    """One shape and type: the bench_cuda row and the flash_bench row."""
    import torch
    from torch.nn.attention import SDPBackend

    b, h, s, d = shape
    scale = d ** -0.5
    flops = 0.5 * (4 + 10) * b * h * s * s * d  # fwd 2 GEMMs + bwd 5 (2 flop each), causal half
    q, k, v, do = (r(*shape).to(dt) for _ in range(4))
    bias = torch.full((s, s), float("-inf"), device="cuda").triu(1).to(dt)
    name = "fp32" if dt == torch.float32 else "bf16"
    other = SDPBackend.EFFICIENT_ATTENTION if dt == torch.float32 else SDPBackend.FLASH_ATTENTION

    def fused():
        return _fused_step(q, k, v, do, bias, scale)

    def math_():
        return _torch_step(SDPBackend.MATH, q, k, v, do, scale)

    def tfused():
        return _torch_step(other, q, k, v, do, scale)

    add(f"FlashAttention+Grad[{name},causal]", list(shape), fused, math_, None, tfused)
    row = dict(shape=list(shape), dtype=name, fused_ms=ms(fused), torch_ms=ms(tfused),
               torch_kernel="efficient" if dt == torch.float32 else "flash",
               fused_peak_mib=_peak_mib(fused), torch_peak_mib=_peak_mib(tfused))
    if dt == torch.float32:
        row["fused_tf32_ms"] = ms(lambda: _fused_step(q, k, v, do, bias, scale, tf32=1))
    row["fused_tflops"] = flops / row["fused_ms"] / 1e9
    row["torch_tflops"] = flops / row["torch_ms"] / 1e9
    return {k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()}
