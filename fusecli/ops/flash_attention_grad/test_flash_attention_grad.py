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


# --- soft-capped scores (Gemma 2's attn_logit_softcapping: c tanh(scale Q K^T / c)) ----------

@pytest.mark.parametrize("k_transposed", [0, 1])
@pytest.mark.parametrize("shape,mask", [((1, 4, 2, 70, 150, 16, 8), "causal_min"),
                                        ((2, 2, 2, 9, 13, 5, 7), "none"),
                                        ((2, 2, 1, 65, 65, 4, 4), "padding_min")])
def test_flash_attention_softcap_vs_reference(shape, mask, k_transposed):
    """Both kernels with softcap against the NumPy reference, on scores large enough that the
    cap changes them (the uncapped O differs)."""
    rng = _rng("flash-softcap", shape, mask, k_transposed)
    q, k, v, do = make_inputs(rng, shape, k_transposed)
    q = (q * 4).astype(F32)
    bias = make_bias(rng, mask, shape[0], shape[1], shape[3], shape[4])
    scale, cap = 0.37, 1.5
    attrs = dict(scale=scale, k_transposed=k_transposed, softcap=cap)
    o, lse = run_fused("FlashAttention", [("Q", q), ("K", k), ("V", v), ("bias", bias)],
                       [("O", F32), ("LSE", F32)], **attrs)
    ref_o, ref_lse = flash_attention(q, k, v, bias, scale, k_transposed, softcap=cap)
    assert_close(o, ref_o, what="O vs reference")
    assert_close(lse, ref_lse, what="LSE vs reference")
    plain_o = flash_attention(q, k, v, bias, scale, k_transposed)[0]
    assert np.abs(plain_o - ref_o).max() > 1e-2  # the cap matters at these scores
    got = run_fused("FlashAttentionGrad", [("dO", do), ("Q", q), ("K", k), ("V", v), ("O", o),
                                           ("LSE", lse), ("bias", bias)],
                    [("dQ", F32), ("dK", F32), ("dV", F32)], **attrs)
    ref = flash_attention_grad(do, q, k, v, ref_o, ref_lse, bias, scale, k_transposed,
                               softcap=cap)
    for g, r, nm in zip(got, ref, "dQ dK dV".split()):
        assert_close(g, r, what=f"{nm} vs reference")


def test_flash_attention_softcap_reference_gradient_is_the_forwards_derivative():
    """The reference's soft-capped gradient against central finite differences of the
    reference forward's sum(O * dO), in float64 (an oracle for the formula the kernels
    follow)."""
    rng = _rng("flash-softcap-fd")
    q, k, v, do = (x.astype(np.float64) for x in make_inputs(rng, (1, 2, 1, 3, 5, 4, 3), 0))
    q = q * 4
    scale, cap, eps = 0.5, 1.5, 1e-6

    def loss(q_, k_, v_):
        return float((flash_attention(q_, k_, v_, None, scale, softcap=cap)[0] * do).sum())

    o, lse = flash_attention(q, k, v, None, scale, softcap=cap)
    grads = flash_attention_grad(do, q, k, v, o, lse, None, scale, softcap=cap)
    for idx, (x, g) in enumerate(zip((q, k, v), grads)):
        num = np.zeros_like(x)
        for pos in np.ndindex(x.shape):
            args = [q, k, v]
            hi, lo = x.copy(), x.copy()
            hi[pos] += eps
            lo[pos] -= eps
            args[idx] = hi
            up = loss(*args)
            args[idx] = lo
            num[pos] = (up - loss(*args)) / (2 * eps)
        np.testing.assert_allclose(g, num, rtol=1e-5, atol=1e-7)
