// Shared helpers: attributes, tensor access, threads, GEMM, activation math, call counters,
// and the library entry point RegisterCustomOps.
#include "common.h"

#include <Eigen/Core>
#include <unsupported/Eigen/SpecialFunctions>

#include <cmath>
#include <cstring>
#if defined(__SSE__) || defined(__x86_64__)
#include <immintrin.h>
#endif
#include <memory>
#include <cstdlib>
#include <mutex>

#define FUSECLI_EXPORT extern "C" __attribute__((visibility("default")))

namespace fusecli {

const char* const kOpNames[kNumOps] = {"ActivationGrad", "LinearActivationGrad", "AttentionGrad",
                                       "ConvBnReluGrad", "LayerNormGrad"};
static std::atomic<int64_t> g_calls[kNumOps];
static std::atomic<int64_t> g_inplace[kNumOps];

void count_call(OpId op) { g_calls[op].fetch_add(1, std::memory_order_relaxed); }
void count_inplace(OpId op) { g_inplace[op].fetch_add(1, std::memory_order_relaxed); }
static const char* const kPhaseNames[kNumPhases] = {"AttentionGrad/softmax_ns"};
static std::atomic<int64_t> g_phase_ns[kNumPhases];
void add_phase_ns(PhaseId phase, int64_t ns) { g_phase_ns[phase].fetch_add(ns, std::memory_order_relaxed); }

// ---- attributes ---------------------------------------------------------------------------
int64_t attr_int(const OrtKernelInfo* info, const char* name, int64_t dflt) {
  int64_t v = 0;
  OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_int64(info, name, &v);
  if (st) {
    Ort::GetApi().ReleaseStatus(st);
    return dflt;
  }
  return v;
}
float attr_float(const OrtKernelInfo* info, const char* name, float dflt) {
  float v = 0;
  OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_float(info, name, &v);
  if (st) {
    Ort::GetApi().ReleaseStatus(st);
    return dflt;
  }
  return v;
}
std::string attr_string(const OrtKernelInfo* info, const char* name, const std::string& dflt) {
  size_t size = 0;
  OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_string(info, name, nullptr, &size);
  if (st) {
    Ort::GetApi().ReleaseStatus(st);
    return dflt;
  }
  std::string s(size, '\0');
  st = Ort::GetApi().KernelInfoGetAttribute_string(info, name, &s[0], &size);
  if (st) {
    Ort::GetApi().ReleaseStatus(st);
    return dflt;
  }
  if (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}
std::vector<int64_t> attr_ints(const OrtKernelInfo* info, const char* name,
                               const std::vector<int64_t>& dflt) {
  size_t size = 0;
  OrtStatus* st = Ort::GetApi().KernelInfoGetAttributeArray_int64(info, name, nullptr, &size);
  if (st) {
    Ort::GetApi().ReleaseStatus(st);
    return dflt;
  }
  std::vector<int64_t> v(size);
  if (size == 0) return v;
  st = Ort::GetApi().KernelInfoGetAttributeArray_int64(info, name, v.data(), &size);
  if (st) {
    Ort::GetApi().ReleaseStatus(st);
    return dflt;
  }
  return v;
}

// ---- tensors ------------------------------------------------------------------------------
In get_input(Ort::KernelContext& ctx, size_t i) {
  In r;
  if (i >= ctx.GetInputCount()) return r;
  Ort::ConstValue v = ctx.GetInput(i);
  if (static_cast<const OrtValue*>(v) == nullptr) return r;
  auto info = v.GetTensorTypeAndShapeInfo();
  r.shape = info.GetShape();
  r.type = info.GetElementType();
  r.data = v.GetTensorRawData();
  r.present = true;
  return r;
}

bool get_output(Ort::KernelContext& ctx, size_t i, const std::vector<int64_t>& shape, void** data) {
  *data = nullptr;
  if (i >= ctx.GetOutputCount()) return false;
  Ort::UnownedValue v = ctx.GetOutput(i, shape);
  if (static_cast<OrtValue*>(v) == nullptr) return false;
  *data = v.GetTensorMutableRawData();
  return true;
}

int64_t prod(const std::vector<int64_t>& v, size_t from, size_t to) {
  int64_t p = 1;
  for (size_t i = from; i < v.size() && i < to; ++i) p *= v[i];
  return p;
}

// ---- threading ----------------------------------------------------------------------------
int num_threads() {
  static const int n = [] {
    if (const char* e = std::getenv("FUSECLI_NUM_THREADS")) {
      int v = std::atoi(e);
      if (v > 0) return v;
    }
    unsigned h = std::thread::hardware_concurrency();
    return h ? static_cast<int>(h) : 1;
  }();
  return n;
}

int planned_threads(int64_t n, int64_t grain, int max_threads) {
  int t = max_threads > 0 ? std::min(max_threads, num_threads()) : num_threads();
  if (grain < 1) grain = 1;
  int64_t chunks = (n + grain - 1) / grain;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(t, chunks)));
}

