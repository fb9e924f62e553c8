// AttentionGrad: onnxruntime CUDAExecutionProvider kernel (calls the C launcher in cuda.cu).
#include "attention_inputs.h"
#include "cuda_op_kernel.h"
#include "op_launchers.h"

namespace fusecli {
namespace {

struct AttnKernel : CudaKernel<AttnKernel, kAttentionGrad> {  // attributes: see AttnAttrs
  template <typename TOp>
  AttnKernel(const OrtKernelInfo* info, const TOp* op) : CudaKernel(info, op) {
    check_attn_attrs(*this);
  }
  void Compute(Ort::KernelContext& ctx) {
    const AttnInputs in(ctx, *this);
    float sq_extra = 1.f, sk_extra = 1.f;  // run-time scales live on the device: read them
    if (in.qs.present)
      check_cuda(fusecli_read_scalar(ctx.GetGPUComputeStream(), in.qs.ptr<float>(), &sq_extra),
                 "AttentionGrad");
    if (in.ks.present)
      check_cuda(fusecli_read_scalar(ctx.GetGPUComputeStream(), in.ks.ptr<float>(), &sk_extra),
                 "AttentionGrad");
    float* dq = opt_out<float>(ctx, 0, in.q.shape);
    float* dk = opt_out<float>(ctx, 1, in.k.shape);
    float* dv = opt_out<float>(ctx, 2, in.v.shape);
    float* ds = opt_out<float>(ctx, 3, in.p.shape);
    const uint8_t* mask = in.mask.present ? in.mask.ptr<uint8_t>() : nullptr;
    check_cuda(fusecli_launch_attention_grad(
                   ctx.GetGPUComputeStream(), in.dO.ptr<float>(), in.q.ptr<float>(),
                   in.k.ptr<float>(), in.v.ptr<float>(), in.p.ptr<float>(), mask, dq, dk, dv, ds,
                   in.kmap.nd, in.kmap.q, in.kmap.kv, in.vmap.kv, in.Sq, in.Sk, in.D, in.Dv,
                   scale_q * sq_extra, scale_k * sk_extra, 1.f / (1.f - dropout_ratio),
                   k_transposed, nan_guard, in.fill.present ? in.fill.ptr<uint8_t>() : nullptr,
                   in.fill.present ? in.fill_strides.data() : nullptr, fill_kept),
               "AttentionGrad");
  }
};

}  // namespace

void add_attention_grad_cuda_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<AttnKernel, true>>(domain);
}

}  // namespace fusecli
