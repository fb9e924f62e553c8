// FlashAttentionGrad: onnxruntime CUDAExecutionProvider kernel (calls the C launcher in cuda.cu).
#include "../flash_attention/flash_inputs.h"
#include "cuda_op_kernel.h"
#include "op_launchers.h"

namespace fusecli {
namespace {

struct FlashGradKernel : CudaKernel<FlashGradKernel, kFlashAttentionGrad> {
  using CudaKernel::CudaKernel;  // attributes: scale, k_transposed, tf32
  void Compute(Ort::KernelContext& ctx) {
    const FlashInputs in(ctx, 1, 2, 3, 6, 7, k_transposed, "FlashAttentionGrad");
    const In dO = get_input(ctx, 0), O = get_input(ctx, 4), L = get_input(ctx, 5);
    FUSECLI_CHECK(dO.numel() == in.B * in.Sq * in.Dv && O.numel() == dO.numel(),
                  "FlashAttentionGrad: dO and O must be [..., Sq, Dv] (Q's batch dims, V's Dv)");
    FUSECLI_CHECK(L.numel() == in.B * in.Sq,
                  "FlashAttentionGrad: LSE must be [..., Sq] (Q's rows)");
    float* dq = opt_out<float>(ctx, 0, in.q.shape);
    float* dk = opt_out<float>(ctx, 1, in.k.shape);
    float* dv = opt_out<float>(ctx, 2, in.v.shape);
    check_cuda(
        fusecli_launch_flash_attention_grad(
            ctx.GetGPUComputeStream(), dO.ptr<float>(), in.q.ptr<float>(), in.k.ptr<float>(),
            in.v.ptr<float>(), O.ptr<float>(), L.ptr<float>(),
            in.bias.present ? in.bias.ptr<float>() : nullptr,
            in.bias.present ? in.bias_strides.data() : nullptr, dq, dk, dv, in.kmap.nd, in.kmap.q,
            in.kmap.kv, in.Sq, in.Sk, in.D, in.Dv, scale, k_transposed, static_cast<int>(tf32),
            in.mask.present ? in.mask.ptr<uint8_t>() : nullptr,
            in.mask.present ? in.mask_strides.data() : nullptr, fill, static_cast<int>(fill_kept),
            static_cast<int>(bias_first), softcap, static_cast<int>(nan_guard)),
        "FlashAttentionGrad");
  }
};

}  // namespace

void add_flash_attention_grad_cuda_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<FlashGradKernel, true>>(domain);
}

}  // namespace fusecli
