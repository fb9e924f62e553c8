// GatedActivationGrad: onnxruntime CUDAExecutionProvider kernel (calls the C launcher in cuda.cu).
#include "cuda_op_kernel.h"
#include "op_launchers.h"

namespace fusecli {
namespace {

struct GatedKernel : CudaKernel<GatedKernel, kGatedActivationGrad> {  // activation, alpha
  using CudaKernel::CudaKernel;
  void Compute(Ort::KernelContext& ctx) {
    In dh = get_input(ctx, 0), a = get_input(ctx, 1), b = get_input(ctx, 2);
    FUSECLI_CHECK(dh.shape == a.shape && dh.shape == b.shape,
                  "GatedActivationGrad: dH, A and B must have the same shape");
    void* da = opt_out<void>(ctx, 0, dh.shape);
    void* db = opt_out<void>(ctx, 1, dh.shape);
    if (!da && !db) return;
    void* s = ctx.GetGPUComputeStream();
    const int act = act_code(activation);
    int err;
    if (half)
      err = fusecli_launch_gated_activation_grad_f16(s, dh.data, a.data, b.data, da, db, dh.numel(),
                                                     act, alpha);
    else if (bf16)
      err = fusecli_launch_gated_activation_grad_bf16(s, dh.data, a.data, b.data, da, db,
                                                      dh.numel(), act, alpha);
    else
      err = fusecli_launch_gated_activation_grad(s, dh.ptr<float>(), a.ptr<float>(), b.ptr<float>(),
                                                 static_cast<float*>(da), static_cast<float*>(db),
                                                 dh.numel(), act, alpha);
    check_cuda(err, "GatedActivationGrad");
  }
};

}  // namespace

void add_gated_activation_grad_cuda_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<GatedKernel, true>>(domain);
}

}  // namespace fusecli
