"""fusecli's custom-op library (fusecli/lib/libfusecli_ops.so) against the NumPy reference and
against the unfused standard-ONNX subgraphs each op replaces, in onnxruntime with graph
optimizations off; plus loading the same .so in onnxruntime-training 1.19.2."""

from __future__ import annotations

import itertools

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from fusecli import library
from fusecli.contracts import infer_output_types
from fusecli.ops import reference as R

from kernel_helpers import (OPSET, Builder, act_grad_subgraph, assert_close, assert_requested,
                            fused_model, ort_session, rand, run_fused, run_in_ortt, tol)

ACTS = ["relu", "gelu", "gelu_tanh", "silu"]
F32, F16 = np.float32, np.float16


@pytest.fixture(autouse=True, scope="module")
def _built():
    library.library_path()  # fails clearly when the library is not built


def _rng(*key):
    return np.random.default_rng(abs(hash(key)) % (2**32))


# ==================================== ActivationGrad ===========================================

@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("shape", [(1,), (3,), (17,), (2, 3, 17), (5, 33), (256, 1023)])
def test_activation_grad_vs_reference(act, dtype, shape):
    rng = _rng("act", act, str(dtype), shape)
    dy, x = rand(rng, shape, dtype), rand(rng, shape, dtype, scale=2.0)
    (dx,) = run_fused("ActivationGrad", [("dY", dy), ("X", x)], [("dX", dtype)], activation=act)
    assert_close(dx, R.activation_grad(dy, x, act), **tol(dtype), what=f"{act} {shape}")


@pytest.mark.parametrize("act", ACTS)
def test_activation_grad_vs_unfused(act):
    rng = _rng("act-unfused", act)
    dy, x = rand(rng, (7, 129)), rand(rng, (7, 129), scale=3.0)
    (dx,) = run_fused("ActivationGrad", [("dY", dy), ("X", x)], [("dX", F32)], activation=act)
    b = Builder()
    out = act_grad_subgraph(b, b.input("dY", dy), b.input("X", x), act)
    (ref,) = b.run([out])
    assert_close(dx, ref, what=act)


@pytest.mark.parametrize("act", ACTS)
def test_activation_grad_accuracy_on_a_dense_grid(act):
    """The vectorized exp / erf / reciprocal approximations (and the masked tail: an odd length)
    against the float64 formula on a dense grid reaching the saturated tails. Errors are absolute
    (dY = 1, act' <= 1.13): 1 ulp near 1 is 1.2e-7. gelu_tanh keeps float32's cancellation in
    1 - tanh^2 near |x| = 5 (the unfused chain has it too), hence its looser bound."""
    x = np.concatenate([np.linspace(-12.0, 12.0, 240_007), [-87.5, -40.0, 40.0, 87.5, 1e6, -1e6]])
    x = x.astype(F32)
    dy = np.ones_like(x)
    (dx,) = run_fused("ActivationGrad", [("dY", dy), ("X", x)], [("dX", F32)], activation=act)
    with np.errstate(over="ignore"):  # exp(1e6) in the float64 silu formula
        ref = R.activation_grad(dy.astype(np.float64), x.astype(np.float64), act)
    err = np.abs(dx.astype(np.float64) - ref)
    worst = int(np.argmax(err))
    assert err.max() <= (5e-6 if act == "gelu_tanh" else 6e-7), f"{act}: |error| {err.max():.3g} at x={x[worst]!r}"
    big = np.abs(ref) > 0.05  # away from act' zero crossings: relative error too
    assert (err[big] / np.abs(ref[big])).max() <= 1e-5, act


def test_activation_grad_bad_activation_is_an_error():
    dy = np.ones((2, 2), F32)
    with pytest.raises(Exception, match="activation"):
        run_fused("ActivationGrad", [("dY", dy), ("X", dy)], [("dX", F32)], activation="tanhh")


# ================================ LinearActivationGrad =========================================

def _lin_inputs(rng, lead, n, k, trans_w):
    dy = rand(rng, (*lead, n))
    x = rand(rng, (*lead, n), scale=2.0)
    a = rand(rng, (*lead, k))
    w = rand(rng, (k, n) if trans_w else (n, k), scale=0.3)
    return dy, x, a, w


LIN_SHAPES = [((1,), 1, 1), ((3,), 17, 5), ((2, 3), 17, 33), ((64,), 3, 129), ((384,), 257, 320)]


@pytest.mark.parametrize("act", ACTS + ["identity"])
@pytest.mark.parametrize("trans_w", [0, 1])
@pytest.mark.parametrize("lead,n,k", LIN_SHAPES)
def test_linear_activation_grad_vs_reference(act, trans_w, lead, n, k):
    rng = _rng("lin", act, trans_w, lead, n, k)
    dy, x, a, w = _lin_inputs(rng, lead, n, k, trans_w)
    da, dw, db = run_fused("LinearActivationGrad", [("dY", dy), ("X", x), ("A", a), ("W", w)],
                           [("dA", F32), ("dW", F32), ("dB", F32)], activation=act, trans_w=trans_w)
    rda, rdw, rdb, _ = R.linear_activation_grad(dy, x, a, w, act, trans_w)
    assert_close(da, rda, what="dA")
    assert_close(dw, rdw, what="dW")
    assert_close(db, rdb, what="dB")