namespace {
const OrtApi* g_pool_api = nullptr;                   // serves KernelContext_ParallelFor
thread_local const OrtKernelContext* tl_ctx = nullptr;  // the running kernel's context
thread_local bool tl_in_chunk = false;                  // inside a parallel_for chunk

struct ChunkJob {
  const std::function<void(int)>* run;
};
void run_chunk(void* data, size_t i) {
  const bool prev = tl_in_chunk;
  tl_in_chunk = true;
  (*static_cast<ChunkJob*>(data)->run)(static_cast<int>(i));
  tl_in_chunk = prev;
}
}  // namespace

void set_pool_api(const OrtApi* api) { g_pool_api = api; }

#if defined(__SSE__) || defined(__x86_64__)
constexpr unsigned kFtzDaz = 0x8040u;  // MXCSR bit 15 (flush to zero) | bit 6 (denormals are zero)
FlushDenormals::FlushDenormals() : saved_(_mm_getcsr()) {
  if ((saved_ & kFtzDaz) != kFtzDaz) _mm_setcsr(saved_ | kFtzDaz);
}
FlushDenormals::~FlushDenormals() {
  if ((saved_ & kFtzDaz) != kFtzDaz) _mm_setcsr(saved_);
}
#else
FlushDenormals::FlushDenormals() : saved_(0) {}
FlushDenormals::~FlushDenormals() {}
#endif

PoolScope::PoolScope(const OrtKernelContext* ctx) : prev_(tl_ctx) { tl_ctx = ctx; }
PoolScope::~PoolScope() { tl_ctx = prev_; }

void parallel_for(int64_t n, int64_t grain, const std::function<void(int, int64_t, int64_t)>& fn,
                  int max_threads) {
  if (n <= 0) return;
  int t = tl_in_chunk ? 1 : planned_threads(n, grain, max_threads);
  if (t == 1) {
    FlushDenormals ftz;
    fn(0, 0, n);
    return;
  }
  std::vector<std::exception_ptr> errs(t);
  std::function<void(int)> run = [&](int i) {
    int64_t b = n * i / t, e = n * (i + 1) / t;
    FlushDenormals ftz;  // onnxruntime's pool threads: restored when the chunk ends
    try {
      if (b < e) fn(i, b, e);
    } catch (...) {
      errs[i] = std::current_exception();
    }
  };
  if (tl_ctx != nullptr && g_pool_api != nullptr) {
    ChunkJob job{&run};
    OrtStatus* st = g_pool_api->KernelContext_ParallelFor(tl_ctx, run_chunk, static_cast<size_t>(t),
                                                          static_cast<size_t>(t), &job);
    if (st == nullptr) {
      for (auto& e : errs)
        if (e) std::rethrow_exception(e);
      return;
    }
    g_pool_api->ReleaseStatus(st);  // pool unavailable: fall back to our own threads
    std::fill(errs.begin(), errs.end(), nullptr);
  }
  std::vector<std::thread> pool;
  pool.reserve(t - 1);
  auto run_marked = [&](int i) {
    tl_in_chunk = true;
    run(i);
  };
  for (int i = 1; i < t; ++i) pool.emplace_back(run_marked, i);
  tl_in_chunk = true;
  run(0);
  tl_in_chunk = false;
  for (auto& th : pool) th.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
}

