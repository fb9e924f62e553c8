"""RMSNormGrad's CUDA launchers (through fusecli/ops/gpu.py, torch device pointers) against torch on
random data. GPU machine only (tests/gpu/run_gpu_checks.sh); skipped elsewhere."""

from __future__ import annotations

import pytest

from gpu_helpers import _seed, memk_path, check_requested, close, rand, tol_of, torch_or_skip

torch = torch_or_skip()  # skips this module where torch.cuda is unavailable
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("memk_path")]  # both kernel paths
from fusecli.ops.rms_norm_grad.gpu import ref_rms_norm, rms_norm_grad  # noqa: E402


@pytest.mark.parametrize("dtype,stats", [("float32", "float32"), ("float16", "float32"),
                                         ("float16", "float16"), ("float32", None),
                                         ("bfloat16", "float32"), ("bfloat16", "bfloat16"),
                                         ("bfloat16", None)])
@pytest.mark.parametrize("with_dr,with_gamma", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("m,n", [(1, 1), (3, 17), (10, 33), (1, 1023), (33, 96), (7, 256),
                                 (64, 512), (4096, 1024), (257, 8192), (5, 16384)])
def test_rms_norm_grad(dtype, stats, with_dr, with_gamma, m, n):
    """stats None: inv_rms absent, recomputed from X and epsilon."""
    dt = getattr(torch, dtype)
    eps = 1e-6
    x = rand(m, n, dtype=dt, scale=2.0)
    x64 = x.double()
    inv_rms = torch.rsqrt(x64.pow(2).mean(1) + eps)
    dy = rand(m, n, dtype=dt)
    gamma = rand(n, dtype=dt) if with_gamma else None
    dr = rand(m, n, dtype=dt) if with_dr else None
    got = rms_norm_grad(dy, x, gamma, None if stats is None else inv_rms.to(getattr(torch, stats)),
                          dr, (1, 1 if with_gamma else 0), eps)
    ref = ref_rms_norm(dy.double(), x64, None if gamma is None else gamma.double(),
                         None if dr is None else dr.double(), eps)
    # the reference recomputes inv_rms in float64: 16-bit saved statistics add their rounding
    tol = 5e-4 if dt == torch.float32 else (2 if stats == "float32" else 8) * tol_of(dt)
    close(got[0], ref[0], tol, "dX")
    if with_gamma:
        close(got[1], ref[1], tol, "dGamma")


def test_rms_norm_grad_optional_outputs():
    x, dy, gamma = rand(5, 67, scale=2.0), rand(5, 67), rand(67)
    inv_rms = torch.rsqrt(x.pow(2).mean(1) + 1e-5)
    ref = ref_rms_norm(dy.double(), x.double(), gamma.double())
    for want in [(1, 0), (0, 1)]:
        got = rms_norm_grad(dy, x, gamma, inv_rms, None, want)
        check_requested(want, got, ref)
