// FlashAttention / FlashAttentionGrad: the shape checks shared by their CPU and CUDA kernels.
#pragma once

#include <string>
#include <vector>

#include "../attention_grad/attn_batch.h"
#include "op_kernel.h"

namespace fusecli {

// Bias entries at or below this are "masked": a tile made only of them is skipped where that is
// exact (see the contracts' math); a row whose running maximum stays at or below
// kFlashMaskedRow saw only masked scores and is recomputed without skipping.
constexpr float kFlashSkipBias = -1e30f;
constexpr float kFlashMaskedRow = -5e29f;

// Q, K, V (and the optional bias) of either op, validated (throws OpError). B = number of query
// items (Q's batch dims flattened), kmap: Q's batch dims against K's and V's (attn_batch.h; V
// must have K's batch dims). bias_strides: the bias's element strides over Q's batch dims, Sq
// and Sk (right-aligned broadcast, 0 for a broadcast dim; empty without a bias).
struct FlashInputs {
  // imask: the bool mask's input index (-1: the op has none).
  FlashInputs(Ort::KernelContext& ctx, int iq, int ik, int iv, int ibias, int imask,
              int k_transposed, const char* op);
  In q, k, v, bias, mask;
  int64_t B, Sq, Sk, D, Dv;
  KvMap kmap;
  std::vector<int64_t> bias_strides, mask_strides;  // mask_strides: as bias_strides, the mask's
  // Offset of query item b's matrix in a broadcast input of these strides (add i * strides[nd]
  // + j * strides[nd + 1]).
  int64_t item_offset(const std::vector<int64_t>& strides, int64_t b) const {
    int64_t off = 0;
    for (int j = kmap.nd - 1; j >= 0 && b; --j) {
      off += (b % kmap.q[j]) * strides[j];
      b /= kmap.q[j];
    }
    return off;
  }
  int64_t bias_item(int64_t b) const { return item_offset(bias_strides, b); }
  int64_t bias_row() const { return bias_strides[kmap.nd]; }
  int64_t bias_col() const { return bias_strides[kmap.nd + 1]; }
  int64_t mask_item(int64_t b) const { return item_offset(mask_strides, b); }
  int64_t mask_row() const { return mask_strides[kmap.nd]; }
  int64_t mask_col() const { return mask_strides[kmap.nd + 1]; }
  // Q's shape with the last dim replaced (O: Dv) or dropped (LSE).
  std::vector<int64_t> o_shape() const;
  std::vector<int64_t> lse_shape() const;
};

}  // namespace fusecli
