// CPU activation-gradient math (ActivationGrad, LinearActivationGrad) and float16 rows (also
// the norms' row helpers).
#pragma once

#include "op_kernel.h"

namespace fusecli {

// ---- activations --------------------------------------------------------------------------
// Act and kActNames come from op_tables.h (domain.yaml's activations).
Act parse_act(const std::string& s, bool allow_identity);
// out[i] = dy[i] * act'(x[i]) for a contiguous block (vectorized through Eigen arrays).
void act_grad_block(Act act, const float* dy, const float* x, float* out, int64_t n);
void half_to_float(const Ort::Float16_t* src, float* dst, int64_t n);
void float_to_half(const float* src, Ort::Float16_t* dst, int64_t n);

// A float32 view of n values: p itself (float32), or p converted into buf (float16).
template <typename T>
inline const float* row_as_float(const T* p, float* buf, int64_t n) {
  if constexpr (std::is_same<T, float>::value) {
    (void)buf; (void)n;
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

}  // namespace fusecli