// ---- GEMM ---------------------------------------------------------------------------------
using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using CMap = Eigen::Map<const RowMat, 0, Eigen::OuterStride<>>;
using MMap = Eigen::Map<RowMat, 0, Eigen::OuterStride<>>;

template <typename EA, typename EB>
static void gemm_block(const EA& a, const EB& b, float alpha, float beta, MMap c) {
  if (beta == 0.f) {
    c.noalias() = alpha * (a * b);
  } else {
    if (beta != 1.f) c *= beta;
    c.noalias() += alpha * (a * b);
  }
}

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc,
          int threads) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.f ? 0.f : beta * c[i * ldc + j];
    return;
  }
  // Stored shapes: A is [m,k] (or [k,m] when ta), B is [k,n] (or [n,k] when tb).
  CMap A(a, ta ? k : m, ta ? m : k, Eigen::OuterStride<>(lda));
  CMap B(b, tb ? n : k, tb ? k : n, Eigen::OuterStride<>(ldb));
  MMap C(c, m, n, Eigen::OuterStride<>(ldc));
  const int64_t flops = m * n * k;
  int max_t = threads > 0 ? threads : num_threads();
  if (flops < (1 << 18)) max_t = 1;
  const bool split_rows = m >= n;
  const int64_t span = split_rows ? m : n;
  const int64_t grain = std::max<int64_t>(16, span / std::max(1, max_t));
  parallel_for(
      span, grain,
      [&](int, int64_t s0, int64_t s1) {
        const int64_t len = s1 - s0;
        if (split_rows) {
          MMap Cb(c + s0 * ldc, len, n, Eigen::OuterStride<>(ldc));
          if (!ta && !tb) gemm_block(A.middleRows(s0, len), B, alpha, beta, Cb);
          else if (!ta && tb) gemm_block(A.middleRows(s0, len), B.transpose(), alpha, beta, Cb);
          else if (ta && !tb) gemm_block(A.middleCols(s0, len).transpose(), B, alpha, beta, Cb);
          else gemm_block(A.middleCols(s0, len).transpose(), B.transpose(), alpha, beta, Cb);
        } else {
          MMap Cb(c + s0, m, len, Eigen::OuterStride<>(ldc));
          if (!ta && !tb) gemm_block(A, B.middleCols(s0, len), alpha, beta, Cb);
          else if (!ta && tb) gemm_block(A, B.middleRows(s0, len).transpose(), alpha, beta, Cb);
          else if (ta && !tb) gemm_block(A.transpose(), B.middleCols(s0, len), alpha, beta, Cb);
          else gemm_block(A.transpose(), B.middleRows(s0, len).transpose(), alpha, beta, Cb);
        }
      },
      max_t);
  (void)C;
}

// ---- GEMM through onnxruntime's MatMul kernels -------------------------------------------
static bool eigen_gemm_forced() {
  static const bool forced = [] {
    const char* e = std::getenv("FUSECLI_GEMM");
    return e && std::strcmp(e, "eigen") == 0;
  }();
  return forced;
}

