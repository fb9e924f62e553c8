// onnxruntime CUDAExecutionProvider kernels: thin wrappers that validate shapes, allocate the
// outputs and call the C launchers (cuda_kernels.cu) on ORT's compute stream.
#include "common.h"
#include "launchers.h"

namespace fusecli {
namespace {

constexpr auto kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto kF16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr const char* kCuda = "CUDAExecutionProvider";
constexpr auto kOpt = OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL;
constexpr auto kReq = OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;

int act_code(Act a) {
  switch (a) {
    case Act::kRelu: return 0;
    case Act::kGelu: return 1;
    case Act::kGeluTanh: return 2;
    case Act::kSilu: return 3;
    default: return 4;
  }
}

void check_cuda(int err, const char* op) {
  if (err != 0)
    throw OpError(std::string("fusecli: CUDA launch of ") + op + " failed with cudaError " +
                  std::to_string(err));
}

template <typename T> T* opt_out(Ort::KernelContext& ctx, size_t i, const std::vector<int64_t>& s) {
  bool present;
  return output_or_null<T>(ctx, i, s, &present);
}

// ----------------------------------------------------------------------------------------------
struct ActOp;
struct ActKernel {
  ActKernel(const OrtKernelInfo* info, const ActOp* op);
  OrtStatusPtr ComputeV2(OrtKernelContext* c) {
    return guarded([&] {
      count_call(kActivationGrad);
      Ort::KernelContext ctx(c);
      In dy = get_input(ctx, 0), x = get_input(ctx, 1);
      FUSECLI_CHECK(dy.numel() == x.numel(), "ActivationGrad: dY and X must have the same size");
      void* out = opt_out<void>(ctx, 0, dy.shape);
      if (!out) return;
      void* s = ctx.GetGPUComputeStream();
      check_cuda(half ? fusecli_launch_activation_grad_f16(s, dy.data, x.data, out, dy.numel(), act_code(act))
                      : fusecli_launch_activation_grad(s, dy.ptr<float>(), x.ptr<float>(),
                                                       static_cast<float*>(out), dy.numel(), act_code(act)),
                 "ActivationGrad");
    });
  }
  Act act;
  bool half;
};
struct ActOp : SigOp<ActOp, ActKernel, kActivationGradSig, kActivationGradInplace> {
  explicit ActOp(bool half) : SigOp("ActivationGrad", kCuda, half) {}
};
ActKernel::ActKernel(const OrtKernelInfo* info, const ActOp* op)
    : act(parse_act(attr_string(info, "activation", ""), false)), half(op->half) {}

// ----------------------------------------------------------------------------------------------
struct LinOp;
struct LinKernel {
  LinKernel(const OrtKernelInfo* info, const LinOp*)
      : act(parse_act(attr_string(info, "activation", ""), true)),
        trans_w(attr_int(info, "trans_w", 0) != 0),
        trans_dw(attr_int(info, "trans_dw", trans_w ? 1 : 0) != 0) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* c) {
    return guarded([&] {
      count_call(kLinearActivationGrad);
      Ort::KernelContext ctx(c);
      In dy = get_input(ctx, 0), x = get_input(ctx, 1), a = get_input(ctx, 2), w = get_input(ctx, 3);
      FUSECLI_CHECK(!dy.shape.empty() && !a.shape.empty() && (!w.present || w.shape.size() == 2),
                    "LinearActivationGrad: bad ranks");
      const int64_t N = dy.shape.back(), K = a.shape.back(), M = N ? dy.numel() / N : 0;
      FUSECLI_CHECK(x.numel() == dy.numel() && a.numel() == M * K, "LinearActivationGrad: shape mismatch");
      FUSECLI_CHECK(!w.present || (trans_w ? (w.shape[0] == K && w.shape[1] == N)
                                           : (w.shape[0] == N && w.shape[1] == K)),
                    "LinearActivationGrad: W shape does not match trans_w");
      float* da = opt_out<float>(ctx, 0, a.shape);
      FUSECLI_CHECK(!da || w.present, "LinearActivationGrad: dA is requested but W is absent");
      float* dw = opt_out<float>(ctx, 1, trans_dw ? std::vector<int64_t>{K, N} : std::vector<int64_t>{N, K});
      float* db = opt_out<float>(ctx, 2, {N});
      float* dz = opt_out<float>(ctx, 3, dy.shape);
      check_cuda(fusecli_launch_linear_activation_grad(ctx.GetGPUComputeStream(), dy.ptr<float>(),
                     x.ptr<float>(), a.ptr<float>(), w.present ? w.ptr<float>() : nullptr, da, dw, db, dz,
                     M, N, K, act_code(act), trans_w, trans_dw),
                 "LinearActivationGrad");
    });
  }
  Act act;
  bool trans_w, trans_dw;
};
struct LinOp : SigOp<LinOp, LinKernel, kLinearActivationGradSig, kLinearActivationGradInplace> {
  LinOp() : SigOp("LinearActivationGrad", kCuda) {}
};

// ----------------------------------------------------------------------------------------------
struct AttnOp;
struct AttnKernel : AttnAttrs {
  AttnKernel(const OrtKernelInfo* info, const AttnOp*) : AttnAttrs(info) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* c) {
    return guarded([&] {
      count_call(kAttentionGrad);
      Ort::KernelContext ctx(c);
      const AttnInputs in(ctx, *this);
      float sq_extra = 1.f, sk_extra = 1.f;  // run-time scales live on the device: read them
      if (in.qs.present) check_cuda(fusecli_read_scalar(ctx.GetGPUComputeStream(), in.qs.ptr<float>(), &sq_extra), "AttentionGrad");
      if (in.ks.present) check_cuda(fusecli_read_scalar(ctx.GetGPUComputeStream(), in.ks.ptr<float>(), &sk_extra), "AttentionGrad");
      float* dq = opt_out<float>(ctx, 0, in.q.shape);
      float* dk = opt_out<float>(ctx, 1, in.k.shape);
      float* dv = opt_out<float>(ctx, 2, in.v.shape);
      float* ds = opt_out<float>(ctx, 3, in.p.shape);
      const uint8_t* mask = in.mask.present ? in.mask.ptr<uint8_t>() : nullptr;
      check_cuda(fusecli_launch_attention_grad(ctx.GetGPUComputeStream(), in.dO.ptr<float>(), in.q.ptr<float>(),
                     in.k.ptr<float>(), in.v.ptr<float>(), in.p.ptr<float>(), mask, dq, dk, dv, ds,
                     in.kmap.nd, in.kmap.q, in.kmap.kv, in.vmap.kv, in.Sq, in.Sk, in.D, in.Dv,
                     scale_q * sq_extra, scale_k * sk_extra, 1.f / (1.f - dropout_ratio), k_transposed),
                 "AttentionGrad");
    });
  }
};
struct AttnOp : SigOp<AttnOp, AttnKernel, kAttentionGradSig> {
  AttnOp() : SigOp("AttentionGrad", kCuda) {}
};

