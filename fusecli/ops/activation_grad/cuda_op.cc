// ActivationGrad: onnxruntime CUDAExecutionProvider kernel (calls the C launcher in cuda.cu).
#include "cuda_op_kernel.h"
#include "op_launchers.h"

namespace fusecli {
namespace {

struct ActKernel : CudaKernel<ActKernel, kActivationGrad> {  // attributes: activation, alpha
  using CudaKernel::CudaKernel;
  void Compute(Ort::KernelContext& ctx) {
    In dy = get_input(ctx, 0), x = get_input(ctx, 1);
    FUSECLI_CHECK(dy.numel() == x.numel(), "ActivationGrad: dY and X must have the same size");
    void* out = opt_out<void>(ctx, 0, dy.shape);
    if (!out) return;
    void* s = ctx.GetGPUComputeStream();
    const int act = act_code(activation);
    int err;
    if (half)
      err = fusecli_launch_activation_grad_f16(s, dy.data, x.data, out, dy.numel(), act, alpha);
    else if (bf16)
      err = fusecli_launch_activation_grad_bf16(s, dy.data, x.data, out, dy.numel(), act, alpha);
    else
      err = fusecli_launch_activation_grad(s, dy.ptr<float>(), x.ptr<float>(),
                                           static_cast<float*>(out), dy.numel(), act, alpha);
    check_cuda(err, "ActivationGrad");
  }
};

}  // namespace

void add_activation_grad_cuda_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<ActKernel, true>>(domain);
}

}  // namespace fusecli
