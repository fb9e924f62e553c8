"""FlashAttentionGrad's CUDA launchers (with FlashAttention for O and LSE; through
fusecli/ops/gpu.py) against torch autograd in float64: the tensor-core dK / dV and dQ tiles at
every tile edge (S and D not multiples of the tile, S = 1, one key, fully masked rows, GQA
groups, head dims 32 .. 256, causal + additive bias, K transposed) in float32 (split TF32),
TF32, float16 and bfloat16, and the one-row-per-block fallback. GPU machine only
(tests/gpu/run_gpu_checks.sh); skipped elsewhere."""

from __future__ import annotations

import pytest

from gpu_helpers import _seed, close, rand, torch_or_skip

torch = torch_or_skip()  # skips this module where torch.cuda is unavailable
pytestmark = pytest.mark.gpu

from fusecli.ops.flash_attention.gpu import flash_attention  # noqa: E402
from fusecli.ops.flash_attention_grad.gpu import (flash_attention_grad,  # noqa: E402
                                                  ref_attention_grad)

TOL = {"fp32": 1e-5, "tf32": 5e-3, "float16": 5e-3, "bfloat16": 3e-2}


@pytest.fixture(autouse=True)
def _tc_path(monkeypatch):
    """The float32 launchers take the tensor-core kernels only under FUSECLI_FLASH_PATH=tc (opt-in
    until measured on a GPU); the tests run that path (test_simt_fallback the default one)."""
    monkeypatch.setenv("FUSECLI_FLASH_PATH", "tc")


def _causal(sq, sk, dtype=torch.float32, fill=-1e30):
    return torch.full((sq, sk), fill, device="cuda", dtype=dtype).triu(1 + sk - sq)


def _check(q, k, v, do, bias, scale, tol, k_transposed=0, tf32=0, want=(1, 1, 1)):
    kk = k.transpose(-1, -2).contiguous() if k_transposed else k
    o, lse = flash_attention(q, kk, v, bias, scale, k_transposed, tf32=tf32)
    got = flash_attention_grad(do, q, kk, v, o, lse, bias, scale, k_transposed, want, tf32=tf32)
    ref = list(ref_attention_grad(do, q, k, v, bias, scale))
    if k_transposed:
        ref[1] = ref[1].transpose(-1, -2)
    for g, r_, w_, name in zip(got, ref, want, "QKV"):
        assert (g is None) == (not w_)
        if w_:
            close(g.double(), r_, tol, f"d{name}")