OrtMatMul::OrtMatMul(const OrtKernelInfo* info) {
  if (eigen_gemm_forced()) return;
  const OrtApi& api = Ort::GetApi();
  const char* tnames[] = {"T"};
  const ONNXTensorElementDataType tvals[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
  for (int i = 0; i < 4; ++i) {
    const int64_t ta = i / 2, tb = i % 2;
    const float alpha = 1.f;
    OrtOpAttr* attrs[3] = {nullptr, nullptr, nullptr};
    bool ok = true;
    auto mk = [&](int j, const char* name, const void* data, OrtOpAttrType type) {
      OrtStatus* st = api.CreateOpAttr(name, data, 1, type, &attrs[j]);
      if (st) {
        api.ReleaseStatus(st);
        ok = false;
      }
    };
    mk(0, "transA", &ta, ORT_OP_ATTR_INT);
    mk(1, "transB", &tb, ORT_OP_ATTR_INT);
    mk(2, "alpha", &alpha, ORT_OP_ATTR_FLOAT);
    if (ok) {
      OrtStatus* st = api.CreateOp(info, "FusedMatMul", "com.microsoft", 1, tnames, tvals, 1,
                                   attrs, 3, 2, 1, &ops_[i]);
      if (st) {
        api.ReleaseStatus(st);
        ops_[i] = nullptr;
      }
    }
    for (auto* a : attrs)
      if (a) api.ReleaseOpAttr(a);
    if (!ops_[i]) break;
  }
  if (!ops_[0] || !ops_[1] || !ops_[2] || !ops_[3]) {  // all or nothing
    for (auto*& op : ops_) {
      if (op) Ort::GetApi().ReleaseOp(op);
      op = nullptr;
    }
  }
}

OrtMatMul::~OrtMatMul() {
  for (auto* op : ops_)
    if (op) Ort::GetApi().ReleaseOp(op);
}

void OrtMatMul::run(const OrtKernelContext* ctx, bool ta, bool tb, int64_t batch, int64_t m,
                    int64_t n, int64_t k, const float* a, const float* b, float* c,
                    bool a_batched, bool b_batched) const {
  if (batch <= 0 || m <= 0 || n <= 0) return;
  if (k <= 0) {
    std::fill(c, c + batch * m * n, 0.f);
    return;
  }
  const OrtOp* op = ops_[(ta ? 2 : 0) + (tb ? 1 : 0)];
  if (!op) {
    const int64_t lda = ta ? m : k, ldb = tb ? k : n;
    for (int64_t i = 0; i < batch; ++i)
      gemm(ta, tb, m, n, k, 1.f, a + (a_batched ? i * m * k : 0), lda,
           b + (b_batched ? i * k * n : 0), ldb, 0.f, c + i * m * n, n);
    return;
  }
  // Deliberately leaked: no release call into onnxruntime from a static destructor at exit.
  static const OrtMemoryInfo* mem = [] {
    OrtMemoryInfo* m = nullptr;
    Ort::ThrowOnError(Ort::GetApi().CreateCpuMemoryInfo(OrtDeviceAllocator, OrtMemTypeDefault, &m));
    return m;
  }();
  auto shape = [&](int64_t r, int64_t cc, bool batched) {
    return batch == 1 || !batched ? std::vector<int64_t>{r, cc} : std::vector<int64_t>{batch, r, cc};
  };
  const auto sa = ta ? shape(k, m, a_batched) : shape(m, k, a_batched);
  const auto sb = tb ? shape(n, k, b_batched) : shape(k, n, b_batched);
  const auto sc = shape(m, n, true);
  Ort::Value va = Ort::Value::CreateTensor<float>(mem, const_cast<float*>(a),
                                                  (a_batched ? batch : 1) * m * k, sa.data(), sa.size());
  Ort::Value vb = Ort::Value::CreateTensor<float>(mem, const_cast<float*>(b),
                                                  (b_batched ? batch : 1) * k * n, sb.data(), sb.size());
  Ort::Value vc = Ort::Value::CreateTensor<float>(mem, c, batch * m * n, sc.data(), sc.size());
  const OrtValue* ins[2] = {va, vb};
  OrtValue* outs[1] = {vc};
  Ort::ThrowOnError(Ort::GetApi().InvokeOp(ctx, op, ins, 2, outs, 1));
}

// ---- activations --------------------------------------------------------------------------
Act parse_act(const std::string& s, bool allow_identity) {
  if (s == "relu") return Act::kRelu;
  if (s == "gelu") return Act::kGelu;
  if (s == "gelu_tanh") return Act::kGeluTanh;
  if (s == "silu") return Act::kSilu;
  if (s == "identity" && allow_identity) return Act::kIdentity;
  throw OpError("fusecli: unsupported activation '" + s + "'");
}

#if defined(__AVX512F__)
namespace {
// e^x on 16 lanes: n = round(x log2 e), r = x - n ln2 (ln2 split in two), degree-6 polynomial
// for e^r, then scalef by 2^n. Relative error about 2 ulp over [-87, 88] (inputs are clamped).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.f), _mm512_min_ps(_mm512_set1_ps(88.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
// 1/a: 14-bit estimate refined by one Newton step (about 23 bits), no divide unit.
inline __m512 recip16(__m512 a) {
  const __m512 y = _mm512_rcp14_ps(a);
  return _mm512_mul_ps(y, _mm512_fnmadd_ps(a, y, _mm512_set1_ps(2.f)));
}
// act'(x) for gelu (erf form) with ONE exponential: Phi(v) = 0.5 erfc(-v / sqrt 2) from
// Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7), whose exp(-z^2) is exp(-v^2 / 2), the same
// factor as the density term v phi(v).
inline __m512 gelu_grad16(__m512 v) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = exp16(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(-0.5f), v), v));
  const __m512 t = recip16(_mm512_fmadd_ps(_mm512_set1_ps(0.3275911f * 0.70710678118654752f),
                                           _mm512_abs_ps(v), one));
  __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(1.061405429f), t, _mm512_set1_ps(-1.453152027f));
  q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(1.421413741f));
  q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(-0.284496736f));
  q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(0.254829592f));
  const __m512 h = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), t), q), e);
  const __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 cdf = _mm512_mask_blend_ps(neg, _mm512_sub_ps(one, h), h);  // Phi(v)
  return _mm512_fmadd_ps(_mm512_mul_ps(v, e), _mm512_set1_ps(0.39894228040143268f), cdf);
}
// silu'(x) = s (1 + x (1 - s)), s = 1 / (1 + e^-x), with 1 - s = e^-x s (no cancellation
// for large x, where s rounds to 1)
inline __m512 silu_grad16(__m512 v) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
  const __m512 s = recip16(_mm512_add_ps(one, e));
  return _mm512_mul_ps(s, _mm512_fmadd_ps(v, _mm512_mul_ps(e, s), one));
}
template <__m512 (*G)(__m512)>
void act_grad16(const float* dy, const float* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(dy + i), G(_mm512_loadu_ps(x + i))));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 g = G(_mm512_maskz_loadu_ps(m, x + i));
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, dy + i), g));
  }
}
}  // namespace
#endif

