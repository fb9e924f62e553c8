"""A NumPy model of the tensor-core kernels of FlashAttention / FlashAttentionGrad (cuda.cu,
flash_mma.cuh), for the CPU tests: the warp's fragment index math exactly as the CUDA code
computes it (which lane loads which shared-memory element into which register), the mma
instruction as the PTX ISA documents its fragment layouts (written separately below, so a
mismatch between the two shows as a wrong product), the tile loops, masking, tile skipping and
the online softmax. Lanes are vectorised: an array of 32 per register. Also the split-TF32
arithmetic ("3xTF32") and its error.

Precision modes: "f32" (split TF32), "tf32" (one TF32 product), "f16", "bf16"."""

from __future__ import annotations

import numpy as np

LANE = np.arange(32)
G, T = LANE >> 2, LANE & 3  # PTX: groupID, threadID_in_group
SKIP_BIAS, MASKED_ROW = np.float32(-1e30), np.float32(-5e29)
PAD = {"f32": 4, "tf32": 4, "f16": 8, "bf16": 8}


# --- element types ---------------------------------------------------------------------------
def tf32(x):
    """cvt.rna.tf32.f32: keep 10 mantissa bits, round to nearest, ties away from zero."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


def bf16(x):
    """float32 -> bfloat16 (round to nearest even), returned as float32."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


def to_type(x, mode):
    """A value stored in the kernel's shared-memory element type (as float32)."""
    x = np.asarray(x, np.float32)
    if mode == "f16":
        return x.astype(np.float16).astype(np.float32)
    if mode == "bf16":
        return bf16(x)
    return x


