"""NumPy reference implementations of fusecli's fused ops (the oracle for the C++/CUDA kernels).

Each function follows the contract in ``contracts.yaml`` literally and computes in float64, then
casts back to the input dtype. ``REFERENCE_OPS`` holds ``onnx.reference`` op classes so a fused
model runs in ``onnx.reference.ReferenceEvaluator(model, new_ops=REFERENCE_OPS)``.
"""

from __future__ import annotations

import math

import numpy as np

DOMAIN = "com.fusecli"

_SQRT1_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _erf(x: np.ndarray) -> np.ndarray:
    # numpy has no erf; math.erf vectorised is exact to double precision.
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def activation_grad(dy: np.ndarray, x: np.ndarray, activation: str) -> np.ndarray:
    d = dy.astype(np.float64)
    v = x.astype(np.float64)
    if activation == "relu":
        out = d * (v > 0)
    elif activation == "gelu":
        out = d * (0.5 * (1.0 + _erf(v * _SQRT1_2)) + v * np.exp(-0.5 * v * v) * _INV_SQRT_2PI)
    elif activation == "gelu_tanh":
        a = math.sqrt(2.0 / math.pi)
        t = np.tanh(a * (v + 0.044715 * v**3))
        out = d * 0.5 * (1.0 + t + v * (1.0 - t * t) * a * (1.0 + 3.0 * 0.044715 * v * v))
    elif activation == "silu":
        s = 1.0 / (1.0 + np.exp(-v))
        out = d * s * (1.0 + v * (1.0 - s))
    elif activation == "identity":
        out = d
    else:
        raise NotImplementedError(f"activation {activation!r}")
    return out.astype(dy.dtype)


def linear_activation_grad(dy, x, a, w=None, activation: str = "relu", trans_w: int = 0,
                           trans_dw: int | None = None):
    n = dy.shape[-1]
    k = a.shape[-1]
    dz = activation_grad(dy, x, activation).astype(np.float64).reshape(-1, n)
    a2 = a.astype(np.float64).reshape(-1, k)
    if w is None:
        da = None
    else:
        w64 = w.astype(np.float64)
        wnk = w64.T if trans_w else w64  # [N, K]
        da = (dz @ wnk).reshape(*a.shape[:-1], wnk.shape[1]).astype(a.dtype)
    dw_nk = dz.T @ a2
    trans_dw = trans_w if trans_dw is None else trans_dw
    dw = (dw_nk.T if trans_dw else dw_nk).astype(a.dtype)
    db = dz.sum(axis=0).astype(dy.dtype)
    return da, dw, db, dz.reshape(dy.shape).astype(dy.dtype)


def attention_kv_dims(q_batch, kv_shape, mat_elems, what="K"):
    """The batch dims of K (or V) aligned with P's batch dims ``q_batch``: a K whose element
    count is P's batch count times ``mat_elems`` counts as P's batch dims; else AttentionGrad's
    grouping rule (right-aligned, missing leading dims 1, each equal to P's or dividing it)."""
    q_batch = tuple(int(d) for d in q_batch)
    kb = tuple(int(d) for d in kv_shape[:-2])
    if int(np.prod(kv_shape)) == int(np.prod(q_batch)) * mat_elems:
        return q_batch
    if len(kb) <= len(q_batch):
        kb_full = (1,) * (len(q_batch) - len(kb)) + kb
        if all(k == q or (k >= 1 and q % k == 0) for q, k in zip(q_batch, kb_full)):
            return kb_full
    raise ValueError(f"AttentionGrad: {what}'s batch dims {list(kb)} must equal or divide P's "
                     f"{list(q_batch)} dim by dim (grouped / multi-query attention)")


