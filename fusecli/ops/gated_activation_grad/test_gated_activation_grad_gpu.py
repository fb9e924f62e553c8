"""GatedActivationGrad's CUDA launchers (through fusecli/ops/gpu.py, torch device pointers)
against torch autograd. GPU machine only (tests/gpu/run_gpu_checks.sh); skipped elsewhere."""

from __future__ import annotations

import pytest

from gpu_helpers import _seed, memk_path, close, rand, tol_of, torch_or_skip

torch = torch_or_skip()  # skips this module where torch.cuda is unavailable
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("memk_path")]  # both kernel paths

from fusecli.ops.gated_activation_grad.gpu import (TORCH_ACT, gated_activation_grad,  # noqa: E402
                                                   ref_gated)


@pytest.mark.parametrize("act", sorted(TORCH_ACT))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1,), (17,), (5, 33), (64, 1024), (1023, 1025)])
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
    tol = tol_of(dt)
    close(da, ref_a, tol, f"dA {act}")
    close(db, ref_b, tol, f"dB {act}")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gated_activation_grad_misaligned_and_one_output(dtype):
    """Tensors off a 16-byte boundary (the scalar kernel) and one requested output."""
    dt = getattr(torch, dtype)
    n = 4099
    dh, a, b = (rand(n + 1, dtype=dt)[1:], rand(n + 1, dtype=dt, scale=2.5)[1:],
                rand(n + 1, dtype=dt)[1:])
    ref_a, ref_b = ref_gated(dh, a, b, "silu")
    da, db = gated_activation_grad(dh, a, b, "silu")
    close(da, ref_a, tol_of(dt), "dA misaligned")
    close(db, ref_b, tol_of(dt), "dB misaligned")
    x = rand(64, 1024, dtype=dt)
    ra, rb = ref_gated(x, x, x, "gelu")
    for want in ((1, 0), (0, 1)):
        da, db = gated_activation_grad(x, x, x, "gelu", want=want)
        assert (da is None, db is None) == (not want[0], not want[1])
        close(da if want[0] else db, ra if want[0] else rb, tol_of(dt), "one output")
