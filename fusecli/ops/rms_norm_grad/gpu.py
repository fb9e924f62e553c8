"""RMSNormGrad on the GPU: its launchers called by parameter name (fusecli/ops/gpu.py), the
outputs allocated with torch, the unfused torch reference and its timing cases for
tests/gpu/bench_cuda.py."""

from __future__ import annotations

from fusecli.ops.gpu import memk_paths, launch


def rms_norm_grad(dy, x, gamma=None, inv_rms=None, dr=None, want=(1, 1), epsilon=1e-5):
    """gamma None: an RMSNorm without weight; inv_rms None: recomputed from x and epsilon."""
    import torch

    n = x.shape[-1]
    m = x.numel() // n
    dx, dgamma = [torch.empty(s, device=x.device, dtype=x.dtype) if w_ else None
                  for s, w_ in zip((x.shape, (n,)), want)]
    half_stats = int(inv_rms is not None and inv_rms.dtype == x.dtype)
    if x.dtype == torch.float16:
        launch("fusecli_launch_rms_norm_grad_f16", dy=dy, x=x, gamma=gamma, inv_rms=inv_rms,
               stats_f16=half_stats, epsilon=epsilon, dr=dr, dx=dx, dgamma=dgamma, m=m, n=n)
    elif x.dtype == torch.bfloat16:
        launch("fusecli_launch_rms_norm_grad_bf16", dy=dy, x=x, gamma=gamma, inv_rms=inv_rms,
               stats_bf16=half_stats, epsilon=epsilon, dr=dr, dx=dx, dgamma=dgamma, m=m, n=n)
    else:
        launch("fusecli_launch_rms_norm_grad", dy=dy, x=x, gamma=gamma, inv_rms=inv_rms,
               epsilon=epsilon, dr=dr, dx=dx, dgamma=dgamma, m=m, n=n)
    return [dx, dgamma]


def ref_rms_norm(dy, x, gamma=None, dr=None, epsilon=1e-5):
    """torch autograd through the unfused forward x * rsqrt(mean(x^2) + eps) (* gamma)."""
    import torch

    xs = x.detach().clone().requires_grad_(True)
    g = None if gamma is None else gamma.detach().clone().requires_grad_(True)
    y = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + epsilon)
    if g is not None:
        y = y * g
    y.backward(dy)
    dx = xs.grad if dr is None else xs.grad + dr
    return dx, None if g is None else g.grad


def bench(add, r):
    """16384 x 4096 (Llama-style rows; 256 MB per tensor), inv_rms saved."""
    add = memk_paths(add)
    import torch

    m, nn = 16384, 4096
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        x, dy, g = r(m, nn, dtype=dt), r(m, nn, dtype=dt), r(nn, dtype=dt)
        irms = torch.rsqrt(x.float().pow(2).mean(1) + 1e-6)

        def unfused_rms(dy=dy, x=x, g=g, irms=irms):  # the torch-joint chain's ops, eager
            r_ = irms[:, None].to(x.dtype)
            gg = dy * g
            s = (gg * x).sum(-1, keepdim=True)
            return (gg * r_ + (s * -0.5 * r_.pow(3)).expand_as(x) / nn * (2 * x),
                    (dy * (x * r_)).sum(0))
        add(f"RMSNormGrad[{str(dt).split('.')[-1]}]", [m, nn],
            lambda: rms_norm_grad(dy, x, g, irms, None, (1, 1), 1e-6), unfused_rms,
            3 * m * nn * x.element_size())
