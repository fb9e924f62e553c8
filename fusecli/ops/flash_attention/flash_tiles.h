// FlashAttention / FlashAttentionGrad CPU kernels: the score tiles both compute (Eigen blocks).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "flash_inputs.h"

namespace fusecli {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using CMat = Eigen::Map<const RowMat, 0, Eigen::OuterStride<>>;
using MMat = Eigen::Map<RowMat, 0, Eigen::OuterStride<>>;

// Tile sizes: a [kFlashBq, kFlashBk] score tile (32 KiB) and its Q / K / V blocks stay in L2.
constexpr int64_t kFlashBq = 64;
constexpr int64_t kFlashBk = 128;

inline int64_t flash_blocks(int64_t n, int64_t blk) {
  return (n + blk - 1) / blk;
}

struct FlashTiles {
  const FlashInputs& in;
  const float scale;
  const bool kt;  // K stored [D, Sk]
  // the bool mask's attributes (contract): the filled value, polarity, order with the bias
  const float fill = 0.f;
  const bool fill_kept = true;
  const bool bias_first = false;
  const float softcap = 0.f;  // > 0: scaled scores c tanh(s / c) before the bias and the mask

  // Query item b's mask row i (nullptr without a mask); entry j at [j * mask_col()].
  const uint8_t* mask_row(int64_t b, int64_t i) const {
    if (!in.mask.present) return nullptr;
    return in.mask.ptr<uint8_t>() + in.mask_item(b) + i * in.mask_row();
  }
  bool filled(const uint8_t* mrow, int64_t j) const {
    return (mrow[j * in.mask_col()] != 0) != fill_kept;
  }
  // What a filled score becomes, given the bias there (bv; 0 without a bias).
  float filled_value(float bv) const { return bias_first || !in.bias.present ? fill : fill + bv; }

  // Query item b's rows [i0, i0 + nr) of an [Sq, n] matrix.
  CMat rows(const float* base, int64_t b, int64_t i0, int64_t nr, int64_t n) const {
    return CMat(base + (b * in.Sq + i0) * n, nr, n, Eigen::OuterStride<>(n));
  }
  // kv item c's K block [j0, j0 + nc): [nc, D] (kt = 0) or [D, nc] (kt = 1).
  CMat kblock(int64_t c, int64_t j0, int64_t nc) const {
    const float* k = in.k.ptr<float>() + c * in.Sk * in.D;
    return kt ? CMat(k + j0, in.D, nc, Eigen::OuterStride<>(in.Sk))
              : CMat(k + j0 * in.D, nc, in.D, Eigen::OuterStride<>(in.D));
  }
  CMat vblock(int64_t c, int64_t j0, int64_t nc) const {
    return CMat(in.v.ptr<float>() + (c * in.Sk + j0) * in.Dv, nc, in.Dv,
                Eigen::OuterStride<>(in.Dv));
  }
  // True when every bias entry of the tile is <= kFlashSkipBias (a fully masked tile).
  // With a mask: every position either filled with a value <= kFlashSkipBias (fill, or fill +
  // bias) or kept with a bias <= kFlashSkipBias.
  bool masked(int64_t b, int64_t i0, int64_t nr, int64_t j0, int64_t nc) const {
    if (in.mask.present) {
      const float* bp = in.bias.present ? in.bias.ptr<float>() + in.bias_item(b) : nullptr;
      const int64_t rs = bp ? in.bias_row() : 0, cs = bp ? in.bias_col() : 0;
      for (int64_t r = 0; r < nr; ++r) {
        const uint8_t* mrow = mask_row(b, i0 + r);
        for (int64_t j = j0; j < j0 + nc; ++j) {
          const bool f = filled(mrow, j);
          if (!f && !bp) return false;  // a kept score without a bias
          const float bv = bp ? bp[(i0 + r) * rs + j * cs] : 0.f;
          if ((f ? filled_value(bv) : bv) > kFlashSkipBias) return false;
        }
      }
      return true;
    }
    if (!in.bias.present) return false;
    const float* bp = in.bias.ptr<float>() + in.bias_item(b);
    const int64_t rs = in.bias_row(), cs = in.bias_col();
    const int64_t rows_ = rs ? nr : 1, cols_ = cs ? nc : 1;
    for (int64_t r = 0; r < rows_; ++r) {
      const float* row = bp + (i0 + r) * rs + j0 * cs;
      if (cs == 1) {
        if (Eigen::Map<const Eigen::ArrayXf>(row, cols_).maxCoeff() > kFlashSkipBias) return false;
      } else if (row[0] > kFlashSkipBias) {
        return false;
      }
    }
    return true;
  }
  // S[0:nr, 0:nc] = scale * Q_b[i0:] K_c[j0:]^T (soft-capped) (+ bias); with softcap and
  // `tanh`, tanh(scale * Q K^T / softcap) there too (the backward's cap derivative).
  void scores(int64_t b, int64_t c, int64_t i0, int64_t nr, int64_t j0, int64_t nc, RowMat& S,
              RowMat* tanh = nullptr) const {
    const CMat qb = rows(in.q.ptr<float>(), b, i0, nr, in.D);
    const CMat kb = kblock(c, j0, nc);
    auto s = S.topLeftCorner(nr, nc);
    if (kt)
      s.noalias() = scale * (qb * kb);
    else
      s.noalias() = scale * (qb * kb.transpose());
    if (softcap > 0.f) {
      auto th = (s.array() / softcap).tanh();
      if (tanh) {
        tanh->topLeftCorner(nr, nc) = th.matrix();
        s = softcap * tanh->topLeftCorner(nr, nc);
      } else {
        s = (softcap * th).matrix();
      }
    }
    const float* bp = in.bias.present ? in.bias.ptr<float>() + in.bias_item(b) : nullptr;
    const int64_t rs = bp ? in.bias_row() : 0, cs = bp ? in.bias_col() : 0;
    if (bp)
      for (int64_t r = 0; r < nr; ++r) {
        const float* row = bp + (i0 + r) * rs + j0 * cs;
        if (cs == 1)
          s.row(r).array() += Eigen::Map<const Eigen::ArrayXf>(row, nc).transpose();
        else
          s.row(r).array() += row[0];
      }
    if (!in.mask.present) return;
    for (int64_t r = 0; r < nr; ++r) {  // filled scores replaced (Where), in float32
      const uint8_t* mrow = mask_row(b, i0 + r);
      for (int64_t j = 0; j < nc; ++j)
        if (filled(mrow, j0 + j))
          s(r, j) = filled_value(bp ? bp[(i0 + r) * rs + (j0 + j) * cs] : 0.f);
    }
  }
  // dS[0:nr, 0:nc] <- 0 where the mask filled (Where's gradient); nothing without a mask.
  void zero_filled(int64_t b, int64_t i0, int64_t nr, int64_t j0, int64_t nc, RowMat& dS) const {
    if (!in.mask.present) return;
    for (int64_t r = 0; r < nr; ++r) {
      const uint8_t* mrow = mask_row(b, i0 + r);
      for (int64_t j = 0; j < nc; ++j)
        if (filled(mrow, j0 + j)) dS(r, j) = 0.f;
    }
  }
};

}  // namespace fusecli
