"""LoraLinearGrad on the GPU: its launcher called by parameter name (fusecli/ops/gpu.py), the
outputs allocated with torch, the torch reference and its timing case for
tests/gpu/bench_cuda.py."""

from __future__ import annotations

from fusecli.ops.gpu import ACT, launch, ref_act_grad, workspace


def lora_linear_grad(dy, x, a, w, la, lb, h, xd=None, act="identity", scale=1.0, trans_w=0,
                     split_dx=0, want=(1, 1, 1, 1, 1, 1), dz=None, alpha=1.0):
    """[dX, dXa, dLa, dLb, dW, dB] (None where not wanted) and, with dz, dZ as a 7th item."""
    import torch

    n, k, r = dy.shape[-1], a.shape[-1], la.shape[0]
    m = dy.numel() // n
    dx = torch.empty_like(a) if want[0] else None
    dxa = torch.empty_like(a) if want[1] else None
    dla = torch.empty_like(la) if want[2] else None
    dlb = torch.empty_like(lb) if want[3] else None
    dw = torch.empty_like(w) if want[4] else None
    db = torch.empty(n, device=dy.device, dtype=dy.dtype) if want[5] else None
    dy, dz_t = workspace(dy, dz)
    launch("fusecli_launch_lora_linear_grad", dy=dy, x=x, a=a, w=w, la=la, lb=lb, h=h, xd=xd,
           dx=dx, dxa=dxa, dla=dla, dlb=dlb, dw=dw, db=db, dz=dz_t, m=m, n=n, k=k, r=r,
           act=ACT[act], alpha=alpha, scale=scale, trans_w=trans_w, split_dx=split_dx)
    out = [dx, dxa, dla, dlb, dw, db]
    return out if dz is None else out + [dz_t]


def ref_lora(dy, x, a, w, la, lb, h, xd, act, scale, trans_w, split_dx):
    """LoraLinearGrad's contract in torch (float64): [dX, dXa, dLa, dLb, dW, dB]."""
    n, k, r = dy.shape[-1], a.shape[-1], la.shape[0]
    dz = ref_act_grad(dy, x, act).reshape(-1, n)
    a2 = a.reshape(-1, k)
    xd2 = a2 if xd is None else xd.reshape(-1, k)
    g = scale * (dz @ lb)
    wnk = w.t() if trans_w else w
    base, adapter = dz @ wnk, g @ la
    dx = (base if split_dx else base + adapter).reshape(a.shape)
    dw = a2.t() @ dz if trans_w else dz.t() @ a2
    return [dx, adapter.reshape(a.shape), g.t() @ xd2,
            scale * dz.t() @ h.reshape(-1, r), dw, dz.sum(0)]


def unfused_lora_frozen(dy, a, w, la, lb, h, scale):
    """What the unfused graph computes for a frozen base (identity activation, no dW / dB):
    dX = dY W + s (dY Lb) La, dLa = s (dY Lb)^T A, dLb = s dY^T H (torch, input precision)."""
    g = scale * (dy @ lb)
    return dy @ w + g @ la, g.t() @ a, scale * (dy.t() @ h)


def bench(add, r):
    """Issue 34's table: M=N=K=4096, rank 16, a frozen base (dX, dLa, dLb)."""
    m, n, k, rank = 4096, 4096, 4096, 16
    dy, x, a, w = r(m, n), r(m, n), r(m, k), r(n, k)
    la, lb = r(rank, k), r(n, rank)
    h = a @ la.t()
    want = (1, 0, 1, 1, 0, 0)
    add("LoraLinearGrad[identity]", [m, n, k, rank],
        lambda: lora_linear_grad(dy, x, a, w, la, lb, h, None, "identity", 2.0, 0, 0, want),
        lambda: unfused_lora_frozen(dy, a, w, la, lb, h, 2.0),
        (3 * m * n + 2 * m * k) * 4, None, flops=2 * m * n * k + 2 * 4 * m * rank * n,
        tf32=lambda: unfused_lora_frozen(dy, a, w, la, lb, h, 2.0))
