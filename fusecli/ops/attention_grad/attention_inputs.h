// AttentionGrad: attributes and input checks shared by its CPU and CUDA kernels.
#pragma once

#include "op_kernel.h"

namespace fusecli {

// ---- AttentionGrad: attributes and the shape checks shared by its CPU and CUDA kernels -----
struct AttnAttrs {
  explicit AttnAttrs(const OrtKernelInfo* info);
  float scale_q, scale_k;  // the attributes; the optional q_scale / k_scale inputs multiply them
  bool k_transposed;
};
// The op's seven inputs, read from the kernel context and validated against the attributes
// (throws OpError), with the batched dimensions both kernels need. q_scale / k_scale are
// checked to be scalars; reading their value is the kernel's (host or device memory).
struct AttnInputs {
  AttnInputs(Ort::KernelContext& ctx, const AttnAttrs& a);
  In dO, q, k, v, p, qs, ks;
  int64_t B, Sq, Sk, D, Dv;
};

}  // namespace fusecli
