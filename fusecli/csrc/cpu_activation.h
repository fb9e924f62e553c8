// CPU activation-gradient math (ActivationGrad, LinearActivationGrad) and float16 rows.
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

}  // namespace fusecli
