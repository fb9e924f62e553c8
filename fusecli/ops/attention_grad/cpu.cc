// AttentionGrad: CPU kernel.
#include <chrono>
#include <cmath>
#include <memory>

#include "attention_inputs.h"
#include "cpu_eigen.h"
#include "cpu_gemm.h"
#include "cpu_threads.h"

namespace fusecli {
namespace {

// ================================= AttentionGrad ============================================
struct AttnOp;
struct AttnKernel : AttnAttrs {
  AttnKernel(const OrtKernelInfo* info, const AttnOp*) : AttnAttrs(info), mm(info) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* c) { return guarded([&] { Compute(c); }); }
  void Compute(OrtKernelContext* c);
  OrtMatMul mm;
};
struct AttnOp : SigOp<AttnOp, AttnKernel, kAttentionGrad> {
  explicit AttnOp(bool half) : SigOp(nullptr, half) {}
};

void AttnKernel::Compute(OrtKernelContext* c) {
  PoolScope pool(c);
  count_call(kAttentionGrad);
  Ort::KernelContext ctx(c);
  const AttnInputs in(ctx, *this);
  const In &dO = in.dO, &q = in.q, &k = in.k, &v = in.v, &p = in.p;
  const int64_t B = in.B, Sq = in.Sq, Sk = in.Sk, D = in.D, Dv = in.Dv;
  const float scale_q = this->scale_q * (in.qs.present ? in.qs.ptr<float>()[0] : 1.f);
  const float scale_k = this->scale_k * (in.ks.present ? in.ks.ptr<float>()[0] : 1.f);

  bool want_dq, want_dk, want_dv;
  float* dq = output_or_null<float>(ctx, 0, q.shape, &want_dq);
  float* dk = output_or_null<float>(ctx, 1, k.shape, &want_dk);
  float* dv = output_or_null<float>(ctx, 2, v.shape, &want_dv);
  if (B == 0) return;
  const float* dOp = dO.ptr<float>();
  const float* qp = q.ptr<float>();
  const float* kp = k.ptr<float>();
  const float* vp = v.ptr<float>();
  const float* pp = p.ptr<float>();

  const OrtKernelContext* kc = ctx.GetOrtKernelContext();
  const bool need_ds = want_dq || want_dk;
  // dS is stored pre-multiplied by f (= scale_q unless that is 0 or not finite), so dQ needs no
  // extra pass and dK one only when scale_k != scale_q.
  const float f = (std::fabs(scale_q) >= 1e-20f && std::fabs(scale_q) <= 1e20f) ? scale_q : 1.f;
  // Batch items go in chunks whose dS scratch (~2 MiB) stays in cache between the dP GEMM, the
  // softmax-backward pass and the dQ / dK GEMMs; each GEMM is one batched onnxruntime MatMul.
  const int64_t item = Sq * Sk;
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(B, (int64_t(1) << 19) / std::max<int64_t>(1, item)));
  std::unique_ptr<float[]> ds(need_ds ? new float[static_cast<size_t>(chunk * item)] : nullptr);
  for (int64_t b0 = 0; b0 < B; b0 += chunk) {
    const int64_t nb = std::min(chunk, B - b0);
    const float* dOb = dOp + b0 * Sq * Dv;
    const float* qb = qp + b0 * Sq * D;
    const float* kb = kp + b0 * Sk * D;
    const float* vb = vp + b0 * Sk * Dv;
    const float* pb = pp + b0 * item;
    if (want_dv) mm.run(kc, true, false, nb, Sk, Dv, Sq, pb, dOb, dv + b0 * Sk * Dv);  // P^T dO
    if (!need_ds) continue;
    mm.run(kc, false, true, nb, Sq, Sk, Dv, dOb, vb, ds.get());  // dP = dO V^T
    // dS = f * P * (dP - rowsum(dP * P)), in place, rows split over threads
    const int64_t rows = nb * Sq;
    const auto t0 = std::chrono::steady_clock::now();
    parallel_for(rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, Sk)), [&](int, int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) {
        MA d(ds.get() + i * Sk, Sk);
        CA pr(pb + i * Sk, Sk);
        const float rs = (d * pr).sum();
        d = (f * pr) * (d - rs);
      }
    });
    add_phase_ns(kAttnSoftmaxPhase, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now() - t0).count());
    if (want_dq) {
      float* dqb = dq + b0 * Sq * D;
      mm.run(kc, false, k_transposed, nb, Sq, D, Sk, ds.get(), kb, dqb);  // dS K (K as [Sk, D])
      if (scale_q != f) MA(dqb, nb * Sq * D) *= scale_q / f;
    }
    if (want_dk) {
      float* dkb = dk + b0 * Sk * D;
      if (!k_transposed) mm.run(kc, true, false, nb, Sk, D, Sq, ds.get(), qb, dkb);  // dS^T Q
      else mm.run(kc, true, false, nb, D, Sk, Sq, qb, ds.get(), dkb);                // Q^T dS
      if (scale_k != f) MA(dkb, nb * Sk * D) *= scale_k / f;
    }
  }
}

}  // namespace

void add_attention_grad_cpu_ops(Ort::CustomOpDomain& domain) {
  add_op<AttnOp>(domain);
}

}  // namespace fusecli
