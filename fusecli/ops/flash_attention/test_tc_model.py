"""The tensor-core kernels' algorithm on the CPU (tc_model.py: the CUDA code's fragment index
math, tile loops, masking, skipping and online softmax, with the mma instruction rebuilt from
the PTX ISA's documented fragment layouts) against float64 NumPy; and the split-TF32 error
model. A layout bug (a lane loading the wrong element) shows here as an O(1) error."""

from __future__ import annotations

import numpy as np
import pytest

from fusecli.ops.flash_attention import tc_model as tm


def ref_forward(q, k, v, bias, scale):
    s = scale * q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2)
    if bias is not None:
        s = s + bias
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    return (e / e.sum(-1, keepdims=True)) @ v, (m + np.log(e.sum(-1, keepdims=True)))[..., 0]


def ref_backward(do, q, k, v, bias, scale):
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    s = scale * q @ np.swapaxes(k, -1, -2)
    if bias is not None:
        s = s + bias
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dv = np.swapaxes(p, -1, -2) @ do
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    return scale * ds @ k, scale * np.swapaxes(ds, -1, -2) @ q, dv


def rel(got, ref):
    return np.abs(got - ref).max() / max(1.0, np.abs(ref).max())


def causal(sq, sk):
    return np.triu(np.full((sq, sk), -1e30, np.float32), 1 + sk - sq)


def data(rng, b, sq, sk, d, dv):
    f = np.float32
    return (rng.standard_normal((b, sq, d)).astype(f), rng.standard_normal((b, sk, d)).astype(f),
            rng.standard_normal((b, sk, dv)).astype(f))


TOL = {"f32": 2e-6, "tf32": 5e-3, "f16": 3e-3, "bf16": 2e-2}


@pytest.mark.parametrize("mode", ["f32", "tf32", "f16", "bf16"])
@pytest.mark.parametrize("sq,sk,d,dv,masked", [(70, 45, 40, 40, True), (1, 9, 16, 16, False),
                                               (33, 1, 64, 48, False), (20, 70, 80, 80, True),
                                               (17, 40, 256, 256, True)])
def test_forward_model(mode, sq, sk, d, dv, masked):
    rng = np.random.default_rng(7)
    q, k, v = data(rng, 1, sq, sk, d, dv)
    bias = np.broadcast_to(causal(sq, sk), (1, sq, sk)) if masked else None
    q, k, v = (tm.to_type(x, mode) for x in (q, k, v))
    o, lse = tm.forward(q, k, v, bias, d ** -0.5, mode)
    ro, rl = ref_forward(q, k, v, None if bias is None else bias.astype(np.float64), d ** -0.5)
    assert rel(o, ro) < TOL[mode], rel(o, ro)
    assert rel(lse, rl) < TOL[mode], rel(lse, rl)


def test_forward_model_masked_rows_and_skips():
    """A finfo.min row: uniform softmax after the recompute pass; a -inf row: NaN."""
    rng = np.random.default_rng(3)
    sq, sk = 70, 100
    q, k, v = data(rng, 1, sq, sk, 32, 32)
    bias = causal(sq, sk)
    bias[:, 80:] = -1e30  # a fully masked key tile for every block: skipped
    bias[5] = np.finfo(np.float32).min
    bias[66] = -np.inf
    o, lse = tm.forward(q, k, v, bias[None], 0.2, "f32")
    assert np.isnan(o[0, 66]).all() and np.isnan(lse[0, 66])
    assert rel(o[0, 5], v[0].astype(np.float64).mean(0)) < 2e-6
    keep = np.ones(sq, bool)
    keep[[5, 66]] = False
    ro, rl = ref_forward(q, k, v, bias.astype(np.float64)[None], 0.2)
    assert rel(o[0, keep], ro[0, keep]) < 2e-6
    assert rel(lse[0, keep], rl[0, keep]) < 2e-6


