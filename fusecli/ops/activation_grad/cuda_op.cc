// ActivationGrad: onnxruntime CUDAExecutionProvider kernel (calls the C launcher in cuda.cu).
#include "cpu_activation.h"
#include "cuda_op_kernel.h"
#include "op_launchers.h"

namespace fusecli {
namespace {

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
struct ActOp : SigOp<ActOp, ActKernel, kActivationGrad> {
  explicit ActOp(bool half) : SigOp(kCuda, half) {}
};
ActKernel::ActKernel(const OrtKernelInfo* info, const ActOp* op)
    : act(parse_act(attr_string(info, "activation", ""), false)), half(op->half) {}

}  // namespace

void add_activation_grad_cuda_ops(Ort::CustomOpDomain& domain) {
  add_op<ActOp>(domain);
}

}  // namespace fusecli
