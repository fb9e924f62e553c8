"""FlashAttention / FlashAttentionGrad with the bool `mask` input (Where(mask, S, fill) and
masked_fill's Where(mask, fill, S)): the CPU kernels against the NumPy reference and against the
unfused standard-ONNX chain in onnxruntime (MatMul, Mul, Where [+ Add], Softmax, MatMul, and the
backward with Where's gradient Where(mask, dS, 0)), on causal, padding (fully masked rows),
sliding-window masks, finfo.min and -inf fills, GQA, and mask shapes [S, S], [B, 1, 1, S],
[B, 1, S, S]."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from fusecli.ops.flash_attention.reference import flash_attention
from fusecli.ops.flash_attention_grad.reference import flash_attention_grad
# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import DOMAIN, F32, Builder, _built, _rng, assert_close, ort_session, rand  # noqa: F401

FMIN = float(np.finfo(np.float32).min)

# (batch, q heads, kv heads, Sq, Sk, D, Dv): across the CPU tiles (64 rows x 128 keys), GQA
SHAPES = [(2, 2, 2, 9, 9, 4, 4), (2, 2, 2, 70, 140, 8, 8), (1, 4, 2, 65, 130, 16, 8)]
MASKS = ["causal", "padding", "window", "causal_padding4d"]


def make_mask(kind, b, sq, sk):
    """True = kept: causal [Sq, Sk] (aligned to the last query), padding [B, 1, 1, Sk] (batch 0
    every key padded: every row fully masked; batch 1 the second half), a sliding window of 3
    keys [Sq, Sk], causal & padding [B, 1, Sq, Sk] (key 0 padded in batch 1: row 0 fully
    masked)."""
    i = np.arange(sq)[:, None] + (sk - sq)
    j = np.arange(sk)[None, :]
    if kind == "causal":
        return j <= i
    if kind == "window":
        return (j <= i) & (j >= i - 2)
    pad = np.ones((b, 1, 1, sk), bool)
    if kind == "padding":
        pad[0] = False
        if b > 1:
            pad[1, ..., sk // 2:] = False
        return pad
    if kind == "causal_padding4d":
        pad[-1, ..., 0] = False
        return (j <= i)[None, None] & pad
    raise ValueError(kind)


def _inputs(rng, shape):
    b, h, hk, sq, sk, d, dv = shape
    return (rand(rng, (b, h, sq, d)), rand(rng, (b, hk, sk, d)), rand(rng, (b, hk, sk, dv)),
            rand(rng, (b, h, sq, dv)))


def fused(q, k, v, do, mask, fill, fill_kept=1, bias=None, bias_first=0, scale=0.5):
    """FlashAttention -> FlashAttentionGrad with the mask input: O, LSE, dQ, dK, dV."""
    feeds = {"Q": q, "K": k, "V": v, "dO": do, "mask": mask}
    if bias is not None:
        feeds["bias"] = bias
    bn = "bias" if bias is not None else ""
    attrs = dict(scale=float(scale), fill=float(fill), fill_kept=fill_kept,
                 bias_first=bias_first)
    nodes = [helper.make_node("FlashAttention", ["Q", "K", "V", bn, "mask"], ["O", "LSE"],
                              domain=DOMAIN, **attrs),
             helper.make_node("FlashAttentionGrad", ["dO", "Q", "K", "V", "O", "LSE", bn, "mask"],
                              ["dQ", "dK", "dV"], domain=DOMAIN, **attrs)]
    ins = [helper.make_tensor_value_info(
        n, onnx.TensorProto.BOOL if a.dtype == bool else onnx.TensorProto.FLOAT, list(a.shape))
        for n, a in feeds.items()]
    names = ["O", "LSE", "dQ", "dK", "dV"]
    outs = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names]
    model = helper.make_model(helper.make_graph(nodes, "flash", ins, outs),
                              opset_imports=[helper.make_opsetid("", 17),
                                             helper.make_opsetid(DOMAIN, 1)], ir_version=9)
    return ort_session(model).run(names, feeds)


def unfused(q, k, v, do, mask, fill, fill_kept=1, bias=None, bias_first=0, scale=0.5):
    """The original chain in standard ops (Hq = Hk): S = Mul(MatMul(Q, K^T), scale), Where(mask,
    S, fill) (fill_kept=0: Where(mask, fill, S)) [+ bias: before or after], Softmax, MatMul(P, V);
    backward dP = dO V^T, dS = P (dP - rowsum(dP P)), dSm = Where's gradient, dQ = scale dSm K,
    dK = scale dSm^T Q, dV = P^T dO. Returns O, dQ, dK, dV."""
    b = Builder()
    qn, kn, vn, don = (b.input(n, a) for n, a in (("Q", q), ("K", k), ("V", v), ("dO", do)))
    mn = b.input("mask", mask)
    perm = [0, 1, 3, 2]
    s = b.mul(b.op("MatMul", qn, b.op("Transpose", kn, perm=perm)), b.const(scale))
    fv, zero = b.const(fill), b.const(0.0)
    bn = b.input("bias", bias) if bias is not None else None

    def where(x, z):
        return b.op("Where", mn, x, z) if fill_kept else b.op("Where", mn, z, x)

    if bn is not None and bias_first:
        s = b.add(s, bn)
    s = where(s, fv)
    if bn is not None and not bias_first:
        s = b.add(s, bn)
    p = b.op("Softmax", s, axis=-1)
    o = b.op("MatMul", p, vn)
    dp = b.op("MatMul", don, b.op("Transpose", vn, perm=perm))
    pd = b.op("Mul", dp, p)
    ds = b.op("Sub", pd, b.op("Mul", p, b.op("ReduceSum", pd, b.ints([-1]), keepdims=1)))
    ds = where(ds, zero)
    dq = b.mul(b.op("MatMul", ds, kn), b.const(scale))
    dk = b.mul(b.op("MatMul", b.op("Transpose", ds, perm=perm), qn), b.const(scale))
    dv = b.op("MatMul", b.op("Transpose", p, perm=perm), don)
    return b.run([o, dq, dk, dv])


def _check(shape, mask, fill, fill_kept=1, bias=None, bias_first=0, tag=""):
    rng = _rng("flash-mask", shape, tag)
    q, k, v, do = _inputs(rng, shape)
    o, lse, dq, dk, dv = fused(q, k, v, do, mask, fill, fill_kept, bias, bias_first)
    ro, rlse = flash_attention(q, k, v, bias, 0.5, 0, mask, fill, fill_kept, bias_first)
    assert_close(o, ro, what="O vs reference")
    assert_close(lse, rlse, what="LSE vs reference")
    for g, r, nm in zip((dq, dk, dv), flash_attention_grad(do, q, k, v, o, lse, bias, 0.5, 0, mask,
                                                           fill, fill_kept, bias_first),
                        "dQ dK dV".split()):
        assert_close(g, r, what=f"{nm} vs reference")
    if shape[1] == shape[2]:
        for g, r, nm in zip((o, dq, dk, dv),
                            unfused(q, k, v, do, mask, fill, fill_kept, bias, bias_first),
                            "O dQ dK dV".split()):
            assert_close(g, r, what=f"{nm} vs the unfused graph")
    return o, lse, dq, dk, dv


@pytest.mark.parametrize("fill", [FMIN, -np.inf])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("shape", SHAPES)
def test_flash_mask_vs_reference_and_unfused(shape, kind, fill):
    b, sq, sk = shape[0], shape[3], shape[4]
    _check(shape, make_mask(kind, b, sq, sk), fill, tag=(kind, fill))


@pytest.mark.parametrize("fill", [FMIN, -np.inf, -10.0])
def test_flash_mask_masked_fill_polarity(fill):
    """masked_fill: True = filled (fill_kept = 0); a moderate fill (-10) keeps some probability
    at filled positions, whose score gradient Where still zeroes."""
    shape = SHAPES[1]
    keep = make_mask("causal", shape[0], shape[3], shape[4])
    _check(shape, ~keep, fill, fill_kept=0, tag=("polarity", fill))


@pytest.mark.parametrize("bias_first", [0, 1])
def test_flash_mask_with_additive_bias(bias_first):
    """GPT-2: Where(causal, S, finfo.min) + (1 - attention_mask) * finfo.min (bias_first = 0),
    and the bias before the Where (bias_first = 1); a padded key 0 leaves row 0 of batch 1
    with one finfo.min score among -inf ones."""
    shape = SHAPES[1]
    b, sq, sk = shape[0], shape[3], shape[4]
    pad = np.zeros((b, 1, 1, sk), F32)
    pad[1, ..., 0] = FMIN
    pad[0, ..., sk // 2:] = FMIN
    _check(shape, make_mask("causal", b, sq, sk), FMIN, bias=pad, bias_first=bias_first,
           tag=("bias", bias_first))


def test_flash_mask_fully_masked_rows_are_the_originals():
    """A fully masked row: finite fill -> uniform P (O = mean of V) in the forward and a zero
    score gradient (Where's), so dQ of that row is 0 (an additive mask's backward is not);
    -inf fill -> NaN in O and LSE (onnxruntime's Softmax of all -inf is NaN, checked on the
    unfused graph above), dQ of that row still 0 (Where selects 0 over the NaN), dV NaN."""
    shape = (2, 2, 2, 70, 140, 8, 8)
    mask = make_mask("padding", 2, 70, 140)  # batch 0: every key padded
    o, lse, dq, dk, dv = _check(shape, mask, FMIN, tag="rows-min")
    rng = _rng("flash-mask", shape, "rows-min")
    _, _, v, _ = _inputs(rng, shape)
    np.testing.assert_allclose(o[0], np.broadcast_to(v[0].mean(axis=-2, keepdims=True),
                                                     o[0].shape), rtol=1e-4, atol=1e-5)
    assert (dq[0] == 0).all() and (dk[0] == 0).all() and np.abs(dv[0]).max() > 0
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    o, lse, dq, dk, dv = _check(shape, mask, -np.inf, tag="rows-inf")
    assert np.isnan(o[0]).all() and np.isnan(lse[0]).all() and np.isfinite(o[1]).all()
    assert (dq[0] == 0).all() and np.isnan(dv[0]).all() and np.isfinite(dq[1]).all()


@pytest.mark.parametrize("mshape", [(70, 140), (2, 1, 1, 140), (2, 1, 70, 140), (1, 2, 70, 140)])
def test_flash_mask_broadcast_shapes(mshape):
    shape = (2, 2, 2, 70, 140, 8, 8)
    rng = np.random.default_rng(7)
    mask = rng.random(mshape) < 0.7
    mask[..., 0] = True  # no fully masked row here (the test above has them)
    _check(shape, mask, FMIN, tag=("bcast", mshape))


def test_flash_mask_refuses_a_mask_that_does_not_broadcast():
    rng = _rng("flash-mask-bad")
    q, k, v, do = _inputs(rng, (1, 2, 2, 4, 5, 4, 4))
    with pytest.raises(Exception, match="mask .* must broadcast"):
        fused(q, k, v, do, np.ones((3, 5), bool), FMIN)
