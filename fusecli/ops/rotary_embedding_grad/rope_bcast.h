// RotaryEmbeddingGrad: the broadcast of cos / sin to dY (shared by the CPU and CUDA kernels).
#pragma once

#include <cstdint>
#include <vector>

#include "op_kernel.h"

namespace fusecli {

constexpr int kRopeMaxRank = 8;

// dims: dY's shape; cs_strides: element strides of cos (= sin's) broadcast to dY's rank, 0 on
// broadcast dims. Throws when cos / sin do not broadcast to dY with last dim D, or differ.
struct RopeBcast {
  std::vector<int64_t> dims, cs_strides;
  int64_t rows = 0, d = 0;
};

inline RopeBcast rope_bcast(const In& dy, const In& cos, const In& sin, int64_t axis,
                            int64_t interleaved) {
  const int64_t rank = static_cast<int64_t>(dy.shape.size());
  FUSECLI_CHECK(rank >= 1 && rank <= kRopeMaxRank, "RotaryEmbeddingGrad: dY rank must be 1..8");
  FUSECLI_CHECK(axis == -1 || axis == rank - 1,
                "RotaryEmbeddingGrad: only the last axis can be rotated");
  FUSECLI_CHECK(cos.shape == sin.shape, "RotaryEmbeddingGrad: cos and sin must have one shape");
  FUSECLI_CHECK(static_cast<int64_t>(cos.shape.size()) <= rank,
                "RotaryEmbeddingGrad: cos has a higher rank than dY");
  RopeBcast b;
  b.dims = dy.shape;
  b.d = dy.shape.back();
  FUSECLI_CHECK(b.d % 2 == 0, "RotaryEmbeddingGrad: the rotated dimension must be even");
  FUSECLI_CHECK(!cos.shape.empty() && cos.shape.back() == b.d,
                "RotaryEmbeddingGrad: cos / sin last dim must equal dY's (the rotated width)");
  (void)interleaved;
  b.cs_strides.assign(rank, 0);
  const int64_t off = rank - static_cast<int64_t>(cos.shape.size());
  int64_t stride = 1;
  for (int64_t k = rank - 1; k >= 0; --k) {
    const int64_t ck = k >= off ? cos.shape[k - off] : 1;
    FUSECLI_CHECK(ck == 1 || ck == dy.shape[k],
                  "RotaryEmbeddingGrad: cos / sin do not broadcast to dY");
    b.cs_strides[k] = ck == 1 ? 0 : stride;
    stride *= ck;
  }
  b.rows = b.d ? dy.numel() / b.d : 0;
  return b;
}

}  // namespace fusecli
