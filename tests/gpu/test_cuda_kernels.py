"""fusecli's CUDA launchers (through ctypes, torch device pointers) against torch on random data.
Skipped only when torch with CUDA is unavailable."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

try:
    import torch
    _HAVE_CUDA = torch.cuda.is_available()
except Exception:  # torch not installed: no CUDA either
    torch = None
    _HAVE_CUDA = False

if not _HAVE_CUDA:  # one skip for the module, not one per case
    pytest.skip("torch.cuda is unavailable (GPU machine only: tests/gpu/run_gpu_checks.sh)",
                allow_module_level=True)

import cuda_lib as L  # noqa: E402

ACTS = ["relu", "gelu", "gelu_tanh", "silu"]


def _close(got, ref, tol=2e-4, what=""):
    ref = ref.to(got.dtype)
    scale = max(1.0, ref.abs().max().item() if ref.numel() else 1.0)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def _check_requested(want, got, ref, tol=2e-4):
    """Each requested output matches its reference; each omitted one came back as None."""
    for wnt, g, r in zip(want, got, ref):
        assert (g is None) == (not wnt)
        if wnt:
            _close(g, r, tol)


def _rand(*shape, dtype=None, scale=1.0, gen=None):
    t = torch.randn(*shape, device="cuda", dtype=torch.float64, generator=gen) * scale
    t = torch.where(t.abs() < 1e-3, torch.full_like(t, 1e-3), t)
    return t.to(dtype or torch.float32)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape", [(1,), (3,), (17,), (5, 33), (1023, 1025)])
def test_activation_grad(act, dtype, shape):
    dt = getattr(torch, dtype)
    dy, x = _rand(*shape, dtype=dt), _rand(*shape, dtype=dt, scale=2.0)
    got = L.activation_grad(dy, x, act)
    ref = L.ref_act_grad(dy.double(), x.double(), act)
    _close(got, ref, 2e-4 if dt == torch.float32 else 1e-2, act)


def _quick_gelu_grad(dy, x, alpha):
    """dY * d/dx [x sigmoid(alpha x)] by torch autograd (float64): independent of the formula."""
    xg = x.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(xg * torch.sigmoid(alpha * xg), xg, dy)
    return g


@pytest.mark.parametrize("alpha", [1.702, 1.0, 0.5])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape", [(3,), (17,), (1023, 1025)])
def test_activation_grad_silu_alpha(alpha, dtype, shape):
    """silu at input scale alpha, x sigmoid(alpha x) (QuickGELU at 1.702), pre-activations up
    to |x| = 40 (the sigmoid saturates: e^-68 underflows far below float16)."""
    dt = getattr(torch, dtype)
    dy = _rand(*shape, dtype=dt)
    x = (torch.rand(*shape, device="cuda", dtype=torch.float64) * 80 - 40).to(dt)
    got = L.activation_grad(dy, x, "silu", alpha)
    ref = _quick_gelu_grad(dy.double(), x.double(), alpha)
    _close(got, ref, 2e-4 if dt == torch.float32 else 1e-2, f"silu alpha={alpha}")


@pytest.mark.parametrize("act", ACTS)
def test_activation_grad_alpha_is_the_input_scale(act):
    """Every activation at alpha is act'(alpha x)."""
    dy, x = _rand(5, 33), _rand(5, 33, scale=2.0)
    got = L.activation_grad(dy, x, act, 0.75)
    _close(got, L.ref_act_grad(dy.double(), 0.75 * x.double(), act), 2e-4, act)


@pytest.mark.parametrize("trans_w", [0, 1])
@pytest.mark.parametrize("dz", [None, "inplace"])
def test_linear_activation_grad_quick_gelu(trans_w, dz):
    dy, x, a = _rand(2, 37, 65), _rand(2, 37, 65, scale=4.0), _rand(2, 37, 24)
    w = _rand(*((24, 65) if trans_w else (65, 24)), scale=0.3)
    got = L.linear_activation_grad(dy, x, a, w, "silu", trans_w, dz=dz, alpha=1.702)
    dz_ref = _quick_gelu_grad(dy.double(), x.double(), 1.702)
    ref = L.ref_linear(dz_ref, x.double(), a.double(), w.double(), "identity", trans_w)
    for g, r, nm in zip(got, ref, "dA dW dB".split()):
        _close(g, r, 5e-4, nm)
    if dz:
        _close(got[3], dz_ref, 2e-4, "dZ")


