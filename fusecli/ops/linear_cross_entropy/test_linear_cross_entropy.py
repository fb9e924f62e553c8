"""LinearCrossEntropy: the CPU kernel (fusecli/lib/libfusecli_ops.so) against the NumPy
reference, against the unfused standard-ONNX head + loss + gradient in onnxruntime (graph
optimizations off: MatMul, Add, LogSoftmax, GatherElements, the mask, ScatterElements, Exp,
ReduceSum, Sub, the gradient MatMuls: the torch-joint spelling) and against onnxruntime-
training's SoftmaxCrossEntropyLoss + SoftmaxCrossEntropyLossGrad, on shapes that cross every
chunk edge: rows not a multiple of the chunk, one-row chunks, a chunk whose every token is
ignored."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from fusecli.ops.linear_cross_entropy.reference import NO_IGNORE, linear_cross_entropy
from fusecli.ops.linear_cross_entropy.shapes import input_problem
# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import (DOMAIN, F32, Builder, _built, _rng, assert_close, ort_session,  # noqa: F401
                            rand, run_fused, run_in_ortt)

I64 = np.int64
# (rows N as [B, S], D, V, chunk_rows): one row; rows below, at and across the chunk; chunk 1
SHAPES = [((1, 1), 4, 3, 0), ((3, 37), 8, 11, 16), ((2, 32), 16, 50, 16), ((5, 7), 6, 29, 1),
          ((2, 40), 12, 300, 0), ((1, 48), 8, 20, 48)]


def make_case(shape, d, v, seed="a", ignore="chunk"):
    rng = _rng("lce", shape, d, v, seed)
    n = int(np.prod(shape))
    h, w, bias = rand(rng, (*shape, d)), rand(rng, (v, d), scale=0.5), rand(rng, (v,))
    lab = rng.integers(0, v, n).astype(I64)
    if ignore == "chunk" and n >= 32:
        lab[16:32] = -100           # every token of the second 16-row chunk
    elif ignore == "some":
        lab[::3] = -100
    return h, w, bias, lab


def fused(h, w, bias, lab, rw=None, rg=None, outs=(1, 1, 1, 1), **attrs):
    names = ["loss", "dH", "dW", "dB"]
    return run_fused("LinearCrossEntropy",
                     [("H", h), ("W", w), ("bias", bias), ("labels", lab), ("row_weight", rw),
                      ("row_grad", rg)],
                     [(nm, F32) if o else None for nm, o in zip(names, outs)], **attrs)


def torch_joint_unfused(h, w, bias, lab, grad_scale=1.0, logit_scale=None, logit_softcap=None,
                        pool=None):
    """The torch-joint decomposition of log_softmax + masked nll (mean over kept tokens) and its
    backward, as torch 2.13's export writes it (tests/data/make_lce.py); logit_scale: the
    logits multiplied by it before the loss (and their gradient after), as Cohere's head;
    logit_softcap: then soft-capped, c tanh(z / c), as Gemma 2's (the gradient times 1 - t^2);
    pool: G positions, the loss on logits[arange(G), pool] of the logits as [G, S, V] (a
    sequence classifier's last-token pooling: GatherND, its gradient ScatterND into zeros)."""
    n, v = lab.size, w.shape[0]
    rows = h.size // h.shape[-1]
    b = Builder()
    hn, wn, ln = b.input("H", h), b.input("W", w), b.input("labels", lab)
    h2 = b.op("Reshape", hn, b.ints([rows, h.shape[-1]]))
    wt = b.op("Transpose", wn, perm=[1, 0])
    z = b.op("MatMul", h2, wt)
    if bias is not None:
        z = b.add(z, b.input("bias", bias))
    if pool is not None:
        gidx = b.op("Concat", b.ints(np.arange(n).reshape(n, 1)),
                    b.op("Unsqueeze", b.input("pos", pool), b.ints([1])), axis=-1)
        z = b.op("GatherND", b.op("Reshape", z, b.ints([n, rows // n, v])), gidx)
    if logit_scale is not None:
        z = b.mul(z, b.const(logit_scale))
    if logit_softcap is not None:
        t = b.op("Tanh", b.op("Div", z, b.const(logit_softcap)))
        z = b.mul(t, b.const(logit_softcap))
    lp = b.op("LogSoftmax", z, axis=-1)
    ne = b.op("Not", b.op("Equal", ln, b.ints(-100)))
    safe = b.op("Where", ne, ln, b.ints(np.zeros(n, I64)))
    idx = b.op("Unsqueeze", safe, b.ints([1]))
    nll = b.op("Neg", b.op("Squeeze", b.op("GatherElements", lp, idx, axis=1), b.ints([1])))
    mf = b.op("Cast", ne, to=1)
    cnt = b.op("Cast", b.op("ReduceSum", b.op("Cast", ne, to=7), keepdims=0), to=1)
    loss = b.op("Div", b.op("ReduceSum", b.mul(nll, mf), keepdims=0), cnt)
    g = b.mul(b.op("Expand", b.op("Div", b.const(grad_scale), cnt), b.ints([n])), mf)
    sa = b.op("ScatterElements", b.const(np.zeros((n, v))), idx,
              b.op("Unsqueeze", b.op("Neg", g), b.ints([1])), axis=1, reduction="add")
    dz = b.sub(sa, b.mul(b.op("Exp", lp), b.op("ReduceSum", sa, b.ints([-1]), keepdims=1)))
    if logit_softcap is not None:
        dz = b.mul(dz, b.sub(b.const(1.0), b.mul(t, t)))
    if logit_scale is not None:
        dz = b.mul(dz, b.const(logit_scale))
    if pool is not None:
        dz = b.op("Reshape", b.op("ScatterND", b.const(np.zeros((n, rows // n, v))), gidx, dz,
                                  reduction="add"), b.ints([rows, v]))
    dw = b.op("MatMul", b.op("Transpose", dz, perm=[1, 0]), h2)
    dh = b.op("Reshape", b.op("MatMul", dz, b.op("Transpose", wt, perm=[1, 0])),
              b.ints(list(h.shape)))
    outs = [loss, dh, dw] + ([b.op("ReduceSum", dz, b.ints([0]), keepdims=0)]
                             if bias is not None else [])
    return b.run(outs), (mf, g)


@pytest.mark.parametrize("case", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_lce_vs_reference_and_torch_joint_unfused(case, with_bias):
    shape, d, v, chunk = case
    h, w, bias, lab = make_case(shape, d, v)
    bias = bias if with_bias else None
    got = fused(h, w, bias, lab, outs=(1, 1, 1, with_bias), chunk_rows=chunk)
    ref = linear_cross_entropy(h, w, bias, lab)
    unf, _ = torch_joint_unfused(h, w, bias, lab)
    for i, nm in enumerate(["loss", "dH", "dW", "dB"][:3 + with_bias]):
        assert_close(got[i], ref[i], what=f"{nm} vs reference")
        assert_close(got[i], unf[i], what=f"{nm} vs unfused")


@pytest.mark.parametrize("case", SHAPES[1:5])
@pytest.mark.parametrize("logit_scale,logit_softcap", [(0.25, None), (2.5, None), (None, 1.5),
                                                       (2.0, 2.5)])
def test_lce_logit_scale_and_softcap_transform_the_logits(case, logit_scale, logit_softcap):
    """Granite's logits / logits_scaling, Cohere's logits * logit_scale, Gemma 2's soft cap
    c tanh(z / c): the op with logit_scale / logit_softcap against the unfused head whose logits
    (and their gradient) go through them, and against the reference; the loss differs from the
    plain op's (the transform is not lost)."""
    shape, d, v, chunk = case
    h, w, bias, lab = make_case(shape, d, v, seed="scale")
    attrs = {k: x for k, x in (("logit_scale", logit_scale), ("logit_softcap", logit_softcap))
             if x is not None}
    got = fused(h, w, bias, lab, chunk_rows=chunk, **attrs)
    ref = linear_cross_entropy(h, w, bias, lab, **attrs)
    unf, _ = torch_joint_unfused(h, w, bias, lab, logit_scale=logit_scale,
                                 logit_softcap=logit_softcap)
    for i, nm in enumerate(["loss", "dH", "dW", "dB"]):
        assert_close(got[i], ref[i], what=f"{nm} vs reference")
        assert_close(got[i], unf[i], what=f"{nm} vs unfused")
    plain = linear_cross_entropy(h, w, bias, lab)   # the transform is not lost: dW differs
    assert not np.allclose(got[2], plain[2], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("case", SHAPES[1:4])
def test_lce_row_weight_and_row_grad_are_the_torch_joint_inputs(case):
    """torch-joint: the op takes the float mask (row_weight) and the gradient coefficient
    (row_grad) that the graph computes, with the ignored labels replaced by 0."""
    shape, d, v, chunk = case
    h, w, bias, lab = make_case(shape, d, v, ignore="some")
    unf, _ = torch_joint_unfused(h, w, None, lab, grad_scale=0.75)
    keep = lab != -100
    mf = keep.astype(F32)
    g = (mf * 0.75 / keep.sum()).astype(F32)
    got = fused(h, w, None, np.where(keep, lab, 0), rw=mf, rg=g, outs=(1, 1, 1, 0),
                chunk_rows=chunk)
    assert_close(got[0], unf[0], what="sum_i w_i nll_i / sum_i w_i")
    loss_sum = fused(h, w, None, np.where(keep, lab, 0), rw=mf, outs=(1, 0, 0, 0),
                     reduction="sum")[0]
    assert_close(loss_sum / F32(keep.sum()), unf[0], what="sum_i w_i nll_i")
    assert_close(got[1], unf[1], what="dH")
    assert_close(got[2], unf[2], what="dW")


def _head(n, d, v, ignore_index, with_bias):
    """The unfused models' inputs H [n, d], W [v, d], labels [n] (and bias [v]), the logits
    z = H W^T (+ bias) and the loss's ignore_index attribute."""
    b = Builder()
    hn, wn, ln = b.input("H", np.zeros((n, d), F32)), b.input("W", np.zeros((v, d), F32)), \
        b.input("labels", np.zeros(n, I64))
    z = b.op("MatMul", hn, b.op("Transpose", wn, perm=[1, 0]))
    if with_bias:
        z = b.add(z, b.input("bias", np.zeros(v, F32)))
    return b, hn, wn, ln, z, {} if ignore_index is None else {"ignore_index": ignore_index}


def ortt_unfused_model(n, d, v, reduction, ignore_index, with_bias, seed_input=False):
    """onnxruntime-training's spelling: SoftmaxCrossEntropyLoss -> SoftmaxCrossEntropyLossGrad
    (com.microsoft) seeded by a constant dLoss (0.5), or by the graph input `dloss`
    (seed_input), and the head's gradient GEMMs."""
    b, hn, wn, ln, z, ii = _head(n, d, v, ignore_index, with_bias)
    loss, lp = b.op("SoftmaxCrossEntropyLoss", z, ln, n_out=2, reduction=reduction, **ii)
    seed = b.input("dloss", np.zeros((), F32)) if seed_input else b.const(0.5)
    dz = b.op("SoftmaxCrossEntropyLossGrad", seed, lp, ln, reduction=reduction, **ii)
    b.nodes[-1].domain = "com.microsoft"
    dh = b.op("MatMul", dz, wn)
    dw = b.op("Gemm", dz, hn, transA=1)
    outs = [loss, dh, dw] + ([b.op("ReduceSum", dz, b.ints([0]), keepdims=0)] if with_bias else [])
    m = b.model(outs)
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return m, outs


def stock_unfused_model(n, d, v, reduction, ignore_index, with_bias, seed_input=False):
    """The same head and loss in standard ops only, for stock onnxruntime (which has no
    SoftmaxCrossEntropyLossGrad; ARM64 has no onnxruntime-training): the standard
    SoftmaxCrossEntropyLoss for the loss, its gradient written out as
    seed * (Softmax(z) - OneHot(label)) * kept / (kept tokens, or 1 for reduction sum), and the
    head's gradient GEMMs."""
    b, hn, wn, ln, z, ii = _head(n, d, v, ignore_index, with_bias)
    loss = b.op("SoftmaxCrossEntropyLoss", z, ln, reduction=reduction, **ii)
    seed = b.input("dloss", np.zeros((), F32)) if seed_input else b.const(0.5)
    if ignore_index is None:
        keep, safe = b.op("ConstantOfShape", b.op("Shape", ln), value=helper.make_tensor(
            "one", 1, [1], [1.0])), ln
    else:
        kb = b.op("Not", b.op("Equal", ln, b.ints(ignore_index)))
        keep, safe = b.op("Cast", kb, to=1), b.op("Where", kb, ln, b.ints(0))
    onehot = b.op("OneHot", safe, b.ints(v), b.const([0.0, 1.0]), axis=-1)
    scale = seed if reduction == "sum" else b.op("Div", seed, b.op("ReduceSum", keep, keepdims=0))
    rows = b.mul(b.op("Unsqueeze", keep, b.ints([1])), scale)
    dz = b.mul(b.sub(b.op("Softmax", z, axis=-1), onehot), rows)
    dh = b.op("MatMul", dz, wn)
    dw = b.op("Gemm", dz, hn, transA=1)
    outs = [loss, dh, dw] + ([b.op("ReduceSum", dz, b.ints([0]), keepdims=0)] if with_bias else [])
    return b.model(outs), outs


def run_in_stock_ort(jobs):
    """run_in_ortt's jobs (unfused models, no library) in this process's stock onnxruntime."""
    return [ort_session(j["model"], with_library=False).run(j["outputs"], j["feeds"]) for j in jobs]


def _lce_vs_unfused_loss(reduction, ignore_index, make_model, run_jobs, where):
    jobs, cases = [], []
    for (shape, d, v, chunk), with_bias in zip(SHAPES[1:5], [True, False, True, False]):
        h, w, bias, lab = make_case(shape, d, v, seed=reduction,
                                    ignore="none" if ignore_index is None else "chunk")
        n = lab.size
        if ignore_index is not None:
            lab = np.where(lab == -100, ignore_index, lab)
        h2 = h.reshape(n, d)
        m, outs = make_model(n, d, v, reduction, ignore_index, with_bias)
        feeds = {"H": h2, "W": w, "labels": lab, **({"bias": bias} if with_bias else {})}
        jobs.append({"model": m, "feeds": feeds, "outputs": outs})
        cases.append((h2, w, bias if with_bias else None, lab, chunk, with_bias))
    results = run_jobs(jobs)
    for (h2, w, bias, lab, chunk, with_bias), want in zip(cases, results):
        got = fused(h2, w, bias, lab, outs=(1, 1, 1, with_bias), chunk_rows=chunk,
                    reduction=reduction, grad_scale=0.5,
                    ignore_index=NO_IGNORE if ignore_index is None else ignore_index)
        ref = linear_cross_entropy(h2, w, bias, lab, ignore_index=NO_IGNORE if ignore_index is None
                                   else ignore_index, reduction=reduction, grad_scale=0.5)
        for i, nm in enumerate(["loss", "dH", "dW", "dB"][:3 + with_bias]):
            assert_close(got[i], want[i], what=f"{nm} vs {where}")
            assert_close(got[i], ref[i], what=f"{nm} vs reference")


@pytest.mark.ortt
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore_index", [None, -100, 3])
def test_lce_matches_ort_training_softmax_cross_entropy(reduction, ignore_index):
    _lce_vs_unfused_loss(reduction, ignore_index, ortt_unfused_model,
                         lambda jobs: run_in_ortt(jobs)[1], "onnxruntime-training")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore_index", [None, -100, 3])
def test_lce_matches_standard_softmax_cross_entropy_and_its_gradient(reduction, ignore_index):
    """The previous test's cases with the loss and gradient in standard ops (stock onnxruntime:
    what `make test-arm64` checks in place of the onnxruntime-training one)."""
    _lce_vs_unfused_loss(reduction, ignore_index, stock_unfused_model, run_in_stock_ort,
                         "the standard-op loss gradient")


def test_lce_outputs_are_optional_and_loss_alone_needs_no_gradient():
    h, w, bias, lab = make_case((2, 40), 8, 30)
    ref = linear_cross_entropy(h, w, bias, lab)
    loss, dh, dw, db = fused(h, w, bias, lab, outs=(1, 0, 0, 0), chunk_rows=16)
    assert dh is None and dw is None and db is None
    assert_close(loss, ref[0], what="loss alone")
    loss, dh, dw, db = fused(h, w, None, lab, outs=(0, 1, 0, 0), chunk_rows=16)
    assert loss is None and dw is None
    assert_close(dh, linear_cross_entropy(h, w, None, lab)[1], what="dH alone (frozen head)")


def test_lce_grad_seed_scales_the_gradients_not_the_loss():
    """A loss gradient fed at run time (grad_seed) multiplies grad_scale."""
    h, w, bias, lab = make_case((3, 37), 8, 11)
    seed = np.array([-1.5], F32)
    got = run_fused("LinearCrossEntropy",
                    [("H", h), ("W", w), ("bias", bias), ("labels", lab), ("row_weight", None),
                     ("row_grad", None), ("grad_seed", seed)],
                    [("loss", F32), ("dH", F32), ("dW", F32), ("dB", F32)], chunk_rows=16,
                    grad_scale=0.5)
    ref = linear_cross_entropy(h, w, bias, lab, grad_scale=0.5, grad_seed=seed)
    unscaled = linear_cross_entropy(h, w, bias, lab)
    for g, r, nm in zip(got, ref, ["loss", "dH", "dW", "dB"]):
        assert_close(g, r, what=nm)
    assert_close(ref[0], unscaled[0], what="the loss does not see the seed")
    assert_close(ref[1], (unscaled[1] * -0.75).astype(F32), what="dH = -0.75 x the unseeded")


SEEDS = [1.0, -1.5, 0.0, 3.25]


def _lce_split_vs_unfused(reduction, make_model, run_jobs, where):
    jobs, cases = [], []
    for (shape, d, v, chunk), with_bias in zip(SHAPES[1:5], [True, False, True, False]):
        h, w, bias, lab = make_case(shape, d, v, seed="split" + reduction)
        n = lab.size
        h2 = h.reshape(n, d)
        m, outs = make_model(n, d, v, reduction, -100, with_bias, seed_input=True)
        for s in SEEDS:
            feeds = {"H": h2, "W": w, "labels": lab, "dloss": np.array(s, F32),
                     **({"bias": bias} if with_bias else {})}
            jobs.append({"model": m, "feeds": feeds, "outputs": outs})
            cases.append((h2, w, bias if with_bias else None, lab, chunk, with_bias, s))
    results = run_jobs(jobs)
    for (h2, w, bias, lab, chunk, with_bias, s), want in zip(cases, results):
        ins = [("H", h2), ("W", w), ("bias", bias), ("labels", lab), ("row_weight", None),
               ("row_grad", None)]
        loss = run_fused("LinearCrossEntropy", ins, [("loss", F32)], chunk_rows=chunk,
                         reduction=reduction)[0]
        grads = run_fused("LinearCrossEntropy", ins + [("grad_seed", np.array([s], F32))],
                          [None, ("dH", F32), ("dW", F32), ("dB", F32) if with_bias else None],
                          chunk_rows=chunk, reduction=reduction)[1:]
        ref = linear_cross_entropy(h2, w, bias, lab, reduction=reduction, grad_seed=s)
        for got, i, nm in [(loss, 0, "loss"), (grads[0], 1, "dH"), (grads[1], 2, "dW"),
                           (grads[2], 3, "dB")][:3 + with_bias]:
            assert_close(got, want[i], what=f"{nm} vs {where}, seed {s}")
            assert_close(got, ref[i], what=f"{nm} vs reference, seed {s}")


@pytest.mark.ortt
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_lce_split_in_two_ops_matches_ort_training_with_a_run_time_seed(reduction):
    """A loss gradient computed from the loss (rules/lce_*.yaml _split): one op writes the loss
    alone (no gradient work), a second one the gradients alone from grad_seed (the logits
    recomputed chunk by chunk), against onnxruntime-training's SoftmaxCrossEntropyLoss + Grad
    seeded by a graph input, and the reference, for several seeds and chunk sizes."""
    _lce_split_vs_unfused(reduction, ortt_unfused_model, lambda jobs: run_in_ortt(jobs)[1],
                          "onnxruntime-training")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_lce_split_in_two_ops_matches_the_standard_op_gradient_with_a_run_time_seed(reduction):
    """The previous test's cases against the standard-op loss and gradient seeded by a graph
    input, in stock onnxruntime (`make test-arm64`'s check in place of onnxruntime-training's)."""
    _lce_split_vs_unfused(reduction, stock_unfused_model, run_in_stock_ort,
                          "the standard-op loss gradient")


def test_lce_split_with_row_grad_matches_the_one_op():
    """The torch-joint split: loss alone from row_weight, gradients alone from row_grad."""
    h, w, bias, lab = make_case((3, 37), 8, 11, ignore="some")
    keep = lab != -100
    mf, safe = keep.astype(F32), np.where(keep, lab, 0)
    for s in SEEDS:
        g = (mf * s / keep.sum()).astype(F32)
        one = fused(h, w, bias, safe, rw=mf, rg=g, chunk_rows=16)
        loss = fused(h, w, bias, safe, rw=mf, outs=(1, 0, 0, 0), chunk_rows=16)[0]
        grads = fused(h, w, bias, safe, rw=mf, rg=g, outs=(0, 1, 1, 1), chunk_rows=16)[1:]
        ref = linear_cross_entropy(h, w, bias, safe, row_weight=mf, row_grad=g)
        for got, i, nm in [(loss, 0, "loss"), (grads[0], 1, "dH"), (grads[1], 2, "dW"),
                           (grads[2], 3, "dB")]:
            assert_close(got, one[i], what=f"{nm} vs the one op, seed {s}")
            assert_close(got, ref[i], what=f"{nm} vs reference, seed {s}")


@pytest.mark.parametrize("case", SHAPES)
def test_lce_reduction_none_writes_each_rows_loss(case):
    """reduction none: the loss output is each row's loss, shaped as the labels (0 where
    ignored), computed here in NumPy from the logits; their sum is the op's sum, and the
    gradients are the sum's (or row_grad's)."""
    shape, d, v, chunk = case
    h, w, bias, lab = make_case(shape, d, v, ignore="some")
    lab2 = lab.reshape(shape)
    got = fused(h, w, bias, lab2, outs=(1, 1, 1, 1), reduction="none", chunk_rows=chunk)
    z = h.reshape(-1, d).astype(np.float64) @ w.T.astype(np.float64) + bias
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    keep = lab != -100
    rows = np.where(keep, lse - z[np.arange(lab.size), np.where(keep, lab, 0)], 0.0)
    assert got[0].shape == lab2.shape
    assert_close(got[0], rows.reshape(shape).astype(F32), what="each row's loss")
    ref = linear_cross_entropy(h, w, bias, lab2, reduction="none")
    summed = fused(h, w, bias, lab, reduction="sum", chunk_rows=chunk)
    assert_close(got[0], ref[0], what="loss vs reference")
    for i, nm in enumerate(["dH", "dW", "dB"], 1):
        assert_close(got[i], summed[i], what=f"{nm} vs the sum's")
        assert_close(got[i], ref[i], what=f"{nm} vs reference")
    g = np.where(keep, np.linspace(0.1, 1.0, lab.size), 0.0).astype(F32)
    with_g = fused(h, w, bias, lab, rg=g, reduction="none", chunk_rows=chunk)
    ref_g = linear_cross_entropy(h, w, bias, lab, row_grad=g, reduction="none")
    for i, nm in enumerate(["loss", "dH", "dW", "dB"]):
        assert_close(with_g[i], ref_g[i], what=f"{nm} with row_grad vs reference")


INT64_MAX = np.iinfo(np.int64).max
# (H [B, S, D], V, chunk_rows, seq_start, seq_end): the shift's [:-1] and [1:], a middle
# window, negative bounds, and a window that crosses chunks of one and of 16 rows
SEQ_CASES = [((2, 7, 6), 11, 0, 0, -1), ((3, 9, 8), 29, 16, 1, INT64_MAX),
             ((2, 12, 4), 7, 1, 2, 9), ((2, 37, 8), 13, 16, -30, -2), ((1, 2, 4), 5, 0, 0, -1)]


@pytest.mark.parametrize("case", SEQ_CASES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_lce_seq_window_is_the_op_on_the_sliced_rows(case, reduction):
    """seq_start / seq_end: the op on H[:, s0:s1] (H [B, S, D]), the labels one per row read;
    dH has H's shape with the rows not read 0: the same as the op on the sliced H, the
    reference, and dH put back into zeros."""
    shape, v, chunk, s0, s1 = case
    rng = _rng("lce_seq", shape, v)
    h, w, bias = rand(rng, shape), rand(rng, (v, shape[-1]), scale=0.5), rand(rng, (v,))
    hs = np.ascontiguousarray(h[:, s0:s1])
    lab = rng.integers(0, v, hs.shape[:2]).astype(I64)
    lab.reshape(-1)[1::4] = -100
    got = fused(h, w, bias, lab, reduction=reduction, chunk_rows=chunk, seq_start=s0,
                seq_end=s1)
    plain = fused(hs, w, bias, lab, reduction=reduction, chunk_rows=chunk)
    ref = linear_cross_entropy(h, w, bias, lab, reduction=reduction, seq_start=s0, seq_end=s1)
    assert got[1].shape == h.shape
    want_dh = np.zeros_like(h)
    want_dh[:, s0:s1] = plain[1]
    for i, nm in enumerate(["loss", "dH", "dW", "dB"]):
        want = want_dh if i == 1 else plain[i]
        assert_close(got[i], want, what=f"{nm} vs the op on the sliced rows")
        assert_close(got[i], ref[i], what=f"{nm} vs reference")


# (H's rows as [G, S], D, V, chunk_rows, positions): the last token, a negative index, the
# first, across one-row chunks, one sequence
POOL_CASES = [((2, 7), 6, 5, 0, [6, 3]), ((3, 9), 8, 29, 1, [-1, 0, 4]),
              ((4, 5), 4, 3, 2, [2, -5, 4, 1]), ((1, 12), 6, 7, 0, [11])]


@pytest.mark.parametrize("case", POOL_CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_lce_seq_index_is_the_loss_on_each_sequences_pooled_row(case, with_bias):
    """seq_index: the head on every token, the loss on logits[arange(G), index] (a
    sequence classifier's last non-pad token): against the reference, the op on the gathered
    rows (dH put back into zeros) and the unfused GatherND / ScatterND spelling on
    onnxruntime."""
    (g, s), d, v, chunk, pos = case
    rng = _rng("lce_pool", g, s, d, v)
    h, w = rand(rng, (g * s, d)), rand(rng, (v, d), scale=0.5)
    bias = rand(rng, (v,)) if with_bias else None
    lab = rng.integers(0, v, g).astype(I64)
    lab[1::3] = -100
    pos = np.array(pos, I64)
    outs = (1, 1, 1, with_bias)
    got = run_fused("LinearCrossEntropy",
                    [("H", h), ("W", w), ("bias", bias), ("labels", lab)] + [(k, None) for k in (
                        "row_weight", "row_grad", "grad_seed", "dw_add_index", "dw_add_rows",
                        "lp_row_grad")] + [("seq_index", pos)],
                    [(nm, F32) if o else None for nm, o in zip(["loss", "dH", "dW", "dB"], outs)],
                    chunk_rows=chunk)
    picked = h.reshape(g, s, d)[np.arange(g), pos]
    plain = fused(picked, w, bias, lab, outs=outs, chunk_rows=chunk)
    ref = linear_cross_entropy(h, w, bias, lab, seq_index=pos)
    unf, _ = torch_joint_unfused(h, w, bias, lab, pool=pos)
    want_dh = np.zeros((g, s, d), np.float32)
    want_dh[np.arange(g), pos] = plain[1]
    assert got[1].shape == h.shape and np.count_nonzero(np.abs(got[1]).sum(1)) <= g
    for i, nm in enumerate(["loss", "dH", "dW", "dB"][:3 + with_bias]):
        want = want_dh.reshape(h.shape) if i == 1 else plain[i]
        assert_close(got[i], want, what=f"{nm} vs the op on the pooled rows")
        assert_close(got[i], ref[i], what=f"{nm} vs reference")
        assert_close(got[i], unf[i], what=f"{nm} vs the unfused GatherND spelling")


def test_lce_seq_index_refuses_what_gather_nd_refuses():
    """An index outside [-S, S), G not splitting H's rows, or seq_index with seq_start: one
    line each."""
    rng = _rng("lce_pool_bad")
    h, w, lab = rand(rng, (12, 4)), rand(rng, (5, 4)), np.array([1, 2], I64)

    def run(pos, **attrs):
        return run_fused("LinearCrossEntropy",
                         [("H", h), ("W", w), ("bias", None), ("labels", lab[:len(pos)])]
                         + [(k, None) for k in ("row_weight", "row_grad", "grad_seed",
                                                "dw_add_index", "dw_add_rows", "lp_row_grad")]
                         + [("seq_index", np.array(pos, I64))], [("loss", F32)], **attrs)
    run([5, -6])                                      # S = 6: both ends are rows
    with pytest.raises(Exception, match="outside"):
        run([6, 0])
    with pytest.raises(Exception, match="outside"):
        run([0, -7])
    with pytest.raises(Exception, match="equal length"):
        run([0, 1, 2, 3, 4])
    with pytest.raises(Exception, match="does not combine"):
        run([0, 1], seq_start=1)
    # the shape guard (shapes.py) refuses the shapes the kernel refuses, before a fusion
    ins = [[12, 4], [5, 4], None, [2]] + [None] * 6
    assert input_problem({}, ins + [[2]]) is None
    assert "equal length" in input_problem({}, [[12, 4], [5, 4], None, [5]] + [None] * 6 + [[5]])
    assert "does not combine" in input_problem({"seq_start": 1}, ins + [[2]])
    assert "labels" in input_problem({}, ins + [[3]])
    with pytest.raises(ValueError, match="outside"):
        linear_cross_entropy(h, w, None, lab, seq_index=np.array([6, 0]))


def test_lce_seq_window_needs_a_sequence_axis():
    """seq_start / seq_end on a 2-D H (no sequence axis) fail in one line."""
    h, w, bias, lab = make_case((1, 6), 4, 5)
    with pytest.raises(Exception, match="seq_start / seq_end need H"):
        fused(h.reshape(6, 4), w, None, lab[:5], seq_start=0, seq_end=-1)


def test_lce_mean_over_no_token_is_nan_and_gradients_zero():
    h, w, bias, lab = make_case((1, 5), 4, 7)
    lab[:] = -100
    loss, dh, dw, _ = fused(h, w, None, lab, outs=(1, 1, 1, 0))
    assert np.isnan(loss) and not np.any(dh) and not np.any(dw)


# --- labels the originals accept, or do not (issue 33) -----------------------------------------

def torch_joint_spelling(lab, grad_scale=1.0):
    """The op's inputs as rules/lce_torch.yaml wires them: idx = Where(label != -100, label, 0),
    row_weight = the float mask, row_grad = its gradient coefficient (scale / count x mask)."""
    keep = lab != -100
    mf = keep.astype(F32)
    return np.where(keep, lab, 0), mf, (mf * F32(grad_scale) / F32(keep.sum())).astype(F32)


def negative_labels(v, n, rng):
    """Labels over the whole of [-V, V) (-V, -1 and the ignored -100 among them), one ignored
    token in five."""
    lab = rng.integers(-v, v, n).astype(I64)
    lab[:3] = [-v, -1, v - 1]
    lab[4::5] = -100
    return lab


# (rows as [B, S], D, V, chunk_rows): V differs from S and B; V > 100 makes -100 itself a
# label in [-V, 0): it is still ignored, first
WRAP_SHAPES = [((2, 8), 4, 11, 0), ((3, 37), 8, 11, 16), ((5, 7), 6, 29, 1),
               ((2, 40), 12, 300, 16)]


@pytest.mark.parametrize("case", WRAP_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_lce_wrap_negative_computes_what_the_torch_joint_original_does(case, with_bias):
    """torch-joint's original gathers and scatters at the label (GatherElements /
    ScatterElements, axis 1), which onnxruntime reads in [-V, V): a label in [-V, 0) is the
    class V + label. The op with wrap_negative (as rules/lce_torch.yaml writes it) computes the
    same loss and gradients, in the rule's spelling (row_weight, row_grad) and with ignore_index
    alone, against the unfused chain on onnxruntime and the reference."""
    shape, d, v, chunk = case
    h, w, bias, _ = make_case(shape, d, v, seed="wrap")
    bias = bias if with_bias else None
    lab = negative_labels(v, int(np.prod(shape)), _rng("lce-wrap", shape, v))
    assert (lab < 0).sum() > (lab == -100).sum()        # negatives other than -100 are fed
    unf, _ = torch_joint_unfused(h, w, bias, lab)
    idx, mf, g = torch_joint_spelling(lab)
    outs = (1, 1, 1, with_bias)
    rule = fused(h, w, bias, idx, rw=mf, rg=g, outs=outs, chunk_rows=chunk, wrap_negative=1)
    plain = fused(h, w, bias, lab, outs=outs, chunk_rows=chunk, wrap_negative=1)
    ref = linear_cross_entropy(h, w, bias, lab, wrap_negative=1)
    wrapped = linear_cross_entropy(h, w, bias, np.where(lab == -100, -100, lab % v))
    for i, nm in enumerate(["loss", "dH", "dW", "dB"][:3 + with_bias]):
        assert_close(rule[i], unf[i], what=f"{nm}, the rule's spelling vs unfused")
        assert_close(plain[i], unf[i], what=f"{nm}, ignore_index vs unfused")
        assert_close(plain[i], ref[i], what=f"{nm} vs reference")
        assert_close(ref[i], wrapped[i], what=f"{nm}: the reference reads V + label")


def _one_line_error(call):
    """The status message of the op's failure (onnxruntime's prefix off): one line."""
    with pytest.raises(Exception) as err:
        call()
    msg = str(err.value).split("Status Message: ", 1)[-1].strip()
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("bad", ["V", "V+3", "-V-1", "big"])
def test_lce_refuses_the_labels_the_torch_joint_original_refuses(bad):
    """A label outside [-V, V) fails in the original (onnxruntime's ScatterElements: 'indices
    element out of data bounds') and in the op (one line), in both of its spellings, and in the
    reference."""
    shape, d, v = (2, 8), 4, 11
    h, w, bias, lab = make_case(shape, d, v, seed="bad")
    lab[3] = {"V": v, "V+3": v + 3, "-V-1": -v - 1, "big": 2 ** 40}[bad]
    with pytest.raises(Exception, match="out of data bounds"):
        torch_joint_unfused(h, w, bias, lab)
    idx, mf, g = torch_joint_spelling(lab)
    want = "LinearCrossEntropy: a label is outside [-V, V) and not ignore_index"
    assert want in _one_line_error(lambda: fused(h, w, bias, idx, rw=mf, rg=g, wrap_negative=1))
    assert want in _one_line_error(lambda: fused(h, w, bias, lab, outs=(1, 0, 0, 0),
                                                 wrap_negative=1))
    with pytest.raises(ValueError, match="outside"):
        linear_cross_entropy(h, w, bias, lab, wrap_negative=1)


@pytest.mark.ortt
def test_lce_ort_training_original_defines_no_label_outside_the_classes():
    """Why the op refuses a label outside [0, V) without wrap_negative (rules/lce_ortt.yaml):
    onnxruntime-training 1.19.2's SoftmaxCrossEntropyLoss computes nothing defined for one.
    Its loss reads the log-probabilities at the unchecked offset row * V + label: label -5 on
    row 3 reads row 2's class V - 5, label V on row 5 reads row 6's class 0 (neither the class
    V + label nor an ignored token), and one far out of range reads past the buffer (a
    segmentation fault when this was written); its Grad puts no one-hot on such a row (dZ =
    softmax). So the op fails (one line) rather than pick a meaning; -100 (ignore_index) is
    ignored by both."""
    n, d, v = 8, 4, 11
    rng = _rng("lce-ortt-bad")
    h, w = rand(rng, (n, d)), rand(rng, (v, d), scale=0.5)
    lab = rng.integers(0, v, n).astype(I64)
    lab[3], lab[5], lab[6] = -5, v, -100
    b = Builder()
    hn, wn, ln = b.input("H", h), b.input("W", w), b.input("labels", lab)
    z = b.op("MatMul", hn, b.op("Transpose", wn, perm=[1, 0]))
    loss, lp = b.op("SoftmaxCrossEntropyLoss", z, ln, n_out=2, reduction="sum",
                    ignore_index=-100)
    dz = b.op("SoftmaxCrossEntropyLossGrad", b.const(1.0), lp, ln, reduction="sum",
              ignore_index=-100)
    b.nodes[-1].domain = "com.microsoft"
    m = b.model([loss, dz])
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _, ((got_loss, got_dz),), _ = run_in_ortt([{"model": m, "feeds": b.feeds,
                                                "outputs": [loss, dz]}])
    zz = h.astype(np.float64) @ w.astype(np.float64).T
    logp = zz - zz.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    flat = logp.reshape(-1)
    kept = [i for i in range(n) if lab[i] != -100]
    unchecked = -sum(flat[i * v + lab[i]] for i in kept)
    wrapped = -sum(logp[i, lab[i] % v] for i in kept)
    np.testing.assert_allclose(got_loss, unchecked, rtol=1e-5)
    assert abs(unchecked - wrapped) > 1e-2                   # not the class V + label
    soft = np.exp(logp)
    np.testing.assert_allclose(got_dz[[3, 5]], soft[[3, 5]], rtol=1e-5, atol=1e-6)  # no one-hot
    np.testing.assert_allclose(got_dz[6], 0, atol=0)           # ignored
    want = "LinearCrossEntropy: a label is outside [0, V) and not ignore_index"
    for bad in (-5, v):
        one = np.where(lab == -100, 0, lab)
        one[3] = bad
        assert want in _one_line_error(lambda: fused(h, w, None, one, outs=(1, 1, 1, 0),
                                                     reduction="sum"))
        with pytest.raises(ValueError, match="outside"):
            linear_cross_entropy(h, w, None, one)


def test_lce_refuses_bad_inputs():
    h, w, bias, lab = make_case((1, 6), 4, 7)
    with pytest.raises(Exception, match="outside"):
        fused(h, w, None, np.full(6, 7, I64), outs=(1, 0, 0, 0))
    with pytest.raises(Exception, match="labels"):
        fused(h, w, None, lab[:5], outs=(1, 0, 0, 0))
    with pytest.raises(Exception, match="W must be"):
        fused(h, w[:, :3], None, lab, outs=(1, 0, 0, 0))


# --- dw_add_index / dw_add_rows: a tied embedding's rows added into the op's dW ---------------
# (ScatterND(dW, index, rows){add} folded into the op: the memory budget's deferred head,
# fusecli/engine/recompute.py)
ADD_CASES = [((2, 7), 6, 13, 0, 5), ((3, 37), 8, 11, 16, 40), ((1, 1), 4, 3, 0, 1)]


@pytest.mark.parametrize("case", ADD_CASES)
def test_lce_dw_add_rows_is_scatter_nd_add_into_dw(case):
    """dW + rows at the classes index (negative ones from the end, repeats summed in order):
    against the reference and against the op's plain dW scattered by ScatterND{add} on
    onnxruntime; the other outputs are the op's without them."""
    shape, d, v, chunk, m = case
    h, w, bias, lab = make_case(shape, d, v)
    rng = _rng("lce_add", shape, d, v)
    idx = rng.integers(-v, v, (m, 1)).astype(I64)
    idx[-1] = idx[0]                                  # a class twice
    rows = rand(rng, (m, d))
    names = [("loss", F32), ("dH", F32), ("dW", F32), ("dB", F32)]
    ins = [("H", h), ("W", w), ("bias", bias), ("labels", lab), ("row_weight", None),
           ("row_grad", None), ("grad_seed", None)]
    got = run_fused("LinearCrossEntropy", ins + [("dw_add_index", idx), ("dw_add_rows", rows)],
                    names, chunk_rows=chunk)
    plain = run_fused("LinearCrossEntropy", ins, names, chunk_rows=chunk)
    b = Builder()
    (scattered,) = b.run([b.op("ScatterND", b.input("dW", plain[2]), b.input("idx", idx),
                               b.input("rows", rows), reduction="add")])
    ref = linear_cross_entropy(h, w, bias, lab, dw_add_index=idx, dw_add_rows=rows)
    assert_close(got[2], ref[2], what="dW vs reference")
    assert_close(got[2], scattered, what="dW vs ScatterND{add} of the op's dW")
    assert not np.allclose(got[2], plain[2])         # the rows did land
    for k in (0, 1, 3):
        np.testing.assert_array_equal(got[k], plain[k])


def test_lce_dw_add_rows_refuses_what_scatter_nd_refuses():
    h, w, bias, lab = make_case((1, 6), 4, 7)
    ins = [("H", h), ("W", w), ("bias", None), ("labels", lab), ("row_weight", None),
           ("row_grad", None), ("grad_seed", None)]
    outs = [None, None, ("dW", F32)]
    rows = np.ones((2, 4), np.float32)
    with pytest.raises(Exception, match="outside"):
        run_fused("LinearCrossEntropy", ins + [("dw_add_index", np.array([[1], [7]], I64)),
                                               ("dw_add_rows", rows)], outs)
    with pytest.raises(Exception, match="D values"):
        run_fused("LinearCrossEntropy", ins + [("dw_add_index", np.array([[1], [2]], I64)),
                                               ("dw_add_rows", rows[:, :3])], outs)
    with pytest.raises(ValueError, match="outside"):
        linear_cross_entropy(h, w, None, lab, dw_add_index=np.array([-8]), dw_add_rows=rows[:1])


def _smoothed_unfused(h, w, bias, lab, eps, reduce, logit_softcap=None):
    """The written-out label-smoothed loss (gen_torch.cross_entropy: (1 - eps) masked nll mean
    + eps masked mean of -log_softmax's row mean (reduce "mean") or row sum times 1 / V
    ("sum", F.cross_entropy's spelling)) and its backward in standard ONNX, with the per-row
    coefficients the graph computes: (loss, dH, dW, dB) and (mask, g, u, the rows' lp)."""
    n, v = lab.size, w.shape[0]
    b = Builder()
    hn, wn, ln = b.input("H", h), b.input("W", w), b.input("labels", lab)
    h2 = b.op("Reshape", hn, b.ints([n, h.shape[-1]]))
    z = b.add(b.op("MatMul", h2, b.op("Transpose", wn, perm=[1, 0])), b.input("bias", bias))
    if logit_softcap is not None:
        t = b.op("Tanh", b.op("Div", z, b.const(logit_softcap)))
        z = b.mul(t, b.const(logit_softcap))
    lp = b.op("LogSoftmax", z, axis=-1)
    ne = b.op("Not", b.op("Equal", ln, b.ints(-100)))
    idx = b.op("Unsqueeze", b.op("Where", ne, ln, b.ints(np.zeros(n, I64))), b.ints([1]))
    nll = b.op("Neg", b.op("Squeeze", b.op("GatherElements", lp, idx, axis=1), b.ints([1])))
    mf = b.op("Cast", ne, to=1)
    cnt = b.op("Cast", b.op("ReduceSum", b.op("Cast", ne, to=7), keepdims=0), to=1)
    row = b.op("ReduceMean" if reduce == "mean" else "ReduceSum", lp, b.ints([-1]), keepdims=0)
    a = 1.0 if reduce == "mean" else 1.0 / v
    smooth = b.op("Div", b.op("ReduceSum", b.mul(b.op("Neg", row), mf), keepdims=0), cnt)
    loss = b.add(b.mul(b.op("Div", b.op("ReduceSum", b.mul(nll, mf), keepdims=0), cnt),
                       b.const(1.0 - eps)), b.mul(smooth, b.const(eps * a)))
    g = b.mul(b.op("Expand", b.op("Div", b.const(1.0 - eps), cnt), b.ints([n])), mf)
    u = b.op("Neg", b.mul(b.op("Expand", b.op("Div", b.const(eps * a), cnt), b.ints([n])), mf))
    sa = b.op("ScatterElements", b.const(np.zeros((n, v))), idx,
              b.op("Unsqueeze", b.op("Neg", g), b.ints([1])), axis=1, reduction="add")
    su = b.op("Expand", b.op("Unsqueeze", u, b.ints([-1])), b.ints([n, v]))
    if reduce == "mean":
        su = b.op("Div", su, b.const(float(v)))
    sa = b.add(su, sa)
    dz = b.sub(sa, b.mul(b.op("Exp", lp), b.op("ReduceSum", sa, b.ints([-1]), keepdims=1)))
    if logit_softcap is not None:
        dz = b.mul(dz, b.sub(b.const(1.0), b.mul(t, t)))
    dw = b.op("MatMul", b.op("Transpose", dz, perm=[1, 0]), h2)
    dh = b.op("Reshape", b.op("MatMul", dz, b.op("Transpose", b.op("Transpose", wn, perm=[1, 0]),
                                                  perm=[1, 0])), b.ints(list(h.shape)))
    return b.run([loss, dh, dw, b.op("ReduceSum", dz, b.ints([0]), keepdims=0), mf, g, u, row])


@pytest.mark.parametrize("case", SHAPES[1:5])
@pytest.mark.parametrize("reduce", ["mean", "sum"])
@pytest.mark.parametrize("logit_softcap", [None, 1.5])
def test_lce_lp_row_and_its_gradient_are_label_smoothings_term(case, reduce, logit_softcap):
    """Label smoothing eps: the op's lp_row (each row's log-probabilities reduced over the
    classes) and lp_row_grad (the loss's gradient with respect to it), with the graph's masking
    and reductions around them, against the unfused label-smoothed loss and backward, the
    reference, and F.cross_entropy(label_smoothing=eps)'s formula in float64 NumPy:
    (1 - eps) nll + eps (lse - mean z), dZ = ((1 - eps) (p - onehot) + eps (p - 1 / V)) / count
    on the kept rows."""
    shape, d, v, chunk = case
    h, w, bias, lab = make_case(shape, d, v, seed="smooth", ignore="some")
    eps = 0.1
    attrs = {"logit_softcap": logit_softcap} if logit_softcap else {}
    loss_u, dh_u, dw_u, db_u, mf, g, u, row_u = _smoothed_unfused(h, w, bias, lab, eps, reduce,
                                                                   logit_softcap)
    safe = np.where(lab == -100, 0, lab)
    ins = [("H", h), ("W", w), ("bias", bias), ("labels", safe), ("row_weight", mf),
           ("row_grad", g), ("grad_seed", None), ("dw_add_index", None), ("dw_add_rows", None),
           ("lp_row_grad", u)]
    names = [("loss", F32), ("dH", F32), ("dW", F32), ("dB", F32), ("lp_row", F32)]
    got = run_fused("LinearCrossEntropy", ins, names, chunk_rows=chunk, lp_row_reduce=reduce,
                    **attrs)
    ref = linear_cross_entropy(h, w, bias, safe, row_weight=mf, row_grad=g, lp_row_grad=u,
                               lp_row_reduce=reduce, **attrs)
    for i, nm in enumerate(["loss", "dH", "dW", "dB", "lp_row"]):
        assert_close(got[i], ref[i], what=f"{nm} vs reference")
    assert_close(got[4], row_u, what="lp_row vs the unfused row reduction")
    a = 1.0 if reduce == "mean" else 1.0 / v
    total = (1 - eps) * got[0] + eps * a * (-(got[4] * mf).sum() / mf.sum())
    for x, want, nm in [(total, loss_u, "loss"), (got[1], dh_u, "dH"), (got[2], dw_u, "dW"),
                        (got[3], db_u, "dB")]:
        assert_close(np.asarray(x, F32), want, what=f"{nm} vs unfused")
    # F.cross_entropy(z, y, ignore_index=-100, label_smoothing=eps) in float64
    z = h.reshape(-1, d).astype(np.float64) @ w.T.astype(np.float64) + bias
    if logit_softcap:
        t = np.tanh(z / logit_softcap)
        z = logit_softcap * t
    keep = lab != -100
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    per = (1 - eps) * (lse - z[np.arange(lab.size), safe]) + eps * (lse - z.mean(1))
    assert_close(np.float32(total), np.float32(per[keep].mean()), what="loss vs F.cross_entropy")
    p = np.exp(z - lse[:, None])
    onehot = np.eye(v)[safe]
    dz = keep[:, None] * ((1 - eps) * (p - onehot) + eps * (p - 1.0 / v)) / keep.sum()
    if logit_softcap:
        dz *= 1 - t * t
    assert_close(got[2], (dz.T @ h.reshape(-1, d)).astype(F32), what="dW vs F.cross_entropy")
    if not logit_softcap:  # (capped at 1.5, the softmax is near uniform: p - 1 / V is small)
        plain = run_fused("LinearCrossEntropy", ins[:6], names[:4], chunk_rows=chunk)
        # the smoothing did land: dW moves by more than 1% of its largest entry
        assert np.abs(got[2] - plain[2]).max() > 0.01 * np.abs(plain[2]).max()
