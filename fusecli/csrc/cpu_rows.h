// CPU row helpers shared by the row-wise kernels (the norms, the activation gradients): float16
// rows, saved per-row statistics of either float type, the second sweep's row store.
// (half_to_float / float_to_half are defined in cpu_activation.cc.)
#pragma once

#include <cstdint>
#include <type_traits>

#include "op_kernel.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace fusecli {

void half_to_float(const Ort::Float16_t* src, float* dst, int64_t n);
void float_to_half(const float* src, Ort::Float16_t* dst, int64_t n);

// A float32 view of n values: p itself (float32), or p converted into buf (float16).
template <typename T> inline const float* row_as_float(const T* p, float* buf, int64_t n) {
  if constexpr (std::is_same<T, float>::value) {
    (void)buf;
    (void)n;
    return p;
  } else {
    half_to_float(p, buf, n);
    return buf;
  }
}

// Value i of a float32-or-float16 input (an `any_float` port, e.g. saved row statistics).
inline float stat_at(const In& t, int64_t i) {
  if (t.type == kF32) return t.ptr<float>()[i];
  return static_cast<float>(t.ptr<Ort::Float16_t>()[i]);
}

#if defined(__AVX512F__)
// dx[0, n) = value(j, mask) per 16-float chunk (mask: the lanes inside the row), with
// non-temporal stores when `stream` (large outputs: no read-for-ownership of dx's lines) and dx
// is 64-byte aligned. The norms' second sweep.
template <typename F> inline void store_row_avx512(float* dx, int64_t n, bool stream, F value) {
  const bool nt = stream && (reinterpret_cast<uintptr_t>(dx) % 64 == 0);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 o = value(j, static_cast<__mmask16>(0xFFFF));
    if (nt)
      _mm512_stream_ps(dx + j, o);
    else
      _mm512_storeu_ps(dx + j, o);
  }
  if (j < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1u);
    _mm512_mask_storeu_ps(dx + j, tail, value(j, tail));
  }
}
#elif defined(__ARM_NEON)
// ---- 4-lane NEON (every ARMv8-A CPU) --------------------------------------------------------
// n < 4 floats at p as a zero-padded vector (the masked loads of the AVX-512 paths), and back
inline float32x4_t load_part4(const float* p, int64_t n) {
  float b[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t i = 0; i < n; ++i) b[i] = p[i];
  return vld1q_f32(b);
}
inline void store_part4(float* p, float32x4_t v, int64_t n) {
  float b[4];
  vst1q_f32(b, v);
  for (int64_t i = 0; i < n; ++i) p[i] = b[i];
}
// min(n, 4) floats at p (zero-padded)
inline float32x4_t load4(const float* p, int64_t n) {
  return n >= 4 ? vld1q_f32(p) : load_part4(p, n);
}
inline void store4(float* p, float32x4_t v, int64_t n) {
  if (n >= 4)
    vst1q_f32(p, v);
  else
    store_part4(p, v, n);
}
// dx[0, n) = value(j, cnt) per 4-float chunk (cnt: the lanes inside the row, 4 but at the end).
template <typename F> inline void store_row_neon(float* dx, int64_t n, F value) {
  for (int64_t j = 0; j < n; j += 4) store4(dx + j, value(j, n - j), n - j);
}
#endif

}  // namespace fusecli
