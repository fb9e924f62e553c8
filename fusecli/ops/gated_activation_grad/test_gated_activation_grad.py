"""GatedActivationGrad: its kernels (fusecli/lib/libfusecli_ops.so) against the NumPy reference
and against the unfused standard-ONNX subgraph it replaces (the two products of the gate's
product rule and the activation gradient), in onnxruntime with graph optimizations off."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fusecli.ops.gated_activation_grad.reference import gated_activation_grad

# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import (F16, F32, Builder, _built, _inplace_run, _rng, act_grad_subgraph,
                            assert_close, rand, run_fused, tol)

GATED_ACTS = ["silu", "gelu", "gelu_tanh"]


def _act_subgraph(b: Builder, x, act):
    """act(x) from standard ops (the forward the torch exporters write)."""
    if act == "silu":
        return b.mul(x, b.op("Sigmoid", x))
    if act == "gelu":
        e = b.op("Erf", b.mul(x, b.const(1 / math.sqrt(2))))
        return b.mul(b.mul(b.const(0.5), x), b.add(b.const(1.0), e))
    if act == "gelu_tanh":
        k, c = math.sqrt(2 / math.pi), 0.044715
        inner = b.mul(b.const(k), b.add(x, b.mul(b.const(c), b.mul(x, b.mul(x, x)))))
        return b.mul(b.mul(b.const(0.5), x), b.add(b.const(1.0), b.op("Tanh", inner)))
    raise ValueError(act)


def _inputs(rng, shape, dtype=F32):
    return rand(rng, shape, dtype), rand(rng, shape, dtype, scale=2.5), rand(rng, shape, dtype)


@pytest.mark.parametrize("act", GATED_ACTS)
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("shape", [(1,), (3,), (17,), (2, 3, 17), (5, 1025), (4, 64, 1100)])
def test_gated_activation_grad_vs_reference(act, dtype, shape):
    rng = _rng("gated", act, str(dtype), shape)
    dh, a, b = _inputs(rng, shape, dtype)
    da, db = run_fused("GatedActivationGrad", [("dH", dh), ("A", a), ("B", b)],
                       [("dA", dtype), ("dB", dtype)], activation=act)
    rda, rdb = gated_activation_grad(dh, a, b, act)
    assert_close(da, rda, **tol(dtype), what=f"dA {act} {shape}")
    assert_close(db, rdb, **tol(dtype), what=f"dB {act} {shape}")


@pytest.mark.parametrize("act", GATED_ACTS)
def test_gated_activation_grad_vs_unfused(act):
    """The subgraph the rules replace: dS = dH * B, dA = act'(A) dS (the activation-gradient
    chain), dB = dH * act(A) (the forward activation output)."""
    rng = _rng("gated-unfused", act)
    dh, a, b = _inputs(rng, (7, 3, 129))
    da, db = run_fused("GatedActivationGrad", [("dH", dh), ("A", a), ("B", b)],
                       [("dA", F32), ("dB", F32)], activation=act)
    g = Builder()
    tdh, ta, tb = g.input("dH", dh), g.input("A", a), g.input("B", b)
    out_a = act_grad_subgraph(g, g.mul(tdh, tb), ta, act)
    out_b = g.mul(tdh, _act_subgraph(g, ta, act))
    ref_a, ref_b = g.run([out_a, out_b])
    assert_close(da, ref_a, what=f"dA {act}")
    assert_close(db, ref_b, what=f"dB {act}")


@pytest.mark.parametrize("alpha", [1.702, 0.5])
def test_gated_activation_grad_alpha(alpha):
    """silu at input scale alpha, act(alpha x) / alpha (x sigmoid(alpha x)), vs the reference and
    the unfused product rule."""
    rng = _rng("gated-alpha", alpha)
    dh, a, b = _inputs(rng, (5, 77))
    da, db = run_fused("GatedActivationGrad", [("dH", dh), ("A", a), ("B", b)],
                       [("dA", F32), ("dB", F32)], activation="silu", alpha=alpha)
    rda, rdb = gated_activation_grad(dh, a, b, "silu", alpha)
    assert_close(da, rda, what="dA")
    assert_close(db, rdb, what="dB")
    g = Builder()
    tdh, ta, tb = g.input("dH", dh), g.input("A", a), g.input("B", b)
    out_a = act_grad_subgraph(g, g.mul(tdh, tb), ta, "silu", alpha)
    out_b = g.mul(tdh, g.mul(ta, g.op("Sigmoid", g.mul(ta, g.const(alpha)))))
    ref_a, ref_b = g.run([out_a, out_b])
    assert_close(da, ref_a, what="dA unfused")
    assert_close(db, ref_b, what="dB unfused")


@pytest.mark.parametrize("mask", [(1, 0), (0, 1)])
def test_gated_activation_grad_one_output(mask):
    """Each output alone (a gate whose other input needs no gradient)."""
    rng = _rng("gated-one", mask)
    dh, a, b = _inputs(rng, (3, 50))
    outs = [(nm, F32) if m else None for nm, m in zip(["dA", "dB"], mask)]
    got = run_fused("GatedActivationGrad", [("dH", dh), ("A", a), ("B", b)], outs,
                    activation="silu")
    for g, r, m in zip(got, gated_activation_grad(dh, a, b, "silu"), mask):
        if m:
            assert_close(g, r)
        else:
            assert g is None


def test_gated_activation_grad_saturated_tails():
    """|A| up to 90: e^-A overflows float32 for silu; the gradient stays finite and exact
    (absolute errors: gelu_tanh keeps float32's cancellation in 1 - tanh^2 near |A| = 5, which
    the unfused chain has too, hence its looser bound)."""
    a = np.concatenate([np.linspace(-90.0, 90.0, 4001), [0.0, -1e6, 1e6]]).astype(F32)
    dh, b = np.ones_like(a), np.full_like(a, 0.75)
    for act in GATED_ACTS:
        da, db = run_fused("GatedActivationGrad", [("dH", dh), ("A", a), ("B", b)],
                           [("dA", F32), ("dB", F32)], activation=act)
        with np.errstate(over="ignore", invalid="ignore"):
            rda, rdb = gated_activation_grad(dh.astype(np.float64), a.astype(np.float64),
                                             b.astype(np.float64), act)
        assert np.isfinite(da).all() and np.isfinite(db).all(), act
        atol = 5e-6 if act == "gelu_tanh" else 1e-6
        np.testing.assert_allclose(da, rda, rtol=1e-5, atol=atol, err_msg=act)
        np.testing.assert_allclose(db, rdb, rtol=1e-5, atol=atol, err_msg=act)


@pytest.mark.parametrize("dead", [True, False])
def test_gated_activation_grad_inplace(dead):
    """The in-place pairs dH -> dA and B -> dB: onnxruntime reuses the buffers when dH and B are
    dead after the node (the kernel counts it), never when they are still read; the results are
    right either way."""
    rng = _rng("gated-inplace", dead)
    dh, a, b = _inputs(rng, (6, 40))
    got, calls, inplace = _inplace_run(
        "GatedActivationGrad", [("dH", dh), ("A", a), ("B", b)], ["dA", "dB"], {"dH", "B"},
        () if dead else {"dH", "B"}, activation="silu")
    for g, r, nm in zip(got, gated_activation_grad(dh, a, b, "silu"), ["dA", "dB"]):
        assert_close(g, r, what=nm)
    assert (calls, inplace) == (1, 1 if dead else 0)


def test_gated_activation_grad_bad_activation_is_an_error():
    x = np.ones((2, 2), F32)
    with pytest.raises(Exception, match="activation"):
        run_fused("GatedActivationGrad", [("dH", x), ("A", x), ("B", x)], [("dA", F32)],
                  activation="relu")


def test_gated_activation_grad_shape_mismatch_is_an_error():
    x, y = np.ones((2, 3), F32), np.ones((3, 2), F32)
    with pytest.raises(Exception, match="same shape"):
        run_fused("GatedActivationGrad", [("dH", x), ("A", x), ("B", y)], [("dA", F32)],
                  activation="silu")