// ----------------------------------------------------------------------------------------------
struct ConvOp;
struct ConvKernel : ConvAttrs {
  ConvKernel(const OrtKernelInfo* info, const ConvOp*) : ConvAttrs(info) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* c) {
    return guarded([&] {
      count_call(kConvBnReluGrad);
      Ort::KernelContext ctx(c);
      const ConvInputs in(ctx, *this);
      const int64_t C = in.C;
      float* dx = opt_out<float>(ctx, 0, in.x.shape);
      float* dw = opt_out<float>(ctx, 1, in.w.shape);
      float* dbc = opt_out<float>(ctx, 2, {C});
      float* dg = opt_out<float>(ctx, 3, {C});
      float* db = opt_out<float>(ctx, 4, {C});
      float* dc = opt_out<float>(ctx, 5, in.dy.shape);
      check_cuda(fusecli_launch_conv_bn_relu_grad(ctx.GetGPUComputeStream(), in.dy.ptr<float>(),
                     in.y.ptr<float>(), in.x.ptr<float>(), in.w.ptr<float>(), in.cv.ptr<float>(),
                     in.gamma.ptr<float>(), in.mean.ptr<float>(), in.istd.ptr<float>(), dx, dw, dbc,
                     dg, db, dc, in.N, C, in.H, in.W, in.Cin, in.Hin, in.Win, in.kh, in.kw, strides[0], strides[1], pads[0], pads[1], pads[2], pads[3],
                     dilations[0], dilations[1], group, relu ? 1 : 0),
                 "ConvBnReluGrad");
    });
  }
};
struct ConvOp : SigOp<ConvOp, ConvKernel, kConvBnReluGradSig, kConvBnReluGradInplace> {
  ConvOp() : SigOp("ConvBnReluGrad", kCuda) {}
};

