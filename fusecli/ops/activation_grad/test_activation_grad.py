"""ActivationGrad: its kernels (fusecli/lib/libfusecli_ops.so) against the NumPy reference
and against the unfused standard-ONNX subgraph it replaces, in onnxruntime with graph
optimizations off."""

from __future__ import annotations

import numpy as np
import pytest

from fusecli.ops.activation_grad.reference import activation_grad

# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import (ACTS, F16, F32, Builder, _built, _rng, act_grad_subgraph, assert_close,
                            rand, run_fused, tol)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("shape", [(1,), (3,), (17,), (2, 3, 17), (5, 33), (256, 1023)])
def test_activation_grad_vs_reference(act, dtype, shape):
    rng = _rng("act", act, str(dtype), shape)
    dy, x = rand(rng, shape, dtype), rand(rng, shape, dtype, scale=2.0)
    (dx,) = run_fused("ActivationGrad", [("dY", dy), ("X", x)], [("dX", dtype)], activation=act)
    assert_close(dx, activation_grad(dy, x, act), **tol(dtype), what=f"{act} {shape}")


@pytest.mark.parametrize("act", ACTS)
def test_activation_grad_vs_unfused(act):
    rng = _rng("act-unfused", act)
    dy, x = rand(rng, (7, 129)), rand(rng, (7, 129), scale=3.0)
    (dx,) = run_fused("ActivationGrad", [("dY", dy), ("X", x)], [("dX", F32)], activation=act)
    b = Builder()
    out = act_grad_subgraph(b, b.input("dY", dy), b.input("X", x), act)
    (ref,) = b.run([out])
    assert_close(dx, ref, what=act)


def _wide(rng, shape, dtype=F32):
    """Pre-activations up to |x| = 40 (QuickGELU's sigmoid(1.702 x) saturates: e^-68), the
    saturation edges included."""
    x = rng.uniform(-40.0, 40.0, shape)
    edges = [0.0, -40.0, 40.0, -9.3, 9.3, -13.3, 13.3, -24.0, 24.0]
    x.reshape(-1)[: min(x.size, len(edges))] = edges[: x.size]
    return x.astype(dtype)


@pytest.mark.parametrize("alpha", [1.702, 0.5])
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("shape", [(1,), (17,), (2, 3, 17), (256, 1023)])
def test_activation_grad_silu_alpha_vs_reference(alpha, dtype, shape):
    """silu at input scale alpha: x sigmoid(alpha x), QuickGELU at alpha = 1.702."""
    rng = _rng("act-alpha", alpha, str(dtype), shape)
    dy, x = rand(rng, shape, dtype), _wide(rng, shape, dtype)
    (dx,) = run_fused("ActivationGrad", [("dY", dy), ("X", x)], [("dX", dtype)],
                      activation="silu", alpha=alpha)
    assert_close(dx, activation_grad(dy, x, "silu", alpha), **tol(dtype), what=f"{alpha} {shape}")


@pytest.mark.parametrize("act,alpha", [("silu", 1.702), ("silu", 1.0), ("gelu", 0.75),
                                       ("relu", 2.0)])
def test_activation_grad_alpha_vs_unfused(act, alpha):
    """alpha against the standard-ONNX chain (QuickGELU: the decomposition torch exports)."""
    rng = _rng("act-alpha-unfused", act, alpha)
    dy, x = rand(rng, (7, 129)), _wide(rng, (7, 129))
    (dx,) = run_fused("ActivationGrad", [("dY", dy), ("X", x)], [("dX", F32)], activation=act,
                      alpha=alpha)
    b = Builder()
    out = act_grad_subgraph(b, b.input("dY", dy), b.input("X", x), act, alpha)
    (ref,) = b.run([out])
    assert_close(dx, ref, what=f"{act} alpha={alpha}")


@pytest.mark.parametrize("act,alpha", [(a, 1.0) for a in ACTS] + [("silu", 1.702), ("gelu", 0.75)])
def test_activation_grad_accuracy_on_a_dense_grid(act, alpha):
    """The vectorized exp / erf / reciprocal approximations (and the masked tail: an odd length)
    against the float64 formula on a dense grid reaching the saturated tails. Errors are absolute
    (dY = 1, act' <= 1.13): 1 ulp near 1 is 1.2e-7. gelu_tanh keeps float32's cancellation in
    1 - tanh^2 near |x| = 5 (the unfused chain has it too), hence its looser bound."""
    x = np.concatenate([np.linspace(-12.0, 12.0, 240_007), [-87.5, -40.0, 40.0, 87.5, 1e6, -1e6]])
    x = x.astype(F32)
    dy = np.ones_like(x)
    (dx,) = run_fused("ActivationGrad", [("dY", dy), ("X", x)], [("dX", F32)], activation=act,
                      alpha=alpha)
    with np.errstate(over="ignore"):  # exp(1e6) in the float64 silu formula
        ref = activation_grad(dy.astype(np.float64), x.astype(np.float64), act, alpha)
    err = np.abs(dx.astype(np.float64) - ref)
    worst = int(np.argmax(err))
    assert err.max() <= (5e-6 if act == "gelu_tanh" else 6e-7), f"{act}: |error| {err.max():.3g} at x={x[worst]!r}"
    big = np.abs(ref) > 0.05  # away from act' zero crossings: relative error too
    assert (err[big] / np.abs(ref[big])).max() <= 1e-5, act


def test_activation_grad_bad_activation_is_an_error():
    dy = np.ones((2, 2), F32)
    with pytest.raises(Exception, match="activation"):
        run_fused("ActivationGrad", [("dY", dy), ("X", dy)], [("dX", F32)], activation="tanhh")
