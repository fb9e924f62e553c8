"""FlashAttentionGrad on its own: the kernel against the NumPy reference (O and LSE from the
forward's reference, not from the kernels) and against the unfused backward in onnxruntime, and
its optional outputs. The forward + backward pair on every tile edge and mask kind is
fusecli/ops/flash_attention/test_flash_attention.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fusecli.ops.flash_attention.reference import flash_attention
from fusecli.ops.flash_attention.test_flash_attention import make_bias, make_inputs, unfused
from fusecli.ops.flash_attention_grad.reference import flash_attention_grad
# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import F32, _built, _rng, assert_close, assert_requested, run_fused


@pytest.mark.parametrize("k_transposed", [0, 1])
@pytest.mark.parametrize("shape,mask", [((2, 4, 2, 70, 150, 16, 8), "causal_min"),
                                        ((1, 2, 1, 3, 129, 8, 8), "bias"),
                                        ((2, 2, 2, 65, 65, 4, 4), "padding_min")])
def test_flash_attention_grad_vs_reference_and_unfused(shape, mask, k_transposed):
    rng = _rng("flash-grad", shape, mask, k_transposed)
    q, k, v, do = make_inputs(rng, shape, k_transposed)
    bias = make_bias(rng, mask, shape[0], shape[1], shape[3], shape[4])
    scale = 0.37
    o, lse = flash_attention(q, k, v, bias, scale, k_transposed)
    got = run_fused("FlashAttentionGrad", [("dO", do), ("Q", q), ("K", k), ("V", v), ("O", o),
                                           ("LSE", lse), ("bias", bias)],
                    [("dQ", F32), ("dK", F32), ("dV", F32)], scale=scale,
                    k_transposed=k_transposed)
    ref = flash_attention_grad(do, q, k, v, o, lse, bias, scale, k_transposed)
    _, *orig = unfused(q, k, v, do, bias, scale, k_transposed)
    for g, r, u, nm in zip(got, ref, orig, "dQ dK dV".split()):
        assert_close(g, r, what=f"{nm} vs reference")
        assert_close(g, u, what=f"{nm} vs the unfused graph")


@pytest.mark.parametrize("want", [m for m in itertools.product([0, 1], repeat=3) if any(m)])
def test_flash_attention_grad_optional_outputs(want):
    rng = _rng("flash-grad-opt", want)
    q, k, v, do = make_inputs(rng, (1, 2, 2, 9, 13, 5, 7), 0)
    o, lse = flash_attention(q, k, v)
    outs = [(nm, F32) if w else None for nm, w in zip(["dQ", "dK", "dV"], want)]
    got = run_fused("FlashAttentionGrad", [("dO", do), ("Q", q), ("K", k), ("V", v), ("O", o),
                                           ("LSE", lse)], outs)
    assert_requested(want, got, flash_attention_grad(do, q, k, v, o, lse))


def test_flash_attention_grad_refuses_a_wrong_lse():
    rng = _rng("flash-grad-bad")
    q, k, v, do = make_inputs(rng, (1, 2, 2, 9, 13, 5, 7), 0)
    o, lse = flash_attention(q, k, v)
    with pytest.raises(Exception, match="LSE must be"):
        run_fused("FlashAttentionGrad", [("dO", do), ("Q", q), ("K", k), ("V", v), ("O", o),
                                         ("LSE", lse[..., :-1])], [("dQ", F32)])
    assert np.isfinite(lse).all()
