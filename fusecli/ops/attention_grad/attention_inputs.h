// AttentionGrad: attributes and input checks shared by its CPU and CUDA kernels.
#pragma once

#include <vector>

#include "attn_batch.h"
#include "op_kernel.h"

namespace fusecli {

// ---- AttentionGrad: attributes and the shape checks shared by its CPU and CUDA kernels -----
// The attributes (OpAttrs, generated from the contract: scale_q, scale_k, k_transposed,
// dropout_ratio); the optional q_scale / k_scale inputs multiply the scales. The kept
// probabilities were scaled 1/(1-r) by the forward dropout.
using AttnAttrs = OpAttrs<kAttentionGrad>;
// What the contract's types cannot say: 0 <= dropout_ratio < 1 (throws OpError).
void check_attn_attrs(const AttnAttrs& a);
// The op's eight inputs, read from the kernel context and validated against the attributes
// (throws OpError), with the batched dimensions both kernels need. q_scale / k_scale are
// checked to be scalars; reading their value is the kernel's (host or device memory).
// kmap / vmap: the query batch dims (P's) against K's / V's (attn_batch.h; B = q_items()).
// fill: the optional fill mask, broadcastable to P's shape; fill_strides: its element strides
// over P's dims (right-aligned, 0 for a broadcast dim; empty without a fill mask).
struct AttnInputs {
  AttnInputs(Ort::KernelContext& ctx, const AttnAttrs& a);
  In dO, q, k, v, p, qs, ks, mask, fill;
  int64_t B, Sq, Sk, D, Dv;
  KvMap kmap, vmap;
  std::vector<int64_t> fill_strides;
  // Offset of the fill mask's row `row` (row in [0, B * Sq), P's rows in order).
  int64_t fill_row(int64_t row) const {
    const size_t r = fill_strides.size();
    int64_t off = (row % Sq) * fill_strides[r - 2];
    row /= Sq;
    for (size_t j = r - 2; j-- > 0 && row;) {
      off += (row % p.shape[j]) * fill_strides[j];
      row /= p.shape[j];
    }
    return off;
  }
};

}  // namespace fusecli