@pytest.mark.parametrize("trans_w,trans_dw", [(0, 1), (1, 0)])
@pytest.mark.parametrize("lead,n,k", [((3,), 17, 5), ((2, 3), 17, 33)])
def test_linear_activation_grad_dw_layout(trans_w, trans_dw, lead, n, k):
    """trans_dw writes dW in the other layout than W's (a folded Transpose of the weight grad)."""
    rng = _rng("lin-dw", trans_w, trans_dw, lead, n, k)
    dy, x, a, w = _lin_inputs(rng, lead, n, k, trans_w)
    da, dw = run_fused("LinearActivationGrad", [("dY", dy), ("X", x), ("A", a), ("W", w)],
                       [("dA", F32), ("dW", F32)], activation="gelu", trans_w=trans_w,
                       trans_dw=trans_dw)
    rda, rdw, _, _ = R.linear_activation_grad(dy, x, a, w, "gelu", trans_w, trans_dw)
    assert dw.shape == ((k, n) if trans_dw else (n, k))
    assert_close(da, rda, what="dA")
    assert_close(dw, rdw, what="dW")


@pytest.mark.parametrize("mask", [m for m in itertools.product([0, 1], repeat=3) if any(m)])
@pytest.mark.parametrize("trans_w", [0, 1])
def test_linear_activation_grad_optional_outputs(mask, trans_w):
    rng = _rng("lin-opt", mask, trans_w)
    dy, x, a, w = _lin_inputs(rng, (2, 9), 19, 11, trans_w)
    outs = [(nm, F32) if m else None for nm, m in zip(["dA", "dW", "dB"], mask)]
    got = run_fused("LinearActivationGrad", [("dY", dy), ("X", x), ("A", a), ("W", w)], outs,
                    activation="gelu", trans_w=trans_w)
    ref = R.linear_activation_grad(dy, x, a, w, "gelu", trans_w)
    assert_requested(mask, got, ref)


def _inplace_model(op, inputs, outs, intermediates, keep=(), elem=F32, **attrs):
    """(model, feeds): `op` in a graph where each input named in `intermediates` is
    Add(<name>_p, <name>_q) of two graph inputs (an intermediate the runtime may reuse; those in
    `keep` are also graph outputs, so they must survive the node) and every fused output goes
    through Neg (a graph output is never placed in an input's buffer). inputs: list of
    (name, array) in port order."""
    onnx_t = helper.np_dtype_to_tensor_dtype(np.dtype(elem))
    vi = lambda n, shape=None: helper.make_tensor_value_info(n, onnx_t, shape)  # noqa: E731
    nodes, g_in, feeds, inner = [], [], {}, []
    for name, arr in inputs:
        if name in intermediates:
            half = (arr / 2).astype(arr.dtype)
            feeds[f"{name}_p"], feeds[f"{name}_q"] = half, (arr - half).astype(arr.dtype)
            g_in += [vi(f"{name}_p", arr.shape), vi(f"{name}_q", arr.shape)]
            nodes.append(helper.make_node("Add", [f"{name}_p", f"{name}_q"], [name]))
            inner.append(vi(name, arr.shape))
        else:
            feeds[name] = arr
            g_in.append(helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(arr.dtype), arr.shape))
    fused = [f"f_{o}" if o else "" for o in outs]  # None: an output the node does not ask for
    fnode = helper.make_node(op, [n for n, _ in inputs], fused, domain="com.fusecli", **attrs)
    nodes.append(fnode)
    outs = [o for o in outs if o]
    nodes += [helper.make_node("Neg", [f"f_{o}"], [o]) for o in outs]
    # the fused outputs' types, recorded as fusecli's rewriter records them: onnxruntime places an
    # output in an input's buffer only when it knows both sizes
    types = {v.name: v.type for v in g_in + inner}
    for f, t in zip(fused, infer_output_types(fnode, types.get)):
        if f and t is not None:
            inner.append(helper.make_value_info(f, t))
    g_out = [vi(o) for o in outs] + [vi(k, dict(inputs)[k].shape) for k in keep]
    g = helper.make_graph(nodes, "inplace", g_in, g_out, value_info=inner)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET),
                                                helper.make_opsetid("com.fusecli", 1)], ir_version=9)
    return model, feeds


def _inplace_run(op, inputs, outs, intermediates, keep=(), elem=F32, **attrs):
    """Runs _inplace_model here; returns (negated-back outputs, kernel calls, in-place calls)."""
    model, feeds = _inplace_model(op, inputs, outs, intermediates, keep, elem, **attrs)
    library.reset_kernel_calls()
    got = ort_session(model).run([o for o in outs if o], feeds)
    return [-g for g in got], library.kernel_calls(op), library.kernel_calls(f"{op}/inplace")


