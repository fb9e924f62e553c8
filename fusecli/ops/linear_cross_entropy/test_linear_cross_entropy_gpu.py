"""LinearCrossEntropy's CUDA launcher (through fusecli/ops/gpu.py) against torch autograd in
float64, on shapes that cross the chunk edges (chunk_rows 16: rows not a multiple of it, a chunk
whose every token is ignored). GPU machine only (tests/gpu/run_gpu_checks.sh); skipped
elsewhere."""

from __future__ import annotations

import pytest

from gpu_helpers import _seed, close, rand, torch_or_skip  # noqa: F401

torch = torch_or_skip()  # skips this module where torch.cuda is unavailable
pytestmark = pytest.mark.gpu

from fusecli.ops.linear_cross_entropy.gpu import linear_cross_entropy, ref_lce  # noqa: E402


@pytest.mark.parametrize("ndv", [(1, 4, 3), (37, 8, 11), (64, 16, 300), (70, 32, 1000)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy(ndv, with_bias, reduction):
    n, d, v = ndv
    h, w = rand(n, d), rand(v, d) * 0.5
    bias = rand(v) if with_bias else None
    lab = torch.randint(0, v, (n,), device="cuda")
    if n >= 32:
        lab[16:32] = -100
    got = linear_cross_entropy(h, w, bias, lab, reduction=reduction, grad_scale=0.5,
                               chunk_rows=16)
    ref = ref_lce(h, w, bias, lab, reduction=reduction, grad_scale=0.5)
    for g, r, nm in zip(got, ref, ["loss", "dH", "dW", "dB"]):
        if r is not None:
            close(g, r, 2e-4, nm)


def test_linear_cross_entropy_row_weight_and_row_grad():
    n, d, v = 50, 8, 40
    h, w = rand(n, d), rand(v, d) * 0.5
    lab = torch.randint(0, v, (n,), device="cuda")
    keep = torch.rand(n, device="cuda") > 0.3
    mf = keep.float()
    g = mf / mf.sum()
    got = linear_cross_entropy(h, w, None, torch.where(keep, lab, 0), mf, g, chunk_rows=16)
    ref = ref_lce(h, w, None, torch.where(keep, lab, -100))
    for x, r, nm in zip(got[:3], ref[:3], ["loss", "dH", "dW"]):
        close(x, r, 2e-4, nm)
