"""LinearActivationGrad on the GPU: its launcher called by parameter name (fusecli/ops/gpu.py),
the outputs allocated with torch, the unfused torch reference and its timing case for
tests/gpu/bench_cuda.py."""

from __future__ import annotations

from fusecli.ops.gpu import ACT, launch, ref_act_grad, workspace


def linear_activation_grad(dy, x, a, w, act, trans_w=0, want=(1, 1, 1), trans_dw=None, dz=None,
                           alpha=1.0):
    """dz: None (no dZ output), "out" (a separate dZ tensor) or "inplace" (dZ written over a
    copy of dY, as onnxruntime's in-place plan does); with dz the result has a 4th item."""
    import torch

    n, k = dy.shape[-1], a.shape[-1]
    m = dy.numel() // n
    da = torch.empty_like(a) if want[0] else None
    trans_dw = trans_w if trans_dw is None else trans_dw
    dw = (torch.empty_like(w) if trans_dw == trans_w else torch.empty_like(w.t())) \
        if want[1] else None
    db = torch.empty(n, device=dy.device, dtype=dy.dtype) if want[2] else None
    dy, dz_t = workspace(dy, dz)
    launch("fusecli_launch_linear_activation_grad", dy=dy, x=x, a=a, w=w, da=da, dw=dw, db=db,
           dz=dz_t, m=m, n=n, k=k, act=ACT[act], alpha=alpha, trans_w=trans_w,
           trans_dw=trans_dw)
    return (da, dw, db) if dz is None else (da, dw, db, dz_t)


def ref_linear(dy, x, a, w, act, trans_w):
    n, k = dy.shape[-1], a.shape[-1]
    dz = ref_act_grad(dy, x, act).reshape(-1, n)
    a2 = a.reshape(-1, k)
    wnk = w.t() if trans_w else w
    da = (dz @ wnk).reshape(a.shape)
    dw = a2.t() @ dz if trans_w else dz.t() @ a2
    return da, dw, dz.sum(0)


def bench(add, r):
    """M=8192 tokens, N=4096, K=1024 (issue 34's table); unfused: torch float32, TF32 off (and
    the same in TF32)."""
    m, nn, k = 8192, 4096, 1024
    dy, x, a, w = r(m, nn), r(m, nn), r(m, k), r(nn, k)
    add("LinearActivationGrad[gelu]", [m, nn, k],
        lambda: linear_activation_grad(dy, x, a, w, "gelu"),
        lambda: ref_linear(dy, x, a, w, "gelu", 0), flops=2 * 2 * m * nn * k,
        tf32=lambda: ref_linear(dy, x, a, w, "gelu", 0))