# --- the PTX ISA's fragment layouts (row, col) of register slot i, per lane ---------------------
def doc_a(mode, i):
    if mode in ("f32", "tf32"):  # m16n8k8 .tf32: a0 (g, t) a1 (g+8, t) a2 (g, t+4) a3 (g+8, t+4)
        return G + 8 * (i % 2), T + 4 * (i // 2)
    # m16n8k16 .f16/.bf16 a0..a7: rows g (i < 2 or 4 <= i < 6) else g+8; cols 2t + (i & 1) (+8
    # for i >= 4)
    return G + 8 * (1 if i in (2, 3, 6, 7) else 0), 2 * T + (i & 1) + 8 * (i >= 4)


def doc_b(mode, i):
    if mode in ("f32", "tf32"):  # b0 (t, g) b1 (t+4, g)
        return T + 4 * i, G
    return 2 * T + (i & 1) + 8 * (i >= 2), G  # b0..b3


def doc_c(i):  # c0 (g, 2t) c1 (g, 2t+1) c2 (g+8, 2t) c3 (g+8, 2t+1)
    return G + 8 * (i >= 2), 2 * T + (i & 1)


def mma(mode, c, a_slots, b_slots):
    """The instruction: C (4 slots x 32 lanes, float32) += A B with A and B rebuilt from the
    register slots by the documented layouts; exact products, float32 sum per instruction."""
    kk = 8 if mode in ("f32", "tf32") else 16
    A = np.full((16, kk), np.nan)
    B = np.full((kk, 8), np.nan)
    for i, s in enumerate(a_slots):
        r, col = doc_a(mode, i)
        A[r, col] = s
    for i, s in enumerate(b_slots):
        r, col = doc_b(mode, i)
        B[r, col] = s
    assert not np.isnan(A).any() and not np.isnan(B).any(), "a fragment slot left unset"
    D = A @ B
    out = c.copy()
    for i in range(4):
        r, col = doc_c(i)
        out[i] = (c[i].astype(np.float64) + D[r, col]).astype(np.float32)
    return out


# --- warp_gemm as flash_mma.cuh computes its indices --------------------------------------------
def warp_gemm(mode, c, a, a_off, lda, b, b_off, ldb, kdim, bn):
    """c [NT, 4, 32] += A B for one warp; a, b flat shared-memory arrays (float32 values of the
    element type), A(r, k) = a[a_off + r lda + k]; B(k, n) = b[b_off + n ldb + k] if bn else
    b[b_off + k ldb + n]."""
    nt = c.shape[0]
    c = c.copy()
    if mode in ("f32", "tf32"):
        for k0 in range(0, kdim, 8):
            ax = [a[a_off + G * lda + k0 + T], a[a_off + (G + 8) * lda + k0 + T],
                  a[a_off + G * lda + k0 + T + 4], a[a_off + (G + 8) * lda + k0 + T + 4]]
            ab = [tf32(x) for x in ax]
            as_ = [tf32(x - y) for x, y in zip(ax, ab)]
            for n in range(nt):
                col = n * 8 + G
                if bn:
                    bx = [b[b_off + col * ldb + k0 + T], b[b_off + col * ldb + k0 + T + 4]]
                else:
                    bx = [b[b_off + (k0 + T) * ldb + col], b[b_off + (k0 + T + 4) * ldb + col]]
                bb = [tf32(x) for x in bx]
                if mode == "f32":
                    bs = [tf32(x - y) for x, y in zip(bx, bb)]
                    c[n] = mma(mode, c[n], as_, bb)
                    c[n] = mma(mode, c[n], ab, bs)
                c[n] = mma(mode, c[n], ab, bb)
        return c
    assert lda % 2 == 0 and ldb % 2 == 0
    for k0 in range(0, kdim, 16):
        af = []
        for r in range(4):  # 32-bit word ((g + 8 (r & 1)) lda + k0 + 2t + 8 (r >> 1)) >> 1
            idx = a_off + (G + 8 * (r & 1)) * lda + k0 + 2 * T + 8 * (r >> 1)
            assert (idx % 2 == 0).all()
            af += [a[idx], a[idx + 1]]  # low half, high half
        for n in range(nt):
            col = n * 8 + G
            bf = []
            for r in range(2):
                k = k0 + 2 * T + 8 * r
                if bn:
                    idx = b_off + col * ldb + k
                    assert (idx % 2 == 0).all()
                    bf += [b[idx], b[idx + 1]]
                else:
                    bf += [b[b_off + k * ldb + col], b[b_off + (k + 1) * ldb + col]]
            c[n] = mma(mode, c[n], af, bf)
    return c


def c_row(e):
    return G + 8 * (e >> 1)


def c_col(e):
    return 2 * T + (e & 1)


def quad(v, op):
    """The value reduced over each quad of lanes (4 g .. 4 g + 3), for every lane."""
    return np.repeat(op(v.reshape(8, 4), axis=1), 4)


def dp_bucket(d):
    for b in (32, 64, 96, 128, 256):
        if d <= b:
            return b
    return 0


def load_tile(rows, dp, ld, src, nr, n, mode):
    """A [rows, dp] tile (leading dimension ld) of src[:nr, :n], zero elsewhere, flat."""
    t = np.zeros((rows, ld), np.float32)
    t[:nr, :n] = to_type(src[:nr, :n], mode)
    return t.ravel()


def bias_at(bias, b, i, j):
    """Bias entries (broadcast [B, Sq, Sk] array or None) at item b, rows i, keys j."""
    return 0.0 if bias is None else bias[b][i, j]


# --- the kernels --------------------------------------------------------------------------------
def forward(q, k, v, bias, scale, mode, kv_of=lambda b: b):
    """flash_fwd_tc: q [B, Sq, D], k [Bk, Sk, D], v [Bk, Sk, Dv], bias [B, Sq, Sk] or None.
    Returns O [B, Sq, Dv] and LSE [B, Sq] (float32)."""
    B, sq, d = q.shape
    sk, dv = k.shape[1], v.shape[2]
    dp = dp_bucket(max(d, dv))
    ts = 4 if mode in ("f32", "tf32") else 2
    br, nw = 64, 4
    bc = 32 if (ts == 4 and dp >= 128) or dp >= 256 else 64
    ld, ldp = dp + PAD[mode], bc + PAD[mode]
    o = np.zeros((B, sq, dv), np.float32)
    lse = np.zeros((B, sq), np.float32)
    f = np.float32
    for b in range(B):
        c = kv_of(b)
        for i0 in range(0, sq, br):
            nr = min(br, sq - i0)
            qs = load_tile(br, dp, ld, q[b, i0:], nr, d, mode)
            state = {}
            for pass_ in range(2):
                skip = pass_ == 0 and bias is not None
                skipped = False
                m = {w: [np.full(32, -np.inf, f), np.full(32, -np.inf, f)] for w in range(nw)}
                l_ = {w: [np.zeros(32, f), np.zeros(32, f)] for w in range(nw)}
                acc = {w: np.zeros((dp // 8, 4, 32), f) for w in range(nw)}
                for j0 in range(0, sk, bc):
                    nc = min(bc, sk - j0)
                    if skip and not (bias[b][i0:i0 + nr, j0:j0 + nc] > SKIP_BIAS).any():
                        skipped = True
                        continue
                    ks = load_tile(bc, dp, ld, k[c, j0:], nc, d, mode)
                    vs = load_tile(bc, dp, ld, v[c, j0:], nc, dv, mode)
                    for w in range(nw):
                        s = warp_gemm(mode, np.zeros((bc // 8, 4, 32), f), qs, w * 16 * ld, ld,
                                      ks, 0, ld, dp, True)
                        mx = [np.full(32, -np.inf, f), np.full(32, -np.inf, f)]
                        for n in range(bc // 8):
                            for e in range(4):
                                i = i0 + w * 16 + c_row(e)
                                j = j0 + n * 8 + c_col(e)
                                x = np.full(32, -np.inf, f)
                                ok = j < sk
                                x[ok] = s[n, e][ok] * f(scale)
                                if bias is not None:
                                    ib = ok & (i < sq)
                                    x[ib] += bias[b][i[ib], j[ib]]
                                s[n, e] = x
                                mx[e >> 1] = np.maximum(mx[e >> 1], x)
                        corr = []
                        for h in range(2):
                            mn = np.maximum(m[w][h], quad(mx[h], np.max))
                            fin = mn != -np.inf
                            with np.errstate(invalid="ignore"):
                                cr = np.where(fin, np.exp(m[w][h] - mn), f(1))
                            corr.append(cr.astype(f))
                            m[w][h] = np.where(fin, mn, m[w][h])
                        pw = np.zeros(16 * ldp, np.float32)
                        sm = [np.zeros(32, f), np.zeros(32, f)]
                        for n in range(bc // 8):
                            for e in range(4):
                                h = e >> 1
                                with np.errstate(invalid="ignore"):
                                    p = np.where(m[w][h] == -np.inf, f(0),
                                                 np.exp(s[n, e] - m[w][h])).astype(f)
                                sm[h] += p
                                pw[c_row(e) * ldp + n * 8 + c_col(e)] = to_type(p, mode)
                        for h in range(2):
                            l_[w][h] = (l_[w][h] * corr[h] + quad(sm[h], np.sum)).astype(f)
                        for e in range(4):
                            acc[w][:, e] *= corr[e >> 1]
                        acc[w] = warp_gemm(mode, acc[w], pw, 0, ldp, vs, 0, ld, bc, False)
                state = (m, l_, acc)
                if not skipped:
                    break
                low = any(((i0 + w * 16 + G + 8 * h < sq) & ~(m[w][h] > MASKED_ROW)).any()
                          for w in range(nw) for h in range(2))
                if not low:
                    break
            m, l_, acc = state
            for w in range(nw):
                for n in range(dp // 8):
                    for e in range(4):
                        h = e >> 1
                        i = i0 + w * 16 + c_row(e)
                        col = n * 8 + c_col(e)
                        ok = (i < sq) & (col < dv)
                        with np.errstate(invalid="ignore", divide="ignore"):
                            val = np.where(l_[w][h] > 0, acc[w][n, e] / l_[w][h], np.nan)
                        o[b, i[ok], col[ok]] = to_type(val[ok], mode)
                for h in range(2):
                    i = i0 + w * 16 + G + 8 * h
                    ok = (i < sq) & (T == 0)
                    with np.errstate(divide="ignore", invalid="ignore"):
                        val = np.where(l_[w][h] > 0, m[w][h] + np.log(l_[w][h]), np.nan)
                    lse[b, i[ok]] = val[ok]
    return o, lse


def _rows(do, o, q, k, lse, bias, scale, kv_of):
    """flash_rows: D = rowsum(dO O) and the masked-row renormalisation."""
    B, sq, _ = q.shape
    drow = (do.astype(np.float64) * o).sum(-1).astype(np.float32)
    ps = np.ones((B, sq), np.float32)
    for b in range(B):
        for i in range(sq):
            li = lse[b, i]
            if np.isfinite(li) and not li > MASKED_ROW:
                s = scale * (q[b, i].astype(np.float32) @ k[kv_of(b)].T.astype(np.float32))
                if bias is not None:
                    s = s + bias[b][i]
                ps[b, i] = 1.0 / np.exp(s - li).sum()
    return drow, ps


def backward(do, q, k, v, o, lse, bias, scale, mode, kv_of=lambda b: b, group=None):
    """flash_bwd_dkv_tc and flash_bwd_dq_tc (MODE 3 for dp <= 128, 1 and 2 for 256): dQ, dK,
    dV (float32 values of the element type). group: kv item -> its query items."""
    B, sq, d = q.shape
    Bk, sk, dv = k.shape[0], k.shape[1], v.shape[2]
    if group is None:
        group = {c: [b for b in range(B) if kv_of(b) == c] for c in range(Bk)}
    dp = dp_bucket(max(d, dv))
    ts = 4 if mode in ("f32", "tf32") else 2
    nw = 2 if dp >= 256 else 4
    rows_blk, bq = 16 * nw, 32
    bc = 32 if (ts == 4 and dp >= 128) or dp >= 256 else 64
    ld, ldq, ldc = dp + PAD[mode], bq + PAD[mode], bc + PAD[mode]
    f = np.float32
    drow, psc = _rows(do, o, q, k, lse, bias, scale, kv_of)
    dq = np.zeros(q.shape, np.float32)
    dk = np.zeros(k.shape, np.float32)
    dvo = np.zeros(v.shape, np.float32)
    # dK / dV
    for c in range(Bk):
        for j0 in range(0, sk, rows_blk):
            nc = min(rows_blk, sk - j0)
            ks = load_tile(rows_blk, dp, ld, k[c, j0:], nc, d, mode)
            vs = load_tile(rows_blk, dp, ld, v[c, j0:], nc, dv, mode)
            adv = {w: np.zeros((dp // 8, 4, 32), f) for w in range(nw)}
            adk = {w: np.zeros((dp // 8, 4, 32), f) for w in range(nw)}
            for b in group[c]:
                for i0 in range(0, sq, bq):
                    nr = min(bq, sq - i0)
                    ls, ds_, pss = (np.zeros(bq, f) for _ in range(3))
                    ls[:nr], ds_[:nr], pss[:nr] = lse[b, i0:i0 + nr], drow[b, i0:i0 + nr], \
                        psc[b, i0:i0 + nr]
                    if bias is not None:
                        bt = bias[b][i0:i0 + nr, j0:j0 + nc]
                        li = ls[:nr, None]
                        zero = (bt <= SKIP_BIAS) & np.isfinite(li) & (li > MASKED_ROW)
                        if zero.all():
                            continue
                    qs = load_tile(bq, dp, ld, q[b, i0:], nr, d, mode)
                    dos = load_tile(bq, dp, ld, do[b, i0:], nr, dv, mode)
                    for w in range(nw):
                        st = warp_gemm(mode, np.zeros((bq // 8, 4, 32), f), ks, w * 16 * ld, ld,
                                       qs, 0, ld, dp, True)
                        dpt = warp_gemm(mode, np.zeros((bq // 8, 4, 32), f), vs, w * 16 * ld, ld,
                                        dos, 0, ld, dp, True)
                        pw = np.zeros(16 * ldq, np.float32)
                        dw = np.zeros(16 * ldq, np.float32)
                        for n in range(bq // 8):
                            for e in range(4):
                                col = n * 8 + c_col(e)
                                key = j0 + w * 16 + c_row(e)
                                i = i0 + col
                                ok = (key < sk) & (col < nr)
                                p = np.zeros(32, f)
                                ds = np.zeros(32, f)
                                x = st[n, e][ok] * f(scale)
                                if bias is not None:
                                    x = x + bias[b][i[ok], key[ok]]
                                with np.errstate(invalid="ignore"):
                                    p[ok] = np.exp(x - ls[col[ok]]) * pss[col[ok]]
                                    ds[ok] = p[ok] * (dpt[n, e][ok] - ds_[col[ok]])
                                pw[c_row(e) * ldq + col] = to_type(p, mode)
                                dw[c_row(e) * ldq + col] = to_type(ds, mode)
                        adv[w] = warp_gemm(mode, adv[w], pw, 0, ldq, dos, 0, ld, bq, False)
                        adk[w] = warp_gemm(mode, adk[w], dw, 0, ldq, qs, 0, ld, bq, False)
            for w in range(nw):
                for e in range(4):
                    key = j0 + w * 16 + c_row(e)
                    for n in range(dp // 8):
                        col = n * 8 + c_col(e)
                        ok = (key < sk) & (col < dv)
                        dvo[c, key[ok], col[ok]] = to_type(adv[w][n, e][ok], mode)
                        ok = (key < sk) & (col < d)
                        dk[c, key[ok], col[ok]] = to_type(f(scale) * adk[w][n, e][ok], mode)
    # dQ
    for b in range(B):
        c = kv_of(b)
        for i0 in range(0, sq, rows_blk):
            nr = min(rows_blk, sq - i0)
            qs = load_tile(rows_blk, dp, ld, q[b, i0:], nr, d, mode)
            dos = load_tile(rows_blk, dp, ld, do[b, i0:], nr, dv, mode)
            acc = {w: np.zeros((dp // 8, 4, 32), f) for w in range(nw)}
            for j0 in range(0, sk, bc):
                nc = min(bc, sk - j0)
                if bias is not None:
                    bt = bias[b][i0:i0 + nr, j0:j0 + nc]
                    li = lse[b, i0:i0 + nr, None]
                    if ((bt <= SKIP_BIAS) & np.isfinite(li) & (li > MASKED_ROW)).all():
                        continue
                ks = load_tile(bc, dp, ld, k[c, j0:], nc, d, mode)
                vs = load_tile(bc, dp, ld, v[c, j0:], nc, dv, mode)
                for w in range(nw):
                    s = warp_gemm(mode, np.zeros((bc // 8, 4, 32), f), qs, w * 16 * ld, ld, ks, 0,
                                  ld, dp, True)
                    dpm = warp_gemm(mode, np.zeros((bc // 8, 4, 32), f), dos, w * 16 * ld, ld, vs,
                                    0, ld, dp, True)
                    dw = np.zeros(16 * ldc, np.float32)
                    for n in range(bc // 8):
                        for e in range(4):
                            i = i0 + w * 16 + c_row(e)
                            j = j0 + n * 8 + c_col(e)
                            ok = (i < sq) & (j < sk)
                            ds = np.zeros(32, f)
                            x = s[n, e][ok] * f(scale)
                            if bias is not None:
                                x = x + bias[b][i[ok], j[ok]]
                            with np.errstate(invalid="ignore"):
                                ds[ok] = np.exp(x - lse[b, i[ok]]) * psc[b, i[ok]] * (
                                    dpm[n, e][ok] - drow[b, i[ok]])
                            dw[c_row(e) * ldc + n * 8 + c_col(e)] = to_type(ds, mode)
                    acc[w] = warp_gemm(mode, acc[w], dw, 0, ldc, ks, 0, ld, bc, False)
            for w in range(nw):
                for n in range(dp // 8):
                    for e in range(4):
                        i = i0 + w * 16 + c_row(e)
                        col = n * 8 + c_col(e)
                        ok = (i < sq) & (col < d)
                        dq[b, i[ok], col[ok]] = to_type(f(scale) * acc[w][n, e][ok], mode)
    return dq, dk, dvo
