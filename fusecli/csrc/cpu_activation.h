// CPU activation-gradient math (ActivationGrad, LinearActivationGrad).
#pragma once

#include "cpu_rows.h"
#include "op_kernel.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace fusecli {

// ---- activations --------------------------------------------------------------------------
// Act comes from op_tables.h (domain.yaml's activations); a kernel's Act attribute is read by
// attr_act (op_kernel.h) through its generated OpAttrs.
// out[i] = dy[i] * act'(alpha x[i]) for a contiguous block (vectorized through Eigen arrays):
// the gradient of the activation at input scale alpha, act(alpha x) / alpha (silu at
// alpha = 1.702 is QuickGELU, x sigmoid(1.702 x)).
void act_grad_block(Act act, float alpha, const float* dy, const float* x, float* out, int64_t n);
// f[i] = act(alpha a[i]) / alpha and g[i] = act'(alpha a[i]) for a block of at most 1024
// (silu, gelu, gelu_tanh: the gated activations; GatedActivationGrad's generic path).
void act_and_grad_block(Act act, float alpha, const float* a, float* f, float* g, int64_t n);

#if defined(__AVX512F__)
// ---- 16-lane float math shared by the activation kernels ----------------------------------
// e^x on 16 lanes: n = round(x log2 e), r = x - n ln2 (ln2 split in two), degree-6 polynomial
// for e^r, then scalef by 2^n. Relative error about 2 ulp over [-87, 88] (inputs are clamped).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.f), _mm512_min_ps(_mm512_set1_ps(88.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
// 1/a: 14-bit estimate refined by one Newton step (about 23 bits), no divide unit.
inline __m512 recip16(__m512 a) {
  const __m512 y = _mm512_rcp14_ps(a);
  return _mm512_mul_ps(y, _mm512_fnmadd_ps(a, y, _mm512_set1_ps(2.f)));
}
// Phi(v) = 0.5 erfc(-v / sqrt 2) from Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7), whose
// exp(-z^2) is exp(-v^2 / 2), the same factor as gelu's density term v phi(v): *e_out gets it.
inline __m512 phi16(__m512 v, __m512* e_out) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = exp16(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(-0.5f), v), v));
  const __m512 t = recip16(
      _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f * 0.70710678118654752f), _mm512_abs_ps(v), one));
  __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(1.061405429f), t, _mm512_set1_ps(-1.453152027f));
  q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(1.421413741f));
  q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(-0.284496736f));
  q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(0.254829592f));
  const __m512 h = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), t), q), e);
  const __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
  *e_out = e;
  return _mm512_mask_blend_ps(neg, _mm512_sub_ps(one, h), h);
}
// f = act(v) and *g = act'(v) on 16 lanes, for silu (one exponential, no divide: s = 1 / (1 + e),
// e = e^-v, and 1 - s = e s, no cancellation where s rounds to 1) and gelu (erf form, one
// exponential: phi16's Phi(v) and exp(-v^2 / 2)). The one source of both formulas for
// ActivationGrad (g only: the compiler drops f) and GatedActivationGrad (both).
template <Act A> inline __m512 act_and_grad16(__m512 v, __m512* g) {
  static_assert(A == Act::kSilu || A == Act::kGelu, "act_and_grad16: silu or gelu");
  const __m512 one = _mm512_set1_ps(1.f);
  if (A == Act::kSilu) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
    const __m512 s = recip16(_mm512_add_ps(one, e));
    *g = _mm512_mul_ps(s, _mm512_fmadd_ps(v, _mm512_mul_ps(e, s), one));
    return _mm512_mul_ps(v, s);
  }
  __m512 e;
  const __m512 cdf = phi16(v, &e);
  *g = _mm512_fmadd_ps(_mm512_mul_ps(v, e), _mm512_set1_ps(0.39894228040143268f), cdf);
  return _mm512_mul_ps(v, cdf);
}
#elif defined(__ARM_NEON)
// ---- the same math on 4 NEON lanes (AArch64; every ARMv8-A CPU) ----------------------------
// e^x as exp16: the same reduction, polynomial and clamp; 2^n is built in the exponent field
// (n in [-126, 127] after the clamp, so the scale is a normal float, as scalef's is).
inline float32x4_t exp4(float32x4_t x) {
  x = vmaxq_f32(vdupq_n_f32(-87.f), vminq_f32(vdupq_n_f32(88.f), x));  // NaN stays NaN
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504f)));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
  r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
  p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
  p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
  p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.f)), vmulq_f32(p, r), r);
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(e));
}
// 1/a: AArch64 has a vector divide (correctly rounded; recip16's estimate + Newton step is
// within an ulp of it)
inline float32x4_t recip4(float32x4_t a) {
  return vdivq_f32(vdupq_n_f32(1.f), a);
}
// Phi(v) and exp(-v^2 / 2) as phi16
inline float32x4_t phi4(float32x4_t v, float32x4_t* e_out) {
  const float32x4_t one = vdupq_n_f32(1.f);
  const float32x4_t e = exp4(vmulq_f32(vmulq_f32(vdupq_n_f32(-0.5f), v), v));
  const float32x4_t t =
      recip4(vfmaq_f32(one, vdupq_n_f32(0.3275911f * 0.70710678118654752f), vabsq_f32(v)));
  float32x4_t q = vfmaq_f32(vdupq_n_f32(-1.453152027f), vdupq_n_f32(1.061405429f), t);
  q = vfmaq_f32(vdupq_n_f32(1.421413741f), q, t);
  q = vfmaq_f32(vdupq_n_f32(-0.284496736f), q, t);
  q = vfmaq_f32(vdupq_n_f32(0.254829592f), q, t);
  const float32x4_t h = vmulq_f32(vmulq_f32(vmulq_f32(vdupq_n_f32(0.5f), t), q), e);
  const uint32x4_t neg = vcltq_f32(v, vdupq_n_f32(0.f));
  *e_out = e;
  return vbslq_f32(neg, h, vsubq_f32(one, h));
}
// f = act(v), *g = act'(v) for silu and gelu: act_and_grad16's formulas on 4 lanes
template <Act A> inline float32x4_t act_and_grad4(float32x4_t v, float32x4_t* g) {
  static_assert(A == Act::kSilu || A == Act::kGelu, "act_and_grad4: silu or gelu");
  const float32x4_t one = vdupq_n_f32(1.f);
  if (A == Act::kSilu) {
    const float32x4_t e = exp4(vnegq_f32(v));
    const float32x4_t s = recip4(vaddq_f32(one, e));
    *g = vmulq_f32(s, vfmaq_f32(one, v, vmulq_f32(e, s)));
    return vmulq_f32(v, s);
  }
  float32x4_t e;
  const float32x4_t cdf = phi4(v, &e);
  *g = vfmaq_f32(cdf, vmulq_f32(v, e), vdupq_n_f32(0.39894228040143268f));
  return vmulq_f32(v, cdf);
}
#endif

}  // namespace fusecli