def test_forward_model_grouped_heads():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((4, 30, 32)).astype(np.float32)
    k = rng.standard_normal((2, 30, 32)).astype(np.float32)
    v = rng.standard_normal((2, 30, 32)).astype(np.float32)
    o, _ = tm.forward(q, k, v, None, 0.3, "f32", kv_of=lambda b: b // 2)
    ro, _ = ref_forward(q, np.repeat(k, 2, 0), np.repeat(v, 2, 0), None, 0.3)
    assert rel(o, ro) < 2e-6


BTOL = {"f32": 5e-6, "tf32": 1e-2, "f16": 5e-3, "bf16": 4e-2}


@pytest.mark.parametrize("mode", ["f32", "tf32", "f16", "bf16"])
@pytest.mark.parametrize("sq,sk,d,dv,masked", [(40, 70, 48, 40, True), (1, 5, 16, 16, False),
                                               (9, 1, 32, 32, False)])
def test_backward_model(mode, sq, sk, d, dv, masked):
    rng = np.random.default_rng(11)
    q, k, v = data(rng, 1, sq, sk, d, dv)
    do = rng.standard_normal((1, sq, dv)).astype(np.float32)
    q, k, v, do = (tm.to_type(x, mode) for x in (q, k, v, do))
    bias = causal(sq, sk)[None] if masked else None
    scale = d ** -0.5
    o, lse = tm.forward(q, k, v, bias, scale, mode)
    got = tm.backward(do, q, k, v, o, lse, bias, scale, mode)
    ref = ref_backward(do, q, k, v, None if bias is None else bias.astype(np.float64), scale)
    for g, r, name in zip(got, ref, ("dQ", "dK", "dV")):
        assert rel(g, r) < BTOL[mode], (name, rel(g, r))


def test_backward_model_groups_masked_row_and_d256():
    rng = np.random.default_rng(13)
    sq = sk = 12
    q = rng.standard_normal((2, sq, 256)).astype(np.float32)
    k = rng.standard_normal((1, sk, 256)).astype(np.float32)
    v = rng.standard_normal((1, sk, 256)).astype(np.float32)
    do = rng.standard_normal((2, sq, 256)).astype(np.float32)
    bias = np.broadcast_to(causal(sq, sk), (2, sq, sk)).copy()
    bias[:, 4] = np.finfo(np.float32).min
    o, lse = tm.forward(q, k, v, bias, 0.0625, "f32", kv_of=lambda b: 0)
    got = tm.backward(do, q, k, v, o, lse, bias, 0.0625, "f32", kv_of=lambda b: 0)
    kk, vv = np.repeat(k, 2, 0), np.repeat(v, 2, 0)
    dq, dk, dv = ref_backward(do, q, kk, vv, bias.astype(np.float64), 0.0625)
    for g, r, name in zip(got, (dq, dk.sum(0, keepdims=True), dv.sum(0, keepdims=True)),
                          ("dQ", "dK", "dV")):
        assert rel(g, r) < 5e-6, (name, rel(g, r))


# --- split TF32 ------------------------------------------------------------------------------
def test_tf32_rounding():
    x = np.array([1.0, 1 + 2 ** -11, 1 + 2 ** -10, 1 + 3 * 2 ** -11, -(1 + 2 ** -11)], np.float32)
    # 10 mantissa bits kept; ties (2^-11) away from zero
    assert tm.tf32(x).tolist() == [1.0, 1 + 2 ** -10, 1 + 2 ** -10, 1 + 2 ** -9, -(1 + 2 ** -10)]
    r = np.random.default_rng(0).standard_normal(100000).astype(np.float32)
    assert (np.abs(tm.tf32(r) - r) <= 2 ** -11 * np.abs(r)).all()


def test_split_tf32_product_error_bound():
    """a = a_big + a_small + e (|a_small| <= 2^-11 |a|, |e| <= 2^-22 |a|): the three products
    miss a_small b_small and the e terms, at most 3 * 2^-22 |a b| per product, float32-class;
    one TF32 product is off by up to 2^-10 |a b|."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal(200000).astype(np.float32) * np.exp(rng.uniform(-5, 5, 200000))
    b = rng.standard_normal(200000).astype(np.float32)
    ab, bb = tm.tf32(a), tm.tf32(b)
    as_, bs = tm.tf32(a - ab), tm.tf32(b - bb)
    exact = a.astype(np.float64) * b
    three = (as_.astype(np.float64) * bb + ab.astype(np.float64) * bs
             + ab.astype(np.float64) * bb)
    one = ab.astype(np.float64) * bb
    err3 = np.abs(three - exact) / np.abs(exact)
    err1 = np.abs(one - exact) / np.abs(exact)
    assert err3.max() <= 3 * 2.0 ** -22, err3.max()
    assert err1.max() <= 2.0 ** -10 + 2.0 ** -20
    assert err1.max() > 100 * err3.max()  # the split is what buys float32 accuracy


def test_split_tf32_dot_products_stay_float32_accurate():
    """Dot products of length 128 through the modelled instruction (float32 sums): split TF32
    within a few float32 ulps of the sum of |a b|, one TF32 product ~1e-3."""
    rng = np.random.default_rng(2)
    A = rng.standard_normal((16, 128)).astype(np.float32)
    B = rng.standard_normal((128, 8)).astype(np.float32)
    a = A.ravel()
    b = B.T.copy().ravel()  # n-major: B(k, n) = b[n * 128 + k]
    for mode, bound in (("f32", 4e-6), ("tf32", 2e-3)):
        c = tm.warp_gemm(mode, np.zeros((1, 4, 32), np.float32), a, 0, 128, b, 0, 128, 128,
                         True)
        got = np.zeros((16, 8))
        for e in range(4):
            got[tm.c_row(e), tm.c_col(e)] = c[0, e]
        exact = A.astype(np.float64) @ B
        err = np.abs(got - exact) / (np.abs(A).astype(np.float64) @ np.abs(B))
        assert err.max() < bound, (mode, err.max())