@pytest.mark.parametrize("act", ACTS + ["identity"])
@pytest.mark.parametrize("trans_w", [0, 1])
@pytest.mark.parametrize("lead,n,k", [((1,), 1, 1), ((3,), 17, 5), ((2, 3), 17, 33), ((512,), 257, 384)])
def test_linear_activation_grad(act, trans_w, lead, n, k):
    dy, x, a = _rand(*lead, n), _rand(*lead, n, scale=2.0), _rand(*lead, k)
    w = _rand(*((k, n) if trans_w else (n, k)), scale=0.3)
    got = L.linear_activation_grad(dy, x, a, w, act, trans_w)
    ref = L.ref_linear(dy.double(), x.double(), a.double(), w.double(), act, trans_w)
    for g, r, nm in zip(got, ref, "dA dW dB".split()):
        _close(g, r, 5e-4, nm)


@pytest.mark.parametrize("act", ["gelu", "identity"])
@pytest.mark.parametrize("dz", ["out", "inplace"])
def test_linear_activation_grad_dz_output(act, dz):
    """Output 3 (dZ), separate or in dY's own buffer as onnxruntime's in-place plan may place it."""
    dy, x, a, w = _rand(33, 19), _rand(33, 19, scale=2.0), _rand(33, 11), _rand(19, 11)
    got = L.linear_activation_grad(dy, x, a, w, act, 0, dz=dz)
    ref = L.ref_linear(dy.double(), x.double(), a.double(), w.double(), act, 0)
    for g, r, nm in zip(got, ref, "dA dW dB".split()):
        _close(g, r, 5e-4, nm)
    _close(got[3], L.ref_act_grad(dy.double(), x.double(), act), 2e-4, "dZ")


@pytest.mark.parametrize("want", [m for m in itertools.product([0, 1], repeat=3) if any(m)])
def test_linear_activation_grad_optional(want):
    dy, x, a, w = _rand(9, 19), _rand(9, 19), _rand(9, 11), _rand(19, 11)
    got = L.linear_activation_grad(dy, x, a, w, "gelu", 0, want)
    ref = L.ref_linear(dy.double(), x.double(), a.double(), w.double(), "gelu", 0)
    _check_requested(want, got, ref)


@pytest.mark.parametrize("act", ACTS + ["identity"])
@pytest.mark.parametrize("trans_w,split_dx,dropout", [(0, 0, False), (1, 0, False), (1, 1, True),
                                                      (0, 1, False)])
@pytest.mark.parametrize("lead,n,k,r", [((1,), 1, 1, 1), ((3,), 17, 5, 2), ((2, 3), 17, 33, 4),
                                        ((512,), 257, 384, 16)])
def test_lora_linear_grad(act, trans_w, split_dx, dropout, lead, n, k, r):
    dy, x, a = _rand(*lead, n), _rand(*lead, n, scale=2.0), _rand(*lead, k)
    w = _rand(*((k, n) if trans_w else (n, k)), scale=0.3)
    la, lb = _rand(r, k, scale=0.3), _rand(n, r, scale=0.3)
    xd = (a * (torch.rand_like(a) > 0.3) / 0.7) if dropout else None
    h = ((a if xd is None else xd).double().reshape(-1, k) @ la.double().t()).float()
    h = h.reshape(*lead, r)
    got = L.lora_linear_grad(dy, x, a, w, la, lb, h, xd, act, 1.5, trans_w, split_dx)
    ref = L.ref_lora(dy.double(), x.double(), a.double(), w.double(), la.double(), lb.double(),
                     h.double(), None if xd is None else xd.double(), act, 1.5, trans_w, split_dx)
    for g, rf, nm in zip(got, ref, "dX dXa dLa dLb dW dB".split()):
        _close(g, rf, 5e-4, nm)


