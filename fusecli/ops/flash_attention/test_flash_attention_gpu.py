"""FlashAttention's CUDA launchers (through fusecli/ops/gpu.py) against torch in float64: the
tensor-core tiles at every tile edge (S and D not multiples of the tile, S = 1, one key, fully
masked rows, GQA groups, head dims 32 .. 256, causal + additive bias, K transposed) in float32
(split TF32, 1e-5), TF32, float16 and bfloat16, and the one-row-per-block fallback. GPU machine
only (tests/gpu/run_gpu_checks.sh); skipped elsewhere."""

from __future__ import annotations

import pytest

from gpu_helpers import _seed, close, rand, torch_or_skip

torch = torch_or_skip()  # skips this module where torch.cuda is unavailable
pytestmark = pytest.mark.gpu

from fusecli.ops.flash_attention.gpu import flash_attention, ref_attention  # noqa: E402

# tolerance (relative to the reference's largest entry) per element type / mode
TOL = {"fp32": 1e-5, "tf32": 5e-3, "float16": 3e-3, "bfloat16": 2e-2}


@pytest.fixture(autouse=True)
def _tc_path(monkeypatch):
    """The float32 launchers take the tensor-core kernels only under FUSECLI_FLASH_PATH=tc (opt-in
    until measured on a GPU); the tests run that path (test_simt_fallback the default one)."""
    monkeypatch.setenv("FUSECLI_FLASH_PATH", "tc")


def _causal(sq, sk, dtype=torch.float32, fill=-1e30):
    return torch.full((sq, sk), fill, device="cuda", dtype=dtype).triu(1 + sk - sq)


def _check(q, k, v, bias, scale, tol, k_transposed=0, tf32=0):
    kk = k.transpose(-1, -2).contiguous() if k_transposed else k
    o, lse = flash_attention(q, kk, v, bias, scale, k_transposed, tf32=tf32)
    ro, rl = ref_attention(q, k, v, bias, scale)
    close(o.double(), ro, tol, "O")
    close(lse.double(), rl, tol, "LSE")


