// Shared helpers for fusecli's custom-op library (CPU and CUDA op wrappers).
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

namespace fusecli {

// The onnxruntime API version this library requests and stamps on every OrtCustomOp, so the
// same .so loads in onnxruntime 1.19 (serves 1..19) and 1.31 (serves 1..31). Everything used
// here exists in API 16 (KernelComputeV2 / CreateKernelV2 were added in 16).
constexpr int kOrtApiVersion = 16;
// Ops that let onnxruntime write an output into an input's buffer (OrtCustomOp::GetMayInplace)
// are stamped 18, the first version whose struct onnxruntime reads that field from (1.18+).
constexpr int kOrtApiVersionInplace = 18;

enum OpId { kActivationGrad = 0, kLinearActivationGrad, kAttentionGrad, kConvBnReluGrad,
            kLayerNormGrad, kNumOps };
extern const char* const kOpNames[kNumOps];
void count_call(OpId op);
void count_inplace(OpId op);  // the runtime placed an output in its input's buffer
// Wall time spent in a kernel phase, for benchmarks that cannot separate it from outside
// (AttentionGrad's softmax backward between its GEMMs). Read as "<Op>/<phase>_ns".
enum PhaseId { kAttnSoftmaxPhase = 0, kNumPhases };
void add_phase_ns(PhaseId phase, int64_t ns);

// ---- errors -------------------------------------------------------------------------------
struct OpError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
#define FUSECLI_CHECK(cond, msg)                                                   \
  do {                                                                             \
    if (!(cond)) throw ::fusecli::OpError(std::string("fusecli: ") + (msg));       \
  } while (0)

// ---- attributes with defaults ---------------------------------------------------------------
int64_t attr_int(const OrtKernelInfo* info, const char* name, int64_t dflt);
float attr_float(const OrtKernelInfo* info, const char* name, float dflt);
std::string attr_string(const OrtKernelInfo* info, const char* name, const std::string& dflt);
std::vector<int64_t> attr_ints(const OrtKernelInfo* info, const char* name,
                               const std::vector<int64_t>& dflt);

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

// ---- threading ----------------------------------------------------------------------------
int num_threads();  // FUSECLI_NUM_THREADS or hardware_concurrency
// Splits [0, n) into at most min(num_threads(), ceil(n / grain)) contiguous chunks;
// fn(thread_index, begin, end). Chunk 0 runs on the calling thread.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int, int64_t, int64_t)>& fn,
                  int max_threads = 0);
int planned_threads(int64_t n, int64_t grain, int max_threads = 0);
// Subnormal floats take a microcode slow path on x86 (~100x per operation): the exp/erf tails
// of activation gradients and tiny variances produce them. FlushDenormals sets FTZ (results
// flushed to zero) and DAZ (subnormal inputs read as zero) in this thread's MXCSR for its
// lifetime and restores the previous MXCSR after, so onnxruntime's threads keep their own mode
// outside fusecli's kernels. Results change by less than the smallest normal float (1.2e-38).
class FlushDenormals {
 public:
  FlushDenormals();
  ~FlushDenormals();
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned saved_;
};
// While a CPU kernel's Compute runs inside a PoolScope (which also flushes denormals on the
// calling thread; parallel_for does so in every chunk), parallel_for runs its chunks on
// onnxruntime's intra-op thread pool (KernelContext_ParallelFor, API 17, used when the runtime
// serves it) instead of starting threads: no thread start-up per call, and the session's
// thread count and spinning policy apply. Nested parallel_for calls run serially.
class PoolScope {
 public:
  explicit PoolScope(const OrtKernelContext* ctx);
  ~PoolScope();
  PoolScope(const PoolScope&) = delete;
  PoolScope& operator=(const PoolScope&) = delete;

 private:
  const OrtKernelContext* prev_;
  FlushDenormals ftz_;
};
void set_pool_api(const OrtApi* api);  // the API struct that has KernelContext_ParallelFor

// ---- GEMM (row-major, Eigen inside, parallel over output rows) ----------------------------
// C[m,n] = alpha * op(A) op(B) + beta * C ; op(A) is [m,k], op(B) is [k,n].
// lda/ldb/ldc are row strides of the stored (untransposed) row-major matrices.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc, int threads = 0);

// ---- GEMM through onnxruntime's own MatMul kernel (MLAS) ------------------------------------
// Created once per kernel from its OrtKernelInfo (OrtApi::CreateOp, API >= 12: the com.microsoft
// FusedMatMul CPU kernel, one per transposition pair, alpha 1), and invoked from Compute with the
// kernel context (OrtApi::InvokeOp), so MLAS runs on the session's intra-op thread pool. When
// onnxruntime cannot create the op (or FUSECLI_GEMM=eigen), run() falls back to gemm() above.
//   c[b] = op(a[b]) op(b[b]) for b < batch; op(a) is [m,k] (stored [k,m] when ta),
//   op(b) is [k,n] (stored [n,k] when tb); every operand contiguous; c is overwritten.
class OrtMatMul {
 public:
  explicit OrtMatMul(const OrtKernelInfo* info);
  ~OrtMatMul();
  OrtMatMul(const OrtMatMul&) = delete;
  OrtMatMul& operator=(const OrtMatMul&) = delete;
  // a_batched / b_batched = false: that operand is one matrix broadcast over the batch.
  void run(const OrtKernelContext* ctx, bool ta, bool tb, int64_t batch, int64_t m, int64_t n,
           int64_t k, const float* a, const float* b, float* c, bool a_batched = true,
           bool b_batched = true) const;
  bool uses_ort() const { return ops_[0] != nullptr; }