@pytest.mark.parametrize("want", [m for m in itertools.product([0, 1], repeat=5) if any(m)])
@pytest.mark.parametrize("dz", [None, "inplace"])
def test_lora_linear_grad_optional(want, dz):
    dy, x, a, w = _rand(9, 19), _rand(9, 19), _rand(9, 11), _rand(19, 11)
    la, lb = _rand(3, 11), _rand(19, 3)
    h = (a.double() @ la.double().t()).float()
    full = (want[0], 0, *want[1:])
    got = L.lora_linear_grad(dy, x, a, w, la, lb, h, None, "gelu", 2.0, 0, 0, full, dz=dz)
    ref = L.ref_lora(dy.double(), x.double(), a.double(), w.double(), la.double(), lb.double(),
                     h.double(), None, "gelu", 2.0, 0, 0)
    _check_requested(full, got[:6], ref)
    if dz:
        _close(got[6], L.ref_act_grad(dy.double(), x.double(), "gelu"), 2e-4, "dZ")


@pytest.mark.parametrize("kt", [0, 1])
@pytest.mark.parametrize("lead,sq,sk,d,dv", [((1,), 1, 1, 1, 1), ((3,), 17, 5, 8, 3),
                                             ((2, 3), 7, 33, 17, 16), ((2, 8), 256, 256, 64, 64)])
def test_attention_grad(kt, lead, sq, sk, d, dv):
    do, q, v = _rand(*lead, sq, dv), _rand(*lead, sq, d), _rand(*lead, sk, dv)
    k = _rand(*lead, d, sk) if kt else _rand(*lead, sk, d)
    p = torch.softmax(torch.randn(*lead, sq, sk, device="cuda"), -1)
    s1, s2 = 1 / d ** 0.5, 0.7 / d ** 0.5
    got = L.attention_grad(do, q, k, v, p, s1, s2, kt)
    ref = L.ref_attention(do.double(), q.double(), k.double(), v.double(), p.double(), s1, s2, kt)
    for g, r, nm in zip(got, ref, "dQ dK dV".split()):
        _close(g, r, 5e-4, nm)


# Grouped / multi-query attention, dropout, dS: (P's batch dims, K's, V's, Sq, Sk, D, Dv).
GQA = [((2, 4), (2, 1), (2, 1), 7, 11, 8, 5),              # one kv head (MQA)
       ((2, 4), (2, 2), (2, 2), 9, 13, 8, 6),              # repeat_kv grouping
       ((2, 4), (2, 2), (2, 1), 5, 12, 4, 7),              # V grouped apart from K
       ((3, 4), (1, 4), (4,), 6, 9, 5, 3),                 # K shared by the batch (expand path)
       ((2, 6), (1, 3), (2, 2), 5, 7, 4, 4),               # every dim grouped differently
       ((3, 2), (), (1, 1), 4, 6, 3, 2),                   # one [Sk, D] matrix
       ((2, 32), (2, 8), (2, 8), 256, 256, 64, 64)]        # Llama-style GQA at a real size


@pytest.mark.parametrize("kt", [0, 1])
@pytest.mark.parametrize("dropout", [0, 1])
@pytest.mark.parametrize("qb,kb,vb,sq,sk,d,dv", GQA)
def test_attention_grad_groups_dropout_ds(kt, dropout, qb, kb, vb, sq, sk, d, dv):
    do, q = _rand(*qb, sq, dv), _rand(*qb, sq, d)
    k = _rand(*kb, d, sk) if kt else _rand(*kb, sk, d)
    v = _rand(*vb, sk, dv)
    p = torch.softmax(torch.randn(*qb, sq, sk, device="cuda"), -1)
    mask = torch.rand(*qb, sq, sk, device="cuda") >= 0.3 if dropout else None
    ratio = 0.3 if dropout else 0.0
    got = L.attention_grad(do, q, k, v, p, 0.3, -0.7, kt, (1, 1, 1, 1), mask, ratio)
    ref = L.ref_attention(do.double(), q.double(), k.double(), v.double(), p.double(), 0.3, -0.7, kt,
                          mask, ratio)
    for g, r, nm in zip(got, ref, "dQ dK dV dS".split()):
        _close(g, r, 5e-4, nm)


