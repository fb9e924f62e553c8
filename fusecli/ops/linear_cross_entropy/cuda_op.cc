// LinearCrossEntropy: onnxruntime CUDAExecutionProvider kernel (calls the C launcher in cuda.cu).
#include "cuda_op_kernel.h"
#include "lce_rows.h"
#include "op_launchers.h"

namespace fusecli {
namespace {

// attributes: ignore_index, wrap_negative, reduction, grad_scale, logit_scale, logit_softcap,
// lp_row_reduce, chunk_rows, seq_start, seq_end
struct LceKernel : CudaKernel<LceKernel, kLinearCrossEntropy> {
  using CudaKernel::CudaKernel;
  void Compute(Ort::KernelContext& ctx) {
    In h = get_input(ctx, 0), w = get_input(ctx, 1), b = get_input(ctx, 2), lab = get_input(ctx, 3),
       rw = get_input(ctx, 4), rg = get_input(ctx, 5), seed = get_input(ctx, 6),
       add_i = get_input(ctx, 7), add_r = get_input(ctx, 8), ug = get_input(ctx, 9),
       sidx = get_input(ctx, 10);
    FUSECLI_CHECK(!h.shape.empty() && w.shape.size() == 2 && w.shape[1] == h.shape.back(),
                  "LinearCrossEntropy: H [..., D] and W [V, D] needed");
    const int64_t D = h.shape.back(), V = w.shape[0];
    const LceRows rows = lce_rows(h, D, seq_start, seq_end, sidx);
    const int64_t S = rows.s, s0 = rows.s0, s1 = rows.s1, G = rows.g, N = rows.n;
    FUSECLI_CHECK(lab.numel() == N && (!b.present || b.numel() == V) &&
                      (!rw.present || rw.numel() == N) && (!rg.present || rg.numel() == N) &&
                      (!seed.present || seed.numel() == 1) && (!ug.present || ug.numel() == N),
                  "LinearCrossEntropy: shape mismatch");
    FUSECLI_CHECK(reduction == "mean" || reduction == "sum" || reduction == "none",
                  "LinearCrossEntropy: reduction must be mean, sum or none");
    const bool none = reduction == "none";  // loss: each row's, shaped as H's leading dims
    float* loss = opt_out<float>(ctx, 0, none ? lab.shape : std::vector<int64_t>{});
    float* dh = opt_out<float>(ctx, 1, h.shape);
    float* dw = opt_out<float>(ctx, 2, w.shape);
    float* db = opt_out<float>(ctx, 3, {V});
    float* lp_row = opt_out<float>(ctx, 4, {N});
    FUSECLI_CHECK(!lp_row || lp_row_labels_ok(lab),
                  "LinearCrossEntropy: lp_row needs labels [N] or [N, 1]");
    FUSECLI_CHECK(lp_row_reduce == "sum" || lp_row_reduce == "mean",
                  "LinearCrossEntropy: lp_row_reduce must be sum or mean");
    FUSECLI_CHECK(!db || b.present, "LinearCrossEntropy: dB is requested but bias is absent");
    FUSECLI_CHECK(add_i.present == add_r.present && (!add_i.present || dw) &&
                      (!add_i.present || add_r.numel() == add_i.numel() * D),
                  "LinearCrossEntropy: dw_add_index and dw_add_rows go together, with dW, D "
                  "values per index");
    check_cuda(fusecli_launch_linear_cross_entropy(
                   ctx.GetGPUComputeStream(), h.ptr<float>(), w.ptr<float>(),
                   b.present ? b.ptr<float>() : nullptr, lab.ptr<int64_t>(),
                   rw.present ? rw.ptr<float>() : nullptr, rg.present ? rg.ptr<float>() : nullptr,
                   seed.present ? seed.ptr<float>() : nullptr, loss, dh, dw, db, N, V, D,
                   ignore_index, wrap_negative ? 1 : 0, reduction == "mean" ? 0 : (none ? 2 : 1),
                   grad_scale, logit_scale, logit_softcap, chunk_rows, G, S, s0, s1,
                   add_i.present ? add_i.ptr<int64_t>() : nullptr,
                   add_r.present ? add_r.ptr<float>() : nullptr, add_i.present ? add_i.numel() : 0,
                   ug.present ? ug.ptr<float>() : nullptr, lp_row, lp_row_reduce == "mean" ? 1 : 0,
                   sidx.present ? sidx.ptr<int64_t>() : nullptr),
               "LinearCrossEntropy");
  }
};

}  // namespace

void add_linear_cross_entropy_cuda_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<LceKernel, true>>(domain);
}

}  // namespace fusecli
