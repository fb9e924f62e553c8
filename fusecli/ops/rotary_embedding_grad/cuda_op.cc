// RotaryEmbeddingGrad: onnxruntime CUDAExecutionProvider kernel (calls the C launcher in cuda.cu).
#include "cuda_op_kernel.h"
#include "op_launchers.h"
#include "rope_bcast.h"

namespace fusecli {
namespace {

struct RopeKernel : CudaKernel<RopeKernel, kRotaryEmbeddingGrad> {  // interleaved, axis
  using CudaKernel::CudaKernel;
  void Compute(Ort::KernelContext& ctx) {
    In dy = get_input(ctx, 0), cos = get_input(ctx, 1), sin = get_input(ctx, 2);
    const RopeBcast b = rope_bcast(dy, cos, sin, axis, interleaved);
    float* dx = opt_out<float>(ctx, 0, dy.shape);
    if (!dx) return;
    check_cuda(fusecli_launch_rotary_embedding_grad(
                   ctx.GetGPUComputeStream(), dy.ptr<float>(), cos.ptr<float>(), sin.ptr<float>(),
                   dx, b.rows, b.d, b.dims.data(), b.cs_strides.data(),
                   static_cast<int>(b.dims.size()), static_cast<int>(interleaved)),
               "RotaryEmbeddingGrad");
  }
};

}  // namespace

void add_rotary_embedding_grad_cuda_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<RopeKernel, true>>(domain);
}

}  // namespace fusecli
