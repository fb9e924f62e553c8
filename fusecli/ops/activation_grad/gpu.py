"""ActivationGrad on the GPU: its launchers called by parameter name (fusecli/ops/gpu.py), the
outputs allocated with torch, and its timing case for tests/gpu/bench_cuda.py."""

from __future__ import annotations

from fusecli.ops.gpu import ACT, launch, ref_act_grad


def activation_grad(dy, x, act, alpha=1.0):
    import torch

    dx = torch.empty_like(dy)
    if dy.dtype == torch.float16:
        launch("fusecli_launch_activation_grad_f16", dy=dy, x=x, dx=dx, n=dy.numel(),
               act=ACT[act], alpha=alpha)
    else:
        launch("fusecli_launch_activation_grad", dy=dy, x=x, dx=dx, n=dy.numel(), act=ACT[act],
               alpha=alpha)
    return dx


def bench(add, r):
    """64M floats (256 MB per tensor) >> L2."""
    import torch

    n = 64 * 2**20
    dy, x = r(n), r(n)
    for act in ["relu", "gelu", "gelu_tanh", "silu"]:
        tf = None
        if act in ("gelu", "gelu_tanh"):
            appr = "tanh" if act == "gelu_tanh" else "none"
            tf = lambda: torch.ops.aten.gelu_backward(dy, x, approximate=appr)  # noqa: E731
        add(f"ActivationGrad[{act}]", [n], lambda: activation_grad(dy, x, act),
            lambda: ref_act_grad(dy, x, act), 3 * n * 4, tf)
    h16, x16 = dy.half(), x.half()
    add("ActivationGrad[gelu,f16]", [n], lambda: activation_grad(h16, x16, "gelu"),
        lambda: ref_act_grad(h16, x16, "gelu"), 3 * n * 2,
        lambda: torch.ops.aten.gelu_backward(h16, x16))
