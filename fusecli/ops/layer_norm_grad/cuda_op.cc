// LayerNormGrad: onnxruntime CUDAExecutionProvider kernel (calls the C launcher in cuda.cu).
#include "cuda_op_kernel.h"
#include "op_launchers.h"

namespace fusecli {
namespace {

struct LnKernel : CudaKernel<LnKernel, kLayerNormGrad> {  // attributes: axis
  using CudaKernel::CudaKernel;
  void Compute(Ort::KernelContext& ctx) {
    In dy = get_input(ctx, 0), x = get_input(ctx, 1), gamma = get_input(ctx, 2);
    In mean = get_input(ctx, 3), rstd = get_input(ctx, 4), dr = get_input(ctx, 5);
    const AxisRows rows = rows_from_axis(x.shape, axis, "LayerNormGrad");
    const size_t ax = rows.ax;
    const int64_t M = rows.M, N = rows.N;
    FUSECLI_CHECK(dy.numel() == x.numel() && (!gamma.present || gamma.numel() == N) &&
                      mean.numel() == M && rstd.numel() == M &&
                      (!dr.present || dr.numel() == M * N),
                  "LayerNormGrad: shape mismatch");
    FUSECLI_CHECK(mean.type == rstd.type && (mean.type == kF32 || (half && mean.type == kF16) ||
                                             (bf16 && mean.type == kBF16)),
                  "LayerNormGrad: mean/inv_std must be float32 (or the data's 16-bit type)");
    const std::vector<int64_t> pshape(x.shape.begin() + ax, x.shape.end());
    void* dx = opt_out<void>(ctx, 0, x.shape);
    void* dg = opt_out<void>(ctx, 1, pshape);
    void* db = opt_out<void>(ctx, 2, pshape);
    void* s = ctx.GetGPUComputeStream();
    int err;
    if (half)
      err = fusecli_launch_layer_norm_grad_f16(
          s, dy.data, x.data, gamma.present ? gamma.data : nullptr, mean.data, rstd.data,
          mean.type == kF16, dr.present ? dr.data : nullptr, dx, dg, db, M, N);
    else if (bf16)
      err = fusecli_launch_layer_norm_grad_bf16(
          s, dy.data, x.data, gamma.present ? gamma.data : nullptr, mean.data, rstd.data,
          mean.type == kBF16, dr.present ? dr.data : nullptr, dx, dg, db, M, N);
    else
      err = fusecli_launch_layer_norm_grad(
          s, dy.ptr<float>(), x.ptr<float>(), gamma.present ? gamma.ptr<float>() : nullptr,
          mean.ptr<float>(), rstd.ptr<float>(), dr.present ? dr.ptr<float>() : nullptr,
          static_cast<float*>(dx), static_cast<float*>(dg), static_cast<float*>(db), M, N);
    check_cuda(err, "LayerNormGrad");
  }
};

}  // namespace

void add_layer_norm_grad_cuda_ops(Ort::CustomOpDomain& domain) {
  // no in-place pairs on CUDA: ln_rows_kernel reads dY / dR through __restrict__ pointers
  add_op<FusedOp<LnKernel, true, false>>(domain);
}

}  // namespace fusecli
