// onnxruntime custom-op plumbing shared by every fused op's CPU and CUDA registration:
// API versions, call counters, errors, attributes, tensor access, the op base with its
// signature and in-place pairs, and the status guard of a kernel body.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "op_tables.h"  // generated: OpId, kOpNames, k<Op>Sig, k<Op>Inplace, Act

namespace fusecli {

constexpr auto kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto kF16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr auto kBF16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;

// The onnxruntime API version this library requests and stamps on every OrtCustomOp, so the
// same .so loads in onnxruntime 1.19 (serves 1..19) and 1.31 (serves 1..31). Everything used
// here exists in API 16 (KernelComputeV2 / CreateKernelV2 were added in 16).
constexpr int kOrtApiVersion = 16;
// Ops that let onnxruntime write an output into an input's buffer (OrtCustomOp::GetMayInplace)
// are stamped 18, the first version whose struct onnxruntime reads that field from (1.18+).
constexpr int kOrtApiVersionInplace = 18;

void count_call(OpId op);
void count_inplace(OpId op);  // the runtime placed an output in its input's buffer
// Wall time spent in a kernel phase, for benchmarks that cannot separate it from outside
// (AttentionGrad's softmax backward between its GEMMs). Read as "<Op>/<phase>_ns".
enum PhaseId { kAttnSoftmaxPhase = 0, kNumPhases };
void add_phase_ns(PhaseId phase, int64_t ns);
// Work done by the CPU kernels, for tests that check a kernel skips the work of an absent output
// (timing-free): GEMMs run through OrtMatMul and their multiply-adds (batch * m * n * k), and the
// rows LinearActivationGrad sums into its bias gradient. Read as "cpu/gemm_calls",
// "cpu/gemm_macs", "LinearActivationGrad/db_rows".
enum WorkId { kWorkGemmCalls = 0, kWorkGemmMacs, kWorkLinDbRows, kNumWork };
void add_work(WorkId work, int64_t n);

// ---- errors -------------------------------------------------------------------------------
struct OpError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
#define FUSECLI_CHECK(cond, msg)                                             \
  do {                                                                       \
    if (!(cond)) throw ::fusecli::OpError(std::string("fusecli: ") + (msg)); \
  } while (0)

// ---- attributes with defaults ---------------------------------------------------------------
int64_t attr_int(const OrtKernelInfo* info, const char* name, int64_t dflt);
float attr_float(const OrtKernelInfo* info, const char* name, float dflt);
std::string attr_string(const OrtKernelInfo* info, const char* name, const std::string& dflt);
std::vector<int64_t> attr_ints(const OrtKernelInfo* info, const char* name,
                               const std::vector<int64_t>& dflt);
// A string attribute naming an activation; `allowed`: bit i = activation code i may be used.
// dflt: the contract's default when the node has no such attribute ("": required)
Act attr_act(const OrtKernelInfo* info, const char* name, uint32_t allowed, const char* dflt = "");
// Each op's attributes with their contract defaults: OpAttrs<k<Op>> (op_attrs.h, generated).
template <OpId Id> struct OpAttrs;

// ---- tensors ------------------------------------------------------------------------------
struct In {
  const void* data = nullptr;
  std::vector<int64_t> shape;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  bool present = false;
  int64_t numel() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
  template <typename T> const T* ptr() const { return static_cast<const T*>(data); }
};
In get_input(Ort::KernelContext& ctx, size_t i);
// Allocates output i with `shape` and returns true with *data set, or returns false (and
// allocates nothing) when the node does not request output i (empty name or past the end).
bool get_output(Ort::KernelContext& ctx, size_t i, const std::vector<int64_t>& shape, void** data);
template <typename T>
T* output_or_null(Ort::KernelContext& ctx, size_t i, const std::vector<int64_t>& shape,
                  bool* present) {
  void* d = nullptr;
  *present = get_output(ctx, i, shape, &d);
  return static_cast<T*>(d);
}

int64_t prod(const std::vector<int64_t>& v, size_t from = 0, size_t to = SIZE_MAX);
// A normalization over the trailing axes from `axis` (negative: from the end): M rows of N
// values, M = prod(shape[:ax]), N = prod(shape[ax:]). Throws "<op>: axis out of range".
struct AxisRows {
  size_t ax;
  int64_t M, N;
};
AxisRows rows_from_axis(const std::vector<int64_t>& shape, int64_t axis, const char* op);

// ---- op base ------------------------------------------------------------------------------
template <typename TOp, typename TKernel> struct OpBase : Ort::CustomOpBase<TOp, TKernel, true> {
  OpBase(const char* name, const char* ep) : name_(name), ep_(ep) {
    this->OrtCustomOp::version = kOrtApiVersion;
  }
  const char* GetName() const { return name_; }
  const char* GetExecutionProviderType() const { return ep_; }
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    try {
      *kernel = new TKernel(info, static_cast<const TOp*>(this));
      return nullptr;
    } catch (const std::exception& e) {
      return api.CreateStatus(ORT_INVALID_ARGUMENT, e.what());
    }
  }
  const char* name_;
  const char* ep_;
};

