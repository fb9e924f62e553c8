"""AttentionGrad's CUDA launchers (through fusecli/ops/gpu.py, torch device pointers) against torch on
random data. GPU machine only (tests/gpu/run_gpu_checks.sh); skipped elsewhere."""

from __future__ import annotations

import itertools

import pytest

from gpu_helpers import _seed, check_requested, close, rand, torch_or_skip

torch = torch_or_skip()  # skips this module where torch.cuda is unavailable
pytestmark = pytest.mark.gpu
from fusecli.ops.attention_grad.gpu import attention_grad, read_scalar, ref_attention  # noqa: E402


@pytest.mark.parametrize("kt", [0, 1])
@pytest.mark.parametrize("lead,sq,sk,d,dv", [((1,), 1, 1, 1, 1), ((3,), 17, 5, 8, 3),
                                             ((2, 3), 7, 33, 17, 16), ((2, 8), 256, 256, 64, 64)])
def test_attention_grad(kt, lead, sq, sk, d, dv):
    do, q, v = rand(*lead, sq, dv), rand(*lead, sq, d), rand(*lead, sk, dv)
    k = rand(*lead, d, sk) if kt else rand(*lead, sk, d)
    p = torch.softmax(torch.randn(*lead, sq, sk, device="cuda"), -1)
    s1, s2 = 1 / d ** 0.5, 0.7 / d ** 0.5
    got = attention_grad(do, q, k, v, p, s1, s2, kt)
    ref = ref_attention(do.double(), q.double(), k.double(), v.double(), p.double(), s1, s2, kt)
    for g, r, nm in zip(got, ref, "dQ dK dV".split()):
        close(g, r, 5e-4, nm)


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
    do, q = rand(*qb, sq, dv), rand(*qb, sq, d)
    k = rand(*kb, d, sk) if kt else rand(*kb, sk, d)
    v = rand(*vb, sk, dv)
    p = torch.softmax(torch.randn(*qb, sq, sk, device="cuda"), -1)
    mask = torch.rand(*qb, sq, sk, device="cuda") >= 0.3 if dropout else None
    ratio = 0.3 if dropout else 0.0
    got = attention_grad(do, q, k, v, p, 0.3, -0.7, kt, (1, 1, 1, 1), mask, ratio)
    ref = ref_attention(do.double(), q.double(), k.double(), v.double(), p.double(), 0.3, -0.7, kt,
                          mask, ratio)
    for g, r, nm in zip(got, ref, "dQ dK dV dS".split()):
        close(g, r, 5e-4, nm)


@pytest.mark.parametrize("want", [m for m in itertools.product([0, 1], repeat=4) if any(m)])
def test_attention_grad_optional_outputs_with_groups_and_dropout(want):
    do, q, k, v = rand(2, 4, 9, 6), rand(2, 4, 9, 8), rand(2, 2, 13, 8), rand(2, 2, 13, 6)
    p = torch.softmax(torch.randn(2, 4, 9, 13, device="cuda"), -1)
    mask = torch.rand(2, 4, 9, 13, device="cuda") >= 0.2
    got = attention_grad(do, q, k, v, p, 0.5, 0.5, 0, want, mask, 0.2)
    ref = ref_attention(do.double(), q.double(), k.double(), v.double(), p.double(), 0.5, 0.5, 0,
                          mask, 0.2)
    check_requested(want, got, ref, 5e-4)


@pytest.mark.parametrize("nan_guard", [0, 1])
@pytest.mark.parametrize("dropout", [0, 1])
def test_attention_grad_nan_rows(nan_guard, dropout):
    """Fully masked (NaN) rows of P: nan_guard=1 reads them as 0 for dV only; dS, dQ and dK keep
    the NaN where the reference has it."""
    do, q, k, v = rand(2, 4, 9, 6), rand(2, 4, 9, 8), rand(2, 2, 13, 8), rand(2, 2, 13, 6)
    p = torch.softmax(torch.randn(2, 4, 9, 13, device="cuda"), -1)
    p[0, 1, 3] = float("nan")
    p[1, :, 0] = float("nan")
    mask = torch.rand(2, 4, 9, 13, device="cuda") >= 0.2 if dropout else None
    ratio = 0.2 if dropout else 0.0
    got = attention_grad(do, q, k, v, p, 0.5, 0.5, 0, (1, 1, 1, 1), mask, ratio, nan_guard)
    ref = ref_attention(do.double(), q.double(), k.double(), v.double(), p.double(), 0.5, 0.5, 0,
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
    do, q, k, v = rand(2, 4, 9, 6), rand(2, 4, 9, 8), rand(2, 2, 13, 8), rand(2, 2, 13, 6)
    filled = torch.rand(*mshape, device="cuda") < 0.35
    filled.view(-1)[: mshape[-1]] = True  # the first mask row filled entirely
    full = filled.expand(2, 4, 9, 13)
    p = torch.softmax(torch.randn(2, 4, 9, 13, device="cuda").masked_fill(full, -3.4e38), -1)
    fill = ~filled if fill_kept else filled
    got = attention_grad(do, q, k, v, p, 0.5, 0.25, 0, want, fill=fill, fill_kept=fill_kept)
    ref = ref_attention(do.double(), q.double(), k.double(), v.double(), p.double(), 0.5, 0.25,
                          0, fill=fill, fill_kept=fill_kept)
    check_requested(want, got, ref, 5e-4)


def test_attention_grad_fill_mask_large():
    """A padded sequence at a real size (one block per row, 256 threads)."""
    do, q, k, v = rand(4, 16, 512, 64), rand(4, 16, 512, 64), rand(4, 16, 512, 64), \
        rand(4, 16, 512, 64)
    filled = torch.zeros(4, 1, 1, 512, dtype=torch.bool, device="cuda")
    filled[0, ..., 300:] = True
    filled[3] = True
    p = torch.softmax(torch.randn(4, 16, 512, 512, device="cuda").masked_fill(filled, -3.4e38), -1)
    got = attention_grad(do, q, k, v, p, 0.125, 0.125, 0, (1, 1, 1, 1), fill=filled)
    ref = ref_attention(do.double(), q.double(), k.double(), v.double(), p.double(), 0.125,
                          0.125, 0, fill=filled)
    check_requested((1, 1, 1, 1), got, ref, 5e-4)
    assert not got[0][3].any() and not got[1][3].any()


def test_attention_grad_rejects_dims_outside_the_group_rule():
    do, q, v = rand(2, 4, 9, 6), rand(2, 4, 9, 8), rand(2, 4, 13, 6)
    p = torch.softmax(torch.randn(2, 4, 9, 13, device="cuda"), -1)
    with pytest.raises(RuntimeError, match="cudaError 1$"):  # cudaErrorInvalidValue
        attention_grad(do, q, rand(2, 3, 13, 8), v, p)


def test_read_scalar():
    """fusecli_read_scalar (the CUDA kernel's read of a run-time scale tensor) copies the
    float back to the host."""
    t = torch.tensor([0.1234, 7.0], device="cuda")
    assert read_scalar(t) == torch.tensor(0.1234).item()
    assert read_scalar(t[1:]) == 7.0
