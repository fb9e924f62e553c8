// CPU activation-gradient math (ActivationGrad, LinearActivationGrad).
#pragma once

#include "cpu_rows.h"
#include "op_kernel.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace fusecli {

// ---- activations --------------------------------------------------------------------------
// Act comes from op_tables.h (domain.yaml's activations); a kernel's Act attribute is read by
// attr_act (op_kernel.h) through its generated OpAttrs.
// out[i] = dy[i] * act'(alpha x[i]) for a contiguous block (vectorized through Eigen arrays):
// the gradient of the activation at input scale alpha, act(alpha x) / alpha (silu at
// alpha = 1.702 is QuickGELU, x sigmoid(1.702 x)).
void act_grad_block(Act act, float alpha, const float* dy, const float* x, float* out, int64_t n);
}  // namespace fusecli
