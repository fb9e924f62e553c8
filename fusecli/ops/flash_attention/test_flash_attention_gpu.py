"""FlashAttention's CUDA launcher (through fusecli/ops/gpu.py) against torch
in float64. GPU machine only (tests/gpu/run_gpu_checks.sh); skipped elsewhere."""

from __future__ import annotations

import pytest

from gpu_helpers import _seed, close, rand, torch_or_skip

torch = torch_or_skip()  # skips this module where torch.cuda is unavailable
pytestmark = pytest.mark.gpu

from fusecli.ops.flash_attention.gpu import flash_attention, ref_attention  # noqa: E402


@pytest.mark.parametrize("shape", [(1, 2, 1, 8), (2, 3, 65, 16), (1, 2, 129, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_forward(shape, causal):
    b, h, s, d = shape
    q, k, v = rand(*shape), rand(*shape), rand(*shape)
    bias = None
    if causal:
        bias = torch.full((s, s), -1e30, device="cuda").triu(1)
    o, lse = flash_attention(q, k, v, bias, d ** -0.5)
    ref_o, ref_lse = ref_attention(q, k, v, bias, d ** -0.5)
    close(o, ref_o, 2e-4, "O")
    close(lse, ref_lse, 2e-4, "LSE")
