"""GatedActivationGrad on the GPU: its launchers called by parameter name (fusecli/ops/gpu.py),
the outputs allocated with torch, the torch reference and its timing case for
tests/gpu/bench_cuda.py."""

from __future__ import annotations

from fusecli.ops.gpu import ACT, launch

TORCH_ACT = {"silu": lambda t, a: t.nn.functional.silu(a),
             "gelu": lambda t, a: t.nn.functional.gelu(a),
             "gelu_tanh": lambda t, a: t.nn.functional.gelu(a, approximate="tanh")}


def gated_activation_grad(dh, a, b, act, alpha=1.0, da=None, db=None):
    """dA, dB of H = act(A) * B; da / db may be given (e.g. dh and b themselves: in place)."""
    import torch

    da = torch.empty_like(dh) if da is None else da
    db = torch.empty_like(dh) if db is None else db
    if dh.dtype == torch.float16:
        launch("fusecli_launch_gated_activation_grad_f16", dh=dh, a=a, b=b, da=da, db=db,
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


def bench(add, r):
    """64M elements (256 MB per float32 tensor) >> L2."""

    n = 64 * 2**20
    dh, a, b = r(n), r(n), r(n)
    for act in ("silu", "gelu"):
        add(f"GatedActivationGrad[{act}]", [n], lambda: gated_activation_grad(dh, a, b, act),
            lambda: ref_gated(dh.float(), a.float(), b.float(), act), 5 * n * 4, None)