def _expand(t, q_batch, kv_batch):
    """[*kv_batch, r, c] -> [*q_batch, r, c]: query index i of dim j reads kv index
    i // (q_j / kv_j)."""
    lead = []
    for k in kv_batch:
        lead += [k, 1]
    t = t.reshape(*lead, *t.shape[-2:])
    full = []
    for q, k in zip(q_batch, kv_batch):
        full += [k, q // k if k else 0]
    return np.broadcast_to(t, (*full, *t.shape[-2:])).reshape(*q_batch, *t.shape[-2:])


def _group_sum(t, q_batch, kv_batch):
    """[*q_batch, r, c] -> [*kv_batch, r, c]: sums the query items that share a kv item."""
    split = []
    for q, k in zip(q_batch, kv_batch):
        split += [k, q // k if k else 0]
    t = t.reshape(*split, *t.shape[-2:])
    return t.sum(axis=tuple(range(1, 2 * len(q_batch), 2))).reshape(*kv_batch, *t.shape[-2:])


def attention_grad(do, q, k, v, p, scale_q=1.0, scale_k=1.0, k_transposed=0, q_scale=None,
                   k_scale=None, dropout_mask=None, dropout_ratio=0.0):
    """Returns (dQ, dK, dV, dS) as the contract defines them (grouped K / V, dropout)."""
    qb, (sq, sk) = p.shape[:-2], p.shape[-2:]
    d, dvd = q.shape[-1], v.shape[-1]
    kb = attention_kv_dims(qb, k.shape, sk * d, "K")
    vb = attention_kv_dims(qb, v.shape, sk * dvd, "V")
    if dropout_mask is None and dropout_ratio:
        raise ValueError("AttentionGrad: dropout_ratio needs dropout_mask")
    if dropout_mask is not None and tuple(dropout_mask.shape) != tuple(p.shape):
        raise ValueError(f"AttentionGrad: dropout_mask must have P's shape {list(p.shape)}")
    do64 = do.astype(np.float64).reshape(*qb, sq, dvd)
    q64 = q.astype(np.float64).reshape(*qb, sq, d)
    p64 = p.astype(np.float64)
    k64 = k.astype(np.float64).reshape(*kb, *k.shape[-2:])
    k_sd = np.swapaxes(k64, -1, -2) if k_transposed else k64  # [*kb, Sk, D]
    v64 = v.astype(np.float64).reshape(*vb, sk, dvd)
    if dropout_mask is None:
        keep = 1.0
    else:
        keep = dropout_mask.astype(np.float64) / (1.0 - float(dropout_ratio))
    pd = p64 * keep
    dv = _group_sum(np.swapaxes(pd, -1, -2) @ do64, qb, vb)
    dp = (do64 @ np.swapaxes(_expand(v64, qb, vb), -1, -2)) * keep
    ds = p64 * (dp - (dp * p64).sum(axis=-1, keepdims=True))
    if q_scale is not None:
        scale_q = scale_q * float(np.asarray(q_scale, dtype=np.float64).reshape(-1)[0])
    if k_scale is not None:
        scale_k = scale_k * float(np.asarray(k_scale, dtype=np.float64).reshape(-1)[0])
    dq = scale_q * (ds @ _expand(k_sd, qb, kb))
    dk = _group_sum(scale_k * (np.swapaxes(ds, -1, -2) @ q64), qb, kb)
    if k_transposed:
        dk = np.swapaxes(dk, -1, -2)
    return (dq.reshape(q.shape).astype(q.dtype), dk.reshape(k.shape).astype(k.dtype),
            dv.reshape(v.shape).astype(v.dtype), ds.astype(p.dtype))


def _conv2d(x, w, strides, pads, dilations, group):
    """Forward 2-D convolution in float64 by explicit im2col (reference only)."""
    n, cin, h, wd = x.shape
    cout, cin_g, kh, kw = w.shape
    sh, sw = strides
    dh, dw = dilations
    pt, pl, pb, pr = pads
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    ho = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
    wo = (wd + pl + pr - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((n, cout, ho, wo))
    cout_g = cout // group
    for g in range(group):
        xs = xp[:, g * cin_g:(g + 1) * cin_g]
        cols = np.empty((n, cin_g, kh, kw, ho, wo))
        for i in range(kh):
            for j in range(kw):
                cols[:, :, i, j] = xs[:, :, i * dh:i * dh + sh * ho:sh, j * dw:j * dw + sw * wo:sw]
        wg = w[g * cout_g:(g + 1) * cout_g].reshape(cout_g, -1)
        out[:, g * cout_g:(g + 1) * cout_g] = np.einsum(
            "ok,nkhw->nohw", wg, cols.reshape(n, -1, ho, wo))
    return out


def conv_bn_relu_grad(dy, y, x, w, cv, gamma, mean, inv_std, strides=(1, 1), pads=(0, 0, 0, 0),
                      dilations=(1, 1), group=1, relu=1):
    d = dy.astype(np.float64)
    if relu:
        d = d * (y > 0)
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


def layer_norm_grad(dy, x, gamma, mean, inv_std, dr=None, axis=-1):
    ax = axis % x.ndim
    n = int(np.prod(x.shape[ax:]))
    d = dy.astype(np.float64).reshape(-1, n)
    xs = x.astype(np.float64).reshape(-1, n)
    mu = mean.astype(np.float64).reshape(-1, 1)
    rs = inv_std.astype(np.float64).reshape(-1, 1)
    xhat = (xs - mu) * rs
    g = d * (1.0 if gamma is None else gamma.astype(np.float64).reshape(1, n))
    dx = rs * (g - g.mean(axis=1, keepdims=True) - xhat * (g * xhat).mean(axis=1, keepdims=True))
    if dr is not None:
        dx = dx + dr.astype(np.float64).reshape(-1, n)
    pshape = x.shape[ax:]
    dgamma = (d * xhat).sum(axis=0).reshape(pshape).astype(dy.dtype)
    dbeta = d.sum(axis=0).reshape(pshape).astype(dy.dtype)
    return dx.reshape(x.shape).astype(dy.dtype), dgamma, dbeta


# --- onnx.reference adapters --------------------------------------------------------------

def _reference_ops():
    from onnx.reference.op_run import OpRun

    def _s(v):
        return v.decode() if isinstance(v, bytes) else v

    def _fit(op, res):
        # a node lists only the outputs it needs; an absent ("") output gets a placeholder
        res = tuple(res)[:len(op.output)]
        return tuple(np.empty(0, np.float32) if r is None else r for r in res)

    class ActivationGrad(OpRun):
        op_domain = DOMAIN

        def _run(self, dy, x, activation=None):
            return _fit(self, (activation_grad(dy, x, _s(activation)),))

    class LinearActivationGrad(OpRun):
        op_domain = DOMAIN

        def _run(self, dy, x, a, w=None, activation=None, trans_w=0, trans_dw=None):
            return _fit(self, linear_activation_grad(dy, x, a, w, _s(activation), trans_w or 0,
                                                     trans_dw))

    class AttentionGrad(OpRun):
        op_domain = DOMAIN

        def _run(self, do, q, k, v, p, q_scale=None, k_scale=None, dropout_mask=None,
                 scale_q=1.0, scale_k=1.0, k_transposed=0, dropout_ratio=0.0):
            return _fit(self, attention_grad(do, q, k, v, p, 1.0 if scale_q is None else scale_q,
                                             1.0 if scale_k is None else scale_k,
                                             k_transposed or 0, q_scale, k_scale, dropout_mask,
                                             dropout_ratio or 0.0))

    class ConvBnReluGrad(OpRun):
        op_domain = DOMAIN

        def _run(self, dy, y, x, w, cv, gamma, mean, inv_std, strides=None, pads=None,
                 dilations=None, group=1, relu=1):
            return _fit(self, conv_bn_relu_grad(
                dy, y, x, w, cv, gamma, mean, inv_std, tuple(strides or (1, 1)),
                tuple(pads or (0, 0, 0, 0)), tuple(dilations or (1, 1)), group or 1,
                1 if relu is None else relu))

    class LayerNormGrad(OpRun):
        op_domain = DOMAIN

        def _run(self, dy, x, gamma=None, mean=None, inv_std=None, dr=None, axis=-1):
            return _fit(self, layer_norm_grad(dy, x, gamma, mean, inv_std, dr,
                                              -1 if axis is None else axis))

    return [ActivationGrad, LinearActivationGrad, AttentionGrad, ConvBnReluGrad, LayerNormGrad]


def reference_ops() -> list:
    """Op classes for ``onnx.reference.ReferenceEvaluator(model, new_ops=reference_ops())``."""
    return _reference_ops()
