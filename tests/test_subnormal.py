"""The CPU kernels on inputs whose intermediates fall into the subnormal float range (exp/erf
tails of large pre-activations, gradients far below 1, tiny variances): the kernels flush
subnormals to zero while they run (MXCSR FTZ/DAZ, restored afterwards), so the results must still
match the float64 reference to float tolerance, and the calling thread and onnxruntime's own
threads must get their floating-point mode back. (Their speed on such inputs is measured by the
benchmark suite, never here.)"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from fusecli.ops.activation_grad.reference import activation_grad
from fusecli.ops.attention_grad.reference import attention_grad
from fusecli.ops.conv_bn_relu_grad.reference import conv_bn_relu_grad
from fusecli.ops.layer_norm_grad.reference import layer_norm_grad
from fusecli.ops.linear_activation_grad.reference import linear_activation_grad

# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import (ACTS, DOMAIN, OPSET, _built, _rng, assert_close, ort_session,  # noqa: F401
                            rand, run_fused)

F32 = np.float32
TINY = np.finfo(F32).tiny  # smallest normal float32, 1.18e-38


def _outliers(rng, shape):
    """Pre-activations up to |x| ~ 40 (exp(-x^2/2) and e^-x underflow far below the smallest
    normal float), with the edges of the underflow band and zero included."""
    x = rng.uniform(-40.0, 40.0, shape)
    flat = x.reshape(-1)
    edges = [0.0, -9.3, 9.3, -13.2, 13.2, -13.3, 13.3, -14.0, 14.0, -87.0, 87.0, -88.7, -104.0]
    flat[: len(edges)] = edges
    return x.astype(F32)


def _gradients(rng, shape):
    """Upstream gradients: half of normal size, half ~1e-36 (products with act' < 1e-2 are
    subnormal), a few subnormal themselves."""
    dy = rng.standard_normal(shape)
    small = rng.random(shape) < 0.5
    dy = np.where(small, dy * 1e-36, dy)
    dy.reshape(-1)[1::97] = 3e-39  # subnormal inputs (read as zero by DAZ: |error| < 1.2e-38)
    return dy.astype(F32)


@pytest.mark.parametrize("act,alpha", [(a, 1.0) for a in ACTS] + [("silu", 1.702)])  # QuickGELU
@pytest.mark.parametrize("n", [4096, 1 << 18])  # one thread; split over the pool's threads
def test_activation_grad_on_subnormal_producing_inputs(act, alpha, n):
    rng = _rng("act-subnormal", act, n)
    x, dy = _outliers(rng, (n,)), _gradients(rng, (n,))
    (dx,) = run_fused("ActivationGrad", [("dY", dy), ("X", x)], [("dX", F32)], activation=act,
                      alpha=alpha)
    with np.errstate(over="ignore", under="ignore"):
        ref = activation_grad(dy.astype(np.float64), x.astype(np.float64), act, alpha)
    assert np.isfinite(dx).all()
    err = np.abs(dx.astype(np.float64) - ref)
    # relative to the gradient's own size (act' <= 1.13), plus what flushing may drop
    bound = (5e-6 if act == "gelu_tanh" else 1e-6) * np.abs(dy.astype(np.float64)) + 4 * TINY
    worst = int(np.argmax(err - bound))
    assert (err <= bound).all(), f"{act}: |error| {err[worst]:.3g} at x={x[worst]!r} dy={dy[worst]!r}"


@pytest.mark.parametrize("act,alpha", [("gelu", 1.0), ("gelu_tanh", 1.0), ("silu", 1.0),
                                       ("silu", 1.702)])
def test_linear_activation_grad_with_outlier_pre_activations(act, alpha):
    """X as a layer with N(0,1) weights produces (std ~ sqrt(fan-in) ~ 22, |x| up to ~90) and
    small upstream gradients: dA, dW, dB against the reference."""
    rng = _rng("lin-subnormal", act)
    m, n, k = 96, 130, 70
    x = (22.0 * rng.standard_normal((m, n))).astype(F32)
    x[0, :13] = [0.0, -9.3, 9.3, -13.2, 13.2, -13.3, 13.3, -14.0, 14.0, -40.0, 40.0, -87.0, 87.0]
    dy = _gradients(rng, (m, n))
    a, w = rand(rng, (m, k)), rand(rng, (n, k))
    got = run_fused("LinearActivationGrad", [("dY", dy), ("X", x), ("A", a), ("W", w)],
                    [("dA", F32), ("dW", F32), ("dB", F32)], activation=act, alpha=alpha)
    with np.errstate(over="ignore", under="ignore"):
        ref = linear_activation_grad(dy, x, a, w, act, 0, alpha=alpha)
    for g, r, nm in zip(got, ref, ["dA", "dW", "dB"]):
        assert np.isfinite(g).all(), nm
        assert_close(g, r, what=nm)


def test_layer_norm_grad_with_tiny_variances():
    """Rows whose variance is far below epsilon (inv_std ~ 1/sqrt(eps)), rows of tiny values
    (x - mean and dY in the subnormal range), and ordinary rows."""
    rng = _rng("ln-subnormal")
    m, n = 48, 200
    x = rand(rng, (m, n), scale=2.0).astype(np.float64)
    dy = rand(rng, (m, n)).astype(np.float64)
    x[0:16] = 1.5 + 1e-6 * rng.standard_normal((16, n))      # variance 1e-12 << eps
    x[16:32] = 1e-37 * rng.standard_normal((16, n))          # x - mean near the subnormal range
    dy[16:32] *= 1e-35
    dy[32:40] = 1e-39 * rng.standard_normal((8, n))          # subnormal gradients
    x, dy = x.astype(F32), dy.astype(F32)
    x64 = x.astype(np.float64)
    mean = x64.mean(1, keepdims=True).astype(F32)
    inv_std = (1 / np.sqrt(x64.var(1, keepdims=True) + 1e-5)).astype(F32)
    gamma, dr = rand(rng, (n,)), rand(rng, (m, n))
    got = run_fused("LayerNormGrad", [("dY", dy), ("X", x), ("gamma", gamma), ("mean", mean),
                                      ("inv_std", inv_std), ("dR", dr)],
                    [("dX", F32), ("dGamma", F32), ("dBeta", F32)], axis=-1)
    ref = layer_norm_grad(dy, x, gamma, mean, inv_std, dr, -1)
    for g, r, nm in zip(got, ref, ["dX", "dGamma", "dBeta"]):
        assert np.isfinite(g).all(), nm
        assert_close(g, r, what=nm)
    # the tiny-variance rows on their own scale (dX there is dR + O(inv_std * dY))
    assert_close(got[0][:16], ref[0][:16], what="dX, variance << eps")


def test_conv_bn_relu_grad_with_tiny_variances():
    """Channels whose batch variance is far below epsilon, channels of subnormal-scale
    gradients, and ordinary ones."""
    rng = _rng("conv-subnormal")
    n, cin, hw, c = 4, 8, 6, 6
    x = rand(rng, (n, cin, hw, hw))
    w = rand(rng, (c, cin, 3, 3), scale=0.5)
    cv = rand(rng, (n, c, hw, hw), scale=1.5).astype(np.float64)
    cv[:, 0] = 0.7 + 1e-6 * rng.standard_normal((n, hw, hw))   # variance 1e-12 << eps
    cv[:, 1] = 1e-37 * rng.standard_normal((n, hw, hw))        # Cv - mean near subnormal
    dy = rand(rng, cv.shape).astype(np.float64)
    dy[:, 1] *= 1e-35
    dy[:, 2] = 1e-39 * rng.standard_normal((n, hw, hw))        # subnormal gradients
    cv, dy = cv.astype(F32), dy.astype(F32)
    mean = cv.astype(np.float64).mean(axis=(0, 2, 3)).astype(F32)
    inv_std = (1 / np.sqrt(cv.astype(np.float64).var(axis=(0, 2, 3)) + 1e-5)).astype(F32)
    y = np.maximum(rand(rng, cv.shape), 0).astype(F32) + (rng.random(cv.shape) < 0.1).astype(F32)
    ins = dict(dY=dy, Y=y, X=x, W=w, Cv=cv, gamma=rand(rng, (c,), positive=True), mean=mean,
               inv_std=inv_std)
    outs = ["dX", "dW", "dBc", "dGamma", "dBeta"]
    got = run_fused("ConvBnReluGrad", list(ins.items()), [(o, F32) for o in outs],
                    strides=[1, 1], pads=[1, 1, 1, 1], dilations=[1, 1], group=1, activation="relu")
    ref = conv_bn_relu_grad(*ins.values(), strides=(1, 1), pads=(1, 1, 1, 1),
                              dilations=(1, 1), group=1, activation="relu")
    for g, r, nm in zip(got, ref, outs):
        assert np.isfinite(g).all(), nm
        assert_close(g, r, rtol=1e-3, atol_scale=1e-3, what=nm)


def test_attention_grad_with_saturated_softmax():
    """Probabilities from logits up to |45| (some below the smallest normal float) and small
    output gradients: the softmax backward's products fall into the subnormal range."""
    rng = _rng("attn-subnormal")
    bh, s, d = 4, 64, 16
    logits = rng.uniform(-45.0, 45.0, (bh, s, s))
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).astype(F32)
    assert ((p > 0) & (p < TINY)).any()  # subnormal probabilities among the inputs
    do = (rng.standard_normal((bh, s, d)) * np.where(rng.random((bh, s, 1)) < 0.5, 1e-30, 1.0))
    q, k, v = (rand(rng, (bh, s, d)) for _ in range(3))
    got = run_fused("AttentionGrad", [("dO", do.astype(F32)), ("Q", q), ("K", k), ("V", v),
                                      ("P", p)], [("dQ", F32), ("dK", F32), ("dV", F32)],
                    scale_q=0.25, scale_k=0.25)
    ref = attention_grad(do.astype(F32), q, k, v, p, 0.25, 0.25)
    for g, r, nm in zip(got, ref, ["dQ", "dK", "dV"]):
        assert np.isfinite(g).all(), nm
        assert_close(g, r, what=nm)


