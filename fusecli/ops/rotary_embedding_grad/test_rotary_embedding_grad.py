"""RotaryEmbeddingGrad: its kernels (fusecli/lib/libfusecli_ops.so) against the NumPy reference
and against the unfused standard-ONNX subgraph it replaces (rotate-half: Mul(dY, sin), the two
halves' Slice, Neg, Concat, Add of Mul(dY, cos); interleaved: the same with strided Slices), in
onnxruntime with graph optimizations off."""

from __future__ import annotations

import numpy as np
import pytest

from fusecli.ops.rotary_embedding_grad.reference import rotary_embedding_grad

# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import F32, Builder, _built, _rng, assert_close, rand, run_fused

SHAPES = [  # (dY, cos): Llama's [B, H, S, D] with cos [B, 1, S, D]; [S, D]; one row; odd rows
    ((2, 3, 5, 8), (2, 1, 5, 8)), ((2, 3, 5, 8), (5, 8)), ((1, 1, 1, 2), (1, 1, 1, 2)),
    ((3, 7, 64), (1, 7, 64)), ((2, 4, 33, 128), (2, 1, 33, 128)), ((4, 6), (4, 6))]


def _inputs(rng, shape, cshape):
    ang = rng.uniform(-6.0, 6.0, cshape)
    return rand(rng, shape), np.cos(ang).astype(F32), np.sin(ang).astype(F32)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("shape,cshape", SHAPES)
def test_rotary_embedding_grad_vs_reference(shape, cshape, interleaved):
    rng = _rng("rope", shape, cshape, interleaved)
    dy, c, s = _inputs(rng, shape, cshape)
    (dx,) = run_fused("RotaryEmbeddingGrad", [("dY", dy), ("cos", c), ("sin", s)],
                      [("dX", F32)], interleaved=interleaved)
    assert_close(dx, rotary_embedding_grad(dy, c, s, interleaved), what=f"{shape} {cshape}")


def _unfused(dy, c, s, interleaved):
    """The backward of X cos + rot(X) sin in standard ops, as autograd writes it."""
    b = Builder()
    tdy, tc, ts = b.input("dY", dy), b.input("cos", c), b.input("sin", s)
    g = b.mul(tdy, ts)
    d = dy.shape[-1]
    ax = b.ints([-1])
    if interleaved:  # rot(x)[0::2] = -x[1::2], rot(x)[1::2] = x[0::2]
        g_even = b.op("Slice", g, b.ints([0]), b.ints([d]), ax, b.ints([2]))
        g_odd = b.op("Slice", g, b.ints([1]), b.ints([d]), ax, b.ints([2]))
        # dX[0::2] += g[1::2], dX[1::2] -= g[0::2]: interleave (g_odd, -g_even) back
        pair = b.op("Concat", b.op("Unsqueeze", g_odd, b.ints([-1])),
                    b.op("Unsqueeze", b.op("Neg", g_even), b.ints([-1])), axis=-1)
        rt = b.op("Reshape", pair, b.ints(list(dy.shape)))
    else:  # rot(x) = cat(-x2, x1): rot^T(g) = cat(g2, -g1)
        h = d // 2
        g1 = b.op("Slice", g, b.ints([0]), b.ints([h]), ax)
        g2 = b.op("Slice", g, b.ints([h]), b.ints([d]), ax)
        rt = b.op("Concat", g2, b.op("Neg", g1), axis=-1)
    (ref,) = b.run([b.add(b.mul(tdy, tc), rt)])
    return ref


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("shape,cshape", SHAPES[:4])
def test_rotary_embedding_grad_vs_unfused(shape, cshape, interleaved):
    rng = _rng("rope-unfused", shape, cshape, interleaved)
    dy, c, s = _inputs(rng, shape, cshape)
    (dx,) = run_fused("RotaryEmbeddingGrad", [("dY", dy), ("cos", c), ("sin", s)],
                      [("dX", F32)], interleaved=interleaved)
    assert_close(dx, _unfused(dy, c, s, interleaved), what=f"{shape} {cshape}")


def test_rotary_embedding_grad_is_the_adjoint_of_the_forward():
    """<dY, rope(X)> = <rope^T(dY), X> for the forward X cos + rot(X) sin written out here."""
    rng = _rng("rope-adjoint")
    dy, c, s = _inputs(rng, (2, 3, 5, 8), (2, 1, 5, 8))
    x = rand(rng, (2, 3, 5, 8)).astype(np.float64)
    for inter in (0, 1):
        if inter:
            rx = np.empty_like(x)
            rx[..., 0::2], rx[..., 1::2] = -x[..., 1::2], x[..., 0::2]
        else:
            rx = np.concatenate([-x[..., 4:], x[..., :4]], axis=-1)
        y = x * c + rx * s
        (dx,) = run_fused("RotaryEmbeddingGrad", [("dY", dy), ("cos", c), ("sin", s)],
                          [("dX", F32)], interleaved=inter)
        assert np.isclose((dy * y).sum(), (dx.astype(np.float64) * x).sum(), rtol=1e-5)


@pytest.mark.parametrize("cshape,axis,msg", [((5, 6), -1, "last dim"), ((2, 5, 8), -1,
                                             "broadcast"), ((5, 8), 2, "last axis")])
def test_rotary_embedding_grad_bad_inputs_are_errors(cshape, axis, msg):
    dy = np.ones((2, 3, 5, 8), F32)
    c = np.ones(cshape, F32)
    with pytest.raises(Exception, match=msg):
        run_fused("RotaryEmbeddingGrad", [("dY", dy), ("cos", c), ("sin", c)], [("dX", F32)],
                  axis=axis)


@pytest.mark.parametrize("shape,cshape,msg", [((2, 3, 5, 7), (5, 7), "even"),
                                              ((2, 3, 5, 8), (5, 6), "last dim")])
def test_shape_guard_refuses_what_the_kernel_refuses(shape, cshape, msg):
    """The shape guard's input check (shapes.py) names the shapes the kernels refuse (an odd
    rotated width, cos / sin of another width), and passes Llama's shapes and unknown dims."""
    from fusecli.engine.shapes import input_problem

    dy, c = np.ones(shape, F32), np.ones(cshape, F32)
    with pytest.raises(Exception, match=msg):
        run_fused("RotaryEmbeddingGrad", [("dY", dy), ("cos", c), ("sin", c)], [("dX", F32)])
    assert input_problem("RotaryEmbeddingGrad", {}, [list(shape), list(cshape), list(cshape)],
                         ["dY", "cos", "sin"])
    ok = [[2, 3, 5, 8], [2, 1, 5, 8], [2, 1, 5, 8]]
    assert input_problem("RotaryEmbeddingGrad", {}, ok, ["dY", "cos", "sin"]) is None
    assert input_problem("RotaryEmbeddingGrad", {}, [["b", 3, "s", None], [1, 1, "s", 7], None],
                         ["dY", "cos", "sin"]) is None
