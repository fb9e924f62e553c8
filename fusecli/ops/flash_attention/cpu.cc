// FlashAttention: CPU kernel (tiles over key blocks, online softmax; threads over query blocks).
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_kernel.h"
#include "flash_tiles.h"

namespace fusecli {
namespace {

struct FlashKernel : CpuKernel<FlashKernel, kFlashAttention> {  // attributes: see contract
  using CpuKernel::CpuKernel;
  void Compute(Ort::KernelContext& ctx);
};

struct FwdScratch {
  RowMat S, acc;
  std::vector<float> m, l;
  // tiles no larger than the matrices (short sequences allocate little)
  FwdScratch(int64_t bq, int64_t bk, int64_t dv) : S(bq, bk), acc(bq, dv), m(bq), l(bq) {}
};

// One query block of item b: the online softmax over the key blocks (skipping fully masked
// tiles when `skip`). Returns false when skipping was not exact for some row (every score it
// saw was masked): the caller recomputes the block without skipping.
bool forward_block(const FlashTiles& t, int64_t b, int64_t i0, int64_t nr, bool skip,
                   FwdScratch& w) {
  const FlashInputs& in = t.in;
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t c = in.kmap.kv_of(b);
  std::fill(w.m.begin(), w.m.begin() + nr, ninf);
  std::fill(w.l.begin(), w.l.begin() + nr, 0.f);
  w.acc.topRows(nr).setZero();
  bool skipped = false;
  for (int64_t j0 = 0; j0 < in.Sk; j0 += kFlashBk) {
    const int64_t nc = std::min(kFlashBk, in.Sk - j0);
    if (skip && t.masked(b, i0, nr, j0, nc)) {
      skipped = true;
      continue;
    }
    t.scores(b, c, i0, nr, j0, nc, w.S);
    for (int64_t r = 0; r < nr; ++r) {
      auto row = w.S.row(r).head(nc).array();
      const float mn = std::max(w.m[r], row.maxCoeff());
      if (mn == ninf) {  // every score so far is -inf: nothing to add yet
        row.setZero();
        continue;
      }
      const float corr = std::exp(w.m[r] - mn);  // 0 for the first finite block
      row = (row - mn).exp();
      w.l[r] = w.l[r] * corr + row.sum();
      if (corr != 1.f) w.acc.row(r) *= corr;
      w.m[r] = mn;
    }
    w.acc.topRows(nr).noalias() += w.S.topLeftCorner(nr, nc) * t.vblock(c, j0, nc);
  }
  if (skipped)
    for (int64_t r = 0; r < nr; ++r)
      if (!(w.m[r] > kFlashMaskedRow)) return false;
  return true;
}

void FlashKernel::Compute(Ort::KernelContext& ctx) {
  const FlashInputs in(ctx, 0, 1, 2, 3, 4, k_transposed, "FlashAttention");
  bool want_o, want_lse;
  float* o = output_or_null<float>(ctx, 0, in.o_shape(), &want_o);
  float* lse = output_or_null<float>(ctx, 1, in.lse_shape(), &want_lse);
  if (in.B == 0 || in.Sq == 0) return;
  const FlashTiles t{in, scale, k_transposed != 0, fill, fill_kept, bias_first, softcap};
  const int64_t nqb = flash_blocks(in.Sq, kFlashBq), Dv = in.Dv;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  parallel_for(in.B * nqb, 1, [&](int, int64_t t0, int64_t t1) {
    FwdScratch w(std::min(kFlashBq, in.Sq), std::min(kFlashBk, in.Sk), Dv);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / nqb, i0 = task % nqb * kFlashBq;
      const int64_t nr = std::min(kFlashBq, in.Sq - i0);
      if (!forward_block(t, b, i0, nr, in.bias.present || in.mask.present, w))
        forward_block(t, b, i0, nr, false, w);
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t row = b * in.Sq + i0 + r;
        const bool empty = !(w.l[r] > 0.f);  // every score -inf: Softmax gives NaN
        const float lv = empty ? nan : w.m[r] + std::log(w.l[r]);
        // nan_guard: a row whose softmax is NaN (2: whose every score is -inf) gets P = 0
        // (O = 0), LSE +inf (contract)
        const bool guarded = nan_guard == 2 ? w.m[r] == -inf : nan_guard && !std::isfinite(lv);
        if (want_o) {
          Eigen::Map<Eigen::RowVectorXf> orow(o + row * Dv, Dv);
          if (guarded)
            orow.setZero();
          else if (empty)
            orow.setConstant(nan);
          else
            orow = w.acc.row(r) * (1.f / w.l[r]);
        }
        if (want_lse) lse[row] = guarded ? inf : lv;
      }
    }
  });
}

}  // namespace

void add_flash_attention_cpu_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<FlashKernel>>(domain);
}

}  // namespace fusecli