void act_grad_block(Act act, const float* dy, const float* x, float* out, int64_t n) {
#if defined(__AVX512F__)
  if (act == Act::kGelu) return act_grad16<gelu_grad16>(dy, x, out, n);
  if (act == Act::kSilu) return act_grad16<silu_grad16>(dy, x, out, n);
#endif
  using Arr = Eigen::Array<float, Eigen::Dynamic, 1>;
  using CA = Eigen::Map<const Arr>;
  using MA = Eigen::Map<Arr>;
  constexpr int64_t kBlock = 1024;
  alignas(64) float tmp[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t len = std::min(kBlock, n - i0);
    CA d(dy + i0, len), v(x + i0, len);
    MA o(out + i0, len);
    MA t(tmp, len);
    switch (act) {
      case Act::kRelu:
        o = (v > 0.f).select(d, 0.f);
        break;
      case Act::kGelu: {
        const float kSqrt1_2 = 0.70710678118654752f, kInvSqrt2Pi = 0.39894228040143268f;
        o = d * (0.5f * (1.f + (v * kSqrt1_2).erf()) + v * (-0.5f * v * v).exp() * kInvSqrt2Pi);
        break;
      }
      case Act::kGeluTanh: {
        const float a = 0.79788456080286536f, c = 0.044715f;
        t = (a * v * (1.f + c * v * v)).tanh();
        o = d * 0.5f * (1.f + t + v * (1.f - t * t) * a * (1.f + 3.f * c * v * v));
        break;
      }
      case Act::kSilu: {  // s (1 + x (1 - s)) with 1 - s = e^-x s, as in silu_grad16
        t = (-v).min(88.f).exp();
        o = d * (1.f + v * (t / (1.f + t))) / (1.f + t);
        break;
      }
      case Act::kIdentity:
        if (o.data() != d.data()) o = d;
        break;
    }
  }
}

void half_to_float(const Ort::Float16_t* src, float* dst, int64_t n) {
  Eigen::Map<Eigen::Array<float, Eigen::Dynamic, 1>>(dst, n) =
      Eigen::Map<const Eigen::Array<Eigen::half, Eigen::Dynamic, 1>>(
          reinterpret_cast<const Eigen::half*>(src), n)
          .cast<float>();
}
void float_to_half(const float* src, Ort::Float16_t* dst, int64_t n) {
  Eigen::Map<Eigen::Array<Eigen::half, Eigen::Dynamic, 1>>(reinterpret_cast<Eigen::half*>(dst), n) =
      Eigen::Map<const Eigen::Array<float, Eigen::Dynamic, 1>>(src, n).cast<Eigen::half>();
}