@pytest.mark.parametrize("op", ["ActivationGrad", "LinearActivationGrad"])
@pytest.mark.parametrize("act", ["gelu", "silu", "relu"])
@pytest.mark.parametrize("dy_used_after", [False, True])
def test_inplace_output_over_dy(op, act, dy_used_after):
    """The in-place pair dY -> dX (ActivationGrad) / dY -> dZ (LinearActivationGrad): onnxruntime
    writes that output into dY's own buffer when dY is dead after the node (the kernel counts
    it), never when dY is still needed; the results are right either way."""
    rng = _rng("inplace", op, act, dy_used_after)
    dy, x = rand(rng, (6, 40)), rand(rng, (6, 40), scale=2.0)
    a, w = rand(rng, (6, 9)), rand(rng, (40, 9))
    if op == "ActivationGrad":
        inputs, outs, ref = [("dY", dy), ("X", x)], ["dX"], [R.activation_grad(dy, x, act)]
    else:
        inputs, outs = [("dY", dy), ("X", x), ("A", a), ("W", w)], ["dA", "dW", "dB", "dZ"]
        ref = R.linear_activation_grad(dy, x, a, w, act)
    got, calls, inplace = _inplace_run(op, inputs, outs, {"dY"}, {"dY"} if dy_used_after else (),
                                       activation=act)
    for g, r, nm in zip(got, ref, outs):
        assert_close(g, r, what=nm)
    assert (calls, inplace) == (1, 0 if dy_used_after else 1)


@pytest.mark.parametrize("dtype", [F32])
@pytest.mark.parametrize("dead,expect", [({"dY"}, 1), ({"dR"}, 1), ((), 0)])
def test_layer_norm_grad_dx_in_place(dtype, dead, expect):
    """LayerNormGrad's pairs dY -> dX, then dR -> dX: dX lands in whichever of the two is dead
    after the node, and dGamma / dBeta (which read dY) stay right. (onnxruntime 1.31 applies the
    pairs of the float32 registration only; float16 ops get fresh outputs.)"""
    rng = _rng("ln-inplace", str(dtype), tuple(dead))
    ins = _ln_inputs(rng, (6, 33), -1, dtype)
    live = {"dY", "dR"} - set(dead)
    got, calls, inplace = _inplace_run("LayerNormGrad", list(ins.items()), ["dX", "dGamma", "dBeta"],
                                       {"dY", "dR"}, live, elem=dtype)
    ref = R.layer_norm_grad(*ins.values())
    for g, r, nm in zip(got, ref, ["dX", "dGamma", "dBeta"]):
        assert_close(g, r, **tol(dtype), what=nm)
    assert (calls, inplace) == (1, expect)


def test_inplace_outputs_in_onnxruntime_training():
    """onnxruntime-training 1.19.2 honours the same in-place pairs (custom-op struct version 18)."""
    rng = _rng("inplace-ortt")
    dy, x, a, w = rand(rng, (6, 40)), rand(rng, (6, 40), scale=2.0), rand(rng, (6, 9)), rand(rng, (40, 9))
    ln = _ln_inputs(rng, (6, 40), -1, F32)
    conv = CONV_CASES[3]
    cv = _conv_inputs(rng, *conv)
    cases = [("ActivationGrad", [("dY", dy), ("X", x)], ["dX"], dict(activation="gelu"),
              [R.activation_grad(dy, x, "gelu")]),
             ("LinearActivationGrad", [("dY", dy), ("X", x), ("A", a), ("W", w)],
              ["dA", "dW", "dB", "dZ"], dict(activation="gelu"),
              R.linear_activation_grad(dy, x, a, w, "gelu")),
             ("LayerNormGrad", list(ln.items()), ["dX", "dGamma", "dBeta"], {},
              R.layer_norm_grad(*ln.values())),
             ("ConvBnReluGrad", list(cv.items()), CONV_OUTS + ["dC"], _conv_attrs(*conv[7:]),
              R.conv_bn_relu_grad(*cv.values(), *conv[7:]))]
    jobs = []
    for op, inputs, outs, attrs, _ in cases:
        model, feeds = _inplace_model(op, inputs, outs, {"dY"}, (), F32, **attrs)
        jobs.append(dict(model=model, feeds=feeds, outputs=outs, library=True,
                         count=[op, f"{op}/inplace"]))
    _, results, calls = run_in_ortt(jobs)
    for (op, _, outs, _, ref), got, c in zip(cases, results, calls):
        assert c == {op: 1, f"{op}/inplace": 1}
        for g, r, nm in zip(got, ref, outs):
            assert_close(-g, r, what=f"{op} {nm}")


@pytest.mark.parametrize("act", ["gelu", "identity"])
def test_linear_activation_grad_dz_output(act):
    """Output 3 (dZ) is the activation gradient, with or without the other outputs."""
    rng = _rng("lin-dz", act)
    dy, x, a, w = _lin_inputs(rng, (2, 9), 19, 11, 0)
    ref = R.linear_activation_grad(dy, x, a, w, act)
    for mask in [(1, 1, 1), (0, 0, 0), (0, 0, 1)]:
        outs = [(nm, F32) if m else None for nm, m in zip(["dA", "dW", "dB"], mask)] + [("dZ", F32)]
        got = run_fused("LinearActivationGrad", [("dY", dy), ("X", x), ("A", a), ("W", w)], outs,
                        activation=act)
        for o, g, r in zip(outs, got, ref):
            if o:
                assert_close(g, r, what=f"{o[0]} {mask}")