// ---- op signatures and in-place pairs: op_tables.h, generated from the contracts ------------
// (k<Op>Sig, k<Op>Inplace). SigOp declares them to onnxruntime.
// One registration of the op `Id` (its name, signature and in-place pairs come from its
// contract through op_tables.h) for the execution provider `ep` (nullptr: CPU), in float32 or
// float16. kWithInplace = false: this registration declares no in-place pairs.
template <typename TOp, typename TKernel, OpId Id, bool kWithInplace = true>
struct SigOp : OpBase<TOp, TKernel> {
  static constexpr OpId kId = Id;
  static constexpr const Signature& S = kOpSigs[Id];
  static constexpr const Inplace& IP = kOpInplace[Id];
  SigOp(const char* ep, ONNXTensorElementDataType elem)
      : OpBase<TOp, TKernel>(kOpNames[Id], ep),
        half(elem == kF16),
        bf16(elem == kBF16),
        elem(elem) {
    if (!kWithInplace || IP.n == 0) return;
    OrtCustomOp& op = *this;
    op.version = kOrtApiVersionInplace;
    op.GetMayInplace = [](int** ins, int** outs) -> size_t {
      *ins = new int[IP.n];
      *outs = new int[IP.n];
      std::copy(IP.in, IP.in + IP.n, *ins);
      std::copy(IP.out, IP.out + IP.n, *outs);
      return static_cast<size_t>(IP.n);
    };
    op.ReleaseMayInplace = [](int* ins, int* outs) {
      delete[] ins;
      delete[] outs;
    };
  }
  size_t GetInputTypeCount() const { return S.n_in; }
  size_t GetOutputTypeCount() const { return S.n_out; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (S.any_float_in >> i & 1u) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // checked later
    if (S.bool_in >> i & 1u) return ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
    if (S.int64_in >> i & 1u) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    return elem;
  }
  ONNXTensorElementDataType GetOutputType(size_t) const { return elem; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return S.opt_in >> i & 1u ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                              : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return S.opt_out >> i & 1u ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                               : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  bool half;  // the float16 registration of an op that has one
  bool bf16;  // the bfloat16 registration (CUDA only: the contract's cuda_types)
  ONNXTensorElementDataType elem;  // the element type of this registration
};

// The kernel base of an op: its attributes as the contract declares them (OpAttrs<Id>, generated
// into op_attrs.h) and which registration (float32 / float16) created it.
template <OpId Id> struct KernelBase : OpAttrs<Id> {
  static constexpr OpId kId = Id;
  template <typename TOp>
  KernelBase(const OrtKernelInfo* info, const TOp* op)
      : OpAttrs<Id>(info), half(op->half), bf16(op->bf16) {}
  bool half;  // float16 registration
  bool bf16;  // bfloat16 registration
};

// The registration of a kernel TKernel (a KernelBase<Id>) for the CPU (ep nullptr) or CUDA
// execution provider; kWithInplace = false: no in-place pairs (see SigOp).
template <typename TKernel, bool kCudaEp = false, bool kWithInplace = true>
struct FusedOp
    : SigOp<FusedOp<TKernel, kCudaEp, kWithInplace>, TKernel, TKernel::kId, kWithInplace> {
  using Base = SigOp<FusedOp<TKernel, kCudaEp, kWithInplace>, TKernel, TKernel::kId, kWithInplace>;
  static constexpr bool kCuda = kCudaEp;
  explicit FusedOp(ONNXTensorElementDataType elem)
      : Base(kCudaEp ? "CUDAExecutionProvider" : nullptr, elem) {}
};

// Adds an op's registrations to the domain: float32, and float16 / bfloat16 when its contract
// lists them (`types` for the CPU registration, `cuda_types` for the CUDA one).
template <typename TOp> void add_op(Ort::CustomOpDomain& domain) {
  constexpr uint32_t types = TOp::kCuda ? kOpCudaTypes[TOp::kId] : kOpCpuTypes[TOp::kId];
  static TOp f32(kF32);
  domain.Add(&f32);
  if (types & kTypeF16) {
    static TOp f16(kF16);
    domain.Add(&f16);
  }
  if (types & kTypeBF16) {
    static TOp b16(kBF16);
    domain.Add(&b16);
  }
}

// Wraps a kernel body into an OrtStatusPtr-returning ComputeV2.
template <typename F> OrtStatusPtr guarded(F&& f) {
  try {
    f();
    return nullptr;
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
}

// Registration: op_registry.cc (generated) calls each op folder's add_<op>_cpu_ops and
// add_<op>_cuda_ops.
void add_cpu_ops(Ort::CustomOpDomain& domain);
void add_cuda_ops(Ort::CustomOpDomain& domain);  // no-op in a CPU-only build

}  // namespace fusecli

#include "op_attrs.h"  // generated: OpAttrs<k<Op>> (needs the declarations above)
