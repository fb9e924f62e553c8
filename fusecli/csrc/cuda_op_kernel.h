// Helpers of the onnxruntime CUDAExecutionProvider kernels (each op's cuda_op.cc): thin
// wrappers that validate shapes, allocate the outputs and call the op's C launcher on ORT's
// compute stream.
#pragma once

#include <string>

#include "op_kernel.h"
#include "cpu_activation.h"

namespace fusecli {
namespace {

constexpr auto kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto kF16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr const char* kCuda = "CUDAExecutionProvider";
constexpr auto kOpt = OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL;
constexpr auto kReq = OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;

int act_code(Act a) {
  switch (a) {
    case Act::kRelu: return 0;
    case Act::kGelu: return 1;
    case Act::kGeluTanh: return 2;
    case Act::kSilu: return 3;
    default: return 4;
  }
}

void check_cuda(int err, const char* op) {
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
