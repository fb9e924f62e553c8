"""LoraLinearGrad: its kernels (fusecli/lib/libfusecli_ops.so) against the NumPy reference and
against the unfused standard-ONNX subgraph it replaces (the activation gradient, the base and
adapter input-gradient GEMMs, the scale Mul and the adapters' weight-gradient GEMMs), in
onnxruntime with graph optimizations off."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fusecli.ops.lora_linear_grad.reference import lora_linear_grad

# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import (ACTS, F32, Builder, _built, _inplace_run, _rng, act_grad_subgraph,
                            assert_close, assert_requested, rand, run_fused)

OUTS = ["dX", "dXa", "dLa", "dLb", "dW", "dB"]


def _inputs(rng, lead, n, k, r, dropout=False):
    dy = rand(rng, (*lead, n))
    x = rand(rng, (*lead, n), scale=2.0)
    a = rand(rng, (*lead, k))
    w = rand(rng, (n, k), scale=0.3)
    la = rand(rng, (r, k), scale=0.3)
    lb = rand(rng, (n, r), scale=0.3)
    xd = (a * (rng.random(a.shape) > 0.3) / 0.7).astype(F32) if dropout else None
    h = ((a if xd is None else xd).reshape(-1, k).astype(np.float64) @ la.T.astype(np.float64))
    return dy, x, a, w, la, lb, h.reshape(*lead, r).astype(F32), xd


def _feeds(dy, x, a, w, la, lb, h, xd):
    return [("dY", dy), ("X", x), ("A", a), ("W", w), ("La", la), ("Lb", lb), ("H", h),
            ("Xd", xd)]


SHAPES = [((1,), 1, 1, 1), ((3,), 17, 5, 2), ((2, 3), 17, 33, 4), ((64,), 48, 129, 8),
          ((384,), 257, 320, 16)]


@pytest.mark.parametrize("act", ACTS + ["identity"])
@pytest.mark.parametrize("lead,n,k,r", SHAPES)
def test_lora_linear_grad_vs_reference(act, lead, n, k, r):
    rng = _rng("lora", act, lead, n, k, r)
    ins = _inputs(rng, lead, n, k, r)
    outs = [("dX", F32), None, ("dLa", F32), ("dLb", F32), ("dW", F32), ("dB", F32)]
    got = run_fused("LoraLinearGrad", _feeds(*ins), outs, activation=act, scale=0.5)
    ref = lora_linear_grad(*ins, activation=act, scale=0.5)
    assert got[1] is None
    for g, rf, nm in zip(got, ref, OUTS):
        if g is not None:
            assert_close(g, rf, what=nm)


@pytest.mark.parametrize("split", [0, 1])
@pytest.mark.parametrize("act", ["gelu", "identity"])
def test_lora_linear_grad_dropout_and_split(split, act):
    """Xd (the dropped-out x) feeds dLa; split_dx=1 writes the adapter's input gradient apart."""
    rng = _rng("lora-drop", split, act)
    ins = _inputs(rng, (2, 9), 19, 11, 3, dropout=True)
    outs = [("dX", F32), ("dXa", F32) if split else None, ("dLa", F32), ("dLb", F32)]
    got = run_fused("LoraLinearGrad", _feeds(*ins), outs, activation=act, scale=2.0,
                    split_dx=split)
    ref = lora_linear_grad(*ins, activation=act, scale=2.0, split_dx=split)
    for g, rf, nm in zip(got, ref, OUTS):
        if g is not None:
            assert_close(g, rf, what=nm)
    # dLa reads Xd, not A: the same call without Xd differs
    ref_a = lora_linear_grad(*ins[:7], None, activation=act, scale=2.0)
    assert not np.allclose(ref_a[2], ref[2])


