// LinearActivationGrad: onnxruntime CUDAExecutionProvider kernel (calls the C launcher in cuda.cu).
#include "cuda_op_kernel.h"
#include "op_launchers.h"

namespace fusecli {
namespace {

// attributes: activation, alpha, trans_w, trans_dw
struct LinKernel : CudaKernel<LinKernel, kLinearActivationGrad> {
  using CudaKernel::CudaKernel;
  void Compute(Ort::KernelContext& ctx) {
    In dy = get_input(ctx, 0), x = get_input(ctx, 1), a = get_input(ctx, 2), w = get_input(ctx, 3);
    FUSECLI_CHECK(!dy.shape.empty() && (!a.present || !a.shape.empty()) &&
                      (!w.present || w.shape.size() == 2),
                  "LinearActivationGrad: bad ranks");
    // K: A's last dim; without A (a frozen weight: no dW), W's input dim
    const int64_t N = dy.shape.back();
    const int64_t K = a.present ? a.shape.back() : w.present ? w.shape[trans_w ? 0 : 1] : 0;
    int64_t M = 1;  // the rows: every dim of dY but the last (0 rows or N = 0 alike)
    for (size_t i = 0; i + 1 < dy.shape.size(); ++i) M *= dy.shape[i];
    FUSECLI_CHECK(x.numel() == dy.numel() && (!a.present || a.numel() == M * K),
                  "LinearActivationGrad: shape mismatch");
    FUSECLI_CHECK(!w.present || (trans_w ? (w.shape[0] == K && w.shape[1] == N)
                                         : (w.shape[0] == N && w.shape[1] == K)),
                  "LinearActivationGrad: W shape does not match trans_w");
    std::vector<int64_t> da_shape = a.present ? a.shape
                                    : flat_da ? std::vector<int64_t>{M, K}
                                              : dy.shape;
    da_shape.back() = K;
    float* da = opt_out<float>(ctx, 0, da_shape);
    FUSECLI_CHECK(!da || w.present, "LinearActivationGrad: dA is requested but W is absent");
    float* dw =
        opt_out<float>(ctx, 1, trans_dw ? std::vector<int64_t>{K, N} : std::vector<int64_t>{N, K});
    FUSECLI_CHECK(!dw || a.present, "LinearActivationGrad: dW is requested but A is absent");
    float* db = opt_out<float>(ctx, 2, {N});
    float* dz = opt_out<float>(ctx, 3, dy.shape);
    check_cuda(fusecli_launch_linear_activation_grad(
                   ctx.GetGPUComputeStream(), dy.ptr<float>(), x.ptr<float>(),
                   a.present ? a.ptr<float>() : nullptr, w.present ? w.ptr<float>() : nullptr, da,
                   dw, db, dz, M, N, K, act_code(activation), alpha, trans_w, trans_dw),
               "LinearActivationGrad");
  }
};

}  // namespace

void add_linear_activation_grad_cuda_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<LinKernel, true>>(domain);
}

}  // namespace fusecli
