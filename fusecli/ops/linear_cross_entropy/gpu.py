"""LinearCrossEntropy on the GPU: its launcher called by parameter name (fusecli/ops/gpu.py), the
outputs allocated with torch, the torch reference and its timing case for
tests/gpu/bench_cuda.py."""

from __future__ import annotations

from fusecli.ops.gpu import launch


def linear_cross_entropy(h, w, bias, labels, row_weight=None, row_grad=None, ignore_index=-100,
                         reduction="mean", grad_scale=1.0, chunk_rows=0, want=(1, 1, 1, 1),
                         grad_seed=None, wrap_negative=0, logit_scale=1.0,
                         logit_softcap=0.0, dw_add_index=None, dw_add_rows=None,
                         lp_row_grad=None, lp_row_reduce=None, seq_index=None):
    """(loss, dH, dW, dB[, lp_row]), None where not wanted (dB also without a bias); grad_seed: a
    one-element device tensor or None; dw_add_index [M] int64, dw_add_rows [M, D]: rows added
    into dW at those classes; lp_row_reduce "sum" / "mean": lp_row is also returned (each row's
    log-probabilities reduced over the classes), lp_row_grad [N] its gradient; seq_index [G]
    int64: H's rows as G sequences, the op reading row seq_index[g] of each (labels [G])."""
    import torch

    d, v = h.shape[-1], w.shape[0]
    rows = h.numel() // d
    g = 0 if seq_index is None else seq_index.numel()
    n = g if seq_index is not None else rows
    loss = (torch.empty(labels.shape if reduction == "none" else (), device=h.device)
            if want[0] else None)
    dh = torch.empty_like(h) if want[1] else None
    dw = torch.empty_like(w) if want[2] else None
    db = torch.empty(v, device=h.device) if want[3] and bias is not None else None
    lp_row = torch.empty(n, device=h.device) if lp_row_reduce else None
    launch("fusecli_launch_linear_cross_entropy", h=h, w=w, bias=bias, labels=labels,
           row_weight=row_weight, row_grad=row_grad, grad_seed=grad_seed, loss=loss, dh=dh, dw=dw,
           db=db, n=n, v=v, d=d, ignore_index=ignore_index, wrap_negative=int(wrap_negative),
           reduction={"mean": 0, "sum": 1, "none": 2}[reduction], grad_scale=grad_scale,
           logit_scale=logit_scale, logit_softcap=logit_softcap, chunk_rows=chunk_rows,
           groups=g, seq=rows // g if g else 0, seq_start=0, seq_end=1 if g else 0,
           dw_add_index=dw_add_index,
           dw_add_rows=dw_add_rows,
           dw_add_count=0 if dw_add_index is None else dw_add_index.numel(),
           lp_row_grad=lp_row_grad, lp_row=lp_row, lp_row_mean=int(lp_row_reduce == "mean"),
           seq_index=seq_index)
    return (loss, dh, dw, db) + ((lp_row,) if lp_row_reduce else ())


def ref_lce(h, w, bias, labels, ignore_index=-100, reduction="mean", grad_scale=1.0,
            logit_scale=1.0, logit_softcap=0.0, label_smoothing=0.0):
    """(loss, dH, dW, dB) with torch autograd in float64 (logits = logit_scale (H W^T + b),
    then soft-capped at logit_softcap when > 0; F.cross_entropy's label_smoothing)."""
    import torch

    hh = h.double().reshape(-1, h.shape[-1]).detach().requires_grad_()
    ww = w.double().detach().requires_grad_()
    bb = None if bias is None else bias.double().detach().requires_grad_()
    z = (hh @ ww.t() + (0 if bb is None else bb)) * logit_scale
    if logit_softcap > 0:
        z = torch.tanh(z / logit_softcap) * logit_softcap
    loss = torch.nn.functional.cross_entropy(z, labels, ignore_index=ignore_index,
                                             reduction=reduction, label_smoothing=label_smoothing)
    (loss * grad_scale).backward()
    return (loss.detach(), hh.grad.reshape(h.shape), ww.grad,
            None if bb is None else bb.grad)


def unfused_lce(h, w, bias, labels):
    """The unfused pair in torch at the inputs' precision: logits = H W^T (+ b), cross-entropy,
    autograd backward: (loss, dH, dW, dB)."""
    import torch

    hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
    bb = None if bias is None else bias.detach().requires_grad_()
    z = hh @ ww.t() + (0 if bb is None else bb)
    loss = torch.nn.functional.cross_entropy(z, labels)
    loss.backward()
    return loss.detach(), hh.grad, ww.grad, None if bb is None else bb.grad


def bench(add, r):
    """Issue 34's table: a Llama-3 LM head and its loss, 4096 tokens, D 2048, vocabulary 128256."""
    import torch

    n, d, v = 4096, 2048, 128256
    h, w = r(n, d), r(v, d) * 0.02
    lab = torch.randint(0, v, (n,), device=h.device)
    add("LinearCrossEntropy", [n, d, v],
        lambda: linear_cross_entropy(h, w, None, lab),
        lambda: unfused_lce(h, w, None, lab),
        (2 * h.numel() + 3 * w.numel()) * 4, None, flops=3 * 2 * n * d * v,
        tf32=lambda: unfused_lce(h, w, None, lab))
