"""LoraLinearGrad's CUDA launcher (through fusecli/ops/gpu.py, torch device pointers) against
torch in float64. GPU machine only (tests/gpu/run_gpu_checks.sh); skipped elsewhere."""

from __future__ import annotations

import pytest

from gpu_helpers import _seed, check_requested, rand, torch_or_skip

torch = torch_or_skip()  # skips this module where torch.cuda is unavailable
pytestmark = pytest.mark.gpu

from fusecli.ops.lora_linear_grad.gpu import lora_linear_grad, ref_lora  # noqa: E402


@pytest.mark.parametrize("act", ["identity", "relu", "gelu", "silu"])
@pytest.mark.parametrize("split_dx", [0, 1])
@pytest.mark.parametrize("trans_w", [0, 1])
@pytest.mark.parametrize("mnkr", [(1, 3, 5, 1), (33, 17, 65, 4), (256, 96, 128, 16)])
def test_lora_linear_grad(act, split_dx, trans_w, mnkr):
    m, n, k, r = mnkr
    dy, x, a = rand(m, n), rand(m, n, scale=2.0), rand(m, k)
    w = rand(k, n) if trans_w else rand(n, k)
    la, lb = rand(r, k), rand(n, r)
    h = a @ la.t()
    want = (1, 1, 1, 1, 1, 1)
    got = lora_linear_grad(dy, x, a, w, la, lb, h, None, act, 2.0, trans_w, split_dx, want)
    ref = ref_lora(*(t.double() for t in (dy, x, a, w, la, lb, h)), None, act, 2.0, trans_w,
                   split_dx)
    check_requested(want, got, ref, 5e-4)
