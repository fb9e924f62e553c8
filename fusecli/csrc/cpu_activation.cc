// CPU activation-gradient math and float16 rows (see cpu_activation.h).
#include "cpu_activation.h"

#include <Eigen/Core>
#include <unsupported/Eigen/SpecialFunctions>

#include <cmath>
#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace fusecli {

// ---- activations --------------------------------------------------------------------------
#if defined(__AVX512F__)
namespace {
template <Act A> inline __m512 grad16(__m512 v) {  // act'(v) of act_and_grad16
  __m512 g;
  act_and_grad16<A>(v, &g);
  return g;
}
// relu6'(x) with the bounds kept (onnxruntime-training's Clip gradient): 1 on [0, 6], else 0
inline __m512 relu6_grad16(__m512 v) {
  const __mmask16 m = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ) &
                      _mm512_cmp_ps_mask(v, _mm512_set1_ps(6.f), _CMP_LE_OQ);
  return _mm512_maskz_mov_ps(m, _mm512_set1_ps(1.f));
}
// hardswish'(x) = (relu6(a) + x [0 <= a <= 6]) / 6 with a = x + 3 (as in the scalar case)
inline __m512 hardswish_grad16(__m512 v) {
  const __m512 a = _mm512_add_ps(v, _mm512_set1_ps(3.f));
  const __mmask16 m = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GE_OQ) &
                      _mm512_cmp_ps_mask(a, _mm512_set1_ps(6.f), _CMP_LE_OQ);
  const __m512 r6 = _mm512_min_ps(_mm512_max_ps(a, _mm512_setzero_ps()), _mm512_set1_ps(6.f));
  return _mm512_mul_ps(_mm512_mask_add_ps(r6, m, r6, v), _mm512_set1_ps(1.f / 6.f));
}
template <__m512 (*G)(__m512)>
void act_grad16(const float* dy, const float* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(dy + i), G(_mm512_loadu_ps(x + i))));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 g = G(_mm512_maskz_loadu_ps(m, x + i));
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, dy + i), g));
  }
}
}  // namespace
#elif defined(__ARM_NEON)
namespace {
template <Act A> inline float32x4_t grad4(float32x4_t v) {  // act'(v) of act_and_grad4
  float32x4_t g;
  act_and_grad4<A>(v, &g);
  return g;
}
inline float32x4_t relu6_grad4(float32x4_t v) {  // 1 on [0, 6], else 0 (as relu6_grad16)
  const uint32x4_t m = vandq_u32(vcgeq_f32(v, vdupq_n_f32(0.f)), vcleq_f32(v, vdupq_n_f32(6.f)));
  return vreinterpretq_f32_u32(vandq_u32(m, vreinterpretq_u32_f32(vdupq_n_f32(1.f))));
}
inline float32x4_t hardswish_grad4(float32x4_t v) {  // as hardswish_grad16
  const float32x4_t a = vaddq_f32(v, vdupq_n_f32(3.f));
  const uint32x4_t m = vandq_u32(vcgeq_f32(a, vdupq_n_f32(0.f)), vcleq_f32(a, vdupq_n_f32(6.f)));
  // maxnm / minnm: a NaN lane gives 0 like _mm512_max_ps / _mm512_min_ps do
  const float32x4_t r6 = vminnmq_f32(vmaxnmq_f32(a, vdupq_n_f32(0.f)), vdupq_n_f32(6.f));
  return vmulq_f32(vbslq_f32(m, vaddq_f32(r6, v), r6), vdupq_n_f32(1.f / 6.f));
}
template <float32x4_t (*G)(float32x4_t)>
void act_grad4(const float* dy, const float* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 4)
    store4(out + i, vmulq_f32(load4(dy + i, n - i), G(load4(x + i, n - i))), n - i);
}
}  // namespace
#endif

namespace {
void act_grad_unscaled(Act act, const float* dy, const float* x, float* out, int64_t n);
}  // namespace

void act_grad_block(Act act, float alpha, const float* dy, const float* x, float* out, int64_t n) {
  if (alpha == 1.f || act == Act::kIdentity) return act_grad_unscaled(act, dy, x, out, n);
  // act'(alpha x): the scaled inputs in L1-sized blocks (out may be dy itself, never x)
  constexpr int64_t kBlock = 1024;
  alignas(64) float xs[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t len = std::min(kBlock, n - i0);
    for (int64_t i = 0; i < len; ++i) xs[i] = alpha * x[i0 + i];
    act_grad_unscaled(act, dy + i0, xs, out + i0, len);
  }
}

