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
inline int act_code(Act a) { return static_cast<int>(a); }

inline void check_cuda(int err, const char* op) {
  if (err != 0)
    throw OpError(std::string("fusecli: CUDA launch of ") + op + " failed with cudaError " +
                  std::to_string(err));
}

template <typename T> T* opt_out(Ort::KernelContext& ctx, size_t i, const std::vector<int64_t>& s) {
  bool present;
  return output_or_null<T>(ctx, i, s, &present);
}

}  // namespace
}  // namespace fusecli
