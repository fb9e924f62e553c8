// Helpers of the onnxruntime CUDAExecutionProvider kernels (each op's cuda_op.cc): thin
// wrappers that validate shapes, allocate the outputs and call the op's C launcher on ORT's
// compute stream.
#pragma once

#include <string>

#include "op_kernel.h"

namespace fusecli {
namespace {

constexpr const char* kCuda = "CUDAExecutionProvider";

// The launcher code of an activation (op_launchers.h's FUSECLI_ACT_*).
inline int act_code(Act a) {
  return static_cast<int>(a);
}

inline void check_cuda(int err, const char* op) {
  if (err != 0)
    throw OpError(std::string("fusecli: CUDA launch of ") + op + " failed with cudaError " +
                  std::to_string(err));
}

// struct XKernel : CudaKernel<XKernel, kX> { using CudaKernel::CudaKernel;
//                                            void Compute(Ort::KernelContext& ctx); };
// registered with add_op<FusedOp<XKernel, true>>(domain) (kWithInplace: see SigOp).
template <typename Derived, OpId Id> struct CudaKernel : KernelBase<Id> {
  using KernelBase<Id>::KernelBase;
  OrtStatusPtr ComputeV2(OrtKernelContext* c) {
    return guarded([&] {
      count_call(Id);
      Ort::KernelContext ctx(c);
      static_cast<Derived*>(this)->Compute(ctx);
    });
  }
};

template <typename T> T* opt_out(Ort::KernelContext& ctx, size_t i, const std::vector<int64_t>& s) {
  bool present;
  return output_or_null<T>(ctx, i, s, &present);
}

}  // namespace
}  // namespace fusecli
