// LinearActivationGrad: CPU kernel.
#include <memory>

#include "cpu_activation.h"
#include "cpu_eigen.h"
#include "cpu_gemm.h"
#include "cpu_kernel.h"

namespace fusecli {
namespace {

// ============================= LinearActivationGrad =========================================
// attributes: activation, alpha (its input scale), trans_w / trans_dw (layout of the W input / of
// the dW output: [K, N] when set), flat_da (without A: dA as the 2-D [rows, K])
struct LinKernel : CpuKernel<LinKernel, kLinearActivationGrad> {
  template <typename TOp>
  LinKernel(const OrtKernelInfo* info, const TOp* op) : CpuKernel(info, op), mm(info) {}
  void Compute(Ort::KernelContext& ctx);
  OrtMatMul mm;
};

void LinKernel::Compute(Ort::KernelContext& ctx) {
  In dy = get_input(ctx, 0), x = get_input(ctx, 1), a = get_input(ctx, 2), w = get_input(ctx, 3);
  FUSECLI_CHECK(!dy.shape.empty() && (!a.present || !a.shape.empty()),
                "LinearActivationGrad: dY and A need rank >= 1");
  FUSECLI_CHECK(!w.present || w.shape.size() == 2, "LinearActivationGrad: W must be 2-D");
  // K: A's last dim; without A (a frozen weight: no dW), W's input dim
  const int64_t N = dy.shape.back();
  const int64_t K = a.present ? a.shape.back() : w.present ? w.shape[trans_w ? 0 : 1] : 0;
  int64_t M = 1;  // the rows: every dim of dY but the last (0 rows or N = 0 alike)
  for (size_t i = 0; i + 1 < dy.shape.size(); ++i) M *= dy.shape[i];
  FUSECLI_CHECK(x.numel() == dy.numel(), "LinearActivationGrad: X and dY must have the same size");
  FUSECLI_CHECK(!a.present || a.numel() == M * K,
                "LinearActivationGrad: A rows must match dY rows");
  if (w.present) {
    if (!trans_w)
      FUSECLI_CHECK(w.shape[0] == N && w.shape[1] == K,
                    "LinearActivationGrad: W must be [N, K] (trans_w=0)");
    else
      FUSECLI_CHECK(w.shape[0] == K && w.shape[1] == N,
                    "LinearActivationGrad: W must be [K, N] (trans_w=1)");
  }
  const std::vector<int64_t> w_shape =
      trans_dw ? std::vector<int64_t>{K, N} : std::vector<int64_t>{N, K};
  // dA: A's shape; without A, dY's leading dims or (flat_da) the 2-D [rows, K]
  std::vector<int64_t> da_shape = a.present ? a.shape
                                  : flat_da ? std::vector<int64_t>{M, K}
                                            : dy.shape;
  da_shape.back() = K;

  bool want_da, want_dw, want_db;
  float* da = output_or_null<float>(ctx, 0, da_shape, &want_da);
  FUSECLI_CHECK(!want_da || w.present, "LinearActivationGrad: dA is requested but W is absent");
  float* dw = output_or_null<float>(ctx, 1, w_shape, &want_dw);
  FUSECLI_CHECK(!want_dw || a.present, "LinearActivationGrad: dW is requested but A is absent");
  float* db = output_or_null<float>(ctx, 2, {N}, &want_db);
  // dZ is written to output 3 when the node names it. The runtime may have placed that output in
  // dY's buffer (in-place pair dY -> dZ): the activation pass reads and writes each element at
  // the same position, so that is safe. Otherwise a GEMM that needs dZ gets a scratch buffer;
  // identity needs none (dZ is dY).
  bool have_dz_out;
  float* dz_out = output_or_null<float>(ctx, 3, dy.shape, &have_dz_out);
  const bool need_gemm = want_da || want_dw;
  const bool store_dz = have_dz_out || (need_gemm && activation != Act::kIdentity);
  if (!want_da && !want_dw && !want_db && !have_dz_out) return;

  const float* dyp = dy.ptr<float>();
  const float* xp = x.ptr<float>();
  const float* ap = a.present ? a.ptr<float>() : nullptr;
  const float* wp = w.present ? w.ptr<float>() : nullptr;
  if (M == 0 || N == 0) {  // empty: dA is a sum over N = 0 terms (zeros), the rest is empty
    if (want_da) std::fill(da, da + M * K, 0.f);
    if (want_dw) std::fill(dw, dw + N * K, 0.f);
    if (want_db) std::fill(db, db + N, 0.f);
    return;
  }
  if (have_dz_out && dz_out == dyp) count_inplace(kLinearActivationGrad);
  if (have_dz_out && activation == Act::kIdentity && dz_out != dyp)
    std::copy(dyp, dyp + M * N, dz_out);
  // One pass over (dY, X): dZ = dY * act'(X) in row tiles that stay in L1/L2 while dB's per-thread
  // partial sums read them back. dZ is stored only when a GEMM needs it or output 3 asks for it.
  std::unique_ptr<float[]> dz_buf(store_dz && !have_dz_out ? new float[static_cast<size_t>(M * N)]
                                                           : nullptr);
  float* dz_store = have_dz_out ? dz_out : dz_buf.get();
  const float* dz = store_dz ? dz_store : dyp;
  if (store_dz || want_db) {
    const int64_t tile_rows = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, N));
    const int64_t grain = std::max<int64_t>(tile_rows, (1 << 15) / std::max<int64_t>(1, N));
    const int T = planned_threads(M, grain);
    std::vector<float> part(want_db ? static_cast<size_t>(T * N) : 0, 0.f);
    parallel_for(
        M, grain,
        [&](int t, int64_t r0, int64_t r1) {
          std::unique_ptr<float[]> tmp(
              !store_dz && activation != Act::kIdentity ? new float[tile_rows * N] : nullptr);
          MA acc(want_db ? part.data() + t * N : nullptr, want_db ? N : 0);
          for (int64_t i = r0; i < r1; i += tile_rows) {
            const int64_t rows = std::min(tile_rows, r1 - i);
            const float* src = dyp + i * N;
            if (activation != Act::kIdentity) {
              float* dst = store_dz ? dz_store + i * N : tmp.get();
              act_grad_block(activation, alpha, dyp + i * N, xp + i * N, dst, rows * N);
              src = dst;
            }
            if (want_db)
              for (int64_t r = 0; r < rows; ++r) acc += CA(src + r * N, N);
          }
        },
        T);
    if (want_db) {
      add_work(kWorkLinDbRows, M);
      MA out(db, N);
      out = CA(part.data(), N);
      for (int t = 1; t < T; ++t) out += CA(part.data() + t * N, N);
    }
  }
  const OrtKernelContext* kc = ctx.GetOrtKernelContext();
  if (want_da)  // dA[M,K] = dZ[M,N] W[N,K]  |  dZ W^T with W stored [K,N]
    mm.run(kc, false, trans_w, 1, M, K, N, dz, wp, da);
  if (want_dw) {
    if (!trans_dw)
      mm.run(kc, true, false, 1, N, K, M, dz, ap, dw);  // dW[N,K] = dZ^T A
    else
      mm.run(kc, true, false, 1, K, N, M, ap, dz, dw);  // dW[K,N] = A^T dZ
  }
}

}  // namespace

void add_linear_activation_grad_cpu_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<LinKernel>>(domain);
}

}  // namespace fusecli