#ifndef FUSECLI_WITH_CUDA
void add_cuda_ops(Ort::CustomOpDomain&) {}
#endif

// ---- AttentionGrad -------------------------------------------------------------------------
AttnAttrs::AttnAttrs(const OrtKernelInfo* info)
    : scale_q(attr_float(info, "scale_q", 1.f)),
      scale_k(attr_float(info, "scale_k", 1.f)),
      k_transposed(attr_int(info, "k_transposed", 0) != 0) {}

AttnInputs::AttnInputs(Ort::KernelContext& ctx, const AttnAttrs& a)
    : dO(get_input(ctx, 0)), q(get_input(ctx, 1)), k(get_input(ctx, 2)), v(get_input(ctx, 3)),
      p(get_input(ctx, 4)), qs(get_input(ctx, 5)), ks(get_input(ctx, 6)) {
  for (const In* t : {&dO, &q, &k, &v, &p})
    FUSECLI_CHECK(t->shape.size() >= 2, "AttentionGrad: every input needs rank >= 2");
  FUSECLI_CHECK((!qs.present || qs.numel() == 1) && (!ks.present || ks.numel() == 1),
                "AttentionGrad: q_scale and k_scale must be scalars");
  const size_t r = p.shape.size();
  Sq = p.shape[r - 2], Sk = p.shape[r - 1], D = q.shape.back(), Dv = v.shape.back();
  B = prod(p.shape, 0, r - 2);
  FUSECLI_CHECK(q.numel() == B * Sq * D, "AttentionGrad: Q must be [..., Sq, D] matching P");
  FUSECLI_CHECK(dO.numel() == B * Sq * Dv, "AttentionGrad: dO must be [..., Sq, Dv]");
  FUSECLI_CHECK(v.numel() == B * Sk * Dv, "AttentionGrad: V must be [..., Sk, Dv]");
  FUSECLI_CHECK(k.numel() == B * Sk * D, "AttentionGrad: K must be [..., Sk, D] or [..., D, Sk]");
  const int64_t k0 = k.shape[k.shape.size() - 2], k1 = k.shape.back();
  if (a.k_transposed)
    FUSECLI_CHECK(k0 == D && k1 == Sk, "AttentionGrad: K must be [..., D, Sk] (k_transposed=1)");
  else
    FUSECLI_CHECK(k0 == Sk && k1 == D, "AttentionGrad: K must be [..., Sk, D]");
}

// ---- ConvBnReluGrad ------------------------------------------------------------------------
ConvAttrs::ConvAttrs(const OrtKernelInfo* info)
    : strides(attr_ints(info, "strides", {1, 1})),
      pads(attr_ints(info, "pads", {0, 0, 0, 0})),
      dilations(attr_ints(info, "dilations", {1, 1})),
      group(attr_int(info, "group", 1)),
      relu(attr_int(info, "relu", 1) != 0) {
  FUSECLI_CHECK(strides.size() == 2 && pads.size() == 4 && dilations.size() == 2,
                "ConvBnReluGrad: strides/dilations need 2 values, pads 4 (2-D convolutions only)");
  FUSECLI_CHECK(group >= 1, "ConvBnReluGrad: group must be >= 1");
}

