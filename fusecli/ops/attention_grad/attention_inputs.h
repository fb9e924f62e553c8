// AttentionGrad: attributes and input checks shared by its CPU and CUDA kernels.
#pragma once

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
struct AttnInputs {
  AttnInputs(Ort::KernelContext& ctx, const AttnAttrs& a);
  In dO, q, k, v, p, qs, ks, mask;
  int64_t B, Sq, Sk, D, Dv;
  KvMap kmap, vmap;
};

}  // namespace fusecli