@pytest.mark.parametrize("want", [m for m in itertools.product([0, 1], repeat=4) if any(m)])
def test_attention_grad_optional_outputs_with_groups_and_dropout(want):
    do, q, k, v = _rand(2, 4, 9, 6), _rand(2, 4, 9, 8), _rand(2, 2, 13, 8), _rand(2, 2, 13, 6)
    p = torch.softmax(torch.randn(2, 4, 9, 13, device="cuda"), -1)
    mask = torch.rand(2, 4, 9, 13, device="cuda") >= 0.2
    got = L.attention_grad(do, q, k, v, p, 0.5, 0.5, 0, want, mask, 0.2)
    ref = L.ref_attention(do.double(), q.double(), k.double(), v.double(), p.double(), 0.5, 0.5, 0,
                          mask, 0.2)
    _check_requested(want, got, ref, 5e-4)


@pytest.mark.parametrize("nan_guard", [0, 1])
@pytest.mark.parametrize("dropout", [0, 1])
def test_attention_grad_nan_rows(nan_guard, dropout):
    """Fully masked (NaN) rows of P: nan_guard=1 reads them as 0 for dV only; dS, dQ and dK keep
    the NaN where the reference has it."""
    do, q, k, v = _rand(2, 4, 9, 6), _rand(2, 4, 9, 8), _rand(2, 2, 13, 8), _rand(2, 2, 13, 6)
    p = torch.softmax(torch.randn(2, 4, 9, 13, device="cuda"), -1)
    p[0, 1, 3] = float("nan")
    p[1, :, 0] = float("nan")
    mask = torch.rand(2, 4, 9, 13, device="cuda") >= 0.2 if dropout else None
    ratio = 0.2 if dropout else 0.0
    got = L.attention_grad(do, q, k, v, p, 0.5, 0.5, 0, (1, 1, 1, 1), mask, ratio, nan_guard)
    ref = L.ref_attention(do.double(), q.double(), k.double(), v.double(), p.double(), 0.5, 0.5, 0,
                          mask, ratio, nan_guard)
    for g, r, nm in zip(got, ref, "dQ dK dV dS".split()):
        r = r.to(g.dtype)
        scale = max(1.0, r.nan_to_num(0.0).abs().max().item())
        torch.testing.assert_close(g, r, rtol=5e-4, atol=5e-4 * scale, equal_nan=True,
                                   msg=lambda m: f"{nm}: {m}")
    assert bool(torch.isfinite(got[2]).all()) == bool(nan_guard)


# fill masks broadcast to P [2, 4, 9, 13]: key padding, 2-D (query x key), causal, per row
FILL_SHAPES = [(2, 1, 1, 13), (2, 1, 9, 13), (9, 13), (2, 4, 9, 1), (2, 4, 9, 13)]


@pytest.mark.parametrize("fill_kept", [0, 1])
@pytest.mark.parametrize("want", [(1, 1, 1, 1), (1, 1, 1), (0, 0, 0, 1), (0, 1, 0, 1)])
@pytest.mark.parametrize("mshape", FILL_SHAPES)
def test_attention_grad_fill_mask(mshape, want, fill_kept):
    """The fill mask (masked_fill / GPT-2's where): rows filled entirely (P uniform there), dQ and
    dK read dS as 0 where filled, the dS output is the softmax gradient before the zeroing."""
    do, q, k, v = _rand(2, 4, 9, 6), _rand(2, 4, 9, 8), _rand(2, 2, 13, 8), _rand(2, 2, 13, 6)
    filled = torch.rand(*mshape, device="cuda") < 0.35
    filled.view(-1)[: mshape[-1]] = True  # the first mask row filled entirely
    full = filled.expand(2, 4, 9, 13)
    p = torch.softmax(torch.randn(2, 4, 9, 13, device="cuda").masked_fill(full, -3.4e38), -1)
    fill = ~filled if fill_kept else filled
    got = L.attention_grad(do, q, k, v, p, 0.5, 0.25, 0, want, fill=fill, fill_kept=fill_kept)
    ref = L.ref_attention(do.double(), q.double(), k.double(), v.double(), p.double(), 0.5, 0.25,
                          0, fill=fill, fill_kept=fill_kept)
    _check_requested(want, got, ref, 5e-4)