@pytest.mark.parametrize("outs", [(0, 1, 1), (0, 1, 0), (0, 0, 1)])
@pytest.mark.parametrize("act", ["gelu", "relu", "identity"])
@pytest.mark.parametrize("trans_w", [0, 1])
def test_linear_activation_grad_without_w(outs, act, trans_w):
    """First layer: W is absent (input 3 is ""), dA is not requested."""
    rng = _rng("lin-no-w", outs, act, trans_w)
    dy, x, a, _ = _lin_inputs(rng, (3, 7), 21, 13, trans_w)
    req = [(nm, F32) if o else None for nm, o in zip(["dA", "dW", "dB"], outs)]
    got = run_fused("LinearActivationGrad", [("dY", dy), ("X", x), ("A", a), ("W", None)], req,
                    activation=act, trans_w=trans_w)
    ref = R.linear_activation_grad(dy, x, a, None, act, trans_w)
    assert got[0] is None and ref[0] is None
    assert_requested(outs, got, ref, ["dA", "dW", "dB"])


def test_linear_activation_grad_da_without_w_is_an_error():
    rng = _rng("lin-no-w-err")
    dy, x, a, _ = _lin_inputs(rng, (4,), 5, 3, 0)
    with pytest.raises(Exception, match="W is absent"):
        run_fused("LinearActivationGrad", [("dY", dy), ("X", x), ("A", a), ("W", None)],
                  [("dA", F32), ("dW", F32), None], activation="relu")


@pytest.mark.parametrize("act", ["relu", "gelu", "identity"])
@pytest.mark.parametrize("trans_w", [0, 1])
def test_linear_activation_grad_vs_unfused(act, trans_w):
    rng = _rng("lin-unfused", act, trans_w)
    lead, n, k = (4, 33), 65, 47
    dy, x, a, w = _lin_inputs(rng, lead, n, k, trans_w)
    da, dw, db = run_fused("LinearActivationGrad", [("dY", dy), ("X", x), ("A", a), ("W", w)],
                           [("dA", F32), ("dW", F32), ("dB", F32)], activation=act, trans_w=trans_w)
    b = Builder()
    dz = act_grad_subgraph(b, b.input("dY", dy), b.input("X", x), act)
    dz2 = b.op("Reshape", dz, b.ints([-1, n]))
    a2 = b.op("Reshape", b.input("A", a), b.ints([-1, k]))
    wn = b.input("W", w)
    if trans_w:
        rda = b.op("Gemm", dz2, wn, transB=1)                 # [M,N] x [K,N]^T
        rdw = b.op("Gemm", a2, dz2, transA=1)                 # A^T dZ = [K,N]
    else:
        rda = b.op("MatMul", dz2, wn)                         # [M,N] x [N,K]
        rdw = b.op("Gemm", dz2, a2, transA=1)                 # dZ^T A = [N,K]
    rda = b.op("Reshape", rda, b.ints([*lead, k]))
    rdb = b.op("ReduceSum", dz2, b.ints([0]), keepdims=0)
    ref = b.run([rda, rdw, rdb])
    for g, r, nm in zip((da, dw, db), ref, "dA dW dB".split()):
        assert_close(g, r, what=nm)


# ==================================== AttentionGrad ============================================

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
    ref = R.attention_grad(do, q, k, v, p, np.float32(sq_), np.float32(sk_), k_transposed)
    for g, r, nm in zip(got, ref, "dQ dK dV".split()):
        assert_close(g, r, what=nm)


