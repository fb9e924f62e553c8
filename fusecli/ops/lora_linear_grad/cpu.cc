// LoraLinearGrad: CPU kernel.
#include <memory>

#include "cpu_activation.h"
#include "cpu_eigen.h"
#include "cpu_gemm.h"
#include "cpu_kernel.h"
#include "cpu_threads.h"

namespace fusecli {
namespace {

// ============================= LoraLinearGrad ===============================================
// attributes: activation, alpha (its input scale), scale (the adapter's s), trans_w (W stored
// [K, N]), split_dx
struct LoraKernel : CpuKernel<LoraKernel, kLoraLinearGrad> {
  template <typename TOp>
  LoraKernel(const OrtKernelInfo* info, const TOp* op) : CpuKernel(info, op), mm(info) {}
  void Compute(Ort::KernelContext& ctx);
  OrtMatMul mm;
};

void LoraKernel::Compute(Ort::KernelContext& ctx) {
  In dy = get_input(ctx, 0), x = get_input(ctx, 1), a = get_input(ctx, 2), w = get_input(ctx, 3);
  In la = get_input(ctx, 4), lb = get_input(ctx, 5), h = get_input(ctx, 6), xd = get_input(ctx, 7);
  FUSECLI_CHECK(!dy.shape.empty() && !a.shape.empty(), "LoraLinearGrad: dY and A need rank >= 1");
  FUSECLI_CHECK(la.shape.size() == 2 && lb.shape.size() == 2, "LoraLinearGrad: La, Lb must be 2-D");
  const int64_t N = dy.shape.back(), K = a.shape.back(), R = la.shape[0];
  const int64_t M = N ? dy.numel() / N : 0;
  FUSECLI_CHECK(a.numel() == M * K, "LoraLinearGrad: A rows must match dY rows");
  FUSECLI_CHECK(la.shape[1] == K, "LoraLinearGrad: La must be [r, K]");
  FUSECLI_CHECK(lb.shape[0] == N && lb.shape[1] == R, "LoraLinearGrad: Lb must be [N, r]");
  FUSECLI_CHECK(h.numel() == M * R, "LoraLinearGrad: H must be [..., r] with dY's rows");
  FUSECLI_CHECK(!xd.present || xd.numel() == M * K, "LoraLinearGrad: Xd must have A's size");
  FUSECLI_CHECK(activation == Act::kIdentity || (x.present && x.numel() == M * N),
                "LoraLinearGrad: X (dY's size) is needed for the activation gradient");
  FUSECLI_CHECK(!w.present || (w.shape.size() == 2 && w.shape[0] == (trans_w ? K : N) &&
                               w.shape[1] == (trans_w ? N : K)),
                "LoraLinearGrad: W must be [N, K] (trans_w=0) or [K, N] (trans_w=1)");

  std::vector<int64_t> dx_shape = a.shape;
  bool want_dx, want_dxa, want_dla, want_dlb, want_dw, want_db, have_dz_out;
  float* dx = output_or_null<float>(ctx, 0, dx_shape, &want_dx);
  float* dxa = output_or_null<float>(ctx, 1, dx_shape, &want_dxa);
  float* dla = output_or_null<float>(ctx, 2, {R, K}, &want_dla);
  float* dlb = output_or_null<float>(ctx, 3, {N, R}, &want_dlb);
  float* dw = output_or_null<float>(
      ctx, 4, trans_w ? std::vector<int64_t>{K, N} : std::vector<int64_t>{N, K}, &want_dw);
  float* db = output_or_null<float>(ctx, 5, {N}, &want_db);
  float* dz_out = output_or_null<float>(ctx, 6, dy.shape, &have_dz_out);
  FUSECLI_CHECK(!want_dx || w.present, "LoraLinearGrad: dX is requested but W is absent");
  const float* dyp = dy.ptr<float>();
  const float* ap = a.ptr<float>();
  const float* xdp = xd.present ? xd.ptr<float>() : ap;
  if (M == 0) {
    if (want_dla) std::fill(dla, dla + R * K, 0.f);
    if (want_dlb) std::fill(dlb, dlb + N * R, 0.f);
    if (want_dw) std::fill(dw, dw + N * K, 0.f);
    if (want_db) std::fill(db, db + N, 0.f);
    return;
  }
  if (have_dz_out && dz_out == dyp) count_inplace(kLoraLinearGrad);

  // dZ = act'(X) dY, written to output 6 when named (possibly dY's own buffer: elementwise,
  // safe), else to a scratch buffer; identity reads dY itself.
  const bool act_pass = activation != Act::kIdentity;
  std::unique_ptr<float[]> dz_buf(act_pass && !have_dz_out ? new float[static_cast<size_t>(M * N)]
                                                           : nullptr);
  float* dz_store = have_dz_out ? dz_out : dz_buf.get();
  if (act_pass) {
    const float* xp = x.ptr<float>();
    parallel_for(M * N, 1 << 15, [&](int, int64_t i0, int64_t i1) {
      act_grad_block(activation, alpha, dyp + i0, xp + i0, dz_store + i0, i1 - i0);
    });
  } else if (have_dz_out && dz_out != dyp) {
    std::copy(dyp, dyp + M * N, dz_out);
  }
  const float* dz = act_pass ? dz_store : dyp;
  const OrtKernelContext* kc = ctx.GetOrtKernelContext();
  const float* lap = la.ptr<float>();
  const float* lbp = lb.ptr<float>();

  // every GEMM runs on onnxruntime's MLAS (OrtMatMul, the session's threads); the scale is folded
  // into a copy of Lb once: sLb = s Lb [N, r]
  std::vector<float> slb(static_cast<size_t>(N * R));
  for (int64_t i = 0; i < N * R; ++i) slb[i] = scale * lbp[i];
  // G[M,r] = dZ sLb: the adapter's hidden gradient, needed by dLa and by the adapter's dX
  const bool need_g = want_dla || want_dxa || (want_dx && !split_dx);
  std::unique_ptr<float[]> g(need_g ? new float[static_cast<size_t>(M * R)] : nullptr);
  if (need_g) mm.run(kc, false, false, 1, M, R, N, dz, slb.data(), g.get());
  if (want_dx) {  // dX[M,K] = dZ W (+ G La)  |  dZ W^T with W stored [K,N]
    const float* wp = w.ptr<float>();
    if (!split_dx && M >= N) {
      // dZ W + (dZ sLb) La = dZ (W + sLb La): one GEMM over the effective weight, in W's layout
      // (its N K r multiply-adds are fewer than the M K r of G La, and no second pass over dX)
      std::unique_ptr<float[]> weff(new float[static_cast<size_t>(N * K)]);
      if (!trans_w)
        mm.run(kc, false, false, 1, N, K, R, slb.data(), lap, weff.get());  // [N,K] = sLb La
      else
        mm.run(kc, true, true, 1, K, N, R, lap, slb.data(), weff.get());  // [K,N] = La^T sLb^T
      float* we = weff.get();
      parallel_for(N * K, 1 << 15, [&](int, int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) we[i] += wp[i];
      });
      mm.run(kc, false, trans_w, 1, M, K, N, dz, we, dx);
    } else {
      mm.run(kc, false, trans_w, 1, M, K, N, dz, wp, dx);
      if (!split_dx) gemm(false, false, M, K, R, 1.f, g.get(), R, lap, K, 1.f, dx, K);
    }
  }
  if (want_dxa) mm.run(kc, false, false, 1, M, K, R, g.get(), lap, dxa);  // G La
  if (want_dla) mm.run(kc, true, false, 1, R, K, M, g.get(), xdp, dla);   // G^T Xd
  if (want_dlb) {                                                         // dLb[N,r] = s dZ^T H
    mm.run(kc, true, false, 1, N, R, M, dz, h.ptr<float>(), dlb);
    for (int64_t i = 0; i < N * R; ++i) dlb[i] *= scale;
  }
  if (want_dw) {
    if (!trans_w)
      mm.run(kc, true, false, 1, N, K, M, dz, ap, dw);  // dW[N,K] = dZ^T A
    else
      mm.run(kc, true, false, 1, K, N, M, ap, dz, dw);  // dW[K,N] = A^T dZ
  }
  if (want_db) {
    const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, N));
    const int T = planned_threads(M, grain);
    std::vector<float> part(static_cast<size_t>(T * N), 0.f);
    parallel_for(
        M, grain,
        [&](int t, int64_t r0, int64_t r1) {
          MA acc(part.data() + t * N, N);
          for (int64_t i = r0; i < r1; ++i) acc += CA(dz + i * N, N);
        },
        T);
    MA out(db, N);
    out = CA(part.data(), N);
    for (int t = 1; t < T; ++t) out += CA(part.data() + t * N, N);
  }
}

}  // namespace

void add_lora_linear_grad_cpu_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<LoraKernel>>(domain);
}

}  // namespace fusecli
