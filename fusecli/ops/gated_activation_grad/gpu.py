"""GatedActivationGrad on the GPU: its launchers called by parameter name (fusecli/ops/gpu.py),
the outputs allocated with torch, the torch reference and its timing case for
tests/gpu/bench_cuda.py."""

from __future__ import annotations

from fusecli.ops.gpu import memk_paths, ACT, launch

TORCH_ACT = {"silu": lambda t, a: t.nn.functional.silu(a),
             "gelu": lambda t, a: t.nn.functional.gelu(a),
             "gelu_tanh": lambda t, a: t.nn.functional.gelu(a, approximate="tanh")}


def gated_activation_grad(dh, a, b, act, alpha=1.0, da=None, db=None, want=(1, 1)):
    """dA, dB of H = act(A) * B; da / db may be given (e.g. dh and b themselves: in place);
    want: which outputs to compute (an omitted one comes back None)."""
    import torch

    da = (torch.empty_like(dh) if da is None else da) if want[0] else None
    db = (torch.empty_like(dh) if db is None else db) if want[1] else None
    if dh.dtype == torch.float16:
        launch("fusecli_launch_gated_activation_grad_f16", dh=dh, a=a, b=b, da=da, db=db,
               n=dh.numel(), act=ACT[act], alpha=alpha)
    elif dh.dtype == torch.bfloat16:
        launch("fusecli_launch_gated_activation_grad_bf16", dh=dh, a=a, b=b, da=da, db=db,
               n=dh.numel(), act=ACT[act], alpha=alpha)
    else:
        launch("fusecli_launch_gated_activation_grad", dh=dh, a=a, b=b, da=da, db=db,
               n=dh.numel(), act=ACT[act], alpha=alpha)
    return da, db


def ref_gated(dh, a, b, act):
    """torch autograd of act(A) * B (float64)."""
    import torch

    ag, bg = a.double().requires_grad_(True), b.double().requires_grad_(True)
    return torch.autograd.grad(TORCH_ACT[act](torch, ag) * bg, (ag, bg), dh.double())


def unfused(dh, a, b, act):
    """What the unfused graph runs, in the tensors' own type: act(A) and its backward, two
    products."""
    import torch

    f = TORCH_ACT[act](torch, a)
    g = (torch.ops.aten.silu_backward(dh * b, a) if act == "silu" else
         torch.ops.aten.gelu_backward(dh * b, a,
                                      approximate="tanh" if act == "gelu_tanh" else "none"))
    return g, dh * f


def bench(add, r):
    """64M elements (256 MB per float32 tensor) >> L2; float32, float16 and bfloat16, each
    against torch's unfused ops in the same type."""
    add = memk_paths(add)
    import torch

    n = 64 * 2**20
    dh, a, b = r(n), r(n), r(n)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        h, x, y = dh.to(dt), a.to(dt), b.to(dt)
        name = "" if dt == torch.float32 else "," + str(dt).split(".")[-1]
        for act in ("silu", "gelu"):
            add(f"GatedActivationGrad[{act}{name}]", [n],
                lambda: gated_activation_grad(h, x, y, act),
                lambda: unfused(h, x, y, act), 5 * n * h.element_size(), None)