// ----------------------------------------------------------------------------------------------
struct LnOp;
struct LnKernel {
  LnKernel(const OrtKernelInfo* info, const LnOp* op);
  OrtStatusPtr ComputeV2(OrtKernelContext* c) {
    return guarded([&] {
      count_call(kLayerNormGrad);
      Ort::KernelContext ctx(c);
      In dy = get_input(ctx, 0), x = get_input(ctx, 1), gamma = get_input(ctx, 2);
      In mean = get_input(ctx, 3), rstd = get_input(ctx, 4), dr = get_input(ctx, 5);
      const int64_t rank = static_cast<int64_t>(x.shape.size());
      const int64_t ax = axis < 0 ? axis + rank : axis;
      FUSECLI_CHECK(ax >= 0 && ax <= rank, "LayerNormGrad: axis out of range");
      const int64_t N = prod(x.shape, static_cast<size_t>(ax)), M = prod(x.shape, 0, static_cast<size_t>(ax));
      FUSECLI_CHECK(dy.numel() == x.numel() && (!gamma.present || gamma.numel() == N) && mean.numel() == M &&
                        rstd.numel() == M && (!dr.present || dr.numel() == M * N),
                    "LayerNormGrad: shape mismatch");
      FUSECLI_CHECK(mean.type == rstd.type && (mean.type == kF32 || (half && mean.type == kF16)),
                    "LayerNormGrad: mean/inv_std must be float32 (or float16 with float16 data)");
      const std::vector<int64_t> pshape(x.shape.begin() + ax, x.shape.end());
      void* dx = opt_out<void>(ctx, 0, x.shape);
      FUSECLI_CHECK(!dx || gamma.present, "LayerNormGrad: dX is requested but gamma is absent");
      void* dg = opt_out<void>(ctx, 1, pshape);
      void* db = opt_out<void>(ctx, 2, pshape);
      void* s = ctx.GetGPUComputeStream();
      int err;
      if (half)
        err = fusecli_launch_layer_norm_grad_f16(s, dy.data, x.data, gamma.present ? gamma.data : nullptr, mean.data, rstd.data,
                                                 mean.type == kF16, dr.present ? dr.data : nullptr,
                                                 dx, dg, db, M, N);
      else
        err = fusecli_launch_layer_norm_grad(s, dy.ptr<float>(), x.ptr<float>(),
                                             gamma.present ? gamma.ptr<float>() : nullptr,
                                             mean.ptr<float>(), rstd.ptr<float>(),
                                             dr.present ? dr.ptr<float>() : nullptr,
                                             static_cast<float*>(dx), static_cast<float*>(dg),
                                             static_cast<float*>(db), M, N);
      check_cuda(err, "LayerNormGrad");
    });
  }
  int64_t axis;
  bool half;
};
struct LnOp : SigOp<LnOp, LnKernel, kLayerNormGradSig> {
  explicit LnOp(bool half) : SigOp("LayerNormGrad", kCuda, half) {}
};
LnKernel::LnKernel(const OrtKernelInfo* info, const LnOp* op) : axis(attr_int(info, "axis", -1)), half(op->half) {}

}  // namespace

void add_cuda_ops(Ort::CustomOpDomain& domain) {
  static ActOp act_f32(false), act_f16(true);
  static LinOp lin;
  static AttnOp attn;
  static ConvOp conv;
  static LnOp ln_f32(false), ln_f16(true);
  for (OrtCustomOp* op : std::initializer_list<OrtCustomOp*>{&act_f32, &act_f16, &lin, &attn, &conv,
                                                              &ln_f32, &ln_f16})
    domain.Add(op);
}

}  // namespace fusecli
