"""AttentionGrad: its kernels (fusecli/lib/libfusecli_ops.so) against the NumPy reference
and against the unfused standard-ONNX subgraph it replaces, in onnxruntime with graph
optimizations off."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fusecli import library
from fusecli.ops.attention_grad.reference import attention_grad

# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import (F32, Builder, _built, _rng, assert_close, assert_requested,
                            fused_model, ort_session, rand, run_fused)


def _attn_inputs(rng, lead, sq, sk, d, dv, k_transposed):
    do = rand(rng, (*lead, sq, dv))
    q = rand(rng, (*lead, sq, d))
    k = rand(rng, (*lead, d, sk) if k_transposed else (*lead, sk, d))
    v = rand(rng, (*lead, sk, dv))
    logits = rng.standard_normal((*lead, sq, sk))
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).astype(F32)
    return do, q, k, v, p


ATTN_SHAPES = [((1,), 1, 1, 1, 1), ((3,), 17, 5, 8, 3), ((2, 3), 7, 33, 17, 16),
               ((1,), 65, 130, 32, 32), ((2, 4), 128, 128, 64, 64)]


@pytest.mark.parametrize("k_transposed", [0, 1])
@pytest.mark.parametrize("lead,sq,sk,d,dv", ATTN_SHAPES)
def test_attention_grad_vs_reference(k_transposed, lead, sq, sk, d, dv):
    rng = _rng("attn", k_transposed, lead, sq, sk, d, dv)
    do, q, k, v, p = _attn_inputs(rng, lead, sq, sk, d, dv, k_transposed)
    sq_, sk_ = 1 / np.sqrt(d), 0.7 / np.sqrt(d)
    got = run_fused("AttentionGrad", [("dO", do), ("Q", q), ("K", k), ("V", v), ("P", p)],
                    [("dQ", F32), ("dK", F32), ("dV", F32)], scale_q=float(sq_), scale_k=float(sk_),
                    k_transposed=k_transposed)
    ref = attention_grad(do, q, k, v, p, np.float32(sq_), np.float32(sk_), k_transposed)
    for g, r, nm in zip(got, ref, "dQ dK dV".split()):
        assert_close(g, r, what=nm)


@pytest.mark.parametrize("mask", [m for m in itertools.product([0, 1], repeat=3) if any(m)])
def test_attention_grad_optional_outputs_and_defaults(mask):
    rng = _rng("attn-opt", mask)
    do, q, k, v, p = _attn_inputs(rng, (2,), 9, 13, 5, 7, 0)
    outs = [(nm, F32) if m else None for nm, m in zip(["dQ", "dK", "dV"], mask)]
    got = run_fused("AttentionGrad", [("dO", do), ("Q", q), ("K", k), ("V", v), ("P", p)], outs)
    ref = attention_grad(do, q, k, v, p)  # default scales 1.0, k_transposed 0
    assert_requested(mask, got, ref)


@pytest.mark.parametrize("k_transposed", [0, 1])
@pytest.mark.parametrize("qs,ks", [(0.5, None), (None, 3.0), (0.25, -2.0), (1.5, 1.5), (0.0, 2.0)])
def test_attention_grad_runtime_scales(k_transposed, qs, ks):
    """Optional scalar inputs 5 (q_scale) and 6 (k_scale) multiply dQ and dK on top of the
    scale_q / scale_k attributes; dV is unaffected."""
    rng = _rng("attn-scales", k_transposed, qs, ks)
    do, q, k, v, p = _attn_inputs(rng, (2, 2), 11, 19, 8, 6, k_transposed)
    q_scale = None if qs is None else np.array(qs, F32)
    k_scale = None if ks is None else np.array([ks], F32)  # rank 0 or [1]: one element each
    attrs = dict(scale_q=0.35, scale_k=0.7, k_transposed=k_transposed)
    got = run_fused("AttentionGrad", [("dO", do), ("Q", q), ("K", k), ("V", v), ("P", p),
                                      ("q_scale", q_scale), ("k_scale", k_scale)],
                    [("dQ", F32), ("dK", F32), ("dV", F32)], **attrs)
    ref = attention_grad(do, q, k, v, p, np.float32(0.35), np.float32(0.7), k_transposed,
                           q_scale, k_scale)
    for g, r, nm in zip(got, ref, "dQ dK dV".split()):
        assert_close(g, r, what=nm)


def test_attention_grad_times_its_softmax_phase():
    """The kernel's own timer of its softmax backward (what `make bench` reports as the op's
    memory-bound part): positive and below the whole call when dS is needed, untouched when
    only dV (one GEMM, no softmax) is asked for."""
    import time

    rng = _rng("attn-phase")
    att = _attn_inputs(rng, (8,), 64, 64, 32, 32, 0)
    ins = list(zip(["dO", "Q", "K", "V", "P"], att))
    for outs, timed in [([("dQ", F32), ("dK", F32), ("dV", F32)], True), ([None, None, ("dV", F32)], False)]:
        sess = ort_session(fused_model("AttentionGrad", ins, outs))
        feeds = dict(ins)
        sess.run(None, feeds)
        library.reset_kernel_calls()
        t0 = time.perf_counter_ns()
        sess.run(None, feeds)
        wall = time.perf_counter_ns() - t0
        ns = library.kernel_calls("AttentionGrad/softmax_ns")
        assert (0 < ns < wall) if timed else ns == 0, (outs, ns, wall)


def test_attention_grad_runtime_scale_must_be_scalar():
    rng = _rng("attn-scales-err")
    do, q, k, v, p = _attn_inputs(rng, (1,), 3, 4, 2, 2, 0)
    with pytest.raises(Exception, match="scalar"):
        run_fused("AttentionGrad", [("dO", do), ("Q", q), ("K", k), ("V", v), ("P", p),
                                    ("q_scale", np.ones(2, F32))], [("dQ", F32), None, None])


@pytest.mark.parametrize("k_transposed", [0, 1])
def test_attention_grad_vs_unfused(k_transposed):
    rng = _rng("attn-unfused", k_transposed)
    lead, sq, sk, d, dv = (2, 3), 33, 47, 16, 24
    do, q, k, v, p = _attn_inputs(rng, lead, sq, sk, d, dv, k_transposed)
    scale = float(1 / np.sqrt(d))
    got = run_fused("AttentionGrad", [("dO", do), ("Q", q), ("K", k), ("V", v), ("P", p)],
                    [("dQ", F32), ("dK", F32), ("dV", F32)], scale_q=scale, scale_k=scale,
                    k_transposed=k_transposed)
    b = Builder()
    ndo, nq, nk, nv, npr = (b.input(nm, t) for nm, t in
                            zip(["dO", "Q", "K", "V", "P"], (do, q, k, v, p)))
    perm = [0, 1, 3, 2]
    rdv = b.op("MatMul", b.op("Transpose", npr, perm=perm), ndo)
    dp = b.op("MatMul", ndo, b.op("Transpose", nv, perm=perm))
    rs = b.op("ReduceSum", b.mul(dp, npr), b.ints([-1]), keepdims=1)
    ds = b.mul(npr, b.sub(dp, rs))
    k_sd = b.op("Transpose", nk, perm=perm) if k_transposed else nk
    rdq = b.mul(b.op("MatMul", ds, k_sd), b.const(scale))
    rdk = b.mul(b.op("MatMul", b.op("Transpose", ds, perm=perm), nq), b.const(scale))
    if k_transposed:
        rdk = b.op("Transpose", rdk, perm=perm)
    ref = b.run([rdq, rdk, rdv])
    for g, r, nm in zip(got, ref, "dQ dK dV".split()):
        assert_close(g, r, what=nm)
