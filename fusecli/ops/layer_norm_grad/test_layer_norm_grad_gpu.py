"""LayerNormGrad's CUDA launchers (through fusecli/ops/gpu.py, torch device pointers) against torch on
random data. GPU machine only (tests/gpu/run_gpu_checks.sh); skipped elsewhere."""

from __future__ import annotations

import pytest

from gpu_helpers import _seed, memk_path, check_requested, close, rand, tol_of, torch_or_skip

torch = torch_or_skip()  # skips this module where torch.cuda is unavailable
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("memk_path")]  # both kernel paths
from fusecli.ops.layer_norm_grad.gpu import layer_norm_grad, ref_layer_norm  # noqa: E402


@pytest.mark.parametrize("dtype,stats", [("float32", "float32"), ("float16", "float32"),
                                         ("float16", "float16"), ("bfloat16", "float32"),
                                         ("bfloat16", "bfloat16")])
@pytest.mark.parametrize("with_dr", [True, False])
@pytest.mark.parametrize("m,n", [(1, 1), (3, 17), (10, 33), (1, 1023), (33, 96), (7, 256),
                                 (64, 512), (4096, 1024), (257, 8192), (5, 16384)])
def test_layer_norm_grad(dtype, stats, with_dr, m, n):
    dt, st = getattr(torch, dtype), getattr(torch, stats)
    x = rand(m, n, dtype=dt, scale=2.0)
    x64 = x.double()
    mean = x64.mean(1)
    inv_std = 1 / torch.sqrt(x64.var(1, unbiased=False) + 1e-5)
    dy, gamma = rand(m, n, dtype=dt), rand(n, dtype=dt)
    dr = rand(m, n, dtype=dt) if with_dr else None
    got = layer_norm_grad(dy, x, gamma, mean.to(st), inv_std.to(st), dr)
    ref = ref_layer_norm(dy.double(), x64, gamma.double(), mean.to(st).double(),
                           inv_std.to(st).double(), None if dr is None else dr.double())
    # the reference takes the same (rounded) statistics: the output's rounding, with margin
    tol = 5e-4 if dt == torch.float32 else 2 * tol_of(dt)
    for g, r, nm in zip(got, ref, "dX dGamma dBeta".split()):
        close(g, r, tol, nm)


@pytest.mark.parametrize("n", [67, 64, 1024])
def test_layer_norm_grad_optional_outputs(n):
    """n = 67: the scalar kernel; 64: a warp per row; 1024: a block per row."""
    x = rand(5, n)
    mean, inv_std = x.mean(1), 1 / torch.sqrt(x.var(1, unbiased=False) + 1e-5)
    dy, gamma = rand(5, n), rand(n)
    for want in [(1, 0, 0), (0, 1, 1), (1, 1, 0)]:
        got = layer_norm_grad(dy, x, gamma, mean, inv_std, None, want)
        ref = ref_layer_norm(dy.double(), x.double(), gamma.double(), mean.double(), inv_std.double())
        check_requested(want, got, ref)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_layer_norm_grad_misaligned_rows(dtype):
    """Tensors that start off a 16-byte boundary take the scalar kernel."""
    dt = getattr(torch, dtype)
    m, n = 6, 512
    x = rand(m * n + 1, dtype=dt, scale=2.0)[1:].view(m, n)
    dy = rand(m * n + 1, dtype=dt)[1:].view(m, n)
    x64 = x.double()
    mean, inv_std = x64.mean(1), 1 / torch.sqrt(x64.var(1, unbiased=False) + 1e-5)
    gamma = rand(n, dtype=dt)
    got = layer_norm_grad(dy, x, gamma, mean.float(), inv_std.float())
    ref = ref_layer_norm(dy.double(), x64, gamma.double(), mean.float().double(),
                         inv_std.float().double())
    tol = 5e-4 if dt == torch.float32 else 2 * tol_of(dt)
    for g, r, nm in zip(got, ref, "dX dGamma dBeta".split()):
        close(g, r, tol, nm)
