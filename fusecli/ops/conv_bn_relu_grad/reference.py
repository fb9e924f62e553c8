"""NumPy reference of ConvBnReluGrad (the oracle for its kernels), following its contract.yaml."""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from fusecli.ops.activation_grad.reference import activation_grad
from fusecli.ops.reference import _fit, _s


def act_grad(d, y, activation):
    """dY * act'(Y) in float64 (d is float64): the activations of this op's contract."""
    if activation == "identity":
        return d
    v = y.astype(np.float64)
    if activation == "relu6":  # Clip(Z, 0, 6) on its input Z, bounds kept (ORT's Clip gradient)
        return d * ((v >= 0) & (v <= 6))
    if activation == "hardswish":  # x relu6(x + 3) / 6: (relu6(a) + x [0 <= a <= 6]) / 6,
        # a = x + 3 rounded to float32 as the graph computes it (where the mask flips)
        a = (y.astype(np.float32) + np.float32(3)).astype(np.float64)
        return d * (np.clip(a, 0, 6) + v * ((a >= 0) & (a <= 6))) / 6
    if activation in ("relu", "silu"):
        return activation_grad(d, v, activation)
    raise NotImplementedError(f"activation {activation!r}")


def conv_bn_relu_grad(dy, y, x, w, cv, gamma, mean, inv_std, strides=(1, 1), pads=(0, 0, 0, 0),
                      dilations=(1, 1), group=1, activation="relu"):
    d = act_grad(dy.astype(np.float64), y, activation)
    c = cv.shape[1]
    shp = (1, c, 1, 1)
    xhat = (cv.astype(np.float64) - mean.reshape(shp)) * inv_std.astype(np.float64).reshape(shp)
    r = cv.shape[0] * cv.shape[2] * cv.shape[3]
    dbeta = d.sum(axis=(0, 2, 3))
    dgamma = (d * xhat).sum(axis=(0, 2, 3))
    coef = (gamma.astype(np.float64) * inv_std.astype(np.float64) / r).reshape(shp)
    dc = coef * (r * d - dbeta.reshape(shp) - xhat * dgamma.reshape(shp))
    x64 = x.astype(np.float64)
    w64 = w.astype(np.float64)
    # dgrad / wgrad as vector-Jacobian products of the linear forward conv (exact, slow).
    dx = _conv_vjp_x(dc, x64.shape, w64, strides, pads, dilations, group)
    dw = _conv_vjp_w(dc, x64, w64.shape, strides, pads, dilations, group)
    dbc = dc.sum(axis=(0, 2, 3))
    f = dy.dtype
    return (dx.astype(f), dw.astype(f), dbc.astype(f), dgamma.astype(f), dbeta.astype(f),
            dc.astype(f))


def _conv_vjp_x(dc, x_shape, w, strides, pads, dilations, group):
    n, cin, h, wd = x_shape
    cout, cin_g, kh, kw = w.shape
    sh, sw = strides
    dh, dw = dilations
    pt, pl, pb, pr = pads
    ho, wo = dc.shape[2], dc.shape[3]
    dxp = np.zeros((n, cin, h + pt + pb, wd + pl + pr))
    cout_g = cout // group
    for g in range(group):
        wg = w[g * cout_g:(g + 1) * cout_g]  # [cout_g, cin_g, kh, kw]
        dcg = dc[:, g * cout_g:(g + 1) * cout_g]
        for i in range(kh):
            for j in range(kw):
                contrib = np.einsum("nohw,oc->nchw", dcg, wg[:, :, i, j])
                dxp[:, g * cin_g:(g + 1) * cin_g, i * dh:i * dh + sh * ho:sh,
                    j * dw:j * dw + sw * wo:sw] += contrib
    return dxp[:, :, pt:pt + h, pl:pl + wd]


def _conv_vjp_w(dc, x, w_shape, strides, pads, dilations, group):
    cout, cin_g, kh, kw = w_shape
    sh, sw = strides
    dh, dw = dilations
    pt, pl, pb, pr = pads
    ho, wo = dc.shape[2], dc.shape[3]
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    dwt = np.zeros(w_shape)
    cout_g = cout // group
    for g in range(group):
        xs = xp[:, g * cin_g:(g + 1) * cin_g]
        dcg = dc[:, g * cout_g:(g + 1) * cout_g]
        for i in range(kh):
            for j in range(kw):
                patch = xs[:, :, i * dh:i * dh + sh * ho:sh, j * dw:j * dw + sw * wo:sw]
                dwt[g * cout_g:(g + 1) * cout_g, :, i, j] = np.einsum("nohw,nchw->oc", dcg, patch)
    return dwt


class Reference(OpRun):

    def _run(self, dy, y, x, w, cv, gamma, mean, inv_std, strides=None, pads=None,
             dilations=None, group=1, activation="relu"):
        return _fit(self, conv_bn_relu_grad(
            dy, y, x, w, cv, gamma, mean, inv_std, tuple(strides or (1, 1)),
            tuple(pads or (0, 0, 0, 0)), tuple(dilations or (1, 1)), group or 1,
            _s(activation) or "relu"))
