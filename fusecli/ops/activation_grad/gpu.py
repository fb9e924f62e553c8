"""ActivationGrad on the GPU: its launchers called by parameter name (fusecli/ops/gpu.py), the
outputs allocated with torch, and its timing case for tests/gpu/bench_cuda.py."""

from __future__ import annotations

from fusecli.ops.gpu import memk_paths, ACT, launch, ref_act_grad


def activation_grad(dy, x, act, alpha=1.0, out=None):
    """dX (float32, float16 or bfloat16 like dY); `out` may be dY itself (the in-place pair)."""
    import torch

    dx = torch.empty_like(dy) if out is None else out
    if dy.dtype == torch.float16:
        launch("fusecli_launch_activation_grad_f16", dy=dy, x=x, dx=dx, n=dy.numel(),
               act=ACT[act], alpha=alpha)
    elif dy.dtype == torch.bfloat16:
        launch("fusecli_launch_activation_grad_bf16", dy=dy, x=x, dx=dx, n=dy.numel(),
               act=ACT[act], alpha=alpha)
    else:
        launch("fusecli_launch_activation_grad", dy=dy, x=x, dx=dx, n=dy.numel(), act=ACT[act],
               alpha=alpha)
    return dx


def bench(add, r):
    """64M floats (256 MB per tensor) >> L2."""
    add = memk_paths(add)
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
    for dt in (torch.float16, torch.bfloat16):  # vs torch in the same type
        h, xh = dy.to(dt), x.to(dt)
        name = str(dt).split(".")[-1]
        torch_fused = {"gelu": lambda: torch.ops.aten.gelu_backward(h, xh),
                       "silu": lambda: torch.ops.aten.silu_backward(h, xh)}
        for act, tf in torch_fused.items():
            add(f"ActivationGrad[{act},{name}]", [n], lambda: activation_grad(h, xh, act),
                lambda: ref_act_grad(h, xh, act), 3 * n * h.element_size(), tf)
