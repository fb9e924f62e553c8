// Helpers of the onnxruntime CUDAExecutionProvider kernels (each op's cuda_op.cc): thin
// wrappers that validate shapes, allocate the outputs and call the op's C launcher on ORT's
// compute stream.
#pragma once

#include <string>

#include "cuda_blas.h"
#include "cuda_dnn.h"
#include "op_kernel.h"

namespace fusecli {
namespace {

constexpr const char* kCuda = "CUDAExecutionProvider";

// The launcher code of an activation (op_launchers.h's FUSECLI_ACT_*).
inline int act_code(Act a) {
  return static_cast<int>(a);
}

inline void check_cuda(int err, const char* op) {
  if (err == 0) return;
  std::string what = err >= blas::kStatusBase && err < dnn::kStatusBase
                         ? "cublasStatus_t " + std::to_string(err - blas::kStatusBase)
                     : err >= dnn::kStatusBase
                         ? "cudnnStatus_t " + std::to_string(err - dnn::kStatusBase)
                         : "cudaError " + std::to_string(err);
  throw OpError(std::string("fusecli: CUDA launch of ") + op + " failed with " + what);
}

// The CUDA execution provider's own handles (onnxruntime/core/providers/cuda/cuda_resource.h:
// resource version 3, cudnn_handle_t = 10001, cublas_handle_t = 10002), read through
// KernelContext_GetResource (API 16, the version the library requests); null where the provider
// does not give them (the launchers then use their own handle on the same stream).
inline void* ort_cuda_resource(OrtKernelContext* c, int id) {
  constexpr int kOrtCudaResourceVersion = 3;
  void* res = nullptr;
  OrtStatus* st = Ort::GetApi().KernelContext_GetResource(c, kOrtCudaResourceVersion, id, &res);
  if (st) {
    Ort::GetApi().ReleaseStatus(st);
    return nullptr;
  }
  return res;
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
      // the launchers' cuBLAS / cuDNN calls run on the provider's handles during this call
      blas::BorrowHandle cublas(ort_cuda_resource(c, 10002));
      dnn::BorrowHandle cudnn(ort_cuda_resource(c, 10001));
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