@pytest.mark.parametrize("mask", [m for m in itertools.product([0, 1], repeat=3) if any(m)])
def test_attention_grad_optional_outputs_and_defaults(mask):
    rng = _rng("attn-opt", mask)
    do, q, k, v, p = _attn_inputs(rng, (2,), 9, 13, 5, 7, 0)
    outs = [(nm, F32) if m else None for nm, m in zip(["dQ", "dK", "dV"], mask)]
    got = run_fused("AttentionGrad", [("dO", do), ("Q", q), ("K", k), ("V", v), ("P", p)], outs)
    ref = R.attention_grad(do, q, k, v, p)  # default scales 1.0, k_transposed 0
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
    ref = R.attention_grad(do, q, k, v, p, np.float32(0.35), np.float32(0.7), k_transposed,
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


# =================================== ConvBnReluGrad ============================================

def _conv_inputs(rng, n, cin, hin, win, c, kh, kw, strides, pads, dilations, group):
    x = rand(rng, (n, cin, hin, win))
    w = rand(rng, (c, cin // group, kh, kw), scale=0.5)
    h = (hin + pads[0] + pads[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    wd = (win + pads[1] + pads[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    cv = rand(rng, (n, c, h, wd), scale=1.5) + 0.2
    mean = cv.mean(axis=(0, 2, 3)).astype(F32)
    inv_std = (1 / np.sqrt(cv.var(axis=(0, 2, 3)) + 1e-5)).astype(F32)
    gamma = rand(rng, (c,), positive=True)
    y = np.maximum(rand(rng, cv.shape), 0).astype(F32) + (rng.random(cv.shape) < 0.1).astype(F32)
    dy = rand(rng, cv.shape)
    return dict(dY=dy, Y=y, X=x, W=w, Cv=cv, gamma=gamma, mean=mean, inv_std=inv_std)


CONV_CASES = [
    # n, cin, hin, win, c, kh, kw, strides, pads, dilations, group
    (1, 1, 1, 1, 1, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 1),
    (2, 3, 7, 9, 5, 3, 3, (1, 1), (0, 0, 0, 0), (1, 1), 1),
    (2, 3, 7, 9, 4, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1), 1),
    (3, 4, 11, 10, 6, 3, 2, (2, 1), (1, 0, 2, 1), (2, 1), 2),
    (2, 6, 9, 9, 6, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 6),      # depthwise
    (2, 8, 8, 8, 16, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 1),     # pointwise
    (3, 8, 5, 7, 12, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 4),     # grouped pointwise
    (2, 4, 9, 9, 8, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1), 4),
    (4, 16, 16, 16, 32, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 1),  # large-ish
    # images in chunks of 2 (2, 2, 1), the columns [Kc, 2*HW] across each chunk's images
    (5, 128, 13, 13, 8, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 2),
    (3, 64, 40, 40, 16, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 1),  # pointwise, chunks of 2
    (8, 64, 2, 2, 64, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 1),    # deep channels, 2x2 maps
    (2, 3, 9, 21, 4, 3, 3, (1, 1), (2, 1, 0, 2), (2, 2), 1),     # unit stride, dilated, 21 wide
]
CONV_OUTS = ["dX", "dW", "dBc", "dGamma", "dBeta"]


def _conv_attrs(strides, pads, dilations, group, relu=1):
    return dict(strides=list(strides), pads=list(pads), dilations=list(dilations), group=group,
                relu=relu)


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: "x".join(map(str, c[:7])) + f"g{c[-1]}")
@pytest.mark.parametrize("relu", [1, 0])
def test_conv_bn_relu_grad_vs_reference(case, relu):
    *dims, strides, pads, dilations, group = case
    rng = _rng("conv", case, relu)
    ins = _conv_inputs(rng, *dims, strides, pads, dilations, group)
    got = run_fused("ConvBnReluGrad", list(ins.items()), [(o, F32) for o in CONV_OUTS],
                    **_conv_attrs(strides, pads, dilations, group, relu))
    ref = R.conv_bn_relu_grad(*ins.values(), strides=strides, pads=pads, dilations=dilations,
                              group=group, relu=relu)
    for g, r, nm in zip(got, ref, CONV_OUTS):
        assert_close(g, r, rtol=1e-3, atol_scale=1e-3, what=nm)


@pytest.mark.parametrize("case", [CONV_CASES[2], CONV_CASES[3], CONV_CASES[6],
                                  (2, 32, 32, 32, 8, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 1)],
                         ids=["strided", "grouped", "grouped-pointwise", "two-chunks"])
@pytest.mark.parametrize("dy_dead", [True, False])
@pytest.mark.parametrize("present", [(1, 1, 1, 1, 1), (0, 0, 0, 0, 0)])
def test_conv_bn_relu_grad_dc_output_in_place(case, dy_dead, present):
    """Output 5 (dC, the working buffer fusecli always names) is the convolution-output gradient;
    onnxruntime puts it in dY's buffer when dY is dead after the node (in-place pair dY -> dC),
    and every output stays right. "two-chunks": each image's columns exceed the chunk budget, so
    the images go one at a time."""
    *dims, strides, pads, dilations, group = case
    rng = _rng("conv-dc", case, dy_dead, present)
    ins = _conv_inputs(rng, *dims, strides, pads, dilations, group)
    outs = [o if p else None for o, p in zip(CONV_OUTS, present)] + ["dC"]
    got, calls, inplace = _inplace_run("ConvBnReluGrad", list(ins.items()), outs, {"dY"},
                                       () if dy_dead else {"dY"},
                                       **_conv_attrs(strides, pads, dilations, group))
    ref = dict(zip(CONV_OUTS + ["dC"], R.conv_bn_relu_grad(
        *ins.values(), strides=strides, pads=pads, dilations=dilations, group=group)))
    for g, nm in zip(got, [o for o in outs if o]):
        assert_close(g, ref[nm], rtol=1e-3, atol_scale=1e-3, what=nm)
    assert (calls, inplace) == (1, 1 if dy_dead else 0)


@pytest.mark.parametrize("present", [
    (0, 1, 1, 1, 1),   # first conv: no dX
    (1, 1, 0, 1, 1),   # bias-free conv: no dBc
    (0, 1, 0, 1, 1),   # both
    (1, 0, 0, 0, 0),   # only dX
    (0, 0, 0, 1, 1),   # BN only
])
def test_conv_bn_relu_grad_optional_outputs(present):
    case = CONV_CASES[2]
    *dims, strides, pads, dilations, group = case
    rng = _rng("conv-opt", present)
    ins = _conv_inputs(rng, *dims, strides, pads, dilations, group)
    outs = [(o, F32) if p else None for o, p in zip(CONV_OUTS, present)]
    got = run_fused("ConvBnReluGrad", list(ins.items()), outs,
                    **_conv_attrs(strides, pads, dilations, group))
    ref = R.conv_bn_relu_grad(*ins.values(), strides=strides, pads=pads, dilations=dilations,
                              group=group)
    assert_requested(present, got, ref, CONV_OUTS, rtol=1e-3, atol_scale=1e-3)


def test_conv_bn_relu_grad_default_attributes():
    rng = _rng("conv-defaults")
    ins = _conv_inputs(rng, 2, 3, 6, 6, 4, 3, 3, (1, 1), (0, 0, 0, 0), (1, 1), 1)
    got = run_fused("ConvBnReluGrad", list(ins.items()), [(o, F32) for o in CONV_OUTS])
    ref = R.conv_bn_relu_grad(*ins.values())
    for g, r in zip(got, ref):
        assert_close(g, r, rtol=1e-3, atol_scale=1e-3)


def _conv_unfused_chain(ins, strides, pads, dilations, group):
    """ReluGrad -> BatchNormalizationGrad -> ConvGrad (com.microsoft, onnxruntime-training)."""
    w = ins["W"]
    nodes = [
        helper.make_node("ReluGrad", ["dY", "Y"], ["dZ"], domain="com.microsoft"),
        helper.make_node("BatchNormalizationGrad", ["dZ", "Cv", "gamma", "mean", "inv_std"],
                         ["dC", "dGamma", "dBeta"], domain="com.microsoft", epsilon=1e-5),
        helper.make_node("ConvGrad", ["dC", "X", "W"], ["dX", "dW", "dBc"], domain="com.microsoft",
                         strides=list(strides), pads=list(pads), dilations=list(dilations),
                         group=group, kernel_shape=list(w.shape[2:])),
    ]
    g_in = [helper.make_tensor_value_info(k, 1, list(v.shape)) for k, v in ins.items()]
    g_out = [helper.make_tensor_value_info(o, 1, None) for o in CONV_OUTS]
    graph = helper.make_graph(nodes, "conv_unfused", g_in, g_out)
    return helper.make_model(graph, ir_version=9, opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)])


def test_conv_bn_relu_grad_vs_unfused_ortt_chain_and_same_so_in_ortt():
    """The unfused com.microsoft chain in onnxruntime-training 1.19.2 vs the fused op, the fused
    op running in onnxruntime-training (same .so, API 16) and in this onnxruntime, and the
    kernel-call counter seen through ctypes in that process."""
    jobs, fused_here = [], []
    for case in (CONV_CASES[1], CONV_CASES[2], CONV_CASES[6]):
        *dims, strides, pads, dilations, group = case
        ins = _conv_inputs(_rng("conv-ortt", case), *dims, strides, pads, dilations, group)
        jobs.append(dict(model=_conv_unfused_chain(ins, strides, pads, dilations, group),
                         feeds=ins, outputs=CONV_OUTS))
        fused = fused_model("ConvBnReluGrad", list(ins.items()), [(o, F32) for o in CONV_OUTS],
                            **_conv_attrs(strides, pads, dilations, group))
        jobs.append(dict(model=fused, feeds=ins, outputs=CONV_OUTS, library=True,
                         count=["ConvBnReluGrad"]))
        fused_here.append(ort_session(fused).run(CONV_OUTS, ins))
    version, results, calls = run_in_ortt(jobs)
    assert version == "1.19.2"
    for i, here in enumerate(fused_here):
        unfused, fused_ortt = results[2 * i], results[2 * i + 1]
        assert calls[2 * i + 1] == {"ConvBnReluGrad": 1}
        for nm, u, f, h in zip(CONV_OUTS, unfused, fused_ortt, here):
            assert_close(f, u, rtol=1e-3, atol_scale=1e-3, what=f"case {i} {nm} fused vs unfused")
            # not bitwise: vectorized sums peel differently with the buffers' alignment
            assert_close(f, h, rtol=1e-5, atol_scale=1e-5, what=f"{nm}: same .so, two onnxruntimes")


# ==================================== LayerNormGrad ============================================

def _ln_inputs(rng, shape, axis, dtype, stat_dtype=F32, with_dr=True):
    ax = axis % len(shape)
    rows = shape[:ax]
    n = int(np.prod(shape[ax:]))
    x = rand(rng, shape, dtype, scale=2.0) + dtype(0.3)
    x64 = x.astype(np.float64).reshape(-1, n)
    mean = x64.mean(1)
    inv_std = 1 / np.sqrt(x64.var(1) + 1e-5)
    stat_shape = (*rows, *([1] * (len(shape) - ax)))
    return dict(dY=rand(rng, shape, dtype), X=x, gamma=rand(rng, shape[ax:], dtype),
                mean=mean.reshape(stat_shape).astype(stat_dtype),
                inv_std=inv_std.reshape(stat_shape).astype(stat_dtype),
                dR=rand(rng, shape, dtype) if with_dr else None)


LN_SHAPES = [((1, 1), -1), ((3, 17), -1), ((2, 5, 33), -1), ((4, 3, 17), -2), ((1, 1023), 1),
             ((512, 768), -1)]


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("with_dr", [True, False])
@pytest.mark.parametrize("shape,axis", LN_SHAPES)
def test_layer_norm_grad_vs_reference(dtype, with_dr, shape, axis):
    rng = _rng("ln", str(dtype), with_dr, shape, axis)
    ins = _ln_inputs(rng, shape, axis, dtype, with_dr=with_dr)
    got = run_fused("LayerNormGrad", list(ins.items()), [("dX", dtype), ("dGamma", dtype),
                                                          ("dBeta", dtype)], axis=axis)
    ref = R.layer_norm_grad(ins["dY"], ins["X"], ins["gamma"], ins["mean"], ins["inv_std"],
                            ins["dR"], axis)
    t = tol(dtype)
    if dtype == F16:  # dGamma/dBeta sum M rows: compare relative to the sum's magnitude
        t = dict(rtol=2e-2, atol_scale=2e-2)
    for g, r, nm in zip(got, ref, ["dX", "dGamma", "dBeta"]):
        assert_close(g, r, **t, what=nm)


def test_layer_norm_grad_fp16_with_fp16_stats():
    rng = _rng("ln-f16-stats")
    ins = _ln_inputs(rng, (6, 40), -1, F16, stat_dtype=F16)
    got = run_fused("LayerNormGrad", list(ins.items()), [("dX", F16), ("dGamma", F16), ("dBeta", F16)])
    ref = R.layer_norm_grad(*ins.values())
    for g, r in zip(got, ref):
        assert_close(g, r, rtol=2e-2, atol_scale=2e-2)


@pytest.mark.parametrize("outs", [(1, 0, 0), (1, 1, 0), (1, 0, 1)])
@pytest.mark.parametrize("with_dr", [True, False])
def test_layer_norm_grad_optional_outputs(outs, with_dr):
    rng = _rng("ln-opt", outs, with_dr)
    ins = _ln_inputs(rng, (5, 67), -1, F32, with_dr=with_dr)
    req = [(nm, F32) if o else None for nm, o in zip(["dX", "dGamma", "dBeta"], outs)]
    got = run_fused("LayerNormGrad", list(ins.items()), req)
    ref = R.layer_norm_grad(*ins.values())
    assert_requested(outs, got, ref)


@pytest.mark.parametrize("outs", [(0, 1, 1), (0, 1, 0), (0, 0, 1)])
@pytest.mark.parametrize("with_gamma", [True, False])
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("shape,axis", [((5, 67), -1), ((4, 3, 17), -2), ((256, 96), -1)])
def test_layer_norm_grad_without_dx(outs, with_gamma, dtype, shape, axis):
    """dX absent (the input needs no gradient); gamma absent too when only dGamma / dBeta are
    requested (gamma is input 2, passed as "" between X and mean)."""
    rng = _rng("ln-no-dx", outs, with_gamma, str(dtype), shape, axis)
    ins = _ln_inputs(rng, shape, axis, dtype, with_dr=False)
    if not with_gamma:
        ins["gamma"] = None
    req = [(nm, dtype) if o else None for nm, o in zip(["dX", "dGamma", "dBeta"], outs)]
    got = run_fused("LayerNormGrad", list(ins.items()), req, axis=axis)
    ref = R.layer_norm_grad(ins["dY"], ins["X"], ins["gamma"], ins["mean"], ins["inv_std"],
                            None, axis)
    t = tol(dtype) if dtype == F32 else dict(rtol=2e-2, atol_scale=2e-2)
    for o, g, r, nm in zip(outs, got, ref, ["dX", "dGamma", "dBeta"]):
        if o:
            assert_close(g, r, **t, what=nm)
            assert g.shape == tuple(shape[axis % len(shape):])
        else:
            assert g is None


@pytest.mark.parametrize("with_dr", [True, False])
def test_layer_norm_grad_dx_without_gamma_is_an_error(with_dr):
    rng = _rng("ln-no-gamma-err", with_dr)
    ins = _ln_inputs(rng, (3, 8), -1, F32, with_dr=with_dr)
    ins["gamma"] = None
    with pytest.raises(Exception, match="gamma is absent"):
        run_fused("LayerNormGrad", list(ins.items()), [("dX", F32), ("dGamma", F32), None])


@pytest.mark.parametrize("with_dr", [True, False])
def test_layer_norm_grad_vs_unfused(with_dr):
    rng = _rng("ln-unfused", with_dr)
    shape = (3, 21, 96)
    ins = _ln_inputs(rng, shape, -1, F32, with_dr=with_dr)
    got = run_fused("LayerNormGrad", list(ins.items()), [("dX", F32), ("dGamma", F32), ("dBeta", F32)])
    b = Builder()
    dy, x, gam, mu, rs = (b.input(k, ins[k]) for k in ["dY", "X", "gamma", "mean", "inv_std"])
    ax = b.ints([-1])
    xhat = b.mul(b.sub(x, mu), rs)
    g = b.mul(dy, gam)
    c2 = b.op("ReduceMean", g, ax, keepdims=1)
    c1 = b.op("ReduceMean", b.mul(g, xhat), ax, keepdims=1)
    dx = b.mul(rs, b.sub(b.sub(g, c2), b.mul(xhat, c1)))
    if with_dr:
        dx = b.add(dx, b.input("dR", ins["dR"]))
    rows = b.ints([0, 1])
    dgam = b.op("ReduceSum", b.mul(dy, xhat), rows, keepdims=0)
    dbet = b.op("ReduceSum", dy, rows, keepdims=0)
    ref = b.run([dx, dgam, dbet])
    for gg, r, nm in zip(got, ref, ["dX", "dGamma", "dBeta"]):
        assert_close(gg, r, what=nm)


# ============================ library plumbing / both onnxruntimes ============================

def test_kernel_call_counter_counts_library_kernels():
    library.reset_kernel_calls()
    assert library.kernel_calls("LayerNormGrad") == 0
    assert library.kernel_calls("NoSuchOp") == -1
    rng = _rng("counter")
    ins = _ln_inputs(rng, (4, 8), -1, F32)
    model = fused_model("LayerNormGrad", list(ins.items()), [("dX", F32)])
    sess = ort_session(model)
    feeds = {k: v for k, v in ins.items() if v is not None}
    for _ in range(3):
        sess.run(None, feeds)
    assert library.kernel_calls("LayerNormGrad") == 3
    assert library.kernel_calls("ActivationGrad") == 0


def test_same_so_runs_each_op_in_onnxruntime_training():
    rng = _rng("ortt-all")
    dy, x = rand(rng, (5, 9)), rand(rng, (5, 9))
    lin = _lin_inputs(rng, (6,), 7, 5, 1)
    att = _attn_inputs(rng, (2,), 5, 6, 4, 3, 1)
    ln = _ln_inputs(rng, (4, 19), -1, F16)
    cases = [
        ("ActivationGrad", dict(dY=dy.astype(F16), X=x.astype(F16)), ["dX"], dict(activation="silu"),
         R.activation_grad(dy.astype(F16), x.astype(F16), "silu"), F16),
        ("LinearActivationGrad", dict(zip(["dY", "X", "A", "W"], lin)), ["dA", "dW", "dB"],
         dict(activation="gelu_tanh", trans_w=1), R.linear_activation_grad(*lin, "gelu_tanh", 1), F32),
        ("AttentionGrad", dict(zip(["dO", "Q", "K", "V", "P"], att)), ["dQ", "dK", "dV"],
         dict(scale_q=0.5, scale_k=0.25, k_transposed=1),
         R.attention_grad(*att, 0.5, 0.25, 1), F32),
        ("LayerNormGrad", {k: v for k, v in ln.items()}, ["dX", "dGamma", "dBeta"], {},
         R.layer_norm_grad(*ln.values()), F16),
    ]
    jobs = []
    for op, feeds, outs, attrs, _, dt in cases:
        model = fused_model(op, list(feeds.items()), [(o, dt) for o in outs], **attrs)
        jobs.append(dict(model=model, feeds=feeds, outputs=outs, library=True, count=[op]))
    version, results, calls = run_in_ortt(jobs)
    assert version == "1.19.2"
    for (op, _, _, _, ref, dt), got, c in zip(cases, results, calls):
        assert c == {op: 1}
        ref = ref if isinstance(ref, tuple) else (ref,)
        t = tol(dt) if dt == F32 else dict(rtol=2e-2, atol_scale=2e-2)
        for g, r in zip(got, ref):
            assert_close(g, r, **t, what=op)


def test_optional_inputs_in_onnxruntime_training():
    """The same .so in onnxruntime-training 1.19.2 with absent non-trailing optional inputs
    (LinearActivationGrad without W, LayerNormGrad without gamma) and present trailing ones
    (AttentionGrad q_scale / k_scale)."""
    rng = _rng("ortt-optional")
    dy, x, a, _ = _lin_inputs(rng, (6,), 9, 5, 0)
    att = _attn_inputs(rng, (2,), 5, 6, 4, 3, 0)
    qs, ks = np.array(0.5, F32), np.array(-1.5, F32)
    ln = _ln_inputs(rng, (7, 19), -1, F32, with_dr=False)
    ln["gamma"] = None
    cases = [
        ("LinearActivationGrad", [("dY", dy), ("X", x), ("A", a), ("W", None)], [None, "dW", "dB"],
         dict(activation="gelu"), R.linear_activation_grad(dy, x, a, None, "gelu")[1:3]),
        ("AttentionGrad", list(zip(["dO", "Q", "K", "V", "P"], att)) + [("q_scale", qs), ("k_scale", ks)],
         ["dQ", "dK", "dV"], dict(scale_q=0.5, scale_k=0.25), R.attention_grad(*att, 0.5, 0.25, 0, qs, ks)),
        ("LayerNormGrad", list(ln.items()), [None, "dGamma", "dBeta"], {},
         R.layer_norm_grad(*ln.values())[1:]),
    ]
    jobs = []
    for op, inputs, outs, attrs, _ in cases:
        model = fused_model(op, inputs, [(o, F32) if o else None for o in outs], **attrs)
        feeds = {n: v for n, v in inputs if v is not None}
        jobs.append(dict(model=model, feeds=feeds, outputs=[o for o in outs if o], library=True,
                         count=[op]))
    version, results, calls = run_in_ortt(jobs)
    assert version == "1.19.2"
    for (op, _, _, _, ref), got, c in zip(cases, results, calls):
        assert c == {op: 1}
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            assert_close(g, r, what=op)


def test_library_path_and_session_options():
    path = library.library_path()
    assert path.endswith("fusecli/lib/libfusecli_ops.so")
    so = library.session_options(threads=1)
    assert isinstance(so, ort.SessionOptions)
    assert so.intra_op_num_threads == 1


def test_profiling_shows_fused_op_names(tmp_path):
    rng = _rng("profile")
    dy, x = rand(rng, (8, 8)), rand(rng, (8, 8))
    model = fused_model("ActivationGrad", [("dY", dy), ("X", x)], [("dX", F32)], activation="gelu")
    so = library.session_options(opt_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    sess.run(None, {"dY": dy, "X": x})
    prof = sess.end_profiling()
    text = open(prof).read()
    assert '"op_name" : "ActivationGrad"' in text or '"op_name":"ActivationGrad"' in text
