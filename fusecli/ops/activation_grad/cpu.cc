// ActivationGrad: CPU kernel.
#include <memory>

#include "cpu_activation.h"
#include "cpu_eigen.h"
#include "cpu_kernel.h"

namespace fusecli {
namespace {

// ================================ ActivationGrad ============================================
struct ActKernel : CpuKernel<ActKernel, kActivationGrad> {  // attributes: activation, alpha
  using CpuKernel::CpuKernel;
  void Compute(Ort::KernelContext& ctx);
};

void ActKernel::Compute(Ort::KernelContext& ctx) {
  In dy = get_input(ctx, 0), x = get_input(ctx, 1);
  FUSECLI_CHECK(dy.numel() == x.numel(), "ActivationGrad: dY and X must have the same size");
  bool present;
  const int64_t n = dy.numel();
  if (!half) {
    float* out = output_or_null<float>(ctx, 0, dy.shape, &present);
    if (!present) return;
    if (out == dy.data) count_inplace(kActivationGrad);  // elementwise: dX over dY is safe
    const float* d = dy.ptr<float>();
    const float* v = x.ptr<float>();
    parallel_for(n, 1 << 15, [&](int, int64_t b, int64_t e) {
      act_grad_block(activation, alpha, d + b, v + b, out + b, e - b);
    });
  } else {
    auto* out = output_or_null<Ort::Float16_t>(ctx, 0, dy.shape, &present);
    if (!present) return;
    if (out == dy.data) count_inplace(kActivationGrad);  // each chunk is read before written
    const auto* d = dy.ptr<Ort::Float16_t>();
    const auto* v = x.ptr<Ort::Float16_t>();
    parallel_for(n, 1 << 15, [&](int, int64_t b, int64_t e) {
      constexpr int64_t kB = 2048;
      alignas(64) float fd[kB], fv[kB];
      for (int64_t i = b; i < e; i += kB) {
        const int64_t len = std::min(kB, e - i);
        half_to_float(d + i, fd, len);
        half_to_float(v + i, fv, len);
        act_grad_block(activation, alpha, fd, fv, fd, len);
        float_to_half(fd, out + i, len);
      }
    });
  }
}

}  // namespace

void add_activation_grad_cpu_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<ActKernel>>(domain);
}

}  // namespace fusecli