namespace {
void act_grad_unscaled(Act act, const float* dy, const float* x, float* out, int64_t n) {
#if defined(__AVX512F__)
  if (act == Act::kGelu) return act_grad16<grad16<Act::kGelu>>(dy, x, out, n);
  if (act == Act::kSilu) return act_grad16<grad16<Act::kSilu>>(dy, x, out, n);
  if (act == Act::kRelu6) return act_grad16<relu6_grad16>(dy, x, out, n);
  if (act == Act::kHardswish) return act_grad16<hardswish_grad16>(dy, x, out, n);
#elif defined(__ARM_NEON)
  if (act == Act::kGelu) return act_grad4<grad4<Act::kGelu>>(dy, x, out, n);
  if (act == Act::kSilu) return act_grad4<grad4<Act::kSilu>>(dy, x, out, n);
  if (act == Act::kRelu6) return act_grad4<relu6_grad4>(dy, x, out, n);
  if (act == Act::kHardswish) return act_grad4<hardswish_grad4>(dy, x, out, n);
#endif
  using Arr = Eigen::Array<float, Eigen::Dynamic, 1>;
  using CA = Eigen::Map<const Arr>;
  using MA = Eigen::Map<Arr>;
  constexpr int64_t kBlock = 1024;
  alignas(64) float tmp[kBlock], gtmp[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t len = std::min(kBlock, n - i0);
    CA d(dy + i0, len), v(x + i0, len);
    MA o(out + i0, len);
    MA t(tmp, len);
    switch (act) {
      case Act::kRelu:
        o = (v > 0.f).select(d, 0.f);
        break;
      case Act::kGelu:
      case Act::kGeluTanh:
      case Act::kSilu:
        act_and_grad_block(act, 1.f, x + i0, tmp, gtmp, len);
        o = d * MA(gtmp, len);
        break;
      case Act::kIdentity:
        if (o.data() != d.data()) o = d;
        break;
      case Act::kRelu6:  // Clip(x, 0, 6): dY where 0 <= x <= 6 (bounds kept, as in ORT)
        o = (v >= 0.f && v <= 6.f).select(d, 0.f);
        break;
      case Act::kHardswish:  // x relu6(x + 3) / 6: (relu6(a) + x [0 <= a <= 6]) / 6, a = x + 3
        // in float (0 below -3, (2x + 3) / 6 up to 3, 1 above; the mask flips where the graph's
        // Clip gradient flips it)
        t = v + 3.f;
        o = d * (t.max(0.f).min(6.f) + (t >= 0.f && t <= 6.f).select(v, 0.f)) * (1.f / 6.f);
        break;
    }
  }
}
}  // namespace

void act_and_grad_block(Act act, float alpha, const float* a, float* f, float* g, int64_t n) {
  using Arr = Eigen::Array<float, Eigen::Dynamic, 1>;
  Eigen::Map<Arr> fo(f, n), go(g, n);
  alignas(64) float vbuf[1024];
  Eigen::Map<Arr> v(vbuf, n);
  v = alpha * Eigen::Map<const Arr>(a, n);
  switch (act) {
    case Act::kSilu: {                  // s = 1 / (1 + e), e = e^-v; 1 - s = e s (no cancellation)
      go = (-v).min(88.f).exp();        // e
      fo = 1.f / (1.f + go);            // s
      go = fo * (1.f + v * (go * fo));  // s (1 + v (1 - s))
      fo = v * fo;                      // v s
      break;
    }
    case Act::kGelu: {
      const float kSqrt1_2 = 0.70710678118654752f, kInvSqrt2Pi = 0.39894228040143268f;
      fo = 0.5f * (1.f + (v * kSqrt1_2).erf());  // Phi(v)
      go = fo + v * (-0.5f * v * v).exp() * kInvSqrt2Pi;
      fo = v * fo;
      break;
    }
    case Act::kGeluTanh: {
      const float k = 0.79788456080286536f, c = 0.044715f;
      // t = tanh(u), u = k v (1 + c v^2); exactly +-1 where float tanh rounds to it (|u| > 9):
      // Eigen's vectorised tanh clamps u at 7.905 when it is built without FMA (NEON,
      // baseline x86-64), and its 1 - t^2 = 4.8e-7 there, times u' ~ 1e5 at |v| = 87, is no zero
      fo = k * v * (1.f + c * v * v);
      fo = (fo.abs() > 9.f).select(fo.sign(), fo.tanh());
      go = 0.5f * (1.f + fo + v * (1.f - fo * fo) * k * (1.f + 3.f * c * v * v));
      fo = 0.5f * v * (1.f + fo);
      break;
    }
    default:
      FUSECLI_CHECK(false, "act_and_grad_block: silu, gelu or gelu_tanh only");
  }
  if (alpha != 1.f) fo *= 1.f / alpha;
}

void half_to_float(const Ort::Float16_t* src, float* dst, int64_t n) {
  Eigen::Map<Eigen::Array<float, Eigen::Dynamic, 1>>(dst, n) =
      Eigen::Map<const Eigen::Array<Eigen::half, Eigen::Dynamic, 1>>(
          reinterpret_cast<const Eigen::half*>(src), n)
          .cast<float>();
}
void float_to_half(const float* src, Ort::Float16_t* dst, int64_t n) {
  Eigen::Map<Eigen::Array<Eigen::half, Eigen::Dynamic, 1>>(reinterpret_cast<Eigen::half*>(dst), n) =
      Eigen::Map<const Eigen::Array<float, Eigen::Dynamic, 1>>(src, n).cast<Eigen::half>();
}

}  // namespace fusecli
