// ConvBnReluGrad: attributes and input checks shared by its CPU and CUDA kernels.
#pragma once

#include "op_kernel.h"

namespace fusecli {

// ---- ConvBnReluGrad: attributes and the shape checks shared by its CPU and CUDA kernels ----
struct ConvAttrs {
  explicit ConvAttrs(const OrtKernelInfo* info);
  std::vector<int64_t> strides, pads, dilations;
  int64_t group;
  bool relu;
};
// The op's eight inputs, read from the kernel context and validated against the attributes
// (throws OpError), with the dimensions both kernels need.
struct ConvInputs {
  ConvInputs(Ort::KernelContext& ctx, const ConvAttrs& a);
  In dy, y, x, w, cv, gamma, mean, istd;
  int64_t N, C, H, W, Cin, Hin, Win, kh, kw;
};

}  // namespace fusecli
