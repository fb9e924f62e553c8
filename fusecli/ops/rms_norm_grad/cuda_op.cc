// RMSNormGrad: onnxruntime CUDAExecutionProvider kernel (calls the C launcher in cuda.cu).
#include "cuda_op_kernel.h"
#include "op_launchers.h"

namespace fusecli {
namespace {

struct RmsKernel : CudaKernel<RmsKernel, kRMSNormGrad> {  // attributes: axis, epsilon
  using CudaKernel::CudaKernel;
  void Compute(Ort::KernelContext& ctx) {
    In dy = get_input(ctx, 0), x = get_input(ctx, 1), gamma = get_input(ctx, 2);
    In rstd = get_input(ctx, 3), dr = get_input(ctx, 4);
    const AxisRows rows = rows_from_axis(x.shape, axis, "RMSNormGrad");
    const size_t ax = rows.ax;
    const int64_t M = rows.M, N = rows.N;
    FUSECLI_CHECK(dy.numel() == x.numel() && (!gamma.present || gamma.numel() == N) &&
                      (!rstd.present || rstd.numel() == M) && (!dr.present || dr.numel() == M * N),
                  "RMSNormGrad: shape mismatch");
    FUSECLI_CHECK(!rstd.present || rstd.type == kF32 || (half && rstd.type == kF16) ||
                      (bf16 && rstd.type == kBF16),
                  "RMSNormGrad: inv_rms must be float32 (or the data's 16-bit type)");
    const std::vector<int64_t> pshape(x.shape.begin() + ax, x.shape.end());
    void* dx = opt_out<void>(ctx, 0, x.shape);
    void* dg = opt_out<void>(ctx, 1, pshape);
    void* s = ctx.GetGPUComputeStream();
    const void* rs = rstd.present ? rstd.data : nullptr;
    int err;
    if (half)
      err = fusecli_launch_rms_norm_grad_f16(
          s, dy.data, x.data, gamma.present ? gamma.data : nullptr, rs,
          rstd.present && rstd.type == kF16, epsilon, dr.present ? dr.data : nullptr, dx, dg, M, N);
    else if (bf16)
      err = fusecli_launch_rms_norm_grad_bf16(s, dy.data, x.data,
                                              gamma.present ? gamma.data : nullptr, rs,
                                              rstd.present && rstd.type == kBF16, epsilon,
                                              dr.present ? dr.data : nullptr, dx, dg, M, N);
    else
      err = fusecli_launch_rms_norm_grad(
          s, dy.ptr<float>(), x.ptr<float>(), gamma.present ? gamma.ptr<float>() : nullptr,
          static_cast<const float*>(rs), epsilon, dr.present ? dr.ptr<float>() : nullptr,
          static_cast<float*>(dx), static_cast<float*>(dg), M, N);
    check_cuda(err, "RMSNormGrad");
  }
};

}  // namespace

void add_rms_norm_grad_cuda_ops(Ort::CustomOpDomain& domain) {
  // no in-place pairs on CUDA: rms_rows_kernel reads dY / dR through __restrict__ pointers
  add_op<FusedOp<RmsKernel, true, false>>(domain);
}

}  // namespace fusecli
