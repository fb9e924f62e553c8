// ConvBnReluGrad: onnxruntime CUDAExecutionProvider kernel (calls the C launcher in cuda.cu).
#include "conv_inputs.h"
#include "cuda_op_kernel.h"
#include "op_launchers.h"

namespace fusecli {
namespace {

struct ConvKernel : CudaKernel<ConvKernel, kConvBnReluGrad> {  // attributes: see conv_inputs.h
  template <typename TOp>
  ConvKernel(const OrtKernelInfo* info, const TOp* op) : CudaKernel(info, op) {
    check_conv_attrs(*this);
  }
  void Compute(Ort::KernelContext& ctx) {
    const ConvInputs in(ctx, *this);
    const int64_t C = in.C;
    float* dx = opt_out<float>(ctx, 0, in.x.shape);
    float* dw = opt_out<float>(ctx, 1, in.w.shape);
    float* dbc = opt_out<float>(ctx, 2, {C});
    float* dg = opt_out<float>(ctx, 3, {C});
    float* db = opt_out<float>(ctx, 4, {C});
    float* dc = opt_out<float>(ctx, 5, in.dy.shape);
    check_cuda(
        fusecli_launch_conv_bn_relu_grad(
            ctx.GetGPUComputeStream(), in.dy.ptr<float>(), in.y.ptr<float>(), in.x.ptr<float>(),
            in.w.ptr<float>(), in.cv.ptr<float>(), in.gamma.ptr<float>(), in.mean.ptr<float>(),
            in.istd.ptr<float>(), dx, dw, dbc, dg, db, dc, in.N, C, in.H, in.W, in.Cin, in.Hin,
            in.Win, in.kh, in.kw, strides[0], strides[1], pads[0], pads[1], pads[2], pads[3],
            dilations[0], dilations[1], group, act_code(activation)),
        "ConvBnReluGrad");
  }
};

}  // namespace

void add_conv_bn_relu_grad_cuda_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<ConvKernel, true>>(domain);
}

}  // namespace fusecli
