"""NumPy reference of LinearCrossEntropy (the oracle for its kernels), following its
contract.yaml: the plain formula on the whole [N, V] logits in float64."""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from fusecli.ops.reference import _fit, _s

NO_IGNORE = -(2 ** 63)
INT64_MAX = 2 ** 63 - 1


def linear_cross_entropy(h, w, bias=None, labels=None, row_weight=None, row_grad=None,
                         ignore_index=-100, reduction="mean", grad_scale=1.0, grad_seed=None,
                         wrap_negative=0, seq_start=0, seq_end=INT64_MAX, logit_scale=1.0,
                         logit_softcap=0.0, dw_add_index=None, dw_add_rows=None,
                         lp_row_grad=None, lp_row_reduce="sum", seq_index=None):
    """Returns (loss, dH, dW, dB, lp_row) as the contract defines them (wrap_negative: a label
    in [-V, 0) is the class V + label, ignore_index ignored first; reduction none: loss is each
    row's; lp_row [N]: each row's log-probabilities summed or averaged over the classes;
    seq_index [G]: row seq_index_g of each of H's G sequences of rows / G rows)."""
    full = h
    sliced = (int(seq_start), int(seq_end)) != (0, INT64_MAX)
    if sliced:  # the rows seq_start:seq_end of every sequence (H [..., S, D])
        if h.ndim < 3:
            raise ValueError("LinearCrossEntropy: seq_start / seq_end need H [..., S, D]")
        h = h[..., int(seq_start):int(seq_end), :]
    if seq_index is not None:  # row seq_index_g of sequence g (H's rows as [G, S, D])
        pos = np.asarray(seq_index).reshape(-1).astype(np.int64)
        seqs = full.reshape(pos.size, -1, full.shape[-1])
        s = seqs.shape[1]
        if sliced or np.any((pos < -s) | (pos >= s)):
            raise ValueError("LinearCrossEntropy: a seq_index entry is outside [-S, S)")
        pos = np.where(pos < 0, pos + s, pos)
        h = seqs[np.arange(pos.size), pos]
    d = h.shape[-1]
    h2 = h.astype(np.float64).reshape(-1, d)
    n, v = h2.shape[0], w.shape[0]
    lab = np.asarray(labels).reshape(-1).astype(np.int64)
    if lab.size != n:
        raise ValueError(f"LinearCrossEntropy: {lab.size} labels for {n} rows")
    z = h2 @ w.astype(np.float64).T
    if bias is not None:
        z = z + bias.astype(np.float64)
    z = z * float(logit_scale)
    cap = float(logit_softcap)
    if cap > 0:
        z = cap * np.tanh(z / cap)
    m = z.max(axis=1, keepdims=True) if v else np.zeros((n, 1))
    lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    valid = lab != ignore_index if row_weight is None else np.ones(n, bool)
    cls = np.where(lab < 0, lab + v, lab) if int(wrap_negative) else lab
    if np.any((cls[valid] < 0) | (cls[valid] >= v)):
        raise ValueError("LinearCrossEntropy: a label is outside "
                         + ("[-V, V)" if int(wrap_negative) else "[0, V)"))
    safe = np.where(valid, cls, 0)
    nll = lse - z[np.arange(n), safe]
    count = float(valid.sum())
    mean = _s(reduction) == "mean"
    with np.errstate(invalid="ignore", divide="ignore"):
        if row_weight is None:
            loss = nll[valid].sum() / (count if mean else 1.0)
            rows = np.where(valid, nll, 0.0)
            seed = 1.0 if grad_seed is None else float(np.asarray(grad_seed).reshape(-1)[0])
            c = valid * (float(grad_scale) * seed / (count if mean else 1.0))
        else:
            rw = row_weight.reshape(-1).astype(np.float64)
            loss = (rw * nll).sum() / (rw.sum() if mean else 1.0)
            rows = rw * nll
        if _s(reduction) == "none":  # each row's loss, shaped as the labels
            loss = rows.reshape(np.shape(labels))
        if row_grad is not None:
            c = row_grad.reshape(-1).astype(np.float64)
    lp = z - lse[:, None]
    a = 1.0 / v if _s(lp_row_reduce) == "mean" else 1.0
    lp_row = a * lp.sum(axis=1)  # [N]
    p = np.exp(lp)
    dz = p.copy()
    dz[np.arange(n), safe] -= 1.0
    dz *= np.asarray(c, np.float64)[:, None]
    if lp_row_grad is not None:  # a u_i on every log-probability: a u_i (1 - V softmax)
        u = a * np.asarray(lp_row_grad, np.float64).reshape(-1)[:, None]
        dz += u * (1.0 - v * p)
    dz *= float(logit_scale)  # d/d(H W^T + b)
    if cap > 0:
        dz *= 1.0 - (z / cap) ** 2
    f = h.dtype
    dh = (dz @ w.astype(np.float64)).reshape(h.shape).astype(f)
    if sliced:  # dH of the rows not read: 0
        dh_full = np.zeros(full.shape, f)
        dh_full[..., int(seq_start):int(seq_end), :] = dh
        dh = dh_full
    elif seq_index is not None:
        dh_full = np.zeros(seqs.shape, f)
        dh_full[np.arange(pos.size), pos] = dh
        dh = dh_full.reshape(full.shape)
    dw = dz.T @ h2
    if dw_add_index is not None:  # ScatterND(dW, index, rows){add}
        idx = np.asarray(dw_add_index).reshape(-1).astype(np.int64)
        if np.any((idx < -v) | (idx >= v)):
            raise ValueError("LinearCrossEntropy: a dw_add_index entry is outside [-V, V)")
        np.add.at(dw, np.where(idx < 0, idx + v, idx),
                  np.asarray(dw_add_rows, np.float64).reshape(idx.size, d))
    return (np.array(loss, f), dh, dw.astype(f),
            None if bias is None else dz.sum(axis=0).astype(f), lp_row.astype(f))


class Reference(OpRun):

    def _run(self, h, w, bias=None, labels=None, row_weight=None, row_grad=None, grad_seed=None,
             dw_add_index=None, dw_add_rows=None, lp_row_grad=None, seq_index=None,
             ignore_index=None,
             wrap_negative=None, reduction=None, grad_scale=None, logit_scale=None,
             logit_softcap=None, lp_row_reduce=None, chunk_rows=None, seq_start=None,
             seq_end=None):
        return _fit(self, linear_cross_entropy(
            h, w, bias, labels, row_weight, row_grad,
            -100 if ignore_index is None else ignore_index, reduction or "mean",
            1.0 if grad_scale is None else grad_scale, grad_seed, wrap_negative or 0,
            seq_start or 0, INT64_MAX if seq_end is None else seq_end,
            1.0 if logit_scale is None else logit_scale,
            0.0 if logit_softcap is None else logit_softcap, dw_add_index, dw_add_rows,
            lp_row_grad, lp_row_reduce or "sum", seq_index))