@pytest.mark.parametrize("mask", [m for m in itertools.product([0, 1], repeat=5) if any(m)])
def test_lora_linear_grad_optional_outputs(mask):
    rng = _rng("lora-opt", mask)
    ins = _inputs(rng, (2, 9), 19, 11, 4)
    names = ["dX", "dLa", "dLb", "dW", "dB"]
    req = [(nm, F32) if m else None for nm, m in zip(names, mask)]
    got = run_fused("LoraLinearGrad", _feeds(*ins), [req[0], None, *req[1:]], activation="silu",
                    scale=1.5)
    ref = lora_linear_grad(*ins, activation="silu", scale=1.5)
    assert_requested(mask, [got[0], *got[2:]], [ref[0], *ref[2:]], names)


def test_lora_linear_grad_identity_without_x():
    """identity needs no X (input 1 is "")."""
    rng = _rng("lora-nox")
    dy, _, a, w, la, lb, h, _ = _inputs(rng, (5,), 7, 6, 2)
    got = run_fused("LoraLinearGrad", _feeds(dy, None, a, w, la, lb, h, None),
                    [("dX", F32), None, ("dLa", F32), ("dLb", F32)], activation="identity",
                    scale=4.0)
    ref = lora_linear_grad(dy, None, a, w, la, lb, h, None, "identity", scale=4.0)
    for g, rf, nm in zip(got, ref, OUTS):
        if g is not None:
            assert_close(g, rf, what=nm)


def test_lora_linear_grad_first_layer_without_w():
    rng = _rng("lora-now")
    dy, x, a, _, la, lb, h, _ = _inputs(rng, (4,), 7, 6, 2)
    got = run_fused("LoraLinearGrad", _feeds(dy, x, a, None, la, lb, h, None),
                    [None, None, ("dLa", F32), ("dLb", F32)], activation="relu", scale=0.25)
    ref = lora_linear_grad(dy, x, a, None, la, lb, h, None, "relu", scale=0.25)
    assert_close(got[2], ref[2], what="dLa")
    assert_close(got[3], ref[3], what="dLb")
    with pytest.raises(Exception, match="W is absent"):
        run_fused("LoraLinearGrad", _feeds(dy, x, a, None, la, lb, h, None),
                  [("dX", F32), None, ("dLa", F32)], activation="relu")


def test_lora_linear_grad_dxa_without_split():
    """dXa asked for with split_dx=0 (a rule absorbed the base + adapter sum, yet the adapter's
    gradient is read elsewhere too): dX holds both, dXa the adapter's part."""
    rng = _rng("lora-dxa")
    ins = _inputs(rng, (4,), 7, 6, 2)
    got = run_fused("LoraLinearGrad", _feeds(*ins), [("dX", F32), ("dXa", F32)],
                    activation="identity", scale=3.0)
    ref = lora_linear_grad(*ins, activation="identity", scale=3.0)
    assert_close(got[0], ref[0], what="dX")
    assert_close(got[1], ref[1], what="dXa")
    split = lora_linear_grad(*ins, activation="identity", scale=3.0, split_dx=1)
    assert_close(ref[0], split[0] + split[1], what="dX = base + adapter")


@pytest.mark.parametrize("dy_used_after", [False, True])
def test_inplace_output_over_dy(dy_used_after):
    """The in-place pair dY -> dZ: onnxruntime writes dZ into dY's buffer when dY is dead after
    the node (the kernel counts it), never when dY is still needed; results right either way."""
    rng = _rng("lora-inplace", dy_used_after)
    dy, x, a, w, la, lb, h, _ = _inputs(rng, (6,), 40, 9, 3)
    inputs = [("dY", dy), ("X", x), ("A", a), ("W", w), ("La", la), ("Lb", lb), ("H", h)]
    outs = ["dX", "dXa", "dLa", "dLb", "dW", "dB", "dZ"]
    ref = lora_linear_grad(dy, x, a, w, la, lb, h, None, "gelu", scale=2.0, split_dx=1)
    got, calls, inplace = _inplace_run("LoraLinearGrad", inputs, outs, {"dY"},
                                       {"dY"} if dy_used_after else (), activation="gelu",
                                       scale=2.0, split_dx=1)
    for g, r, nm in zip(got, ref, outs):
        assert_close(g, r, what=nm)
    assert (calls, inplace) == (1, 0 if dy_used_after else 1)


