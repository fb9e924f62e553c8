"""LinearCrossEntropy's CUDA launcher (through fusecli/ops/gpu.py) against torch autograd in
float64, on shapes that cross the chunk edges (chunk_rows 16: rows not a multiple of it, a chunk
whose every token is ignored). GPU machine only (tests/gpu/run_gpu_checks.sh); skipped
elsewhere."""

from __future__ import annotations

import pytest

from gpu_helpers import _seed, close, rand, torch_or_skip  # noqa: F401

torch = torch_or_skip()  # skips this module where torch.cuda is unavailable
pytestmark = pytest.mark.gpu

from fusecli.ops.linear_cross_entropy.gpu import linear_cross_entropy, ref_lce  # noqa: E402


@pytest.mark.parametrize("ndv", [(1, 4, 3), (37, 8, 11), (64, 16, 300), (70, 32, 1000)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy(ndv, with_bias, reduction):
    n, d, v = ndv
    h, w = rand(n, d), rand(v, d) * 0.5
    bias = rand(v) if with_bias else None
    lab = torch.randint(0, v, (n,), device="cuda")
    if n >= 32:
        lab[16:32] = -100
    got = linear_cross_entropy(h, w, bias, lab, reduction=reduction, grad_scale=0.5,
                               chunk_rows=16)
    ref = ref_lce(h, w, bias, lab, reduction=reduction, grad_scale=0.5)
    for g, r, nm in zip(got, ref, ["loss", "dH", "dW", "dB"]):
        if r is not None:
            close(g, r, 2e-4, nm)


@pytest.mark.parametrize("logit_scale,logit_softcap", [(0.25, 0.0), (2.0, 0.0), (1.0, 1.5)])
def test_linear_cross_entropy_logit_scale(logit_scale, logit_softcap):
    """Granite's / Cohere's logits times a constant (the op's logit_scale), Gemma 2's soft cap
    (logit_softcap)."""
    n, d, v = 70, 16, 300
    h, w, bias = rand(n, d), rand(v, d) * 0.5, rand(v)
    lab = torch.randint(0, v, (n,), device="cuda")
    lab[16:32] = -100
    got = linear_cross_entropy(h, w, bias, lab, chunk_rows=16, logit_scale=logit_scale,
                               logit_softcap=logit_softcap)
    ref = ref_lce(h, w, bias, lab, logit_scale=logit_scale, logit_softcap=logit_softcap)
    for g, r, nm in zip(got, ref, ["loss", "dH", "dW", "dB"]):
        close(g, r, 2e-4, nm)


def test_linear_cross_entropy_dw_add_rows():
    """A tied embedding's rows added into dW by the op (negative classes from the end, a class
    twice): dW + index_add of the rows, in float64 torch."""
    n, d, v, m = 70, 16, 300, 40
    h, w, bias = rand(n, d), rand(v, d) * 0.5, rand(v)
    lab = torch.randint(0, v, (n,), device="cuda")
    idx = torch.randint(-v, v, (m,), device="cuda")
    idx[-1] = idx[0]
    rows = rand(m, d)
    got = linear_cross_entropy(h, w, bias, lab, chunk_rows=16, dw_add_index=idx,
                               dw_add_rows=rows)
    ref = ref_lce(h, w, bias, lab)
    dw = ref[2].double().index_add(0, torch.where(idx < 0, idx + v, idx), rows.double())
    for g, r, nm in zip(got, (ref[0], ref[1], dw.to(ref[2].dtype), ref[3]),
                        ["loss", "dH", "dW", "dB"]):
        close(g, r, 2e-4, nm)


def test_linear_cross_entropy_row_weight_and_row_grad():
    n, d, v = 50, 8, 40
    h, w = rand(n, d), rand(v, d) * 0.5
    lab = torch.randint(0, v, (n,), device="cuda")
    keep = torch.rand(n, device="cuda") > 0.3
    mf = keep.float()
    g = mf / mf.sum()
    got = linear_cross_entropy(h, w, None, torch.where(keep, lab, 0), mf, g, chunk_rows=16)
    ref = ref_lce(h, w, None, torch.where(keep, lab, -100))
    for x, r, nm in zip(got[:3], ref[:3], ["loss", "dH", "dW"]):
        close(x, r, 2e-4, nm)


@pytest.mark.parametrize("seed", [-1.5, 0.0, 3.25])
def test_linear_cross_entropy_split_with_grad_seed(seed):
    """The two ops of a loss gradient computed from the loss (rules/lce_*.yaml _split): the
    loss alone, then the gradients alone from grad_seed (a device tensor), the logits
    recomputed chunk by chunk."""
    n, d, v = 70, 32, 1000
    h, w, bias = rand(n, d), rand(v, d) * 0.5, rand(v)
    lab = torch.randint(0, v, (n,), device="cuda")
    lab[16:32] = -100
    loss = linear_cross_entropy(h, w, bias, lab, chunk_rows=16, want=(1, 0, 0, 0))
    assert loss[1] is None and loss[2] is None and loss[3] is None
    grads = linear_cross_entropy(h, w, bias, lab, chunk_rows=16, want=(0, 1, 1, 1),
                                 grad_seed=torch.tensor([seed], device="cuda"))
    assert grads[0] is None
    ref = ref_lce(h, w, bias, lab, grad_scale=seed)
    close(loss[0], ref[0], 2e-4, "loss")
    for g, r, nm in zip(grads[1:], ref[1:], ["dH", "dW", "dB"]):
        close(g, r, 2e-4, nm)


@pytest.mark.parametrize("rw", [False, True])
def test_linear_cross_entropy_wrap_negative(rw):
    """torch-joint's labels in [-V, 0) (rules/lce_torch.yaml sets wrap_negative): the class
    V + label, as onnxruntime's GatherElements reads it; -100 is still ignored first (V > 100
    makes it a label in [-V, 0) too); with row_weight (the rule's spelling) likewise."""
    n, d, v = 70, 16, 300
    h, w, bias = rand(n, d), rand(v, d) * 0.5, rand(v)
    lab = torch.randint(-v, v, (n,), device="cuda")
    lab[::5] = -100
    keep = lab != -100
    wrapped = torch.where(keep, lab % v, lab)
    if rw:
        mf = keep.float()
        got = linear_cross_entropy(h, w, bias, torch.where(keep, lab, 0), mf, mf / mf.sum(),
                                   chunk_rows=16, wrap_negative=1)
    else:
        got = linear_cross_entropy(h, w, bias, lab, chunk_rows=16, wrap_negative=1)
    ref = ref_lce(h, w, bias, wrapped)
    for g, r, nm in zip(got, ref, ["loss", "dH", "dW", "dB"]):
        close(g, r, 2e-4, nm)


@pytest.mark.parametrize("lp_row_reduce", ["mean", "sum"])
def test_linear_cross_entropy_lp_row_is_label_smoothing(lp_row_reduce):
    """Label smoothing 0.1 as a torch-joint graph feeds the op: row_grad (1 - eps) mask / count,
    lp_row_grad -eps a mask / count (a = 1 for the rows' mean of log-probabilities, 1 / V for
    their sum), the loss (1 - eps) loss + eps a mean(-lp_row) over the kept rows: against
    F.cross_entropy(label_smoothing=0.1) in float64."""
    n, d, v, eps = 70, 16, 300, 0.1
    h, w, bias = rand(n, d), rand(v, d) * 0.5, rand(v)
    lab = torch.randint(0, v, (n,), device="cuda")
    keep = torch.rand(n, device="cuda") > 0.3
    mf = keep.float()
    a = 1.0 if lp_row_reduce == "mean" else 1.0 / v
    got = linear_cross_entropy(h, w, bias, torch.where(keep, lab, 0), mf,
                               (1 - eps) * mf / mf.sum(), chunk_rows=16,
                               lp_row_grad=-eps * a * mf / mf.sum(), lp_row_reduce=lp_row_reduce)
    ref = ref_lce(h, w, bias, torch.where(keep, lab, -100), label_smoothing=eps)
    loss = (1 - eps) * got[0] + eps * a * (-(got[4] * mf).sum() / mf.sum())
    for x, r, nm in zip((loss,) + tuple(got[1:4]), ref, ["loss", "dH", "dW", "dB"]):
        close(x, r, 2e-4, nm)


@pytest.mark.parametrize("gs", [(3, 40), (70, 9), (1, 300)])
def test_linear_cross_entropy_seq_index_pools_one_row_per_sequence(gs):
    """A sequence classifier's last-token pooling (rules/_lce_pool_torch.yaml): H's rows as G
    sequences of S, the op reading row seq_index[g] of each (a negative one from the end):
    the op on those rows, dH 0 elsewhere, against float64 torch on the gathered rows."""
    g, s = gs
    d, v = 16, 5
    h, w = rand(g * s, d), rand(v, d) * 0.5
    pos = torch.randint(-s, s, (g,), device="cuda")
    lab = torch.randint(0, v, (g,), device="cuda")
    got = linear_cross_entropy(h, w, None, lab, chunk_rows=16, seq_index=pos)
    rows = torch.arange(g, device="cuda") * s + torch.where(pos < 0, pos + s, pos)
    ref = ref_lce(h[rows], w, None, lab)
    dh = torch.zeros_like(h, dtype=ref[1].dtype)
    dh[rows] = ref[1]
    for x, r, nm in zip(got[:3], (ref[0], dh, ref[2]), ["loss", "dH", "dW"]):
        close(x, r, 2e-4, nm)
