"""GatedActivationGrad's CUDA launchers (through fusecli/ops/gpu.py, torch device pointers)
against torch autograd. GPU machine only (tests/gpu/run_gpu_checks.sh); skipped elsewhere."""

from __future__ import annotations

import pytest

from gpu_helpers import _seed, close, rand, torch_or_skip

torch = torch_or_skip()  # skips this module where torch.cuda is unavailable
pytestmark = pytest.mark.gpu

from fusecli.ops.gated_activation_grad.gpu import (TORCH_ACT, gated_activation_grad,  # noqa: E402
                                                   ref_gated)


@pytest.mark.parametrize("act", sorted(TORCH_ACT))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape", [(1,), (17,), (5, 33), (1023, 1025)])
@pytest.mark.parametrize("inplace", [False, True])
def test_gated_activation_grad(act, dtype, shape, inplace):
    """dA, dB of H = act(A) * B against torch autograd (float64); in place: dA over dH and dB
    over B, as onnxruntime may place them."""
    dt = getattr(torch, dtype)
    dh, a, b = rand(*shape, dtype=dt), rand(*shape, dtype=dt, scale=2.5), rand(*shape, dtype=dt)
    ref_a, ref_b = ref_gated(dh, a, b, act)
    dh_in, b_in = dh.clone(), b.clone()
    da, db = gated_activation_grad(dh_in, a, b_in, act, da=dh_in if inplace else None,
                                   db=b_in if inplace else None)
    torch.cuda.synchronize()
    tol = 2e-4 if dt == torch.float32 else 1e-2
    close(da, ref_a, tol, f"dA {act}")
    close(db, ref_b, tol, f"dB {act}")
