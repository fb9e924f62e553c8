// LinearCrossEntropy: CPU kernel. Rows in chunks: Z = Hc W^T (+ b) on onnxruntime's MLAS, the
// row log-sum-exp (of the logits times logit_scale, soft-capped at logit_softcap), loss, lp_row and
// dZ = c (softmax - onehot) + a u (1 - V softmax) in place (threads over rows), then dHc = dZ W
// (MLAS) and dW += dZ^T Hc (Eigen, accumulating; threads over W's rows).
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "cpu_eigen.h"
#include "cpu_gemm.h"
#include "cpu_kernel.h"
#include "cpu_threads.h"
#include "lce_rows.h"

namespace fusecli {
namespace {

// attributes: ignore_index, wrap_negative, reduction, grad_scale, logit_scale, logit_softcap,
// lp_row_reduce, chunk_rows, seq_start, seq_end
struct LceKernel : CpuKernel<LceKernel, kLinearCrossEntropy> {
  template <typename TOp>
  LceKernel(const OrtKernelInfo* info, const TOp* op) : CpuKernel(info, op), mm(info) {
    FUSECLI_CHECK(reduction == "mean" || reduction == "sum" || reduction == "none",
                  "LinearCrossEntropy: reduction must be mean, sum or none");
    FUSECLI_CHECK(lp_row_reduce == "sum" || lp_row_reduce == "mean",
                  "LinearCrossEntropy: lp_row_reduce must be sum or mean");
  }
  void Compute(Ort::KernelContext& ctx);
  OrtMatMul mm;
};

// the class a label names: with wrap, a label in [-V, 0) counts from the end (as ONNX
// GatherElements and ScatterElements read a negative index); -1 where it names none
inline int64_t class_of(int64_t label, int64_t v, bool wrap) {
  const int64_t t = wrap && label < 0 ? label + v : label;
  return t >= 0 && t < v ? t : -1;
}

constexpr int64_t kChunkBytes = 32 << 20;  // a chunk's logits: at most 32 MiB (at least 16 rows)

void LceKernel::Compute(Ort::KernelContext& ctx) {
  In h = get_input(ctx, 0), w = get_input(ctx, 1), b = get_input(ctx, 2), lab = get_input(ctx, 3);
  In rw = get_input(ctx, 4), rg = get_input(ctx, 5), seed = get_input(ctx, 6);
  In add_i = get_input(ctx, 7), add_r = get_input(ctx, 8), ug = get_input(ctx, 9);
  In sidx = get_input(ctx, 10);
  FUSECLI_CHECK(!h.shape.empty() && w.shape.size() == 2,
                "LinearCrossEntropy: H needs rank >= 1, "
                "W must be [V, D]");
  const int64_t D = h.shape.back(), V = w.shape[0];
  FUSECLI_CHECK(w.shape[1] == D, "LinearCrossEntropy: W must be [V, D] with H's last dim D");
  const LceRows rows = lce_rows(h, D, seq_start, seq_end, sidx);
  const bool sliced = rows.sliced || rows.indexed;  // the rows read are packed first
  const int64_t S = rows.s, G = rows.g, N = rows.n, L = rows.s1 - rows.s0;
  // sliced: the first row read of each sequence (rows.s0, or its seq_index entry), L rows from it
  std::vector<int64_t> first(static_cast<size_t>(sliced ? G : 0), rows.s0);
  if (rows.indexed) {
    const int64_t* ip = sidx.ptr<int64_t>();
    for (int64_t g = 0; g < G; ++g) {
      FUSECLI_CHECK(ip[g] >= -S && ip[g] < S,
                    "LinearCrossEntropy: a seq_index entry is outside [-S, S) of its sequence");
      first[g] = ip[g] < 0 ? ip[g] + S : ip[g];
    }
  }
  FUSECLI_CHECK(lab.numel() == N, "LinearCrossEntropy: labels must have one entry per row of H");
  FUSECLI_CHECK(!b.present || b.numel() == V, "LinearCrossEntropy: bias must be [V]");
  FUSECLI_CHECK(!rw.present || rw.numel() == N, "LinearCrossEntropy: row_weight must be [N]");
  FUSECLI_CHECK(!rg.present || rg.numel() == N, "LinearCrossEntropy: row_grad must be [N]");
  FUSECLI_CHECK(!ug.present || ug.numel() == N, "LinearCrossEntropy: lp_row_grad must be [N]");
  FUSECLI_CHECK(V > 0 || N == 0, "LinearCrossEntropy: an empty vocabulary");
  FUSECLI_CHECK(!seed.present || seed.numel() == 1,
                "LinearCrossEntropy: grad_seed must hold one value");
  bool want_loss, want_dh, want_dw, want_db;
  const bool none = reduction == "none";  // loss: each row's, shaped as H's leading dims
  const std::vector<int64_t> loss_shape = none ? lab.shape : std::vector<int64_t>{};
  float* loss = output_or_null<float>(ctx, 0, loss_shape, &want_loss);
  float* dh = output_or_null<float>(ctx, 1, h.shape, &want_dh);
  float* dw = output_or_null<float>(ctx, 2, w.shape, &want_dw);
  float* db = output_or_null<float>(ctx, 3, {V}, &want_db);
  bool want_lp_row;
  float* lp_row = output_or_null<float>(ctx, 4, {N}, &want_lp_row);
  FUSECLI_CHECK(!want_lp_row || lp_row_labels_ok(lab),
                "LinearCrossEntropy: lp_row needs labels [N] or [N, 1]");
  FUSECLI_CHECK(!want_db || b.present, "LinearCrossEntropy: dB is requested but bias is absent");
  FUSECLI_CHECK(add_i.present == add_r.present && (!add_i.present || want_dw),
                "LinearCrossEntropy: dw_add_index and dw_add_rows go together, with dW");
  FUSECLI_CHECK(!add_i.present || add_r.numel() == add_i.numel() * D,
                "LinearCrossEntropy: dw_add_rows must hold D values per dw_add_index entry");
  if (want_dw) std::fill(dw, dw + V * D, 0.f);
  if (want_db) std::fill(db, db + V, 0.f);
  const float* hp = h.ptr<float>();
  std::vector<float> hsel, dhsel;  // sliced: the rows read, packed, and their dH
  if (sliced) {
    hsel.resize(static_cast<size_t>(N * D));
    for (int64_t g = 0; g < G; ++g)
      std::copy(hp + (g * S + first[g]) * D, hp + (g * S + first[g] + L) * D,
                hsel.data() + g * L * D);
    hp = hsel.data();
    if (want_dh) {
      std::fill(dh, dh + h.numel(), 0.f);
      dhsel.resize(static_cast<size_t>(N * D));
    }
  }
  float* dhp = sliced ? dhsel.data() : dh;
  const float* wp = w.ptr<float>();
  const float* bp = b.present ? b.ptr<float>() : nullptr;
  const int64_t* lp = lab.ptr<int64_t>();
  const float* rwp = rw.present ? rw.ptr<float>() : nullptr;
  const float* rgp = rg.present ? rg.ptr<float>() : nullptr;
  const float* ugp = ug.present ? ug.ptr<float>() : nullptr;
  const bool mean = reduction == "mean";
  // lp_row's reduction over the classes: a = 1 (sum) or 1 / V (mean)
  const float row_a =
      lp_row_reduce == "mean" ? 1.f / static_cast<float>(std::max<int64_t>(V, 1)) : 1.f;

  // tokens that count (without row_weight), and the labels' range
  double count = 0.0, wsum = 0.0;
  for (int64_t i = 0; i < N; ++i) {
    const bool valid = rwp || lp[i] != ignore_index;
    FUSECLI_CHECK(!valid || class_of(lp[i], V, wrap_negative) >= 0,
                  wrap_negative
                      ? "LinearCrossEntropy: a label is outside [-V, V) and not ignore_index"
                      : "LinearCrossEntropy: a label is outside [0, V) and not ignore_index");
    count += valid;
    if (rwp) wsum += rwp[i];
  }
  const double denom = mean ? (rwp ? wsum : count) : 1.0;
  const double seed_v = seed.present ? static_cast<double>(*seed.ptr<float>()) : 1.0;
  const float coef = static_cast<float>(grad_scale * seed_v / denom);
  const bool want_grad = want_dh || want_dw || want_db;

  int64_t C =
      chunk_rows > 0
          ? chunk_rows
          : std::max<int64_t>(
                16, kChunkBytes / static_cast<int64_t>(sizeof(float) * std::max<int64_t>(V, 1)));
  C = std::max<int64_t>(1, std::min(C, N));
  std::unique_ptr<float[]> zbuf(new float[static_cast<size_t>(C * V)]);
  std::vector<double> nll(static_cast<size_t>(C));
  const OrtKernelContext* kc = ctx.GetOrtKernelContext();
  double total = 0.0;
  for (int64_t r0 = 0; r0 < N; r0 += C) {
    const int64_t c = std::min(C, N - r0);
    float* z = zbuf.get();
    const float* hc = hp + r0 * D;
    mm.run(kc, false, true, 1, c, V, D, hc, wp, z);  // Z[c, V] = Hc W^T
    parallel_for(c, std::max<int64_t>(1, (1 << 14) / V), [&](int, int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        MA row(z + i * V, V);
        if (bp) row += CA(bp, V);
        if (logit_scale != 1.f) row *= logit_scale;
        if (logit_softcap > 0.f) row = (row / logit_softcap).tanh() * logit_softcap;
        const int64_t g = r0 + i;
        const bool valid = rwp || lp[g] != ignore_index;
        const int64_t t = valid ? class_of(lp[g], V, wrap_negative) : 0;  // checked above
        const float mx = row.maxCoeff();
        const float zt = row[t];
        const float lse = mx + std::log((row - mx).exp().sum());
        nll[i] = !valid ? 0.0 : (rwp ? static_cast<double>(rwp[g]) : 1.0) * (lse - zt);
        if (want_lp_row)  // sum_j (Z_j - lse), times a
          lp_row[g] =
              static_cast<float>((row.cast<double>().sum() - static_cast<double>(V) * lse) * row_a);
        if (!want_grad) continue;
        // the gradient of the unscaled logits H W^T + b, times logit_scale: c (softmax - onehot)
        // + a u (1 - V softmax) = (c - V a u) softmax + a u - c onehot
        const float ci = (rgp ? rgp[g] : (valid ? coef : 0.f)) * logit_scale;
        const float ui = ugp ? ugp[g] * row_a * logit_scale : 0.f;
        if (ci == 0.f && ui == 0.f) {
          row.setZero();
          continue;
        }
        const float pc = ci - static_cast<float>(V) * ui;
        if (logit_softcap > 0.f) {  // times the cap's derivative 1 - (Z / cap)^2
          const float dt = 1.f - (zt / logit_softcap) * (zt / logit_softcap);
          row = ((row - lse).exp() * pc + ui) * (1.f - (row / logit_softcap).square());
          row[t] -= ci * dt;
          continue;
        }
        row = (row - lse).exp() * pc + ui;
        row[t] -= ci;
      }
    });
    for (int64_t i = 0; i < c; ++i) total += nll[i];
    if (none && want_loss)
      for (int64_t i = 0; i < c; ++i) loss[r0 + i] = static_cast<float>(nll[i]);
    if (!want_grad) continue;
    if (want_dh) mm.run(kc, false, false, 1, c, D, V, z, wp, dhp + r0 * D);  // dHc = dZ W
    if (want_dw) gemm(true, false, V, D, c, 1.f, z, V, hc, D, 1.f, dw, D);   // dW += dZ^T Hc
    if (want_db) {
      parallel_for(V, 4096, [&](int, int64_t j0, int64_t j1) {
        for (int64_t i = 0; i < c; ++i) {
          const float* zr = z + i * V;
          for (int64_t j = j0; j < j1; ++j) db[j] += zr[j];
        }
      });
    }
  }
  if (want_loss && !none) *loss = static_cast<float>(total / denom);
  if (sliced && want_dh)
    for (int64_t g = 0; g < G; ++g)
      std::copy(dhp + g * L * D, dhp + (g + 1) * L * D, dh + (g * S + first[g]) * D);
  if (add_i.present) {  // dW[index_k] += rows_k, in order (ScatterND{add})
    const int64_t* ip = add_i.ptr<int64_t>();
    const float* rp = add_r.ptr<float>();
    for (int64_t k = 0; k < add_i.numel(); ++k) {
      const int64_t t = class_of(ip[k], V, true);
      FUSECLI_CHECK(t >= 0, "LinearCrossEntropy: a dw_add_index entry is outside [-V, V)");
      float* dst = dw + t * D;
      const float* src = rp + k * D;
      for (int64_t j = 0; j < D; ++j) dst[j] += src[j];
    }
  }
}

}  // namespace

void add_linear_cross_entropy_cpu_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<LceKernel>>(domain);
}

}  // namespace fusecli