@pytest.mark.parametrize("shape", [(1, 2, 1, 8), (2, 3, 65, 16), (1, 2, 129, 64), (1, 1, 200, 33)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_forward(shape, causal):
    b, h, s, d = shape
    q, k, v = rand(*shape), rand(*shape), rand(*shape)
    _check(q, k, v, _causal(s, s) if causal else None, d ** -0.5, TOL["fp32"])


@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(d, causal):
    q, k, v = rand(1, 2, 77, d), rand(1, 2, 77, d), rand(1, 2, 77, d)
    _check(q, k, v, _causal(77, 77) if causal else None, d ** -0.5, TOL["fp32"])


@pytest.mark.parametrize("sq,sk", [(1, 130), (50, 1), (70, 33), (33, 200)])
def test_rectangular_and_one_key(sq, sk):
    q, k, v = rand(2, 2, sq, 48), rand(2, 2, sk, 48), rand(2, 2, sk, 40)  # Dv != D
    _check(q, k, v, None, 0.2, TOL["fp32"])
    _check(q, k, v, rand(sq, sk), 0.2, TOL["fp32"])  # an additive bias of [Sq, Sk]


@pytest.mark.parametrize("hk", [1, 2])
def test_grouped_heads(hk):
    q = rand(2, 8, 70, 64)
    k, v = rand(2, hk, 70, 64), rand(2, hk, 70, 64)
    _check(q, k, v, _causal(70, 70), 0.125, TOL["fp32"])


def test_k_transposed_and_alibi_bias():
    q, k, v = rand(1, 4, 90, 64), rand(1, 4, 90, 64), rand(1, 4, 90, 64)
    bias = rand(1, 4, 90, 90) + _causal(90, 90)  # per-head bias plus a causal mask
    _check(q, k, v, bias, 0.125, TOL["fp32"], k_transposed=1)


def test_fully_masked_rows():
    """A row masked with finfo.min everywhere gets the uniform softmax (as the original
    Softmax); a row of -inf gets NaN in O and LSE; skipping masked tiles changes neither."""
    sq, sk = 100, 150
    q, k, v = rand(1, 2, sq, 64), rand(1, 2, sk, 64), rand(1, 2, sk, 64)
    bias = _causal(sq, sk)
    fmin = torch.finfo(torch.float32).min
    bias[3] = fmin
    bias[70] = float("-inf")
    o, lse = flash_attention(q, k, v, bias, 0.125)
    ro, rl = ref_attention(q, k, v, bias, 0.125)
    assert torch.isnan(o[:, :, 70]).all() and torch.isnan(lse[:, :, 70]).all()
    keep = torch.ones(sq, dtype=torch.bool, device="cuda")
    keep[70] = False
    close(o[:, :, keep].double(), ro[:, :, keep], TOL["fp32"], "O")
    close(o[:, :, 3].double(), v.double().mean(-2), TOL["fp32"], "uniform row")
    assert (lse[:, :, 3] == fmin).all()  # fmin + log(Sk) rounds to fmin in float32
    keep[3] = False
    close(lse[:, :, keep].double(), rl[:, :, keep], TOL["fp32"], "LSE")


@pytest.mark.parametrize("d", [64, 128])
def test_tf32_mode(d):
    q, k, v = rand(1, 2, 100, d), rand(1, 2, 100, d), rand(1, 2, 100, d)
    _check(q, k, v, _causal(100, 100), d ** -0.5, TOL["tf32"], tf32=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,hk", [((1, 2, 1, 8), 2), ((2, 4, 77, 64), 2),
                                      ((1, 2, 130, 128), 2), ((1, 2, 65, 256), 1),
                                      ((1, 2, 90, 80), 2)])
def test_half_types(dtype, shape, hk):
    b, h, s, d = shape
    q = rand(*shape, dtype=dtype)
    k, v = rand(b, hk, s, d, dtype=dtype), rand(b, hk, s, d, dtype=dtype)
    bias = _causal(s, s, dtype, float("-inf"))
    o, lse = flash_attention(q, k, v, bias, d ** -0.5)
    assert o.dtype == dtype and lse.dtype == torch.float32
    ro, rl = ref_attention(q, k, v, bias, d ** -0.5)
    tol = TOL[str(dtype).removeprefix("torch.")]
    close(o.double(), ro, tol, "O")
    close(lse.double(), rl, tol, "LSE")


def test_simt_fallback(monkeypatch):
    """FUSECLI_FLASH_PATH=simt and head dims above 256 run the one-row-per-block kernel."""
    q, k, v = rand(1, 2, 70, 64), rand(1, 2, 70, 64), rand(1, 2, 70, 64)
    monkeypatch.setenv("FUSECLI_FLASH_PATH", "simt")  # the default kernels
    _check(q, k, v, _causal(70, 70), 0.125, 1e-5)
    monkeypatch.delenv("FUSECLI_FLASH_PATH")
    q, k, v = rand(1, 1, 40, 300), rand(1, 1, 40, 300), rand(1, 1, 40, 300)
    _check(q, k, v, None, 0.05, 1e-5)


def _bool_mask(kind, b, sq, sk):
    """True = kept: causal [Sq, Sk], a 3-key sliding window [Sq, Sk], padding [B, 1, 1, Sk]
    (batch 0 fully padded: every row fully masked, uniform softmax under finfo.min)."""
    i = torch.arange(sq, device="cuda")[:, None] + (sk - sq)
    j = torch.arange(sk, device="cuda")[None, :]
    if kind == "causal":
        return j <= i
    if kind == "window":
        return (j <= i) & (j >= i - 2)
    pad = torch.ones(b, 1, 1, sk, dtype=torch.bool, device="cuda")
    pad[0] = False
    return pad


@pytest.mark.parametrize("path", ["tc", "simt"])
@pytest.mark.parametrize("fill_kept", [1, 0])
@pytest.mark.parametrize("kind", ["causal", "window", "padding"])
def test_flash_attention_bool_mask(kind, fill_kept, path, monkeypatch):
    """The bool mask (float32 only) on the float32-core kernels; with FUSECLI_FLASH_PATH=tc a
    masked call falls back to them (the tensor-core tiles take no mask)."""
    if path == "simt":
        monkeypatch.delenv("FUSECLI_FLASH_PATH", raising=False)
    _seed(f"flash-mask-{kind}-{fill_kept}")
    b, h, hk, sq, sk, d = 2, 4, 2, 70, 140, 32
    q, k, v = rand(b, h, sq, d), rand(b, hk, sk, d), rand(b, hk, sk, d)
    keep = _bool_mask(kind, b, sq, sk)
    mask = keep if fill_kept else ~keep
    fmin = torch.finfo(torch.float32).min
    o, lse = flash_attention(q, k, v, None, 0.2, mask=mask, fill=fmin, fill_kept=fill_kept)
    ro, rl = ref_attention(q, k, v, None, 0.2, mask=mask, fill=fmin, fill_kept=fill_kept)
    close(o.double(), ro, TOL["fp32"], "O")
    if kind != "padding":  # a fully masked row's LSE is finfo.min + log(Sk) = finfo.min
        close(lse.double(), rl, TOL["fp32"], "LSE")
    # -inf fill: a fully masked row is NaN, as onnxruntime's Softmax gives
    o, lse = flash_attention(q, k, v, None, 0.2, mask=mask, fill=float("-inf"),
                             fill_kept=fill_kept)
    if kind == "padding":
        assert torch.isnan(o[0]).all() and torch.isnan(lse[0]).all()
        assert torch.isfinite(o[1]).all()
    else:
        close(o.double(), ro, TOL["fp32"], "O (-inf fill)")


@pytest.mark.parametrize("guard", [1, 2])
def test_nan_guard_zeroes_whole_masked_rows_and_their_gradients_are_nan(guard):
    """nan_guard (1: TorchScript's sdpa NaN guard; 2: torch's _safe_softmax) on the float32
    cores: against the NumPy reference (fusecli/ops/flash_attention/test_nan_guard.py's oracle),
    rows 0..2 of batch 0 fully -inf (O 0, LSE +inf, dQ / dK NaN as the original's with 1, 0 with
    2; dV finite)."""
    import numpy as np

    from fusecli.ops.flash_attention.reference import flash_attention as ref_fwd
    from fusecli.ops.flash_attention_grad.gpu import flash_attention_grad
    from fusecli.ops.flash_attention_grad.reference import flash_attention_grad as ref_bwd

    q, k, v, do = (rand(2, 2, 70, 16) for _ in range(4))
    keep = torch.ones(2, 1, 70, 70, dtype=torch.bool, device="cuda").tril()
    keep[0, ..., :3] = False
    bias = torch.zeros(2, 1, 70, 70, device="cuda").masked_fill(~keep, float("-inf"))
    o, lse = flash_attention(q, k, v, bias, 0.25, nan_guard=guard)
    grads = flash_attention_grad(do, q, k, v, o, lse, bias, 0.25, nan_guard=guard)
    h = [t.cpu().numpy() for t in (q, k, v, do, bias)]
    ro, rl = ref_fwd(*h[:3], h[4], 0.25, nan_guard=guard)
    assert np.isposinf(lse.cpu().numpy()).sum() == 2 * 3 and np.isposinf(rl).sum() == 2 * 3
    close(o.double(), torch.from_numpy(ro).double().cuda(), TOL["fp32"], "O")
    for g, r, nm in zip(grads, ref_bwd(h[3], *h[:3], ro, rl, h[4], 0.25, nan_guard=guard),
                        ("dQ", "dK", "dV")):
        g = g.cpu().numpy()
        assert (np.isnan(g) == np.isnan(r)).all(), nm
        fin = ~np.isnan(r)
        close(torch.from_numpy(g[fin]).double(), torch.from_numpy(r[fin]).double(),
              TOL["fp32"], nm)
