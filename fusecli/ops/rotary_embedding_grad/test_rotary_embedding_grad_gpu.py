"""RotaryEmbeddingGrad's CUDA launcher (through fusecli/ops/gpu.py, torch device pointers)
against torch autograd. GPU machine only (tests/gpu/run_gpu_checks.sh); skipped elsewhere."""

from __future__ import annotations

import pytest

from gpu_helpers import _seed, close, rand, torch_or_skip

torch = torch_or_skip()  # skips this module where torch.cuda is unavailable
pytestmark = pytest.mark.gpu

from fusecli.ops.rotary_embedding_grad.gpu import ref_rope, rotary_embedding_grad  # noqa: E402


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("shape,cs_shape", [((2, 3, 5, 8), (1, 1, 5, 8)),
                                            ((2, 3, 5, 8), (2, 1, 5, 8)),
                                            ((7, 64), (7, 64)), ((1, 4, 129, 64), (129, 64))])
def test_rotary_embedding_grad(interleaved, shape, cs_shape):
    dy, cos, sin = rand(*shape), rand(*cs_shape), rand(*cs_shape)
    got = rotary_embedding_grad(dy, cos, sin, interleaved)
    torch.cuda.synchronize()
    close(got, ref_rope(dy, cos, sin, interleaved), 2e-4, f"interleaved={interleaved}")
