"""ActivationGrad's CUDA launchers (through fusecli/ops/gpu.py, torch device pointers) against
torch on random data. GPU machine only (tests/gpu/run_gpu_checks.sh); skipped elsewhere."""

from __future__ import annotations

import pytest

from gpu_helpers import _seed, memk_path, close, rand, tol_of, torch_or_skip

torch = torch_or_skip()  # skips this module where torch.cuda is unavailable
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("memk_path")]  # both kernel paths

from fusecli.ops.activation_grad.gpu import activation_grad  # noqa: E402
from fusecli.ops.gpu import ACT, quick_gelu_grad, ref_act_grad  # noqa: E402

ACTS = [a for a in ACT if a != "identity"]


DTYPES = ["float32", "float16", "bfloat16"]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3,), (17,), (5, 33), (64, 1024), (1023, 1025)])
def test_activation_grad(act, dtype, shape):
    """(64, 1024): 16-byte packs only; (1023, 1025): packs and a scalar tail."""
    dt = getattr(torch, dtype)
    dy, x = rand(*shape, dtype=dt), rand(*shape, dtype=dt, scale=2.0)
    got = activation_grad(dy, x, act)
    ref = ref_act_grad(dy.double(), x.double(), act)
    close(got, ref, tol_of(dt), act)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [1, 2, 4])
def test_activation_grad_misaligned_and_inplace(dtype, offset):
    """Tensors that start off a 16-byte boundary take the scalar kernel; dX written over dY (the
    in-place pair) gives the same result."""
    dt = getattr(torch, dtype)
    base_dy, base_x = rand(4099 + offset, dtype=dt), rand(4099 + offset, dtype=dt, scale=2.0)
    dy, x = base_dy[offset:], base_x[offset:]
    ref = ref_act_grad(dy.double(), x.double(), "gelu")
    close(activation_grad(dy, x, "gelu"), ref, tol_of(dt), "misaligned")
    inplace = base_dy.clone()[:4096]  # aligned, dX over dY
    ref2 = ref_act_grad(inplace.double(), base_x[:4096].double(), "silu")
    got = activation_grad(inplace, base_x[:4096], "silu", out=inplace)
    assert got.data_ptr() == inplace.data_ptr()
    close(got, ref2, tol_of(dt), "in place")


@pytest.mark.parametrize("alpha", [1.702, 1.0, 0.5])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3,), (17,), (1023, 1025)])
def test_activation_grad_silu_alpha(alpha, dtype, shape):
    """silu at input scale alpha, x sigmoid(alpha x) (QuickGELU at 1.702), pre-activations up
    to |x| = 40 (the sigmoid saturates: e^-68 underflows far below float16)."""
    dt = getattr(torch, dtype)
    dy = rand(*shape, dtype=dt)
    x = (torch.rand(*shape, device="cuda", dtype=torch.float64) * 80 - 40).to(dt)
    got = activation_grad(dy, x, "silu", alpha)
    ref = quick_gelu_grad(dy.double(), x.double(), alpha)
    close(got, ref, tol_of(dt), f"silu alpha={alpha}")


@pytest.mark.parametrize("act", ACTS)
def test_activation_grad_alpha_is_the_input_scale(act):
    """Every activation at alpha is act'(alpha x)."""
    dy, x = rand(5, 33), rand(5, 33, scale=2.0)
    got = activation_grad(dy, x, act, 0.75)
    close(got, ref_act_grad(dy.double(), 0.75 * x.double(), act), 2e-4, act)
