// ConvBnReluGrad: attributes and input checks (see conv_inputs.h).
#include "conv_inputs.h"

namespace fusecli {

// ---- ConvBnReluGrad ------------------------------------------------------------------------
void check_conv_attrs(const OpAttrs<kConvBnReluGrad>& a) {
  FUSECLI_CHECK(a.strides.size() == 2 && a.pads.size() == 4 && a.dilations.size() == 2,
                "ConvBnReluGrad: strides/dilations need 2 values, pads 4 (2-D convolutions only)");
  FUSECLI_CHECK(a.group >= 1, "ConvBnReluGrad: group must be >= 1");
}

ConvInputs::ConvInputs(Ort::KernelContext& ctx, const OpAttrs<kConvBnReluGrad>& a)
    : dy(get_input(ctx, 0)),
      y(get_input(ctx, 1)),
      x(get_input(ctx, 2)),
      w(get_input(ctx, 3)),
      cv(get_input(ctx, 4)),
      gamma(get_input(ctx, 5)),
      mean(get_input(ctx, 6)),
      istd(get_input(ctx, 7)) {
  FUSECLI_CHECK(dy.shape.size() == 4 && x.shape.size() == 4 && w.shape.size() == 4,
                "ConvBnReluGrad: dY, X and W must be 4-D");
  N = dy.shape[0], C = dy.shape[1], H = dy.shape[2], W = dy.shape[3];
  Cin = x.shape[1], Hin = x.shape[2], Win = x.shape[3], kh = w.shape[2], kw = w.shape[3];
  FUSECLI_CHECK(x.shape[0] == N, "ConvBnReluGrad: batch of X and dY differ");
  FUSECLI_CHECK(y.present || a.activation == Act::kIdentity,
                "ConvBnReluGrad: Y is required unless activation is identity");
  FUSECLI_CHECK((!y.present || y.numel() == dy.numel()) && cv.numel() == dy.numel(),
                "ConvBnReluGrad: Y/Cv must match dY");
  FUSECLI_CHECK(gamma.numel() == C && mean.numel() == C && istd.numel() == C,
                "ConvBnReluGrad: gamma/mean/inv_std must be [C]");
  FUSECLI_CHECK(C % a.group == 0 && Cin % a.group == 0,
                "ConvBnReluGrad: channels not divisible by group");
  FUSECLI_CHECK(w.shape[0] == C && w.shape[1] == Cin / a.group,
                "ConvBnReluGrad: W must be [C, Cin/group, kh, kw]");
  const int64_t eho =
      (Hin + a.pads[0] + a.pads[2] - a.dilations[0] * (kh - 1) - 1) / a.strides[0] + 1;
  const int64_t ewo =
      (Win + a.pads[1] + a.pads[3] - a.dilations[1] * (kw - 1) - 1) / a.strides[1] + 1;
  FUSECLI_CHECK(eho == H && ewo == W,
                "ConvBnReluGrad: dY spatial size does not match the convolution");
}

}  // namespace fusecli
