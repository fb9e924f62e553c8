// FlashAttention: onnxruntime CUDAExecutionProvider kernel (calls the C launcher in cuda.cu).
#include "cuda_op_kernel.h"
#include "flash_inputs.h"
#include "op_launchers.h"

namespace fusecli {
namespace {

struct FlashKernel
    : CudaKernel<FlashKernel, kFlashAttention> {  // attributes: scale, k_transposed, tf32
  using CudaKernel::CudaKernel;
  void Compute(Ort::KernelContext& ctx) {
    const FlashInputs in(ctx, 0, 1, 2, 3, 4, k_transposed, "FlashAttention");
    float* o = opt_out<float>(ctx, 0, in.o_shape());
    float* lse = opt_out<float>(ctx, 1, in.lse_shape());
    check_cuda(
        fusecli_launch_flash_attention(
            ctx.GetGPUComputeStream(), in.q.ptr<float>(), in.k.ptr<float>(), in.v.ptr<float>(),
            in.bias.present ? in.bias.ptr<float>() : nullptr,
            in.bias.present ? in.bias_strides.data() : nullptr, o, lse, in.kmap.nd, in.kmap.q,
            in.kmap.kv, in.Sq, in.Sk, in.D, in.Dv, scale, k_transposed, static_cast<int>(tf32),
            in.mask.present ? in.mask.ptr<uint8_t>() : nullptr,
            in.mask.present ? in.mask_strides.data() : nullptr, fill, static_cast<int>(fill_kept),
            static_cast<int>(bias_first), softcap, static_cast<int>(nan_guard)),
        "FlashAttention");
  }
};

}  // namespace

void add_flash_attention_cuda_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<FlashKernel, true>>(domain);
}

}  // namespace fusecli
