"""LinearActivationGrad: its kernels (fusecli/lib/libfusecli_ops.so) against the NumPy reference
and against the unfused standard-ONNX subgraph it replaces, in onnxruntime with graph
optimizations off."""

from __future__ import annotations

import itertools

import pytest

from fusecli.ops.activation_grad.reference import activation_grad
from fusecli.ops.linear_activation_grad.reference import linear_activation_grad

# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import (ACTS, F32, Builder, _built, _inplace_run, _rng, act_grad_subgraph,
                            assert_close, assert_requested, rand, run_fused)


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
    rda, rdw, rdb, _ = linear_activation_grad(dy, x, a, w, act, trans_w)
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
    rda, rdw, _, _ = linear_activation_grad(dy, x, a, w, "gelu", trans_w, trans_dw)
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
    ref = linear_activation_grad(dy, x, a, w, "gelu", trans_w)
    assert_requested(mask, got, ref)


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
        inputs, outs, ref = [("dY", dy), ("X", x)], ["dX"], [activation_grad(dy, x, act)]
    else:
        inputs, outs = [("dY", dy), ("X", x), ("A", a), ("W", w)], ["dA", "dW", "dB", "dZ"]
        ref = linear_activation_grad(dy, x, a, w, act)
    got, calls, inplace = _inplace_run(op, inputs, outs, {"dY"}, {"dY"} if dy_used_after else (),
                                       activation=act)
    for g, r, nm in zip(got, ref, outs):
        assert_close(g, r, what=nm)
    assert (calls, inplace) == (1, 0 if dy_used_after else 1)


@pytest.mark.parametrize("act", ["gelu", "identity"])
def test_linear_activation_grad_dz_output(act):
    """Output 3 (dZ) is the activation gradient, with or without the other outputs."""
    rng = _rng("lin-dz", act)
    dy, x, a, w = _lin_inputs(rng, (2, 9), 19, 11, 0)
    ref = linear_activation_grad(dy, x, a, w, act)
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
    ref = linear_activation_grad(dy, x, a, None, act, trans_w)
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


@pytest.mark.parametrize("trans_w", [0, 1])
@pytest.mark.parametrize("lead,n,k", [((3,), 17, 5), ((2, 3), 17, 33), ((384,), 257, 320)])
def test_linear_activation_grad_quick_gelu_vs_reference(trans_w, lead, n, k):
    """silu at alpha = 1.702, QuickGELU x sigmoid(1.702 x), pre-activations up to |x| = 40."""
    rng = _rng("lin-qgelu", trans_w, lead, n, k)
    dy, _, a, w = _lin_inputs(rng, lead, n, k, trans_w)
    x = rng.uniform(-40.0, 40.0, dy.shape).astype(F32)
    got = run_fused("LinearActivationGrad", [("dY", dy), ("X", x), ("A", a), ("W", w)],
                    [("dA", F32), ("dW", F32), ("dB", F32), ("dZ", F32)], activation="silu",
                    alpha=1.702, trans_w=trans_w)
    ref = linear_activation_grad(dy, x, a, w, "silu", trans_w, alpha=1.702)
    for g, r, nm in zip(got, ref, "dA dW dB dZ".split()):
        assert_close(g, r, what=nm)


@pytest.mark.parametrize("trans_w", [0, 1])
def test_linear_activation_grad_quick_gelu_vs_unfused(trans_w):
    """Against the standard-ONNX chain of x sigmoid(1.702 x) (as autograd decomposes it) and the
    Linear's gradient GEMMs, pre-activations up to |x| = 40."""
    rng = _rng("lin-qgelu-unfused", trans_w)
    lead, n, k = (4, 33), 65, 47
    dy, _, a, w = _lin_inputs(rng, lead, n, k, trans_w)
    x = rng.uniform(-40.0, 40.0, dy.shape).astype(F32)
    da, dw, db = run_fused("LinearActivationGrad", [("dY", dy), ("X", x), ("A", a), ("W", w)],
                           [("dA", F32), ("dW", F32), ("dB", F32)], activation="silu",
                           alpha=1.702, trans_w=trans_w)
    b = Builder()
    dz = act_grad_subgraph(b, b.input("dY", dy), b.input("X", x), "silu", 1.702)
    dz2 = b.op("Reshape", dz, b.ints([-1, n]))
    a2 = b.op("Reshape", b.input("A", a), b.ints([-1, k]))
    wn = b.input("W", w)
    rda = b.op("Gemm", dz2, wn, transB=trans_w)
    rdw = b.op("Gemm", a2, dz2, transA=1) if trans_w else b.op("Gemm", dz2, a2, transA=1)
    rda = b.op("Reshape", rda, b.ints([*lead, k]))
    rdb = b.op("ReduceSum", dz2, b.ints([0]), keepdims=0)
    ref = b.run([rda, rdw, rdb])
    for g, r, nm in zip((da, dw, db), ref, "dA dW dB".split()):
        assert_close(g, r, what=nm)
