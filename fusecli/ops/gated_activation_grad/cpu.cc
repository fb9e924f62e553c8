// GatedActivationGrad: CPU kernel (Eigen array expressions in L1-sized blocks, threads).
#include <algorithm>

#include "cpu_activation.h"
#include "cpu_eigen.h"
#include "cpu_kernel.h"

namespace fusecli {
namespace {

constexpr int64_t kBlock = 1024;

#if defined(__AVX512F__)
// da = dh * b * g, db = dh * f over [0, n), one pass: each element of dh, a, b is loaded
// before da / db at that position are stored (da may be dh, db may be b).
template <Act A>
void gated16(const float* dh, const float* a, const float* b, float* da, float* db, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m =
        n - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 d = _mm512_maskz_loadu_ps(m, dh + i);
    const __m512 bb = _mm512_maskz_loadu_ps(m, b + i);
    __m512 g;
    const __m512 f = act_and_grad16<A>(_mm512_maskz_loadu_ps(m, a + i), &g);
    if (da) _mm512_mask_storeu_ps(da + i, m, _mm512_mul_ps(_mm512_mul_ps(d, bb), g));
    if (db) _mm512_mask_storeu_ps(db + i, m, _mm512_mul_ps(d, f));
  }
}
#elif defined(__ARM_NEON)
// gated16 on 4 NEON lanes (the same one pass: loads before the stores at each position)
template <Act A>
void gated4(const float* dh, const float* a, const float* b, float* da, float* db, int64_t n) {
  for (int64_t i = 0; i < n; i += 4) {
    const int64_t m = n - i;
    const float32x4_t d = load4(dh + i, m), bb = load4(b + i, m);
    float32x4_t g;
    const float32x4_t f = act_and_grad4<A>(load4(a + i, m), &g);
    if (da) store4(da + i, vmulq_f32(vmulq_f32(d, bb), g), m);
    if (db) store4(db + i, vmulq_f32(d, f), m);
  }
}
#endif

// One block: da = dh * b * g, db = dh * f. da may be dh and db may be b (read before written).
void gated_block(Act act, float alpha, const float* dh, const float* a, const float* b, float* da,
                 float* db, int64_t len) {
#if defined(__AVX512F__)
  if (alpha == 1.f && act == Act::kSilu) return gated16<Act::kSilu>(dh, a, b, da, db, len);
  if (alpha == 1.f && act == Act::kGelu) return gated16<Act::kGelu>(dh, a, b, da, db, len);
#elif defined(__ARM_NEON)
  if (alpha == 1.f && act == Act::kSilu) return gated4<Act::kSilu>(dh, a, b, da, db, len);
  if (alpha == 1.f && act == Act::kGelu) return gated4<Act::kGelu>(dh, a, b, da, db, len);
#endif
  alignas(64) float fbuf[kBlock], gbuf[kBlock];
  act_and_grad_block(act, alpha, a, fbuf, gbuf, len);
  CA d(dh, len), bb(b, len);
  MA f(fbuf, len), g(gbuf, len);
  f = d * f;                         // dB, kept until da is written (db may alias b)
  if (da) MA(da, len) = d * bb * g;  // da may alias dh: coefficient-wise, read then write
  if (db) MA(db, len) = f;
}

struct GatedKernel : CpuKernel<GatedKernel, kGatedActivationGrad> {  // activation, alpha
  using CpuKernel::CpuKernel;
  void Compute(Ort::KernelContext& ctx);
};

void GatedKernel::Compute(Ort::KernelContext& ctx) {
  In dh = get_input(ctx, 0), a = get_input(ctx, 1), b = get_input(ctx, 2);
  FUSECLI_CHECK(dh.shape == a.shape && dh.shape == b.shape,
                "GatedActivationGrad: dH, A and B must have the same shape");
  const int64_t n = dh.numel();
  bool pa, pb;
  if (!half) {
    float* da = output_or_null<float>(ctx, 0, dh.shape, &pa);
    float* db = output_or_null<float>(ctx, 1, dh.shape, &pb);
    if (!pa && !pb) return;
    if ((pa && da == dh.data) || (pb && db == b.data)) count_inplace(kGatedActivationGrad);
    const float *d = dh.ptr<float>(), *x = a.ptr<float>(), *y = b.ptr<float>();
    parallel_for(n, 1 << 14, [&](int, int64_t s, int64_t e) {
      for (int64_t i = s; i < e; i += kBlock) {
        const int64_t len = std::min(kBlock, e - i);
        gated_block(activation, alpha, d + i, x + i, y + i, pa ? da + i : nullptr,
                    pb ? db + i : nullptr, len);
      }
    });
  } else {
    auto* da = output_or_null<Ort::Float16_t>(ctx, 0, dh.shape, &pa);
    auto* db = output_or_null<Ort::Float16_t>(ctx, 1, dh.shape, &pb);
    if (!pa && !pb) return;
    if ((pa && da == dh.data) || (pb && db == b.data)) count_inplace(kGatedActivationGrad);
    const auto* d = dh.ptr<Ort::Float16_t>();
    const auto* x = a.ptr<Ort::Float16_t>();
    const auto* y = b.ptr<Ort::Float16_t>();
    parallel_for(n, 1 << 14, [&](int, int64_t s, int64_t e) {
      alignas(64) float fd[kBlock], fx[kBlock], fy[kBlock];
      for (int64_t i = s; i < e; i += kBlock) {
        const int64_t len = std::min(kBlock, e - i);
        half_to_float(d + i, fd, len);
        half_to_float(x + i, fx, len);
        half_to_float(y + i, fy, len);
        gated_block(activation, alpha, fd, fx, fy, fd, fy, len);  // dA over fd, dB over fy
        if (pa) float_to_half(fd, da + i, len);
        if (pb) float_to_half(fy, db + i, len);
      }
    });
  }
}

}  // namespace

void add_gated_activation_grad_cpu_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<GatedKernel>>(domain);
}

}  // namespace fusecli
