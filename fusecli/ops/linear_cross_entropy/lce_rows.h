// LinearCrossEntropy: which rows of H the op reads, and the labels lp_row needs (shared by the
// CPU and CUDA kernels).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "op_kernel.h"

namespace fusecli {

// seq_start / seq_end: the rows s0:s1 of each of G sequences of S rows (H [..., S, D]);
// seq_index: one row of each of its G sequences of S = rows / G rows (s0 0, s1 1: the row is
// the group's index, resolved by the kernel); neither (sliced and indexed false): every row of
// H [..., D]. n: the rows read (labels' entries).
struct LceRows {
  bool sliced = false, indexed = false;
  int64_t s = 0, s0 = 0, s1 = 0, g = 0, n = 0;
};

inline LceRows lce_rows(const In& h, int64_t d, int64_t seq_start, int64_t seq_end,
                        const In& seq_index) {
  LceRows r;
  r.sliced = seq_start != 0 || seq_end != std::numeric_limits<int64_t>::max();
  if (seq_index.present) {
    FUSECLI_CHECK(!r.sliced,
                  "LinearCrossEntropy: seq_index does not combine with seq_start / seq_end");
    const int64_t rows = d ? h.numel() / d : 0;
    r.indexed = true;
    r.g = r.n = seq_index.numel();
    FUSECLI_CHECK(r.g > 0 ? rows > 0 && rows % r.g == 0 : rows == 0,
                  "LinearCrossEntropy: seq_index's G entries must split H's rows into G "
                  "sequences of equal length");
    r.s = r.g ? rows / r.g : 0;
    r.s1 = 1;
    return r;
  }
  FUSECLI_CHECK(!r.sliced || h.shape.size() >= 3,
                "LinearCrossEntropy: seq_start / seq_end need H [..., S, D]");
  r.s = r.sliced ? h.shape[h.shape.size() - 2] : 0;
  const int64_t s = r.s;
  const auto bound = [s](int64_t x) {
    return std::min(std::max<int64_t>(x < 0 ? x + s : x, 0), s);
  };
  r.s0 = bound(seq_start);
  r.s1 = std::max(r.s0, bound(seq_end));
  r.g = r.sliced && s && d ? h.numel() / (s * d) : 0;
  r.n = r.sliced ? r.g * (r.s1 - r.s0) : d ? h.numel() / d : 0;
  return r;
}

// lp_row is [N]: the labels must be [N] or [N, 1] (a gather's index), as the contract says
inline bool lp_row_labels_ok(const In& lab) {
  return lab.shape.size() == 1 || (lab.shape.size() == 2 && lab.shape[1] == 1);
}

}  // namespace fusecli
