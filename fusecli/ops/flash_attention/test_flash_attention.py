"""FlashAttention (+ FlashAttentionGrad on its outputs): the kernels (fusecli/lib/
libfusecli_ops.so) against the NumPy reference and against the unfused standard-ONNX attention
(MatMul, Mul, Add, Softmax, MatMul and its backward) in onnxruntime with graph optimizations
off, on shapes that cross every tile edge (the CPU tiles are 64 query rows x 128 keys)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from fusecli.ops.flash_attention.reference import flash_attention
from fusecli.ops.flash_attention_grad.reference import flash_attention_grad
# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import (DOMAIN, F32, Builder, _built, _rng, assert_close, ort_session, rand, run_fused)

from fusecli.ops.attention_grad.test_attention_grad import attention_grad_subgraph

FMIN = float(np.finfo(np.float32).min)

# (batch, q heads, kv heads, Sq, Sk, D, Dv): one-token rows, Sq / Sk below, at and across the
# 64 / 128 tile sizes, grouped (Hq = 2 Hkv) and multi-query (Hkv = 1) heads
SHAPES = [(1, 1, 1, 1, 1, 1, 1), (2, 3, 3, 17, 5, 8, 3), (1, 4, 2, 65, 130, 16, 16),
          (2, 2, 1, 129, 257, 32, 8), (1, 2, 2, 64, 128, 8, 8), (1, 1, 1, 1, 300, 4, 4),
          (1, 2, 2, 200, 1, 4, 4)]
MASKS = ["none", "causal_min", "causal_inf", "padding_min", "bias", "rows_inf"]


def make_bias(rng, kind, b, h, sq, sk):
    """An additive mask: causal (finfo.min or -inf above the diagonal, aligned to the last
    query), key padding [B, 1, 1, Sk] with batch 0 fully padded (every row fully masked: the
    original softmax is uniform there), a learned-style [H, Sq, Sk] bias, or -inf rows (a query
    whose every key is -inf: softmax NaN)."""
    if kind == "none":
        return None
    i = np.arange(sq)[:, None] + (sk - sq)
    j = np.arange(sk)[None, :]
    if kind in ("causal_min", "causal_inf"):
        fill = FMIN if kind == "causal_min" else -np.inf
        return np.where(j <= i, 0.0, fill).astype(F32)
    if kind == "padding_min":
        m = np.zeros((b, 1, 1, sk), F32)
        m[0] = FMIN
        if b > 1:
            m[1, ..., sk // 2:] = FMIN
        return m
    if kind == "bias":
        return rand(rng, (h, sq, sk))
    if kind == "rows_inf":
        m = np.zeros((b, h, sq, sk), F32)
        m[..., ::3, :] = -np.inf
        m[..., 1::3, : max(1, sk // 2)] = -np.inf
        return m
    raise ValueError(kind)


def make_inputs(rng, shape, k_transposed):
    b, h, hk, sq, sk, d, dv = shape
    q = rand(rng, (b, h, sq, d))
    k = rand(rng, (b, hk, d, sk) if k_transposed else (b, hk, sk, d))
    v = rand(rng, (b, hk, sk, dv))
    do = rand(rng, (b, h, sq, dv))
    return q, k, v, do


def fused_pair(q, k, v, do, bias, scale, k_transposed, **extra):
    """FlashAttention -> FlashAttentionGrad in one onnxruntime session: O, LSE, dQ, dK, dV
    (extra: more attributes of both nodes)."""
    feeds = {"Q": q, "K": k, "V": v, "dO": do}
    if bias is not None:
        feeds["bias"] = bias
    bn = "bias" if bias is not None else ""
    attrs = dict(scale=float(scale), k_transposed=k_transposed, **extra)
    nodes = [helper.make_node("FlashAttention", ["Q", "K", "V", bn], ["O", "LSE"], domain=DOMAIN,
                              **attrs),
             helper.make_node("FlashAttentionGrad", ["dO", "Q", "K", "V", "O", "LSE", bn],
                              ["dQ", "dK", "dV"], domain=DOMAIN, **attrs)]
    ins = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, list(a.shape))
           for n, a in feeds.items()]
    names = ["O", "LSE", "dQ", "dK", "dV"]
    outs = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names]
    model = helper.make_model(helper.make_graph(nodes, "flash", ins, outs),
                              opset_imports=[helper.make_opsetid("", 17),
                                             helper.make_opsetid(DOMAIN, 1)], ir_version=9)
    return ort_session(model).run(names, feeds)


def unfused(q, k, v, do, bias, scale, k_transposed):
    """The attention chain and its backward from standard ops: O, dQ, dK, dV."""
    b = Builder()
    nb = q.ndim - 2
    perm = list(range(nb)) + [nb + 1, nb]
    qn, kn, vn, don = (b.input(n, a) for n, a in (("Q", q), ("K", k), ("V", v), ("dO", do)))
    qb, kb = q.shape[:-2], k.shape[:-2]

    def expand(t, rows, cols):
        pairs = [x for qd, kd in zip(qb, kb) for x in (kd, qd // kd)]
        t = b.op("Reshape", t, b.ints([x for kd in kb for x in (kd, 1)] + [rows, cols]))
        t = b.op("Expand", t, b.ints(pairs + [rows, cols]))
        return b.op("Reshape", t, b.ints([*qb, rows, cols]))

    sk, d, dv = v.shape[-2], q.shape[-1], v.shape[-1]
    kt = expand(kn, d, sk) if k_transposed else b.op("Transpose", expand(kn, sk, d), perm=perm)
    s = b.mul(b.op("MatMul", qn, kt), b.const(scale))
    if bias is not None:
        s = b.add(s, b.input("bias", bias))
    p = b.op("Softmax", s, axis=-1)
    o = b.op("MatMul", p, expand(vn, sk, dv))
    pshape = (*qb, q.shape[-2], sk)
    dq, dk, dvv, _ = attention_grad_subgraph(b, don, (qn, q.shape), (kn, k.shape), (vn, v.shape),
                                             (p, pshape), qb, kb, kb, k_transposed, scale, scale)
    return b.run([o, dq, dk, dvv])


def _case(shape, mask, k_transposed):
    rng = _rng("flash", shape, mask, k_transposed)
    q, k, v, do = make_inputs(rng, shape, k_transposed)
    bias = make_bias(rng, mask, shape[0], shape[1], shape[3], shape[4])
    return q, k, v, do, bias, 1.0 / np.sqrt(shape[5])


@pytest.mark.parametrize("k_transposed", [0, 1])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("shape", SHAPES)
def test_flash_attention_vs_reference_and_unfused(shape, mask, k_transposed):
    q, k, v, do, bias, scale = _case(shape, mask, k_transposed)
    o, lse, dq, dk, dv = fused_pair(q, k, v, do, bias, scale, k_transposed)
    ro, rlse = flash_attention(q, k, v, bias, scale, k_transposed)
    assert_close(o, ro, what="O vs reference")
    assert_close(lse, rlse, what="LSE vs reference")
    # the backward reference on the kernel's own O / LSE, and the whole chain vs the original
    for g, r, nm in zip((dq, dk, dv),
                        flash_attention_grad(do, q, k, v, o, lse, bias, scale, k_transposed),
                        "dQ dK dV".split()):
        assert_close(g, r, what=f"{nm} vs reference")
    for g, r, nm in zip((o, dq, dk, dv), unfused(q, k, v, do, bias, scale, k_transposed),
                        "O dQ dK dV".split()):
        assert_close(g, r, what=f"{nm} vs the unfused graph")


def test_flash_attention_masked_rows_are_what_the_original_computes():
    """A row masked entirely with finfo.min gets the original softmax's uniform P (O = mean of
    V, finite gradients), one masked with -inf gets NaN, as Softmax gives: the kernels skip
    masked tiles only where that is exact."""
    shape = (2, 2, 2, 70, 140, 8, 8)
    rng = _rng("flash-rows")
    q, k, v, do = make_inputs(rng, shape, 0)
    bias = make_bias(rng, "padding_min", 2, 2, 70, 140)
    o, *_ = fused_pair(q, k, v, do, bias, 0.5, 0)
    np.testing.assert_allclose(o[0], np.broadcast_to(v[0].mean(axis=-2, keepdims=True),
                                                     o[0].shape), rtol=1e-4, atol=1e-5)
    bias = make_bias(rng, "rows_inf", 2, 2, 70, 140)
    o, lse, dq, dk, dv = fused_pair(q, k, v, do, bias, 0.5, 0)
    assert np.isnan(o[..., ::3, :]).all() and np.isnan(lse[..., ::3]).all()
    assert np.isfinite(o[..., 1::3, :]).all()


def test_flash_attention_lse_is_optional():
    rng = _rng("flash-opt")
    q, k, v, _ = make_inputs(rng, (1, 2, 2, 9, 11, 4, 4), 0)
    o, lse = run_fused("FlashAttention", [("Q", q), ("K", k), ("V", v)], [("O", F32), None],
                       scale=0.3)
    assert lse is None
    assert_close(o, flash_attention(q, k, v, None, 0.3)[0], what="O")


def test_flash_attention_refuses_bad_shapes():
    rng = _rng("flash-bad")
    q, k, v, _ = make_inputs(rng, (1, 3, 2, 4, 5, 4, 4), 0)  # 3 query heads, 2 kv heads
    with pytest.raises(Exception, match="must equal or divide"):
        run_fused("FlashAttention", [("Q", q), ("K", k), ("V", v)], [("O", F32), ("LSE", F32)])
    q, k, v, _ = make_inputs(rng, (1, 2, 2, 4, 5, 4, 4), 0)
    with pytest.raises(Exception, match="must broadcast"):
        run_fused("FlashAttention", [("Q", q), ("K", k), ("V", v), ("bias", rand(rng, (3, 5)))],
                  [("O", F32), ("LSE", F32)])
