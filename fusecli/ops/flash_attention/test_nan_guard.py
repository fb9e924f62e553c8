"""FlashAttention / FlashAttentionGrad with nan_guard 1 (TorchScript's scaled_dot_product_attention:
Softmax -> Where(IsNaN(P), 0, P) -> MatMul with V, and the same Where on dP before SoftmaxGrad)
and 2 (torch's math scaled_dot_product_attention in a joint graph: _safe_softmax's
Where(all(S == -inf), 0, P), read by the P V MatMul and the softmax backward): the CPU kernels
against the NumPy reference and against that unfused chain in standard ONNX on onnxruntime,
with additive -inf masks that leave whole rows masked (O = 0 there, dV untouched; dQ / dK NaN
as the original's SoftmaxGrad on the NaN row gives with 1, zero with 2), and without such rows
(the guard changes nothing)."""

from __future__ import annotations

import numpy as np
import pytest

from fusecli.ops.flash_attention.reference import flash_attention
from fusecli.ops.flash_attention.test_flash_attention import fused_pair
from fusecli.ops.flash_attention_grad.reference import flash_attention_grad
# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import Builder, _built, _rng, assert_close, rand  # noqa: F401

SCALE = 0.5
# (batch, heads, Sq = Sk, D): one tile, and several query / key tiles (64 x 128)
SHAPES = [(2, 2, 9, 4), (1, 2, 150, 8)]


def _bias(kind, b, s):
    """Additive [B, 1, S, S] masks of 0 and -inf (a bool mask as TorchScript's sdpa adds it):
    causal; causal with batch 0's first three keys padded (its queries 0..2 see no key: whole
    rows -inf); every key of batch 0 padded (all its rows -inf)."""
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    keep = np.broadcast_to(j <= i, (b, 1, s, s)).copy()
    if kind == "left_pad":
        keep[0, ..., :3] = False
    elif kind == "all_padded":
        keep[0] = False
    return np.where(keep, 0.0, -np.inf).astype(np.float32)


def unfused(q, k, v, do, bias, guard):
    """The original chain: S = MatMul(Q, K^T) * scale + bias, P = Softmax(S), then
    guard 1 (TorchScript's sdpa): Pg = Where(IsNaN(P), 0, P), O = Pg V; backward dPg = dO V^T,
    dP = Where(IsNaN(P), 0, dPg), dS = P (dP - rowsum(dP P)) (SoftmaxGrad on the unguarded P);
    guard 2 (torch's math sdpa in a joint graph, _safe_softmax): Pg = Where(all(S == -inf) per
    row, 0, P), O = Pg V; backward dP = dO V^T, dS = Pg (dP - rowsum(dP Pg)) (torch's softmax
    backward on the guarded output); then dQ = scale dS K, dK = scale dS^T Q, dV = Pg^T dO."""
    b = Builder()
    qn, kn, vn, don, bn = (b.input(n, a) for n, a in
                           (("Q", q), ("K", k), ("V", v), ("dO", do), ("bias", bias)))
    perm = [0, 1, 3, 2]
    s = b.add(b.mul(b.op("MatMul", qn, b.op("Transpose", kn, perm=perm)), b.const(SCALE)), bn)
    p = b.op("Softmax", s, axis=-1)
    zero = b.const(0.0)
    dp = b.op("MatMul", don, b.op("Transpose", vn, perm=perm))
    if guard == 1:
        nan = b.op("IsNaN", p)
        pg = b.op("Where", nan, zero, p)
        dp, p_bwd = b.op("Where", nan, zero, dp), p
    else:
        ninf = b.op("Cast", b.op("Equal", s, b.const(-np.inf)), to=7)
        every = b.op("Cast", b.op("ReduceMin", ninf, b.ints([-1]), keepdims=1), to=9)
        pg = p_bwd = b.op("Where", every, zero, p)
    o = b.op("MatMul", pg, vn)
    pd = b.op("Mul", dp, p_bwd)
    ds = b.op("Sub", pd, b.op("Mul", p_bwd, b.op("ReduceSum", pd, b.ints([-1]), keepdims=1)))
    dq = b.mul(b.op("MatMul", ds, kn), b.const(SCALE))
    dk = b.mul(b.op("MatMul", b.op("Transpose", ds, perm=perm), qn), b.const(SCALE))
    dv = b.op("MatMul", b.op("Transpose", pg, perm=perm), don)
    return b.run([o, dq, dk, dv])


@pytest.mark.parametrize("guard", [1, 2])
@pytest.mark.parametrize("kind", ["causal", "left_pad", "all_padded"])
@pytest.mark.parametrize("shape", SHAPES)
def test_nan_guard_vs_reference_and_unfused(shape, kind, guard):
    """nan_guard 1: the rows the guard zeroes (O 0, LSE +inf) exist exactly where the mask
    masks whole rows, and the original's NaN gradients are reproduced (dV stays finite: P is 0
    there); 2: the same rows, with zero gradients (nothing flows from a guarded row)."""
    bsz, h, s, d = shape
    rng = _rng("flash-nan-guard", shape, kind, guard)
    q, k, v, do = (rand(rng, (bsz, h, s, d)) for _ in range(4))
    bias = _bias(kind, bsz, s)
    o, lse, dq, dk, dv = fused_pair(q, k, v, do, bias, SCALE, 0, nan_guard=guard)
    ro, rlse = flash_attention(q, k, v, bias, SCALE, nan_guard=guard)
    assert_close(o, ro, what="O vs reference")
    # LSE: +inf on the guarded rows (compared apart: an inf would widen assert_close's tolerance)
    np.testing.assert_array_equal(np.isposinf(lse), np.isposinf(rlse))
    fin = np.isfinite(rlse)
    assert_close(lse[fin], rlse[fin], what="LSE vs reference")
    for g, r, nm in zip((dq, dk, dv), flash_attention_grad(do, q, k, v, o, lse, bias, SCALE,
                                                           nan_guard=guard), "dQ dK dV".split()):
        assert_close(g, r, what=f"{nm} vs reference")
    for g, r, nm in zip((o, dq, dk, dv), unfused(q, k, v, do, bias, guard), "O dQ dK dV".split()):
        assert_close(g, r, what=f"{nm} vs the unfused graph")
    guarded = kind != "causal"
    assert np.isinf(lse).any() == guarded
    assert np.isnan(dq).any() == (guarded and guard == 1)
    assert np.isfinite(o).all() and np.isfinite(dv).all()
    if guard == 2:
        assert np.isfinite(dq).all() and np.isfinite(dk).all()
        if kind == "all_padded":  # batch 0 entirely guarded: nothing flows from it
            assert not o[0].any() and not dq[0].any()


def test_without_nan_guard_a_masked_row_is_nan():
    """The guard is what zeroes those rows: without it O is NaN there, as Softmax gives."""
    rng = _rng("flash-nan-guard-off")
    q, k, v = (rand(rng, (2, 2, 9, 4)) for _ in range(3))
    o, lse = flash_attention(q, k, v, _bias("left_pad", 2, 9), SCALE)
    assert np.isnan(o[0, :, :3]).all() and np.isfinite(o[1]).all()

