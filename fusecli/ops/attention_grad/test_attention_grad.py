"""AttentionGrad: its kernels (fusecli/lib/libfusecli_ops.so) against the NumPy reference
and against the unfused standard-ONNX subgraph it replaces, in onnxruntime with graph
optimizations off."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from onnx import TensorProto

from fusecli.runtime import library
from fusecli.ops.attention_grad.reference import attention_grad
# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import (F32, Builder, _built, _rng, assert_close, assert_requested,
                            fused_model, ort_session, rand, run_fused)


def attention_grad_subgraph(b: Builder, do, q, k, v, p, qb, kb, vb, k_transposed, scale_q, scale_k,
                            q_scale=None, k_scale=None, mask=None, ratio=0.0, nan_guard=False,
                            fill=None, fill_kept=0):
    """AttentionGrad's contract from standard ops; returns (dQ, dK, dV, dS). q, k, v, p are
    (name, shape) pairs, do a name; qb / kb / vb the batch dims of P, K, V. K / V are expanded to
    the query heads (Reshape + Expand + Reshape, as repeat_kv), then MatMuls, the
    softmax-gradient decomposition, the dropout mask as a Cast + Mul, and the group sums as a
    Reshape + ReduceSum. nan_guard: F.scaled_dot_product_attention's guard, V sees
    Where(IsNaN(P), 0, P) and its gradient goes through Where(IsNaN(P), 0, .), the softmax
    gradient reads the unguarded P. fill: a bool fill mask (name) broadcastable to P: dQ and dK
    read Where(fill, 0, dS) (fill_kept=1: Where(fill, dS, 0)), as the backward of masked_fill /
    GPT-2's where; the returned dS is the softmax gradient before it."""
    nb = len(qb)
    perm = list(range(nb)) + [nb + 1, nb]

    def swap_last(t, rank):
        return b.op("Transpose", t, perm=list(range(rank - 2)) + [rank - 1, rank - 2])

    def pairs(tb):  # each batch dim split into (kv size, group size)
        return [x for qd, kd in zip(qb, tb) for x in (kd, qd // kd)]

    def expand(t, tb, rows, cols):
        t = b.op("Reshape", t, b.ints([x for kd in tb for x in (kd, 1)] + [rows, cols]))
        t = b.op("Expand", t, b.ints(pairs(tb) + [rows, cols]))
        return b.op("Reshape", t, b.ints([*qb, rows, cols]))

    def group_sum(t, tb, shape):
        t = b.op("Reshape", t, b.ints(pairs(tb) + [-1]))
        t = b.op("ReduceSum", t, b.ints(list(range(1, 2 * nb, 2))), keepdims=0)
        return b.op("Reshape", t, b.ints(list(shape)))

    sk = p[1][-1]
    d, dv = q[1][-1], v[1][-1]
    kb_full, vb_full = (1,) * (nb - len(kb)) + tuple(kb), (1,) * (nb - len(vb)) + tuple(vb)
    keep = None
    if mask is not None:
        keep = b.mul(b.op("Cast", mask, to=TensorProto.FLOAT), b.const(1.0 / (1.0 - ratio)))
    nan = b.op("IsNaN", p[0]) if nan_guard else None
    pg = p[0] if nan is None else b.op("Where", nan, b.const(0.0), p[0])
    pd = pg if keep is None else b.mul(pg, keep)
    rdv = group_sum(b.op("MatMul", b.op("Transpose", pd, perm=perm), do), vb_full, v[1])
    dp = b.op("MatMul", do, b.op("Transpose", expand(v[0], vb_full, sk, dv), perm=perm))
    if keep is not None:
        dp = b.mul(dp, keep)
    if nan is not None:
        dp = b.op("Where", nan, b.const(0.0), dp)
    rs = b.op("ReduceSum", b.mul(dp, p[0]), b.ints([-1]), keepdims=1)
    ds_out = ds = b.mul(p[0], b.sub(dp, rs))
    if fill is not None:
        zero = b.const(0.0)
        ds = b.op("Where", fill, ds, zero) if fill_kept else b.op("Where", fill, zero, ds)
    rank_k = len(k[1])
    k_sd = expand(swap_last(k[0], rank_k) if k_transposed else k[0], kb_full, sk, d)
    sq_ = b.const(scale_q) if q_scale is None else b.mul(b.const(scale_q), q_scale)
    sk_ = b.const(scale_k) if k_scale is None else b.mul(b.const(scale_k), k_scale)
    rdq = b.mul(b.op("MatMul", ds, k_sd), sq_)
    dk_full = b.mul(b.op("MatMul", b.op("Transpose", ds, perm=perm), q[0]), sk_)
    kshape = (*k[1][:-2], k[1][-1], k[1][-2]) if k_transposed else k[1]
    rdk = group_sum(dk_full, kb_full, kshape)
    if k_transposed:
        rdk = swap_last(rdk, rank_k)
    return rdq, rdk, rdv, ds_out


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


# Grouped / multi-query attention, dropout and the dS output. Each case: (P's batch dims, K's
# batch dims, V's batch dims, Sq, Sk, D, Dv). K / V batch dims are right-aligned with P's.
GQA_CASES = {
    "plain": ((2, 3), (2, 3), (2, 3), 9, 13, 8, 6),
    "mqa": ((2, 4), (2, 1), (2, 1), 7, 11, 8, 5),          # one kv head broadcast
    "gqa": ((2, 4), (2, 2), (2, 2), 9, 13, 8, 6),          # repeat_kv: head h uses h // 2
    "gqa_k_mqa_v": ((2, 4), (2, 2), (2, 1), 5, 12, 4, 7),  # V grouped apart from K
    "batch_bcast": ((3, 4), (1, 4), (4,), 6, 9, 5, 3),     # K shared by the batch (rank 3)
    "mixed": ((2, 6), (1, 3), (2, 2), 5, 7, 4, 4),         # every dim grouped differently
    "one_kv": ((3, 2), (), (1, 1), 4, 6, 3, 2),            # K is one [Sk, D] matrix
}


def _gqa_inputs(rng, case, k_transposed, dropout):
    qb, kb, vb, sq, sk, d, dv = GQA_CASES[case]
    do, q, _, _, p = _attn_inputs(rng, qb, sq, sk, d, dv, k_transposed)
    k = rand(rng, (*kb, d, sk) if k_transposed else (*kb, sk, d))
    v = rand(rng, (*vb, sk, dv))
    mask = rng.random(p.shape) >= 0.3 if dropout else None
    return do, q, k, v, p, mask


def _attn_run(do, q, k, v, p, mask=None, q_scale=None, k_scale=None, want=(1, 1, 1, 1),
              fill=None, **attrs):
    ins = [("dO", do), ("Q", q), ("K", k), ("V", v), ("P", p), ("q_scale", q_scale),
           ("k_scale", k_scale), ("dropout_mask", mask), ("fill_mask", fill)]
    outs = [(nm, F32) if w else None for nm, w in zip(["dQ", "dK", "dV", "dS"], want)]
    return run_fused("AttentionGrad", ins, outs, **attrs)


@pytest.mark.parametrize("case", sorted(GQA_CASES))
@pytest.mark.parametrize("k_transposed", [0, 1])
@pytest.mark.parametrize("dropout", [0, 1])
def test_attention_grad_groups_dropout_ds_vs_reference(case, k_transposed, dropout):
    """Grouped / multi-query K and V (dK, dV summed over each group), the dropout mask and the
    dS output, with run-time scales, against the NumPy reference."""
    rng = _rng("attn-gqa", case, k_transposed, dropout)
    do, q, k, v, p, mask = _gqa_inputs(rng, case, k_transposed, dropout)
    qs, ks = np.array(0.5, F32), np.array([-1.25], F32)
    attrs = dict(scale_q=0.3, scale_k=0.7, k_transposed=k_transposed,
                 dropout_ratio=0.3 if dropout else 0.0)
    got = _attn_run(do, q, k, v, p, mask, qs, ks, **attrs)
    ref = attention_grad(do, q, k, v, p, np.float32(0.3), np.float32(0.7), k_transposed, qs, ks,
                           mask, attrs["dropout_ratio"])
    for g, r, nm in zip(got, ref, "dQ dK dV dS".split()):
        assert_close(g, r, what=f"{case} {nm}")


@pytest.mark.parametrize("case,lead_k", [("mqa", (1, 1)), ("gqa", (1, 4))])
def test_attention_grad_group_split_over_chunks(case, lead_k):
    """Large score matrices (256 x 256, the kernel works in ~2 MiB chunks of them): 16 query
    heads sharing one kv head span two chunks (the group sum accumulates across chunks); groups
    of 4 fit whole in a chunk (one GEMM per group, written in place)."""
    rng = _rng("attn-gqa-big", case)
    do, q, _, _, p = _attn_inputs(rng, (1, 16), 256, 256, 16, 8, 0)
    k, v = rand(rng, (*lead_k, 256, 16)), rand(rng, (*lead_k, 256, 8))
    mask = rng.random(p.shape) >= 0.1
    got = _attn_run(do, q, k, v, p, mask, scale_q=0.25, scale_k=0.25, dropout_ratio=0.1)
    ref = attention_grad(do, q, k, v, p, 0.25, 0.25, 0, None, None, mask, 0.1)
    for g, r, nm in zip(got, ref, "dQ dK dV dS".split()):
        assert_close(g, r, what=f"{case} {nm}")


@pytest.mark.parametrize("want", [m for m in itertools.product([0, 1], repeat=4) if any(m)])
def test_attention_grad_optional_outputs_with_groups_and_dropout(want):
    rng = _rng("attn-gqa-opt", want)
    do, q, k, v, p, mask = _gqa_inputs(rng, "gqa", 0, 1)
    got = _attn_run(do, q, k, v, p, mask, want=want, scale_q=0.5, scale_k=0.5, dropout_ratio=0.2)
    ref = attention_grad(do, q, k, v, p, 0.5, 0.5, 0, None, None, mask, 0.2)
    assert_requested(want, got, ref, "dQ dK dV dS".split())


@pytest.mark.parametrize("case", sorted(GQA_CASES))
@pytest.mark.parametrize("k_transposed", [0, 1])
@pytest.mark.parametrize("dropout", [0, 1])
def test_attention_grad_vs_unfused(case, k_transposed, dropout):
    """The fused op against the unfused standard-op subgraph in onnxruntime (optimizations off):
    every grouping, k_transposed, run-time scales, dropout mask as a given input, dS."""
    rng = _rng("attn-unfused", case, k_transposed, dropout)
    do, q, k, v, p, mask = _gqa_inputs(rng, case, k_transposed, dropout)
    qb, kb, vb = GQA_CASES[case][:3]
    qs, ks = np.array(0.5, F32), np.array(1.5, F32)
    ratio = 0.25 if dropout else 0.0
    scale = float(1 / np.sqrt(q.shape[-1]))
    got = _attn_run(do, q, k, v, p, mask, qs, ks, scale_q=scale, scale_k=scale,
                    k_transposed=k_transposed, dropout_ratio=ratio)
    b = Builder()
    names = ["dO", "Q", "K", "V", "P"]
    t = {nm: (b.input(nm, a), a.shape) for nm, a in zip(names, (do, q, k, v, p))}
    outs = attention_grad_subgraph(b, t["dO"][0], t["Q"], t["K"], t["V"], t["P"], qb, kb, vb,
                             k_transposed, scale, scale, b.input("q_scale", qs),
                             b.input("k_scale", ks),
                             None if mask is None else b.input("mask", mask), ratio)
    ref = b.run(list(outs))
    for g, r, nm in zip(got, ref, "dQ dK dV dS".split()):
        assert_close(g, r, what=f"{case} {nm}")


def _nan_rows(rng, p):
    """P with some whole rows NaN: the softmax of a fully masked score row (a padded query's
    every key masked), as F.scaled_dot_product_attention computes it before its NaN guard."""
    p = p.copy()
    rows = p.reshape(-1, p.shape[-1])
    rows[rng.random(rows.shape[0]) < 0.25] = np.nan
    rows[0] = np.nan
    return p


@pytest.mark.parametrize("case", ["plain", "gqa", "mqa"])
@pytest.mark.parametrize("dropout", [0, 1])
@pytest.mark.parametrize("nan_guard", [0, 1])
def test_attention_grad_nan_rows(case, dropout, nan_guard):
    """P with fully masked (NaN) rows, against the reference and the unfused subgraph in
    onnxruntime (optimizations off): nan_guard=1 is F.scaled_dot_product_attention's guard
    Where(IsNaN(P), 0, P) before V (dV stays finite, the unfused Where(IsNaN(P), 0, dP) and
    SoftmaxGrad keep NaN in dS, dQ, dK exactly where the original has it); nan_guard=0 lets the
    NaN reach dV too, as the plain softmax backward does."""
    rng = _rng("attn-nan", case, dropout, nan_guard)
    do, q, k, v, p, mask = _gqa_inputs(rng, case, 0, dropout)
    p = _nan_rows(rng, p)
    qb, kb, vb = GQA_CASES[case][:3]
    ratio = 0.2 if dropout else 0.0
    attrs = dict(scale_q=0.25, scale_k=0.25, dropout_ratio=ratio, nan_guard=nan_guard)
    got = _attn_run(do, q, k, v, p, mask, **attrs)
    ref = attention_grad(do, q, k, v, p, 0.25, 0.25, 0, None, None, mask, ratio, nan_guard)
    b = Builder()
    t = {nm: (b.input(nm, a), a.shape) for nm, a in zip(["dO", "Q", "K", "V", "P"],
                                                         (do, q, k, v, p))}
    outs = attention_grad_subgraph(b, t["dO"][0], t["Q"], t["K"], t["V"], t["P"], qb, kb, vb, 0,
                                   0.25, 0.25, None, None,
                                   None if mask is None else b.input("mask", mask), ratio,
                                   nan_guard=bool(nan_guard))
    unfused = b.run(list(outs))
    for g, r, u, nm in zip(got, ref, unfused, "dQ dK dV dS".split()):
        assert_close(r, u, what=f"reference vs unfused {nm}")
        assert_close(g, r, what=f"{case} {nm}")
    assert np.isnan(got[3]).any() and np.isnan(got[0]).any()  # the NaN rows reach dS and dQ
    assert np.isfinite(got[2]).all() == bool(nan_guard)  # dV: finite exactly under the guard


@pytest.mark.parametrize("kshape,vshape,match", [
    ((2, 3, 13, 8), (2, 4, 13, 6), "K's batch dims \\[2, 3\\] must equal or divide P's \\[2, 4\\]"),
    ((2, 2, 13, 8), (4, 4, 13, 6), "V's batch dims \\[4, 4\\] must equal or divide P's"),
    ((3, 2, 2, 13, 8), (2, 2, 13, 6), "K's batch dims \\[3, 2, 2\\]"),
    ((2, 2, 12, 8), (2, 2, 13, 6), "K must be \\[..., Sk, D\\]"),
    ((2, 2, 13, 8), (2, 2, 12, 6), "V must be \\[..., 13, 6\\] \\(from P, Q and dO\\), got \\[2, 2, 12, 6\\]"),
])
def test_attention_grad_rejects_shapes_outside_the_group_rule(kshape, vshape, match):
    rng = _rng("attn-bad-groups", kshape, vshape)
    do, q, _, _, p = _attn_inputs(rng, (2, 4), 9, 13, 8, 6, 0)
    k, v = rand(rng, kshape), rand(rng, vshape)
    with pytest.raises(Exception, match=match):
        _attn_run(do, q, k, v, p)
    if "batch dims" in match:
        with pytest.raises(ValueError, match=match):
            attention_grad(do, q, k, v, p)


@pytest.mark.parametrize("mshape", [(2, 4, 9, 12), (2, 1, 9, 13), (8, 9, 13)])
def test_attention_grad_rejects_a_dropout_mask_of_the_wrong_shape(mshape):
    rng = _rng("attn-bad-mask", mshape)
    do, q, k, v, p = _attn_inputs(rng, (2, 4), 9, 13, 8, 6, 0)
    mask = rng.random(mshape) > 0.5
    with pytest.raises(Exception, match="dropout_mask must be bool with P's shape \\[2, 4, 9, 13\\]"):
        _attn_run(do, q, k, v, p, mask, dropout_ratio=0.1)
    with pytest.raises(ValueError, match="dropout_mask must have P's shape"):
        attention_grad(do, q, k, v, p, dropout_mask=mask, dropout_ratio=0.1)


def test_attention_grad_rejects_bad_dropout_settings():
    rng = _rng("attn-bad-dropout")
    do, q, k, v, p = _attn_inputs(rng, (2,), 5, 6, 4, 3, 0)
    mask = rng.random(p.shape) > 0.5
    with pytest.raises(Exception, match="dropout_ratio is set but the dropout_mask input is absent"):
        _attn_run(do, q, k, v, p, dropout_ratio=0.1)
    with pytest.raises(Exception, match="dropout_ratio must be in \\[0, 1\\)"):
        _attn_run(do, q, k, v, p, mask, dropout_ratio=1.0)
    with pytest.raises(Exception, match="dropout_mask"):  # a float mask is not the bool input
        _attn_run(do, q, k, v, p, mask.astype(F32), dropout_ratio=0.1)


# ---- the fill mask: masked_fill / GPT-2's where, fully filled rows ---------------------------
# (P's batch dims, the fill mask's shape, Sq, Sk); the mask broadcasts to P's shape
FILL_CASES = {
    "key_pad": ((2, 3), (2, 1, 1, 13), 9, 13),      # a padded sequence fills every row
    "query_key": ((2, 3), (2, 1, 9, 13), 9, 13),    # 2-D mask: padded query rows fill entirely
    "causal": ((2, 3), (9, 13), 9, 13),             # [Sq, Sk], rows 0.. filled past the diagonal
    "row_flag": ((2, 3), (2, 3, 9, 1), 9, 13),      # one flag per row
    "full": ((2, 3), (2, 3, 9, 13), 9, 13),
    "head_key": ((2, 3), (3, 1, 13), 9, 13),       # per head and key
    "rank3": ((6,), (6, 1, 13), 9, 13),
}


def _fill_inputs(rng, case, fill_kept, k_transposed=0, dropout=False, kv=None):
    """Inputs with a fill mask and P = softmax(Where(filled, -big, S)): P is 0 at filled
    positions and uniform (1/Sk) in a row filled entirely (at least one such row)."""
    qb, mshape, sq, sk = FILL_CASES[case]
    d, dv = 8, 6
    do, q, k, v, _ = _attn_inputs(rng, qb, sq, sk, d, dv, k_transposed)
    if kv is not None:  # grouped K / V
        k = rand(rng, (*kv, d, sk) if k_transposed else (*kv, sk, d))
        v = rand(rng, (*kv, sk, dv))
    filled = rng.random(mshape) < 0.35
    if case == "causal":
        filled = np.triu(np.ones(mshape, bool), 1)
        filled[2] = True  # a fully filled row
    else:
        filled.reshape(-1)[: int(np.prod(mshape[-1:]))] = True  # the first mask row: all filled
    full = np.broadcast_to(filled, (*qb, sq, sk))
    assert full.all(axis=-1).any() and not full.all()
    logits = np.where(full, np.float32(-3.4e38), rng.standard_normal(full.shape).astype(F32))
    e = np.exp(logits - logits.max(-1, keepdims=True))
    p = (e / e.sum(-1, keepdims=True)).astype(F32)
    mask = rng.random(p.shape) >= 0.3 if dropout else None
    return do, q, k, v, p, mask, (~filled if fill_kept else filled)


@pytest.mark.parametrize("case", sorted(FILL_CASES))
@pytest.mark.parametrize("fill_kept", [0, 1])
@pytest.mark.parametrize("dropout", [0, 1])
def test_attention_grad_fill_mask_vs_reference_and_unfused(case, fill_kept, dropout):
    """The fill mask (broadcast shapes, both polarities, rows filled entirely) against the
    reference and the unfused subgraph with the backward Where(m, 0, dS): dQ and dK read dS
    as 0 where the forward filled, dS (the softmax gradient before the Where) does not."""
    rng = _rng("attn-fill", case, fill_kept, dropout)
    do, q, k, v, p, mask, fill = _fill_inputs(rng, case, fill_kept, 1, dropout)
    qb = FILL_CASES[case][0]
    ratio = 0.2 if dropout else 0.0
    attrs = dict(scale_q=0.35, scale_k=0.7, k_transposed=1, dropout_ratio=ratio,
                 fill_kept=fill_kept)
    got = _attn_run(do, q, k, v, p, mask, fill=fill, **attrs)
    ref = attention_grad(do, q, k, v, p, 0.35, 0.7, 1, None, None, mask, ratio, 0, fill,
                         fill_kept)
    b = Builder()
    t = {nm: (b.input(nm, a), a.shape) for nm, a in zip(["dO", "Q", "K", "V", "P"],
                                                         (do, q, k, v, p))}
    outs = attention_grad_subgraph(b, t["dO"][0], t["Q"], t["K"], t["V"], t["P"], qb, qb, qb, 1,
                                   0.35, 0.7, None, None,
                                   None if mask is None else b.input("mask", mask), ratio,
                                   fill=b.input("fill", fill), fill_kept=fill_kept)
    unfused = b.run(list(outs))
    for g, r, u, nm in zip(got, ref, unfused, "dQ dK dV dS".split()):
        assert_close(r, u, what=f"reference vs unfused {nm}")
        assert_close(g, r, what=f"{case} {nm}")
    # without the mask the op is wrong in the fully filled rows (what the bug was)
    plain = attention_grad(do, q, k, v, p, 0.35, 0.7, 1, None, None, mask, ratio)
    assert not np.allclose(plain[0], ref[0], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("want", [m for m in itertools.product([0, 1], repeat=4) if any(m)])
def test_attention_grad_fill_mask_optional_outputs(want):
    """Every subset of outputs with a fill mask and grouped K / V: the dS output stays the
    unzeroed softmax gradient also when dQ / dK (which read the zeroed one) are asked for."""
    rng = _rng("attn-fill-opt", want)
    do, q, k, v, p, mask, fill = _fill_inputs(rng, "query_key", 0, kv=(2, 1))
    got = _attn_run(do, q, k, v, p, want=want, fill=fill, scale_q=0.5, scale_k=0.5)
    ref = attention_grad(do, q, k, v, p, 0.5, 0.5, 0, fill_mask=fill)
    assert_requested(want, got, ref, "dQ dK dV dS".split())


@pytest.mark.parametrize("fill_kept", [0, 1])
def test_attention_grad_fill_mask_over_chunks(fill_kept):
    """Large score matrices (the CPU kernel works in chunks of items): the fill mask's row
    offsets past the first chunk, a padded sequence in the last one."""
    rng = _rng("attn-fill-big", fill_kept)
    do, q, k, v, p = _attn_inputs(rng, (4, 16), 128, 128, 16, 8, 0)
    filled = np.zeros((4, 1, 1, 128), bool)
    filled[0, ..., 100:] = True
    filled[3] = True
    p = np.where(np.broadcast_to(filled, p.shape), 0.0, p).astype(F32)
    p[3] = 1.0 / 128
    fill = ~filled if fill_kept else filled
    for want in [(1, 1, 1, 1), (1, 1, 0, 0)]:
        got = _attn_run(do, q, k, v, p, fill=fill, want=want, scale_q=0.25, scale_k=0.25,
                        fill_kept=fill_kept)
        ref = attention_grad(do, q, k, v, p, 0.25, 0.25, 0, fill_mask=fill, fill_kept=fill_kept)
        assert_requested(want, got, ref, "dQ dK dV dS".split())
        assert not got[0][3].any() and not got[1][3].any()  # the padded sequence: no gradient


@pytest.mark.parametrize("mshape", [(2, 4, 9, 12), (3, 1, 9, 13), (1, 2, 4, 9, 13)])
def test_attention_grad_rejects_a_fill_mask_that_does_not_broadcast(mshape):
    rng = _rng("attn-bad-fill", mshape)
    do, q, k, v, p = _attn_inputs(rng, (2, 4), 9, 13, 8, 6, 0)
    fill = rng.random(mshape) > 0.5
    with pytest.raises(Exception, match="fill_mask .* must broadcast to P's shape"):
        _attn_run(do, q, k, v, p, fill=fill)
    with pytest.raises(ValueError, match="fill_mask .* must broadcast to P's shape"):
        attention_grad(do, q, k, v, p, fill_mask=fill)
