// ConvBnReluGrad: attributes and input checks shared by its CPU and CUDA kernels.
#pragma once

#include "op_kernel.h"

namespace fusecli {

// ---- ConvBnReluGrad: attributes and the shape checks shared by its CPU and CUDA kernels ----
// The attributes (OpAttrs, generated from the contract: strides, pads, dilations, group,
// activation)
// and what their types cannot say (check_conv_attrs: 2-D only, group >= 1; throws OpError).
void check_conv_attrs(const OpAttrs<kConvBnReluGrad>& a);
// The op's eight inputs, read from the kernel context and validated against the attributes
// (throws OpError), with the dimensions both kernels need.
struct ConvInputs {
  ConvInputs(Ort::KernelContext& ctx, const OpAttrs<kConvBnReluGrad>& a);
  In dy, y, x, w, cv, gamma, mean, istd;
  int64_t N, C, H, W, Cin, Hin, Win, kh, kw;
};

}  // namespace fusecli