@pytest.mark.parametrize("shape", [(1, 2, 1, 8), (2, 3, 65, 16), (1, 2, 129, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_grad(shape, causal):
    b, h, s, d = shape
    q, k, v, do = rand(*shape), rand(*shape), rand(*shape), rand(*shape)
    _check(q, k, v, do, _causal(s, s) if causal else None, d ** -0.5, TOL["fp32"])


@pytest.mark.parametrize("d", [32, 80, 96, 128, 256])
def test_head_dims(d):
    q, k, v, do = (rand(1, 2, 75, d) for _ in range(4))
    _check(q, k, v, do, _causal(75, 75), d ** -0.5, TOL["fp32"])


@pytest.mark.parametrize("sq,sk", [(1, 130), (50, 1), (70, 33)])
def test_rectangular_and_one_key(sq, sk):
    q, k, v, do = rand(2, 2, sq, 48), rand(2, 2, sk, 48), rand(2, 2, sk, 40), rand(2, 2, sq, 40)
    _check(q, k, v, do, rand(sq, sk), 0.2, TOL["fp32"])


@pytest.mark.parametrize("hk", [1, 2])
def test_grouped_heads(hk):
    q, do = rand(2, 8, 70, 64), rand(2, 8, 70, 64)
    k, v = rand(2, hk, 70, 64), rand(2, hk, 70, 64)
    _check(q, k, v, do, _causal(70, 70), 0.125, TOL["fp32"])


def test_k_transposed_bias_and_partial_outputs():
    q, k, v, do = (rand(1, 4, 90, 64) for _ in range(4))
    bias = rand(1, 4, 90, 90) + _causal(90, 90)
    _check(q, k, v, do, bias, 0.125, TOL["fp32"], k_transposed=1)
    _check(q, k, v, do, bias, 0.125, TOL["fp32"], want=(0, 1, 0))
    _check(q, k, v, do, bias, 0.125, TOL["fp32"], want=(1, 0, 1))


def test_fully_masked_row():
    """A row masked with finfo.min everywhere: the original's uniform softmax and its
    gradients (the masked-row renormalisation), tiles skipped elsewhere."""
    sq, sk = 100, 150
    q, k, v, do = rand(1, 2, sq, 64), rand(1, 2, sk, 64), rand(1, 2, sk, 64), rand(1, 2, sq, 64)
    bias = _causal(sq, sk)
    bias[3] = torch.finfo(torch.float32).min
    _check(q, k, v, do, bias, 0.125, TOL["fp32"])


def test_tf32_mode():
    q, k, v, do = (rand(1, 2, 100, 64) for _ in range(4))
    _check(q, k, v, do, _causal(100, 100), 0.125, TOL["tf32"], tf32=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,hk", [((1, 2, 1, 8), 2), ((2, 4, 77, 64), 2),
                                      ((1, 2, 130, 128), 1), ((1, 2, 65, 256), 2)])
def test_half_types(dtype, shape, hk):
    b, h, s, d = shape
    q, do = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype)
    k, v = rand(b, hk, s, d, dtype=dtype), rand(b, hk, s, d, dtype=dtype)
    bias = _causal(s, s, dtype, float("-inf"))
    o, lse = flash_attention(q, k, v, bias, d ** -0.5)
    got = flash_attention_grad(do, q, k, v, o, lse, bias, d ** -0.5)
    tol = TOL[str(dtype).removeprefix("torch.")]
    for g, r_, name in zip(got, ref_attention_grad(do, q, k, v, bias, d ** -0.5), "QKV"):
        assert g.dtype == dtype
        close(g.double(), r_, tol, f"d{name}")


def test_simt_fallback(monkeypatch):
    q, k, v, do = (rand(1, 2, 70, 64) for _ in range(4))
    monkeypatch.setenv("FUSECLI_FLASH_PATH", "simt")  # the default kernels
    _check(q, k, v, do, _causal(70, 70), 0.125, 1e-5)
    monkeypatch.delenv("FUSECLI_FLASH_PATH")
    q, k, v, do = (rand(1, 1, 40, 300) for _ in range(4))
    _check(q, k, v, do, None, 0.05, 1e-5)


@pytest.mark.parametrize("path", ["tc", "simt"])
@pytest.mark.parametrize("kind", ["causal", "padding", "bias_after"])
def test_flash_attention_grad_bool_mask(kind, path, monkeypatch):
    """The bool mask's backward: Where's gradient (0 at filled positions; a fully masked row
    under finfo.min: uniform P for dV, zero dQ), against torch autograd of Where(mask, S, fill)
    [+ an additive padding bias]; a masked call never takes the tensor-core tiles."""
    if path == "simt":
        monkeypatch.delenv("FUSECLI_FLASH_PATH", raising=False)
    _seed(f"flash-grad-mask-{kind}")
    b, h, hk, sq, sk, d = 2, 4, 2, 70, 140, 32
    q, k, v, do = rand(b, h, sq, d), rand(b, hk, sk, d), rand(b, hk, sk, d), rand(b, h, sq, d)
    i = torch.arange(sq, device="cuda")[:, None] + (sk - sq)
    j = torch.arange(sk, device="cuda")[None, :]
    fmin = torch.finfo(torch.float32).min
    bias = None
    if kind == "padding":
        mask = torch.ones(b, 1, 1, sk, dtype=torch.bool, device="cuda")
        mask[0] = False
    else:
        mask = j <= i
    if kind == "bias_after":
        bias = torch.zeros(b, 1, 1, sk, device="cuda")
        bias[1, ..., sk // 2:] = fmin
    o, lse = flash_attention(q, k, v, bias, 0.2, mask=mask, fill=fmin)
    got = flash_attention_grad(do, q, k, v, o, lse, bias, 0.2, mask=mask, fill=fmin)
    ref = ref_attention_grad(do, q, k, v, bias, 0.2, mask=mask, fill=fmin)
    for g, r_, name in zip(got, ref, "QKV"):
        close(g.double(), r_, TOL["fp32"], f"d{name}")
    if kind == "padding":
        assert (got[0][0] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_softcap_forward_and_backward(causal):
    """Gemma 2's soft-capped scores (softcap: the float32-core kernels, whatever the path)
    against float64 torch autograd of c tanh(S / c) (+ mask)."""
    q, k, v, do = rand(2, 4, 70, 32) * 4, rand(2, 4, 90, 32), rand(2, 4, 90, 32), rand(2, 4, 70, 32)
    bias = _causal(70, 90) if causal else None
    o, lse = flash_attention(q, k, v, bias, 0.2, softcap=2.0)
    got = flash_attention_grad(do, q, k, v, o, lse, bias, 0.2, softcap=2.0)
    ref = ref_attention_grad(do, q, k, v, bias, 0.2, softcap=2.0)
    for g, r_, name in zip(got, ref, "QKV"):
        close(g.double(), r_, TOL["fp32"], f"d{name}")