ConvInputs::ConvInputs(Ort::KernelContext& ctx, const ConvAttrs& a)
    : dy(get_input(ctx, 0)), y(get_input(ctx, 1)), x(get_input(ctx, 2)), w(get_input(ctx, 3)),
      cv(get_input(ctx, 4)), gamma(get_input(ctx, 5)), mean(get_input(ctx, 6)),
      istd(get_input(ctx, 7)) {
  FUSECLI_CHECK(dy.shape.size() == 4 && x.shape.size() == 4 && w.shape.size() == 4,
                "ConvBnReluGrad: dY, X and W must be 4-D");
  N = dy.shape[0], C = dy.shape[1], H = dy.shape[2], W = dy.shape[3];
  Cin = x.shape[1], Hin = x.shape[2], Win = x.shape[3], kh = w.shape[2], kw = w.shape[3];
  FUSECLI_CHECK(x.shape[0] == N, "ConvBnReluGrad: batch of X and dY differ");
  FUSECLI_CHECK(y.numel() == dy.numel() && cv.numel() == dy.numel(),
                "ConvBnReluGrad: Y/Cv must match dY");
  FUSECLI_CHECK(gamma.numel() == C && mean.numel() == C && istd.numel() == C,
                "ConvBnReluGrad: gamma/mean/inv_std must be [C]");
  FUSECLI_CHECK(C % a.group == 0 && Cin % a.group == 0,
                "ConvBnReluGrad: channels not divisible by group");
  FUSECLI_CHECK(w.shape[0] == C && w.shape[1] == Cin / a.group,
                "ConvBnReluGrad: W must be [C, Cin/group, kh, kw]");
  const int64_t eho = (Hin + a.pads[0] + a.pads[2] - a.dilations[0] * (kh - 1) - 1) / a.strides[0] + 1;
  const int64_t ewo = (Win + a.pads[1] + a.pads[3] - a.dilations[1] * (kw - 1) - 1) / a.strides[1] + 1;
  FUSECLI_CHECK(eho == H && ewo == W, "ConvBnReluGrad: dY spatial size does not match the convolution");
}

}  // namespace fusecli

// ---- exported C entry points ----------------------------------------------------------------
// Counters: "Op": calls of the op's kernels; "Op/inplace": calls whose in-place output
// (GetMayInplace) the runtime had placed in the input's own buffer; "Op/<phase>_ns": wall time
// spent in a timed phase (see PhaseId). -1 for an unknown name.
FUSECLI_EXPORT int64_t fusecli_kernel_calls(const char* op_name) {
  if (!op_name) return -1;
  for (int i = 0; i < fusecli::kNumPhases; ++i)
    if (std::strcmp(op_name, fusecli::kPhaseNames[i]) == 0) return fusecli::g_phase_ns[i].load();
  static const char kSuffix[] = "/inplace";
  const size_t len = std::strlen(op_name), sl = sizeof(kSuffix) - 1;
  const bool inplace = len > sl && std::strcmp(op_name + len - sl, kSuffix) == 0;
  const std::string base(op_name, inplace ? len - sl : len);
  for (int i = 0; i < fusecli::kNumOps; ++i)
    if (base == fusecli::kOpNames[i])
      return inplace ? fusecli::g_inplace[i].load() : fusecli::g_calls[i].load();
  return -1;
}

FUSECLI_EXPORT void fusecli_reset_kernel_calls(void) {
  for (auto& c : fusecli::g_calls) c.store(0);
  for (auto& c : fusecli::g_inplace) c.store(0);
  for (auto& c : fusecli::g_phase_ns) c.store(0);
}

FUSECLI_EXPORT int fusecli_has_cuda(void) {
#ifdef FUSECLI_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

FUSECLI_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                         const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(fusecli::kOrtApiVersion);
  if (!api) {
    const OrtApi* v1 = api_base->GetApi(1);
    return v1 ? v1->CreateStatus(ORT_FAIL, "fusecli: onnxruntime does not serve API version 16")
              : nullptr;
  }
  Ort::InitApi(api);
  // KernelContext_ParallelFor is API 17: use it where the runtime serves it (1.17 and newer).
  // (FUSECLI_OWN_THREADS=1 keeps the library's own threads, for A/B measurements.)
  if (!std::getenv("FUSECLI_OWN_THREADS")) fusecli::set_pool_api(api_base->GetApi(17));
  // One domain object for the library's lifetime, shared by every session that registers it.
  static std::mutex mu;
  static std::unique_ptr<Ort::CustomOpDomain> domain;
  std::lock_guard<std::mutex> lock(mu);
  try {
    if (!domain) {
      domain = std::make_unique<Ort::CustomOpDomain>("com.fusecli");
      fusecli::add_cpu_ops(*domain);
      fusecli::add_cuda_ops(*domain);
    }
    Ort::UnownedSessionOptions(options).Add(*domain);
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
