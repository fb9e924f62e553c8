"""LayerNormGrad: its kernels (fusecli/lib/libfusecli_ops.so) against the NumPy reference
and against the unfused standard-ONNX subgraph it replaces, in onnxruntime with graph
optimizations off."""

from __future__ import annotations

import numpy as np
import pytest

from fusecli.ops.layer_norm_grad.reference import layer_norm_grad

# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import (F16, F32, Builder, _built, _inplace_run, _rng, assert_close,
                            assert_requested, rand, run_fused, tol)


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
    ref = layer_norm_grad(ins["dY"], ins["X"], ins["gamma"], ins["mean"], ins["inv_std"],
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
    ref = layer_norm_grad(*ins.values())
    for g, r in zip(got, ref):
        assert_close(g, r, rtol=2e-2, atol_scale=2e-2)


@pytest.mark.parametrize("outs", [(1, 0, 0), (1, 1, 0), (1, 0, 1)])
@pytest.mark.parametrize("with_dr", [True, False])
def test_layer_norm_grad_optional_outputs(outs, with_dr):
    rng = _rng("ln-opt", outs, with_dr)
    ins = _ln_inputs(rng, (5, 67), -1, F32, with_dr=with_dr)
    req = [(nm, F32) if o else None for nm, o in zip(["dX", "dGamma", "dBeta"], outs)]
    got = run_fused("LayerNormGrad", list(ins.items()), req)
    ref = layer_norm_grad(*ins.values())
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
    ref = layer_norm_grad(ins["dY"], ins["X"], ins["gamma"], ins["mean"], ins["inv_std"],
                            None, axis)
    t = tol(dtype) if dtype == F32 else dict(rtol=2e-2, atol_scale=2e-2)
    for o, g, r, nm in zip(outs, got, ref, ["dX", "dGamma", "dBeta"]):
        if o:
            assert_close(g, r, **t, what=nm)
            assert g.shape == tuple(shape[axis % len(shape):])
        else:
            assert g is None


@pytest.mark.parametrize("with_dr", [True, False])
def test_layer_norm_grad_without_gamma_is_gamma_one(with_dr):
    """An absent gamma is 1 (a LayerNorm without weight): dX as with gamma = ones and as the
    reference without gamma."""
    rng = _rng("ln-no-gamma", with_dr)
    ins = _ln_inputs(rng, (3, 40), -1, F32, with_dr=with_dr)
    ones = dict(ins, gamma=np.ones_like(ins["gamma"]))
    ins["gamma"] = None
    [got] = run_fused("LayerNormGrad", list(ins.items()), [("dX", F32)])
    [with_ones] = run_fused("LayerNormGrad", list(ones.items()), [("dX", F32)])
    ref = layer_norm_grad(*(ins[k] for k in ("dY", "X", "gamma", "mean", "inv_std")),
                          ins.get("dR"))[0]
    assert_close(got, ref, what="dX")
    assert_close(got, with_ones, what="dX vs gamma = 1")


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
    ref = layer_norm_grad(*ins.values())
    for g, r, nm in zip(got, ref, ["dX", "dGamma", "dBeta"]):
        assert_close(g, r, **tol(dtype), what=nm)
    assert (calls, inplace) == (1, expect)
