// The CPU kernel base every op folder's cpu.cc derives from: attributes (KernelBase), the
// thread-pool scope, the call counter and the status guard around Compute.
#pragma once

#include "cpu_threads.h"
#include "op_kernel.h"

namespace fusecli {

// struct XKernel : CpuKernel<XKernel, kX> { using CpuKernel::CpuKernel;
//                                           void Compute(Ort::KernelContext& ctx); };
// registered with add_op<FusedOp<XKernel>>(domain).
template <typename Derived, OpId Id> struct CpuKernel : KernelBase<Id> {
  using KernelBase<Id>::KernelBase;
  OrtStatusPtr ComputeV2(OrtKernelContext* c) {
    return guarded([&] {
      PoolScope pool(c);
      count_call(Id);
      Ort::KernelContext ctx(c);
      static_cast<Derived*>(this)->Compute(ctx);
    });
  }
};

// A kernel registered for float and float16 (its contract's `half`): Compute runs
// Derived::Run<float> or Derived::Run<Ort::Float16_t>.
//   struct XKernel : TypedCpuKernel<XKernel, kX> {
//     using TypedCpuKernel::TypedCpuKernel;
//     template <typename T> void Run(Ort::KernelContext& ctx);
//   };
template <typename Derived, OpId Id> struct TypedCpuKernel : CpuKernel<Derived, Id> {
  using CpuKernel<Derived, Id>::CpuKernel;
  void Compute(Ort::KernelContext& ctx) {
    auto* self = static_cast<Derived*>(this);
    if (this->half)
      self->template Run<Ort::Float16_t>(ctx);
    else
      self->template Run<float>(ctx);
  }
};

}  // namespace fusecli