 private:
  OrtOp* ops_[4] = {nullptr, nullptr, nullptr, nullptr};  // index ta * 2 + tb
};

// ---- activations --------------------------------------------------------------------------
enum class Act { kRelu, kGelu, kGeluTanh, kSilu, kIdentity };
Act parse_act(const std::string& s, bool allow_identity);
// out[i] = dy[i] * act'(x[i]) for a contiguous block (vectorized through Eigen arrays).
void act_grad_block(Act act, const float* dy, const float* x, float* out, int64_t n);
void half_to_float(const Ort::Float16_t* src, float* dst, int64_t n);
void float_to_half(const float* src, Ort::Float16_t* dst, int64_t n);

// ---- op base ------------------------------------------------------------------------------
template <typename TOp, typename TKernel>
struct OpBase : Ort::CustomOpBase<TOp, TKernel, true> {
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

// ---- op signatures (fusecli/ops/contracts.yaml) -------------------------------------------
// One signature per fused op, shared by its CPU and its CUDA registration: port counts, which
// ports are optional (bit i = port i), which inputs accept float32 or float16 at run time, and
// whether the op has a float16 variant.
struct Signature {
  size_t n_in, n_out;
  uint32_t opt_in, opt_out, any_float_in;
};
constexpr uint32_t kAll = 0xffffffffu;
constexpr Signature kActivationGradSig{2, 1, 0, 0, 0};
constexpr Signature kLinearActivationGradSig{4, 4, 1u << 3 /* W */, kAll, 0};
constexpr Signature kAttentionGradSig{7, 3, (1u << 5) | (1u << 6) /* q/k_scale */, kAll, 0};
constexpr Signature kConvBnReluGradSig{8, 6, 0, kAll, 0};
constexpr Signature kLayerNormGradSig{6, 3, (1u << 2) | (1u << 5) /* gamma, dR */, kAll,
                                      (1u << 3) | (1u << 4) /* mean, inv_std */};

// In-place pairs for OrtCustomOp::GetMayInplace: output out[i] may reuse input in[i]'s buffer.
// The runtime's memory planner decides (only when that input is not used after the node, has
// the same size and is not a graph input; the first usable pair wins); the kernel must give the
// same result either way.
struct Inplace {
  int n;
  int in[2], out[2];
};
constexpr Inplace kNoInplace{0, {}, {}};
constexpr Inplace kActivationGradInplace{1, {0}, {0}};        // dX over dY
constexpr Inplace kLinearActivationGradInplace{1, {0}, {3}};  // the dZ workspace over dY
constexpr Inplace kLayerNormGradInplace{2, {0, 5}, {0, 0}};   // dX over dY, else over dR
constexpr Inplace kConvBnReluGradInplace{1, {0}, {5}};        // the dC workspace over dY

template <typename TOp, typename TKernel, const Signature& S, const Inplace& IP = kNoInplace>
struct SigOp : OpBase<TOp, TKernel> {
  SigOp(const char* name, const char* ep, bool half = false)
      : OpBase<TOp, TKernel>(name, ep), half(half) {
    if (IP.n == 0) return;
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
    return half ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    return half ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return S.opt_in >> i & 1u ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                              : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return S.opt_out >> i & 1u ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                               : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  bool half;  // the float16 registration of an op that has one
};

// ---- AttentionGrad: attributes and the shape checks shared by its CPU and CUDA kernels -----
struct AttnAttrs {
  explicit AttnAttrs(const OrtKernelInfo* info);
  float scale_q, scale_k;  // the attributes; the optional q_scale / k_scale inputs multiply them
  bool k_transposed;
};
// The op's seven inputs, read from the kernel context and validated against the attributes
// (throws OpError), with the batched dimensions both kernels need. q_scale / k_scale are
// checked to be scalars; reading their value is the kernel's (host or device memory).
struct AttnInputs {
  AttnInputs(Ort::KernelContext& ctx, const AttnAttrs& a);
  In dO, q, k, v, p, qs, ks;
  int64_t B, Sq, Sk, D, Dv;
};

// ---- ConvBnReluGrad: attributes and the shape checks shared by its CPU and CUDA kernels ----
struct ConvAttrs {
  explicit ConvAttrs(const OrtKernelInfo* info);
  std::vector<int64_t> strides, pads, dilations;
  int64_t group;
  bool relu;
};
// The op's eight inputs, read from the kernel context and validated against the attributes
// (throws OpError), with the dimensions both kernels need.
struct ConvInputs {
  ConvInputs(Ort::KernelContext& ctx, const ConvAttrs& a);
  In dy, y, x, w, cv, gamma, mean, istd;
  int64_t N, C, H, W, Cin, Hin, Win, kh, kw;
};

// Wraps a kernel body into an OrtStatusPtr-returning ComputeV2.
template <typename F>
OrtStatusPtr guarded(F&& f) {
  try {
    f();
    return nullptr;
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
}

// Registration hooks (each translation unit adds its ops to the domain).
void add_cpu_ops(Ort::CustomOpDomain& domain);
void add_cuda_ops(Ort::CustomOpDomain& domain);  // no-op in a CPU-only build

}  // namespace fusecli
