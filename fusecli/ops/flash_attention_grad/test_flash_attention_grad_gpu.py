"""FlashAttentionGrad's CUDA launcher (with FlashAttention for O and LSE) (through fusecli/ops/gpu.py) against torch
in float64. GPU machine only (tests/gpu/run_gpu_checks.sh); skipped elsewhere."""

from __future__ import annotations

import pytest

from gpu_helpers import _seed, close, rand, torch_or_skip

torch = torch_or_skip()  # skips this module where torch.cuda is unavailable
pytestmark = pytest.mark.gpu

from fusecli.ops.flash_attention.gpu import flash_attention  # noqa: E402
from fusecli.ops.flash_attention_grad.gpu import (flash_attention_grad,  # noqa: E402
                                                  ref_attention_grad)


@pytest.mark.parametrize("shape", [(1, 2, 1, 8), (2, 3, 65, 16), (1, 2, 129, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_grad(shape, causal):
    b, h, s, d = shape
    q, k, v, do = rand(*shape), rand(*shape), rand(*shape), rand(*shape)
    bias = None
    if causal:
        bias = torch.full((s, s), -1e30, device="cuda").triu(1)
    o, lse = flash_attention(q, k, v, bias, d ** -0.5)   # checked by the forward op's test
    got = flash_attention_grad(do, q, k, v, o, lse, bias, d ** -0.5)
    for g, r_, name in zip(got, ref_attention_grad(do, q, k, v, bias, d ** -0.5), "QKV"):
        close(g, r_, 5e-4, f"d{name}")