def test_attention_grad_fill_mask_large():
    """A padded sequence at a real size (one block per row, 256 threads)."""
    do, q, k, v = _rand(4, 16, 512, 64), _rand(4, 16, 512, 64), _rand(4, 16, 512, 64), \
        _rand(4, 16, 512, 64)
    filled = torch.zeros(4, 1, 1, 512, dtype=torch.bool, device="cuda")
    filled[0, ..., 300:] = True
    filled[3] = True
    p = torch.softmax(torch.randn(4, 16, 512, 512, device="cuda").masked_fill(filled, -3.4e38), -1)
    got = L.attention_grad(do, q, k, v, p, 0.125, 0.125, 0, (1, 1, 1, 1), fill=filled)
    ref = L.ref_attention(do.double(), q.double(), k.double(), v.double(), p.double(), 0.125,
                          0.125, 0, fill=filled)
    _check_requested((1, 1, 1, 1), got, ref, 5e-4)
    assert not got[0][3].any() and not got[1][3].any()


def test_attention_grad_rejects_dims_outside_the_group_rule():
    do, q, v = _rand(2, 4, 9, 6), _rand(2, 4, 9, 8), _rand(2, 4, 13, 6)
    p = torch.softmax(torch.randn(2, 4, 9, 13, device="cuda"), -1)
    with pytest.raises(RuntimeError, match="cudaError 1$"):  # cudaErrorInvalidValue
        L.attention_grad(do, q, _rand(2, 3, 13, 8), v, p)


CONV = [
    (1, 1, 1, 1, 1, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 1),
    (2, 3, 7, 9, 4, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1), 1),
    (3, 4, 11, 10, 6, 3, 2, (2, 1), (1, 0, 2, 1), (2, 1), 2),
    (2, 6, 9, 9, 6, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 6),
    (2, 8, 8, 8, 16, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 1),
    (8, 32, 28, 28, 64, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 1),
]