@pytest.mark.parametrize("threads", [1, 2])
def test_floating_point_mode_is_restored_after_the_kernels(threads):
    """After a fused kernel ran, onnxruntime's own Mul in the same session (on the calling
    thread and the pool's threads) and NumPy on this thread still produce subnormal results:
    the kernels' flush-to-zero mode does not leak out of them."""
    n = 1 << 20
    node = helper.make_node("ActivationGrad", ["dY", "X"], ["dX"], domain=DOMAIN,
                            activation="gelu")
    mul = helper.make_node("Mul", ["dX", "s"], ["out"])
    scale = helper.make_tensor("s", TensorProto.FLOAT, [], [1e-36])
    vi = [helper.make_tensor_value_info(k, TensorProto.FLOAT, [n]) for k in ("dY", "X")]
    g = helper.make_graph([node, mul], "ftz_leak", vi,
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [n])],
                          initializer=[scale])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET),
                                                helper.make_opsetid(DOMAIN, 1)], ir_version=9)
    sess = ort_session(model, threads=threads)
    rng = _rng("ftz-leak", threads)
    dy = rng.uniform(0.5, 1.0, n).astype(F32)
    x = rng.uniform(1.0, 3.0, n).astype(F32)  # gelu' in [1.08, 1.13]: dX ~ 1, out ~ 1e-36
    x[::2] = 8.0  # gelu'(8) = 1: out = dy * 1e-36 ... and dy * 1e-36 * 1e-3 below
    dy[1::2] *= 1e-3  # out ~ 1e-39: subnormal unless someone flushes it
    for _ in range(3):
        (out,) = sess.run(["out"], {"dY": dy, "X": x})
        sub = out[1::2]
        assert (sub != 0).all() and (np.abs(sub) < TINY).all(), \
            "onnxruntime's Mul flushed subnormal results after a fused kernel ran"
        assert np.float32(1e-38) * np.float32(1e-2) != 0, "this thread's MXCSR was left with FTZ"
    ref = (activation_grad(dy.astype(np.float64), x.astype(np.float64), "gelu") * 1e-36)
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=1e-5, atol=2 * 1.4e-45)

