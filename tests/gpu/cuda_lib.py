"""ctypes bindings of fusecli's CUDA launchers (declared in each op's contract.yaml) for torch
tensors.

The library is FUSECLI_CUDA_LIB if set, else build/gpu/libfusecli_cuda.so (launchers only, built
by run_gpu_checks.sh with nvcc alone), else fusecli/lib/libfusecli_ops.so."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _contracts():
    """fusecli/contracts.py loaded by file path (a GPU machine needs PyYAML, not onnx)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("fusecli_contracts_standalone",
                                                  REPO / "fusecli" / "contracts.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


_C = _contracts()
ACT = _C.activation_codes()           # activation name -> launcher code (ops/domain.yaml)
SIGNATURES = _C.launcher_argtypes()   # launcher name -> ctypes argtypes (ops/<op>/contract.yaml)


def library_file() -> str:
    env = os.environ.get("FUSECLI_CUDA_LIB")
    if env:
        return env
    for cand in (REPO / "build" / "gpu" / "libfusecli_cuda.so", REPO / "fusecli" / "lib" / "libfusecli_ops.so"):
        if cand.exists():
            return str(cand)
    raise FileNotFoundError("no fusecli CUDA library: run tests/gpu/run_gpu_checks.sh or `make lib`")


_LIB = None


def lib():
    global _LIB
    if _LIB is None:
        l = ctypes.CDLL(library_file())
        for name, args in SIGNATURES.items():
            f = getattr(l, name)
            f.argtypes = args
            f.restype = ctypes.c_int
        _LIB = l
    return _LIB


def ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def stream():
    import torch
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def call(name, *args):
    err = getattr(lib(), name)(*args)
    if err != 0:
        raise RuntimeError(f"{name} returned cudaError {err}")


# --- convenience wrappers (allocate outputs with torch) ----------------------------------------

def activation_grad(dy, x, act, alpha=1.0):
    import torch
    out = torch.empty_like(dy)
    name = "fusecli_launch_activation_grad" + ("_f16" if dy.dtype == torch.float16 else "")
    call(name, stream(), ptr(dy), ptr(x), ptr(out), dy.numel(), ACT[act], alpha)
    return out


def _workspace(dy, mode):
    """(dY to pass, workspace output) for an op's dY-shaped workspace output (dZ, dC): mode None
    (not requested), "out" (a separate tensor) or "inplace" (a copy of dY that the op
    overwrites, as onnxruntime's in-place plan does)."""
    import torch
    if mode == "inplace":
        dy = dy.clone()
        return dy, dy
    return dy, (torch.empty_like(dy) if mode == "out" else None)


def linear_activation_grad(dy, x, a, w, act, trans_w=0, want=(1, 1, 1), trans_dw=None, dz=None,
                           alpha=1.0):
    """dz: None (no dZ output), "out" (a separate dZ tensor) or "inplace" (dZ written over a
    copy of dY, as onnxruntime's in-place plan does); with dz the result has a 4th item."""
    import torch
    n, k = dy.shape[-1], a.shape[-1]
    m = dy.numel() // n
    da = torch.empty_like(a) if want[0] else None
    trans_dw = trans_w if trans_dw is None else trans_dw
    dw = (torch.empty_like(w) if trans_dw == trans_w else torch.empty_like(w.t())) \
        if want[1] else None
    db = torch.empty(n, device=dy.device, dtype=dy.dtype) if want[2] else None
    dy, dz_t = _workspace(dy, dz)
    call("fusecli_launch_linear_activation_grad", stream(), ptr(dy), ptr(x), ptr(a), ptr(w),
         ptr(da), ptr(dw), ptr(db), ptr(dz_t), m, n, k, ACT[act], alpha, trans_w, trans_dw)
    return (da, dw, db) if dz is None else (da, dw, db, dz_t)


def lora_linear_grad(dy, x, a, w, la, lb, h, xd=None, act="identity", scale=1.0, trans_w=0,
                     split_dx=0, want=(1, 1, 1, 1, 1, 1), dz=None, alpha=1.0):
    """LoraLinearGrad's launcher: returns [dX, dXa, dLa, dLb, dW, dB] (None where not wanted)
    and, with dz, dZ as a 7th item."""
    import torch
    n, k, r = dy.shape[-1], a.shape[-1], la.shape[0]
    m = dy.numel() // n
    dx = torch.empty_like(a) if want[0] else None
    dxa = torch.empty_like(a) if want[1] else None
    dla = torch.empty_like(la) if want[2] else None
    dlb = torch.empty_like(lb) if want[3] else None
    dw = torch.empty_like(w) if want[4] else None
    db = torch.empty(n, device=dy.device, dtype=dy.dtype) if want[5] else None
    dy, dz_t = _workspace(dy, dz)
    call("fusecli_launch_lora_linear_grad", stream(), ptr(dy), ptr(x), ptr(a), ptr(w), ptr(la),
         ptr(lb), ptr(h), ptr(xd), ptr(dx), ptr(dxa), ptr(dla), ptr(dlb), ptr(dw), ptr(db),
         ptr(dz_t), m, n, k, r, ACT[act], alpha, scale, trans_w, split_dx)
    out = [dx, dxa, dla, dlb, dw, db]
    return out if dz is None else out + [dz_t]


def ref_lora(dy, x, a, w, la, lb, h, xd, act, scale, trans_w, split_dx):
    """LoraLinearGrad's contract in torch (float64): [dX, dXa, dLa, dLb, dW, dB]."""
    n, k, r = dy.shape[-1], a.shape[-1], la.shape[0]
    dz = ref_act_grad(dy, x, act).reshape(-1, n)
    a2 = a.reshape(-1, k)
    xd2 = a2 if xd is None else xd.reshape(-1, k)
    g = scale * (dz @ lb)
    wnk = w.t() if trans_w else w
    base, adapter = dz @ wnk, g @ la
    dx = (base if split_dx else base + adapter).reshape(a.shape)
    dw = a2.t() @ dz if trans_w else dz.t() @ a2
    return [dx, adapter.reshape(a.shape), g.t() @ xd2,
            scale * dz.t() @ h.reshape(-1, r), dw, dz.sum(0)]


def _kv_dims(q_batch, t):
    """K's (or V's) batch dims right-aligned with P's, missing leading ones 1."""
    kb = tuple(t.shape[:-2])
    return (1,) * (len(q_batch) - len(kb)) + kb


def _fill_strides(shape, pshape):
    """The fill mask's element strides over P's dims (right-aligned, 0 where broadcast)."""
    st, out = 1, [0] * len(pshape)
    for i, n in enumerate(reversed(shape)):
        out[len(pshape) - 1 - i] = 0 if n == 1 else st
        st *= n
    return out


def attention_grad(do, q, k, v, p, scale_q=1.0, scale_k=1.0, k_transposed=0, want=(1, 1, 1),
                   mask=None, ratio=0.0, nan_guard=0, fill=None, fill_kept=0):
    """want: dQ, dK, dV (and dS when it has 4 items); mask: bool tensor of P's shape or None;
    nan_guard: the contract's attribute (dV reads P's NaN entries as 0); fill: a bool fill
    mask broadcastable to P's shape (fill_kept: its polarity), dQ and dK read dS as 0 there.
    K and V may have fewer batch rows than P (grouped / multi-query attention)."""
    import torch
    qb = tuple(p.shape[:-2])
    sq, sk = p.shape[-2], p.shape[-1]
    d, dv_dim = q.shape[-1], v.shape[-1]
    dims = [(ctypes.c_int64 * max(1, len(qb)))(*b) for b in (qb, _kv_dims(qb, k), _kv_dims(qb, v))]
    outs = [torch.empty_like(t) if w_ else None for t, w_ in zip((q, k, v, p), want)]
    outs += [None] * (4 - len(outs))
    m = None if mask is None else mask.to(torch.bool).contiguous()
    f = None if fill is None else fill.to(torch.bool).contiguous()
    fs = None if f is None else (ctypes.c_int64 * p.dim())(*_fill_strides(f.shape, p.shape))
    call("fusecli_launch_attention_grad", stream(), ptr(do), ptr(q), ptr(k), ptr(v), ptr(p), ptr(m),
         *(ptr(o) for o in outs), len(qb), *dims, sq, sk, d, dv_dim, scale_q, scale_k,
         1.0 / (1.0 - ratio), k_transposed, nan_guard, ptr(f), fs, fill_kept)
    return outs[:len(want)]


def conv_bn_relu_grad(dy, y, x, w, cv, gamma, mean, inv_std, strides=(1, 1), pads=(0, 0, 0, 0),
                      dilations=(1, 1), group=1, relu=1, want=(1, 1, 1, 1, 1), dc=None):
    """dc: None, "out" (a separate dC output) or "inplace" (dC written over a copy of dY, as
    onnxruntime's in-place plan does); with dc the result has a 6th item."""
    import torch
    c = dy.shape[1]
    shapes = [x.shape, w.shape, (c,), (c,), (c,)]
    outs = [torch.empty(s, device=dy.device, dtype=dy.dtype) if w_ else None for s, w_ in zip(shapes, want)]
    dy, dc_t = _workspace(dy, dc)
    call("fusecli_launch_conv_bn_relu_grad", stream(), *(ptr(t) for t in (dy, y, x, w, cv, gamma, mean, inv_std)),
         *(ptr(o) for o in outs), ptr(dc_t), dy.shape[0], c, dy.shape[2], dy.shape[3], x.shape[1],
         x.shape[2], x.shape[3], w.shape[2], w.shape[3], strides[0], strides[1], *pads, dilations[0],
         dilations[1], group, relu)
    return outs if dc is None else outs + [dc_t]


def layer_norm_grad(dy, x, gamma, mean, inv_std, dr=None, want=(1, 1, 1)):
    import torch
    n = gamma.numel()
    m = x.numel() // n
    outs = [torch.empty(s, device=x.device, dtype=x.dtype) if w_ else None
            for s, w_ in zip((x.shape, gamma.shape, gamma.shape), want)]
    if x.dtype == torch.float16:
        call("fusecli_launch_layer_norm_grad_f16", stream(), ptr(dy), ptr(x), ptr(gamma), ptr(mean),
             ptr(inv_std), int(mean.dtype == torch.float16), ptr(dr), *(ptr(o) for o in outs), m, n)
    else:
        call("fusecli_launch_layer_norm_grad", stream(), ptr(dy), ptr(x), ptr(gamma), ptr(mean),
             ptr(inv_std), ptr(dr), *(ptr(o) for o in outs), m, n)
    return outs


def rms_norm_grad(dy, x, gamma=None, inv_rms=None, dr=None, want=(1, 1), epsilon=1e-5):
    """gamma None: an RMSNorm without weight; inv_rms None: recomputed from x and epsilon."""
    import torch
    n = x.shape[-1]
    m = x.numel() // n
    outs = [torch.empty(s, device=x.device, dtype=x.dtype) if w_ else None
            for s, w_ in zip((x.shape, (n,)), want)]
    if x.dtype == torch.float16:
        f16 = int(inv_rms is not None and inv_rms.dtype == torch.float16)
        call("fusecli_launch_rms_norm_grad_f16", stream(), ptr(dy), ptr(x), ptr(gamma), ptr(inv_rms),
             f16, epsilon, ptr(dr), *(ptr(o) for o in outs), m, n)
    else:
        call("fusecli_launch_rms_norm_grad", stream(), ptr(dy), ptr(x), ptr(gamma), ptr(inv_rms),
             epsilon, ptr(dr), *(ptr(o) for o in outs), m, n)
    return outs


# --- torch references (unfused ops) -------------------------------------------------------------

def ref_act_grad(dy, x, act):
    import math
    import torch
    if act == "identity":
        return dy
    if act == "relu":
        return dy * (x > 0)
    if act == "gelu":
        return dy * (0.5 * (1 + torch.erf(x / math.sqrt(2))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi))
    if act == "gelu_tanh":
        a, c = math.sqrt(2 / math.pi), 0.044715
        t = torch.tanh(a * (x + c * x ** 3))
        return dy * 0.5 * (1 + t + x * (1 - t * t) * a * (1 + 3 * c * x * x))
    if act == "silu":
        s = torch.sigmoid(x)
        return dy * s * (1 + x * (1 - s))
    raise ValueError(act)


def ref_linear(dy, x, a, w, act, trans_w):
    n, k = dy.shape[-1], a.shape[-1]
    dz = ref_act_grad(dy, x, act).reshape(-1, n)
    a2 = a.reshape(-1, k)
    wnk = w.t() if trans_w else w
    da = (dz @ wnk).reshape(a.shape)
    dw = a2.t() @ dz if trans_w else dz.t() @ a2
    return da, dw, dz.sum(0)


def ref_attention(do, q, k, v, p, sq_, sk_, kt, mask=None, ratio=0.0, nan_guard=0, fill=None,
                  fill_kept=0):
    """AttentionGrad's contract in torch: K / V expanded to P's batch dims (query index i of a
    dim reads kv index i // (Hq / Hkv)), dK / dV summed back over each group; the fill mask
    zeroes the dS dQ and dK read (not the dS output); (dQ, dK, dV, dS)."""
    qb = tuple(p.shape[:-2])

    def split(tb):
        return [x for qd, kd in zip(qb, tb) for x in (kd, qd // kd)]

    def expand(t):
        tb = _kv_dims(qb, t)
        t = t.reshape(*[x for kd in tb for x in (kd, 1)], *t.shape[-2:])
        return t.expand(*split(tb), *t.shape[-2:]).reshape(*qb, *t.shape[-2:])

    def group_sum(t, like):
        tb = _kv_dims(qb, like)
        if qb:  # (torch sums over every dim for an empty dim tuple)
            t = t.reshape(*split(tb), *t.shape[-2:]).sum(tuple(range(1, 2 * len(qb), 2)))
        return t.reshape(like.shape[:-2] + t.shape[-2:])

    keep = 1.0 if mask is None else mask.to(p.dtype) / (1.0 - ratio)
    k_sd = expand(k.transpose(-1, -2) if kt else k)
    pg = p.nan_to_num(nan=0.0, posinf=float("inf"), neginf=float("-inf")) if nan_guard else p
    dv = group_sum((pg * keep).transpose(-1, -2) @ do, v)
    dp = (do @ expand(v).transpose(-1, -2)) * keep
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dsm = ds
    if fill is not None:
        filled = (~fill if fill_kept else fill).bool().expand(p.shape)
        dsm = ds.masked_fill(filled, 0.0)
    dq = sq_ * (dsm @ k_sd)
    dk = group_sum(sk_ * (dsm.transpose(-1, -2) @ q), k.transpose(-1, -2) if kt else k)
    return dq, (dk.transpose(-1, -2) if kt else dk), dv, ds


def ref_conv(dy, y, x, w, cv, gamma, mean, inv_std, strides, pads, dilations, group, relu):
    import torch
    d = dy * (y > 0) if relu else dy
    sh = (1, -1, 1, 1)
    xhat = (cv - mean.view(sh)) * inv_std.view(sh)
    r = cv.shape[0] * cv.shape[2] * cv.shape[3]
    dbeta = d.sum((0, 2, 3))
    dgamma = (d * xhat).sum((0, 2, 3))
    dc = (gamma * inv_std / r).view(sh) * (r * d - dbeta.view(sh) - xhat * dgamma.view(sh))
    # asymmetric pads: pad X explicitly, then a symmetric-free conv
    pt, pl, pb, pr = pads
    xp = torch.nn.functional.pad(x, (pl, pr, pt, pb))
    dxp = torch.nn.grad.conv2d_input(xp.shape, w, dc, stride=strides, dilation=dilations, groups=group)
    dx = dxp[:, :, pt:pt + x.shape[2], pl:pl + x.shape[3]]
    dw = torch.nn.grad.conv2d_weight(xp, w.shape, dc, stride=strides, dilation=dilations, groups=group)
    return dx, dw, dc.sum((0, 2, 3)), dgamma, dbeta, dc


def ref_layer_norm(dy, x, gamma, mean, inv_std, dr=None):
    n = gamma.numel()
    d = dy.reshape(-1, n)
    xs = x.reshape(-1, n)
    mu = mean.reshape(-1, 1)
    rs = inv_std.reshape(-1, 1)
    xhat = (xs - mu) * rs
    g = d * gamma.reshape(1, n)
    dx = rs * (g - g.mean(1, keepdim=True) - xhat * (g * xhat).mean(1, keepdim=True))
    if dr is not None:
        dx = dx + dr.reshape(-1, n)
    return dx.reshape(x.shape), (d * xhat).sum(0).reshape(gamma.shape), d.sum(0).reshape(gamma.shape)


def ref_rms_norm(dy, x, gamma=None, dr=None, epsilon=1e-5):
    """torch autograd through the unfused forward x * rsqrt(mean(x^2) + eps) (* gamma)."""
    import torch
    xs = x.detach().clone().requires_grad_(True)
    g = None if gamma is None else gamma.detach().clone().requires_grad_(True)
    y = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + epsilon)
    if g is not None:
        y = y * g
    y.backward(dy)
    dx = xs.grad if dr is None else xs.grad + dr
    return dx, None if g is None else g.grad
