// FlashAttentionGrad: CPU kernel (FlashAttention-2 backward: the probabilities are recomputed
// tile by tile from the saved LSE). No two threads ever add into the same output
// (deterministic): with enough kv items, one pass per kv item (its dK, dV and its group's dQ);
// else two passes, each threaded over independent tiles: dK / dV per (kv item, key block) over
// the query blocks of its group, then dQ per (query item, query block) over the key blocks.
#include <cmath>
#include <limits>
#include <vector>

#include "../flash_attention/flash_tiles.h"
#include "cpu_kernel.h"

namespace fusecli {
namespace {

struct FlashGradKernel : CpuKernel<FlashGradKernel, kFlashAttentionGrad> {
  using CpuKernel::CpuKernel;  // attributes: scale, k_transposed
  void Compute(Ort::KernelContext& ctx);
};

struct BwdScratch {
  RowMat S, dP, acc_k, acc_v, T;  // T: the tile's tanh with softcap (else empty)
  // tiles no larger than the matrices (short sequences allocate little)
  BwdScratch(const FlashInputs& in, int64_t rows, int64_t dv, bool tanh)
      : S(std::min(kFlashBq, in.Sq), std::min(kFlashBk, in.Sk)),
        dP(std::min(kFlashBq, in.Sq), std::min(kFlashBk, in.Sk)),
        acc_k(rows, in.D),
        acc_v(rows, dv),
        T(tanh ? S.rows() : 0, tanh ? S.cols() : 0) {}
};

struct Bwd {
  const FlashTiles& t;
  const float* dO;
  const float* lse;
  const float* drow;    // rowsum(dO * O) per query row
  const float* pscale;  // 1, or 1 / rowsum(exp(S - LSE)) for a fully masked row (see below)
  // S <- dS = P * (dP - drow) for the tile (b, i0.., j0..), with P = exp(S - LSE) left in
  // P_out (the S buffer before dS overwrites it) only through the dV callback.
  template <typename DvFn>
  void tile(int64_t b, int64_t c, int64_t i0, int64_t nr, int64_t j0, int64_t nc, BwdScratch& w,
            DvFn&& with_p) const {
    const FlashInputs& in = t.in;
    t.scores(b, c, i0, nr, j0, nc, w.S, t.softcap > 0.f ? &w.T : nullptr);
    auto s = w.S.topLeftCorner(nr, nc);
    for (int64_t r = 0; r < nr; ++r)
      s.row(r).array() =
          (s.row(r).array() - lse[b * in.Sq + i0 + r]).exp() * pscale[b * in.Sq + i0 + r];
    with_p(s);
    const CMat dob = t.rows(dO, b, i0, nr, in.Dv);
    auto dp = w.dP.topLeftCorner(nr, nc);
    dp.noalias() = dob * t.vblock(c, j0, nc).transpose();
    for (int64_t r = 0; r < nr; ++r)
      s.row(r).array() *= dp.row(r).array() - drow[b * in.Sq + i0 + r];
    t.zero_filled(b, i0, nr, j0, nc, w.S);  // Where's gradient: 0 where the mask filled
    if (t.softcap > 0.f)                    // through the cap: times 1 - tanh^2
      s.array() *= 1.f - w.T.topLeftCorner(nr, nc).array().square();
  }
};

void FlashGradKernel::Compute(Ort::KernelContext& ctx) {
  const FlashInputs in(ctx, 1, 2, 3, 6, 7, k_transposed, "FlashAttentionGrad");
  const In dO = get_input(ctx, 0), O = get_input(ctx, 4), L = get_input(ctx, 5);
  const int64_t B = in.B, Sq = in.Sq, Sk = in.Sk, D = in.D, Dv = in.Dv;
  FUSECLI_CHECK(dO.numel() == B * Sq * Dv && O.numel() == B * Sq * Dv,
                "FlashAttentionGrad: dO and O must be [..., Sq, Dv] (Q's batch dims, V's Dv)");
  FUSECLI_CHECK(L.numel() == B * Sq, "FlashAttentionGrad: LSE must be [..., Sq] (Q's rows)");
  bool want_dq, want_dk, want_dv;
  float* dq = output_or_null<float>(ctx, 0, in.q.shape, &want_dq);
  float* dk = output_or_null<float>(ctx, 1, in.k.shape, &want_dk);
  float* dv = output_or_null<float>(ctx, 2, in.v.shape, &want_dv);
  if (want_dk) std::fill(dk, dk + in.k.numel(), 0.f);
  if (want_dv) std::fill(dv, dv + in.v.numel(), 0.f);
  if (B == 0 || Sq == 0 || Sk == 0) {
    if (want_dq) std::fill(dq, dq + in.q.numel(), 0.f);
    return;
  }
  const FlashTiles t{in, scale, k_transposed != 0, fill, fill_kept, bias_first, softcap};
  const float* lse = L.ptr<float>();
  const float* dop = dO.ptr<float>();
  const int64_t nqb = flash_blocks(Sq, kFlashBq), nkb = flash_blocks(Sk, kFlashBk);
  // rowsum(dO * O), and per query block whether skipping masked tiles is exact (every row's
  // LSE finite and above kFlashMaskedRow: P is exactly 0 on a tile of masked scores)
  std::vector<float> drow(static_cast<size_t>(B * Sq));
  // A row whose scores are all masked with finfo.min-like values has S = LSE = that value in
  // float32 (log(l) is lost next to it, while the original softmax there is uniform, 1 / l):
  // its P is renormalised by its row sum, computed once here (such rows are rare).
  std::vector<char> can_skip(static_cast<size_t>(B * nqb),
                             in.bias.present || in.mask.present ? 1 : 0);
  std::vector<float> pscale(static_cast<size_t>(B * Sq), 1.f);
  parallel_for(B * nqb, 1, [&](int, int64_t t0, int64_t t1) {
    RowMat srow(1, kFlashBk);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / nqb, i0 = task % nqb * kFlashBq;
      const int64_t nr = std::min(kFlashBq, Sq - i0);
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t row = b * Sq + i0 + r;
        drow[row] =
            Eigen::Map<const Eigen::ArrayXf>(dop + row * Dv, Dv)
                .cwiseProduct(Eigen::Map<const Eigen::ArrayXf>(O.ptr<float>() + row * Dv, Dv))
                .sum();
        // nan_guard 1: a guarded row (LSE +inf) has P = 0 and, as SoftmaxGrad on the
        // original's NaN P row, a NaN dS: P (dP - NaN); 2 (torch's _safe_softmax): P = 0 and
        // O = 0 there, so drow = 0 and dS = 0, as the softmax backward on its zero row
        if (nan_guard == 1 && lse[row] == std::numeric_limits<float>::infinity())
          drow[row] = std::numeric_limits<float>::quiet_NaN();
        if (!(lse[row] > kFlashMaskedRow) || !std::isfinite(lse[row])) can_skip[task] = 0;
        if (std::isfinite(lse[row]) && !(lse[row] > kFlashMaskedRow)) {
          double sum = 0.0;
          for (int64_t j0 = 0; j0 < Sk; j0 += kFlashBk) {
            const int64_t nc = std::min(kFlashBk, Sk - j0);
            t.scores(b, in.kmap.kv_of(b), i0 + r, 1, j0, nc, srow);
            sum += (srow.row(0).head(nc).array() - lse[row]).exp().sum();
          }
          pscale[row] = static_cast<float>(1.0 / sum);
        }
      }
    }
  });
  const Bwd bwd{t, dop, lse, drow.data(), pscale.data()};
  const KvMap& km = in.kmap;
  const int64_t group = km.group();
  // Enough kv items to keep every thread busy: one pass per kv item, which owns dK / dV and
  // the dQ of its group's query items (each tile's probabilities computed once, dQ added tile
  // by tile in a fixed order). Else the two passes below (every tile computed twice).
  if (want_dq && km.kv_items() >= 2 * planned_threads(km.kv_items(), 1)) {
    std::fill(dq, dq + in.q.numel(), 0.f);
    parallel_for(km.kv_items(), 1, [&](int, int64_t t0, int64_t t1) {
      BwdScratch w(in, std::min(kFlashBk, Sk), Dv, softcap > 0.f);
      for (int64_t c = t0; c < t1; ++c) {
        for (int64_t j0 = 0; j0 < Sk; j0 += kFlashBk) {
          const int64_t nc = std::min(kFlashBk, Sk - j0);
          auto ak = w.acc_k.topRows(nc);
          auto av = w.acc_v.topRows(nc);
          ak.setZero();
          av.setZero();
          const CMat kb = t.kblock(c, j0, nc);
          for (int64_t g = 0; g < group; ++g) {
            const int64_t b = km.member(c, g);
            for (int64_t qb = 0; qb < nqb; ++qb) {
              const int64_t i0 = qb * kFlashBq, nr = std::min(kFlashBq, Sq - i0);
              if (can_skip[b * nqb + qb] && t.masked(b, i0, nr, j0, nc)) continue;
              const CMat dob = t.rows(dop, b, i0, nr, Dv);
              bwd.tile(b, c, i0, nr, j0, nc, w, [&](const auto& p) {
                if (want_dv) av.noalias() += p.transpose() * dob;
              });
              const auto ds = w.S.topLeftCorner(nr, nc);
              if (want_dk) ak.noalias() += ds.transpose() * t.rows(in.q.ptr<float>(), b, i0, nr, D);
              MMat dqb(dq + (b * Sq + i0) * D, nr, D, Eigen::OuterStride<>(D));
              if (t.kt)
                dqb.noalias() += ds * kb.transpose();
              else
                dqb.noalias() += ds * kb;
            }
          }
          if (want_dv) MMat(dv + (c * Sk + j0) * Dv, nc, Dv, Eigen::OuterStride<>(Dv)) = av;
          if (want_dk) {
            float* kc = dk + c * Sk * D;
            if (t.kt)
              MMat(kc + j0, D, nc, Eigen::OuterStride<>(Sk)) = scale * ak.transpose();
            else
              MMat(kc + j0 * D, nc, D, Eigen::OuterStride<>(D)) = scale * ak;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          const int64_t b = km.member(c, g);
          Eigen::Map<Eigen::ArrayXf>(dq + b * Sq * D, Sq * D) *= scale;
        }
      }
    });
    return;
  }
  if (want_dk || want_dv) {  // pass 1: per (kv item, key block), over its group's query blocks
    parallel_for(km.kv_items() * nkb, 1, [&](int, int64_t t0, int64_t t1) {
      BwdScratch w(in, std::min(kFlashBk, Sk), Dv, softcap > 0.f);
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t c = task / nkb, j0 = task % nkb * kFlashBk;
        const int64_t nc = std::min(kFlashBk, Sk - j0);
        auto ak = w.acc_k.topRows(nc);
        auto av = w.acc_v.topRows(nc);
        ak.setZero();
        av.setZero();
        for (int64_t g = 0; g < group; ++g) {
          const int64_t b = km.member(c, g);
          for (int64_t qb = 0; qb < nqb; ++qb) {
            const int64_t i0 = qb * kFlashBq, nr = std::min(kFlashBq, Sq - i0);
            if (can_skip[b * nqb + qb] && t.masked(b, i0, nr, j0, nc)) continue;
            const CMat dob = t.rows(dop, b, i0, nr, Dv);
            bwd.tile(b, c, i0, nr, j0, nc, w, [&](const auto& p) {
              if (want_dv) av.noalias() += p.transpose() * dob;
            });
            if (want_dk)
              ak.noalias() +=
                  w.S.topLeftCorner(nr, nc).transpose() * t.rows(in.q.ptr<float>(), b, i0, nr, D);
          }
        }
        if (want_dv) MMat(dv + (c * Sk + j0) * Dv, nc, Dv, Eigen::OuterStride<>(Dv)) = av;
        if (want_dk) {
          float* kc = dk + c * Sk * D;
          if (t.kt)
            MMat(kc + j0, D, nc, Eigen::OuterStride<>(Sk)) = scale * ak.transpose();
          else
            MMat(kc + j0 * D, nc, D, Eigen::OuterStride<>(D)) = scale * ak;
        }
      }
    });
  }
  if (!want_dq) return;
  // pass 2: per (query item, query block), over the key blocks
  parallel_for(B * nqb, 1, [&](int, int64_t t0, int64_t t1) {
    BwdScratch w(in, std::min(kFlashBq, Sq), 0, softcap > 0.f);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / nqb, i0 = task % nqb * kFlashBq;
      const int64_t nr = std::min(kFlashBq, Sq - i0);
      const int64_t c = km.kv_of(b);
      auto aq = w.acc_k.topRows(nr);
      aq.setZero();
      for (int64_t j0 = 0; j0 < Sk; j0 += kFlashBk) {
        const int64_t nc = std::min(kFlashBk, Sk - j0);
        if (can_skip[task] && t.masked(b, i0, nr, j0, nc)) continue;
        bwd.tile(b, c, i0, nr, j0, nc, w, [](const auto&) {});
        const CMat kb = t.kblock(c, j0, nc);
        if (t.kt)
          aq.noalias() += w.S.topLeftCorner(nr, nc) * kb.transpose();
        else
          aq.noalias() += w.S.topLeftCorner(nr, nc) * kb;
      }
      MMat(dq + (b * Sq + i0) * D, nr, D, Eigen::OuterStride<>(D)) = scale * aq;
    }
  });
}

}  // namespace

void add_flash_attention_grad_cpu_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<FlashGradKernel>>(domain);
}

}  // namespace fusecli
