// LoraLinearGrad: onnxruntime CUDAExecutionProvider kernel (calls the C launcher in cuda.cu).
#include "cuda_op_kernel.h"
#include "op_launchers.h"

namespace fusecli {
namespace {

// attributes: activation, alpha, scale, trans_w, split_dx
struct LoraKernel : CudaKernel<LoraKernel, kLoraLinearGrad> {
  using CudaKernel::CudaKernel;
  void Compute(Ort::KernelContext& ctx) {
    In dy = get_input(ctx, 0), x = get_input(ctx, 1), a = get_input(ctx, 2), w = get_input(ctx, 3);
    In la = get_input(ctx, 4), lb = get_input(ctx, 5), h = get_input(ctx, 6),
       xd = get_input(ctx, 7);
    FUSECLI_CHECK(!dy.shape.empty() && !a.shape.empty() && la.shape.size() == 2 &&
                      lb.shape.size() == 2 && (!w.present || w.shape.size() == 2),
                  "LoraLinearGrad: bad ranks");
    const int64_t N = dy.shape.back(), K = a.shape.back(), R = la.shape[0];
    const int64_t M = N ? dy.numel() / N : 0;
    FUSECLI_CHECK(a.numel() == M * K && la.shape[1] == K && lb.shape[0] == N && lb.shape[1] == R &&
                      h.numel() == M * R && (!xd.present || xd.numel() == M * K) &&
                      (!w.present || (trans_w ? (w.shape[0] == K && w.shape[1] == N)
                                              : (w.shape[0] == N && w.shape[1] == K))),
                  "LoraLinearGrad: shape mismatch");
    FUSECLI_CHECK(activation == Act::kIdentity || (x.present && x.numel() == M * N),
                  "LoraLinearGrad: X (dY's size) is needed for the activation gradient");
    float* dx = opt_out<float>(ctx, 0, a.shape);
    FUSECLI_CHECK(!dx || w.present, "LoraLinearGrad: dX is requested but W is absent");
    float* dxa = opt_out<float>(ctx, 1, a.shape);
    float* dla = opt_out<float>(ctx, 2, {R, K});
    float* dlb = opt_out<float>(ctx, 3, {N, R});
    float* dw =
        opt_out<float>(ctx, 4, trans_w ? std::vector<int64_t>{K, N} : std::vector<int64_t>{N, K});
    float* db = opt_out<float>(ctx, 5, {N});
    float* dz = opt_out<float>(ctx, 6, dy.shape);
    check_cuda(
        fusecli_launch_lora_linear_grad(
            ctx.GetGPUComputeStream(), dy.ptr<float>(), x.present ? x.ptr<float>() : nullptr,
            a.ptr<float>(), w.present ? w.ptr<float>() : nullptr, la.ptr<float>(), lb.ptr<float>(),
            h.ptr<float>(), xd.present ? xd.ptr<float>() : nullptr, dx, dxa, dla, dlb, dw, db, dz,
            M, N, K, R, act_code(activation), alpha, scale, trans_w, split_dx),
        "LoraLinearGrad");
  }
};

}  // namespace

void add_lora_linear_grad_cuda_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<LoraKernel, true>>(domain);
}

}  // namespace fusecli