def _unfused(b, dy, x, a, w, la, lb, h, xd, act, scale, split):
    """The standard-ONNX backward of act(A W^T + s (Xd La^T) Lb^T) as exporters spell it."""
    n, k, r = dy.shape[-1], a.shape[-1], la.shape[0]
    dz = act_grad_subgraph(b, b.input("dY", dy), b.input("X", x), act)
    dz2 = b.op("Reshape", dz, b.ints([-1, n]))
    a2 = b.op("Reshape", b.input("A", a), b.ints([-1, k]))
    xd2 = a2 if xd is None else b.op("Reshape", b.input("Xd", xd), b.ints([-1, k]))
    h2 = b.op("Reshape", b.input("H", h), b.ints([-1, r]))
    du = b.mul(dz2, b.const(scale))                                 # Mul(U, s) backward
    lbn, lan = b.input("Lb", lb), b.input("La", la)
    dh = b.op("MatMul", du, lbn)                                    # lora_B input grad
    dlb = b.op("MatMul", b.op("Transpose", du, perm=[1, 0]), h2)    # lora_B weight grad
    dxa = b.op("MatMul", dh, lan)                                   # lora_A input grad
    dla = b.op("Gemm", dh, xd2, transA=1)                           # lora_A weight grad
    base = b.op("MatMul", dz2, b.input("W", w))
    dx = base if split else b.add(base, dxa)
    lead = [*a.shape[:-1], k]
    outs = [b.op("Reshape", dx, b.ints(lead))]
    if split:
        outs.append(b.op("Reshape", dxa, b.ints(lead)))
    return [*outs, dla, dlb]


@pytest.mark.parametrize("act,dropout,split", [("relu", False, 0), ("gelu", True, 1),
                                                ("silu", False, 1), ("identity", True, 0),
                                                ("gelu_tanh", False, 0)])
def test_lora_linear_grad_vs_unfused(act, dropout, split):
    rng = _rng("lora-unfused", act, dropout, split)
    ins = _inputs(rng, (4, 33), 65, 47, 8, dropout=dropout)
    outs = [("dX", F32), ("dXa", F32) if split else None, ("dLa", F32), ("dLb", F32)]
    got = [g for g in run_fused("LoraLinearGrad", _feeds(*ins), outs, activation=act,
                                scale=0.75, split_dx=split) if g is not None]
    b = Builder()
    want = _unfused(b, *ins, act, 0.75, split)
    ref = b.run(want)
    for g, rf, nm in zip(got, ref, ["dX", "dXa", "dLa", "dLb"] if split else
                         ["dX", "dLa", "dLb"]):
        assert_close(g, rf, what=nm)


@pytest.mark.parametrize("act", ["identity", "gelu"])
def test_lora_linear_grad_trans_w(act):
    """trans_w=1: W stored [K, N] (the operand of ort-training's FusedMatMul{transB=1} input
    gradient); dX and dW agree with the [N, K] layout, dW comes back in W's layout."""
    rng = _rng("lora-tw", act)
    dy, x, a, w, la, lb, h, _ = _inputs(rng, (3, 5), 13, 9, 3)
    outs = [("dX", F32), None, ("dLa", F32), ("dLb", F32), ("dW", F32), ("dB", F32)]
    got = run_fused("LoraLinearGrad", _feeds(dy, x, a, np.ascontiguousarray(w.T), la, lb, h, None),
                    outs, activation=act, scale=1.25, trans_w=1)
    ref = lora_linear_grad(dy, x, a, w, la, lb, h, None, act, scale=1.25)
    assert got[4].shape == (9, 13)
    for g, rf, nm in zip(got, [ref[0], None, ref[2], ref[3], ref[4].T, ref[5]], OUTS):
        if g is not None:
            assert_close(g, rf, what=nm)
