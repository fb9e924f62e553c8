"""NumPy reference of RotaryEmbeddingGrad (the oracle for its kernels), following its
contract.yaml: the backward of Y = X cos + rot(X) sin."""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from fusecli.ops.reference import _fit


def rotate(x: np.ndarray, interleaved: int) -> np.ndarray:
    """rot(x) of the forward, along the last axis."""
    if interleaved:
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = -x[..., 1::2], x[..., 0::2]
        return out
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def rotate_transposed(g: np.ndarray, interleaved: int) -> np.ndarray:
    """rot^T(g): the adjoint of rot (rot is a signed permutation, rot^T = rot^-1 = -rot)."""
    return -rotate(g, interleaved)


def rotary_embedding_grad(dy, cos, sin, interleaved=0, axis=-1):
    if axis not in (-1, dy.ndim - 1):
        raise NotImplementedError("RotaryEmbeddingGrad: the last axis only")
    d = dy.astype(np.float64)
    c = np.broadcast_to(cos.astype(np.float64), d.shape)
    s = np.broadcast_to(sin.astype(np.float64), d.shape)
    return (d * c + rotate_transposed(d * s, interleaved)).astype(dy.dtype)


class Reference(OpRun):

    def _run(self, dy, cos, sin, interleaved=0, axis=-1):
        return _fit(self, (rotary_embedding_grad(dy, cos, sin, 0 if interleaved is None else
                                                 interleaved, -1 if axis is None else axis),))
