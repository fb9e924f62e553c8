"""LayerNormGrad on the GPU: its launchers called by parameter name (fusecli/ops/gpu.py), the
outputs allocated with torch, the unfused torch reference and its timing cases for
tests/gpu/bench_cuda.py."""

from __future__ import annotations

from fusecli.ops.gpu import memk_paths, launch


def layer_norm_grad(dy, x, gamma, mean, inv_std, dr=None, want=(1, 1, 1)):
    import torch

    n = gamma.numel()
    m = x.numel() // n
    dx, dgamma, dbeta = [torch.empty(s, device=x.device, dtype=x.dtype) if w_ else None
                         for s, w_ in zip((x.shape, gamma.shape, gamma.shape), want)]
    if x.dtype == torch.float16:
        launch("fusecli_launch_layer_norm_grad_f16", dy=dy, x=x, gamma=gamma, mean=mean,
               inv_std=inv_std, stats_f16=int(mean.dtype == torch.float16), dr=dr, dx=dx,
               dgamma=dgamma, dbeta=dbeta, m=m, n=n)
    elif x.dtype == torch.bfloat16:
        launch("fusecli_launch_layer_norm_grad_bf16", dy=dy, x=x, gamma=gamma, mean=mean,
               inv_std=inv_std, stats_bf16=int(mean.dtype == torch.bfloat16), dr=dr, dx=dx,
               dgamma=dgamma, dbeta=dbeta, m=m, n=n)
    else:
        launch("fusecli_launch_layer_norm_grad", dy=dy, x=x, gamma=gamma, mean=mean,
               inv_std=inv_std, dr=dr, dx=dx, dgamma=dgamma, dbeta=dbeta, m=m, n=n)
    return [dx, dgamma, dbeta]


def ref_layer_norm(dy, x, gamma, mean, inv_std, dr=None):
    n = gamma.numel()
    d = dy.reshape(-1, n)
    xs = x.reshape(-1, n)
    mu = mean.reshape(-1, 1)
    rs = inv_std.reshape(-1, 1)
    xhat = (xs - mu) * rs
    g = d * gamma.reshape(1, n)
    dx = rs * (g - g.mean(1, keepdim=True) - xhat * (g * xhat).mean(1, keepdim=True))
    if dr is not None:
        dx = dx + dr.reshape(-1, n)
    return (dx.reshape(x.shape), (d * xhat).sum(0).reshape(gamma.shape),
            d.sum(0).reshape(gamma.shape))


def bench(add, r):
    """16384 x 4096 (256 MB per tensor)."""
    add = memk_paths(add)
    import torch

    m, nn = 16384, 4096
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        x, dy, g = r(m, nn, dtype=dt), r(m, nn, dtype=dt), r(nn, dtype=dt)
        mean = x.float().mean(1)
        istd = 1 / torch.sqrt(x.float().var(1) + 1e-5)
        es = x.element_size()
        add(f"LayerNormGrad[{str(dt).split('.')[-1]}]", [m, nn],
            lambda: layer_norm_grad(dy, x, g, mean, istd),
            lambda: ref_layer_norm(dy.float(), x.float(), g.float(), mean, istd),
            3 * m * nn * es,
            lambda: torch.ops.aten.native_layer_norm_backward(
                dy, x, [nn], mean[:, None], istd[:, None], g, torch.zeros_like(g),
                [True, True, True]))