def _conv_inputs(n, cin, hin, win, c, kh, kw, strides, pads, dil, group):
    x = _rand(n, cin, hin, win)
    w = _rand(c, cin // group, kh, kw, scale=0.5)
    h = (hin + pads[0] + pads[2] - dil[0] * (kh - 1) - 1) // strides[0] + 1
    wd = (win + pads[1] + pads[3] - dil[1] * (kw - 1) - 1) // strides[1] + 1
    cv = _rand(n, c, h, wd, scale=1.5) + 0.2
    mean = cv.mean((0, 2, 3))
    inv_std = 1 / torch.sqrt(cv.var((0, 2, 3), unbiased=False) + 1e-5)
    gamma = _rand(c).abs() + 0.5
    y = torch.relu(_rand(n, c, h, wd))
    return _rand(n, c, h, wd), y, x, w, cv, gamma, mean, inv_std


@pytest.mark.parametrize("relu", [1, 0])
@pytest.mark.parametrize("case", CONV)
def test_conv_bn_relu_grad(case, relu):
    *dims, strides, pads, dil, group = case
    ins = _conv_inputs(*dims, strides, pads, dil, group)
    got = L.conv_bn_relu_grad(*ins, strides, pads, dil, group, relu)
    ref = L.ref_conv(*(t.double() for t in ins), strides, pads, dil, group, relu)
    for g, r, nm in zip(got, ref, "dX dW dBc dGamma dBeta".split()):
        _close(g, r, 1e-3, nm)


@pytest.mark.parametrize("dc", [None, "out", "inplace"])
@pytest.mark.parametrize("want", [(1, 1, 1, 1, 1), (0, 1, 1, 1, 1), (1, 1, 0, 1, 1),
                                  (0, 0, 0, 1, 1), (1, 0, 0, 0, 0), (0, 0, 0, 0, 0)])
def test_conv_bn_relu_grad_optional(want, dc):
    """Any subset of outputs, plus output 5 (dC) separate or in dY's own buffer as
    onnxruntime's in-place plan may place it."""
    *dims, strides, pads, dil, group = CONV[1]
    ins = _conv_inputs(*dims, strides, pads, dil, group)
    got = L.conv_bn_relu_grad(*ins, strides, pads, dil, group, 1, want, dc=dc)
    ref = L.ref_conv(*(t.double() for t in ins), strides, pads, dil, group, 1)
    _check_requested(list(want) + ([1] if dc else []), got, ref, 1e-3)


@pytest.mark.parametrize("dtype,stats", [("float32", "float32"), ("float16", "float32"), ("float16", "float16")])
@pytest.mark.parametrize("with_dr", [True, False])
@pytest.mark.parametrize("m,n", [(1, 1), (3, 17), (10, 33), (1, 1023), (4096, 1024), (257, 8192)])
def test_layer_norm_grad(dtype, stats, with_dr, m, n):
    dt, st = getattr(torch, dtype), getattr(torch, stats)
    x = _rand(m, n, dtype=dt, scale=2.0)
    x64 = x.double()
    mean = x64.mean(1)
    inv_std = 1 / torch.sqrt(x64.var(1, unbiased=False) + 1e-5)
    dy, gamma = _rand(m, n, dtype=dt), _rand(n, dtype=dt)
    dr = _rand(m, n, dtype=dt) if with_dr else None
    got = L.layer_norm_grad(dy, x, gamma, mean.to(st), inv_std.to(st), dr)
    ref = L.ref_layer_norm(dy.double(), x64, gamma.double(), mean.to(st).double(),
                           inv_std.to(st).double(), None if dr is None else dr.double())
    tol = 5e-4 if dt == torch.float32 else 2e-2
    for g, r, nm in zip(got, ref, "dX dGamma dBeta".split()):
        _close(g, r, tol, nm)


def test_layer_norm_grad_optional_outputs():
    x = _rand(5, 67)
    mean, inv_std = x.mean(1), 1 / torch.sqrt(x.var(1, unbiased=False) + 1e-5)
    dy, gamma = _rand(5, 67), _rand(67)
    for want in [(1, 0, 0), (0, 1, 1), (1, 1, 0)]:
        got = L.layer_norm_grad(dy, x, gamma, mean, inv_std, None, want)
        ref = L.ref_layer_norm(dy.double(), x.double(), gamma.double(), mean.double(), inv_std.double())
        _check_requested(want, got, ref)


@pytest.mark.parametrize("dtype,stats", [("float32", "float32"), ("float16", "float32"),
                                         ("float16", "float16"), ("float32", None)])
@pytest.mark.parametrize("with_dr,with_gamma", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("m,n", [(1, 1), (3, 17), (10, 33), (1, 1023), (4096, 1024), (257, 8192)])
def test_rms_norm_grad(dtype, stats, with_dr, with_gamma, m, n):
    """stats None: inv_rms absent, recomputed from X and epsilon."""
    dt = getattr(torch, dtype)
    eps = 1e-6
    x = _rand(m, n, dtype=dt, scale=2.0)
    x64 = x.double()
    inv_rms = torch.rsqrt(x64.pow(2).mean(1) + eps)
    dy = _rand(m, n, dtype=dt)
    gamma = _rand(n, dtype=dt) if with_gamma else None
    dr = _rand(m, n, dtype=dt) if with_dr else None
    got = L.rms_norm_grad(dy, x, gamma, None if stats is None else inv_rms.to(getattr(torch, stats)),
                          dr, (1, 1 if with_gamma else 0), eps)
    ref = L.ref_rms_norm(dy.double(), x64, None if gamma is None else gamma.double(),
                         None if dr is None else dr.double(), eps)
    tol = 5e-4 if dt == torch.float32 else 2e-2
    _close(got[0], ref[0], tol, "dX")
    if with_gamma:
        _close(got[1], ref[1], tol, "dGamma")


def test_rms_norm_grad_optional_outputs():
    x, dy, gamma = _rand(5, 67, scale=2.0), _rand(5, 67), _rand(67)
    inv_rms = torch.rsqrt(x.pow(2).mean(1) + 1e-5)
    ref = L.ref_rms_norm(dy.double(), x.double(), gamma.double())
    for want in [(1, 0), (0, 1)]:
        got = L.rms_norm_grad(dy, x, gamma, inv_rms, None, want)
        _check_requested(want, got, ref)
