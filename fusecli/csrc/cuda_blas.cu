// cuBLAS loaded at run time for the fused ops' GEMMs (see cuda_blas.h).
#include "cuda_blas.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <library_types.h>  // cudaDataType (CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF): cudart's header

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#define FUSECLI_EXPORT_C extern "C" __attribute__((visibility("default")))

namespace fusecli {
namespace blas {
namespace {

// ---- the few cuBLAS declarations used, as in cublas_api.h (cuBLAS 12 / 13) -------------------
// (declared here so the build needs no cuBLAS headers; the values are the header's)
using cublasHandle_t = void*;
using cublasStatus_t = int;  // CUBLAS_STATUS_SUCCESS = 0
enum : int { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum : int { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_FAST_TF32 = 77 };
enum : int { CUBLAS_DEFAULT_MATH = 0, CUBLAS_TF32_TENSOR_OP_MATH = 3 };
enum : int { CUBLAS_GEMM_DEFAULT = -1 };

using CreateFn = cublasStatus_t (*)(cublasHandle_t*);
using SetStreamFn = cublasStatus_t (*)(cublasHandle_t, cudaStream_t);
using GetMathModeFn = cublasStatus_t (*)(cublasHandle_t, int*);
using SetMathModeFn = cublasStatus_t (*)(cublasHandle_t, int);
using GetVersionFn = cublasStatus_t (*)(cublasHandle_t, int*);
// cublasGemmStridedBatchedEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B,
//   Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo)
using GemmSBEFn = cublasStatus_t (*)(cublasHandle_t, int, int, int, int, int, const void*,
                                     const void*, cudaDataType, int, long long, const void*,
                                     cudaDataType, int, long long, const void*, void*, cudaDataType,
                                     int, long long, int, int, int);

struct Lib {
  bool tried = false;
  void* so = nullptr;
  CreateFn create = nullptr;
  SetStreamFn set_stream = nullptr;
  GetMathModeFn get_math = nullptr;
  SetMathModeFn set_math = nullptr;
  GetVersionFn get_version = nullptr;
  GemmSBEFn gemm = nullptr;
  std::string path;  // the one-line report
};

Lib g_lib;
std::once_flag g_once;
thread_local cublasHandle_t t_borrowed = nullptr;
constexpr int kMaxDevices = 64;
thread_local cublasHandle_t t_own[kMaxDevices] = {};

void* sym(void* so, const char* name) {
  const std::string v2 = std::string(name) + "_v2";
  void* p = dlsym(so, v2.c_str());
  return p ? p : dlsym(so, name);
}

const char* status_name(int st) {
  switch (st) {
    case 1:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case 3:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case 7:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case 8:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case 11:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case 13:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case 14:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case 15:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    default:
      return "unknown cublasStatus_t";
  }
}

void load() {
  Lib& L = g_lib;
  L.tried = true;
  const char* force = std::getenv("FUSECLI_GEMM_PATH");
  if (force && std::strcmp(force, "simt") == 0) {
    L.path = "built-in SIMT GEMM (FUSECLI_GEMM_PATH=simt)";
    return;
  }
  std::string tried, err;
  auto try_open = [&](const std::string& name, const std::string& lt) -> void* {
    if (!lt.empty()) dlopen(lt.c_str(), RTLD_NOW | RTLD_GLOBAL);  // libcublas's own dependency
    void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    tried += (tried.empty() ? "" : ", ") + name;
    if (!h) {
      const char* e = dlerror();
      if (e) err = e;
    }
    return h;
  };
  const char* dir = std::getenv("FUSECLI_CUBLAS_DIR");
  const char* const versions[] = {"13", "12"};
  std::string opened;
  if (dir && *dir) {
    for (const char* v : versions) {
      const std::string d(dir);
      if ((L.so = try_open(d + "/libcublas.so." + v, d + "/libcublasLt.so." + v))) {
        opened = d + "/libcublas.so." + v;
        break;
      }
    }
  }
  for (const char* v : versions) {
    if (L.so) break;
    const std::string name = std::string("libcublas.so.") + v;
    if ((L.so = try_open(name, ""))) opened = name;
  }
  if (!L.so) {
    L.path = "built-in SIMT GEMM (cuBLAS not found: tried " + tried +
             (err.empty() ? "" : "; last error: " + err) +
             "; set FUSECLI_CUBLAS_DIR to the folder of libcublas.so.13)";
    return;
  }
  L.create = reinterpret_cast<CreateFn>(sym(L.so, "cublasCreate"));
  L.set_stream = reinterpret_cast<SetStreamFn>(sym(L.so, "cublasSetStream"));
  L.get_math = reinterpret_cast<GetMathModeFn>(dlsym(L.so, "cublasGetMathMode"));
  L.set_math = reinterpret_cast<SetMathModeFn>(dlsym(L.so, "cublasSetMathMode"));
  L.get_version = reinterpret_cast<GetVersionFn>(sym(L.so, "cublasGetVersion"));
  L.gemm = reinterpret_cast<GemmSBEFn>(dlsym(L.so, "cublasGemmStridedBatchedEx"));
  if (!L.create || !L.set_stream || !L.get_math || !L.set_math || !L.gemm) {
    L.path = "built-in SIMT GEMM (" + opened +
             " lacks cublasCreate / cublasSetStream / cublasSetMathMode / "
             "cublasGemmStridedBatchedEx)";
    L.gemm = nullptr;
    return;
  }
  std::string version = "?";
  cublasHandle_t h = nullptr;
  int ver = 0;
  if (L.get_version && L.create(&h) == 0 && h && L.get_version(h, &ver) == 0)
    version = std::to_string(ver / 10000) + "." + std::to_string(ver / 100 % 100) + "." +
              std::to_string(ver % 100);
  // h becomes this thread's handle for the current device (not leaked, not destroyed)
  int dev = 0;
  if (h && cudaGetDevice(&dev) == cudaSuccess && dev >= 0 && dev < kMaxDevices && !t_own[dev])
    t_own[dev] = h;
  L.path = "cuBLAS " + version + " (" + opened + ")";
}

void ensure_loaded() {
  std::call_once(g_once, [] {
    load();
    if (!std::getenv("FUSECLI_QUIET_GEMM"))
      std::fprintf(stderr, "fusecli: CUDA GEMMs on %s\n", g_lib.path.c_str());
  });
}

cudaDataType cuda_type(DType t) {
  return t == DType::kF16 ? CUDA_R_16F : t == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
}

int fail(const char* what, int st, int64_t m, int64_t n, int64_t k, int64_t batch) {
  std::fprintf(stderr,
               "fusecli: %s failed: %s (%d) for a GEMM m=%lld n=%lld k=%lld batch=%lld on %s\n",
               what, status_name(st), st, (long long)m, (long long)n, (long long)k,
               (long long)batch, g_lib.path.c_str());
  return kStatusBase + st;
}

}  // namespace

const char* path() {
  ensure_loaded();
  return g_lib.path.c_str();
}

BorrowHandle::BorrowHandle(void* handle) : prev_(t_borrowed) {
  if (handle) t_borrowed = handle;
}
BorrowHandle::~BorrowHandle() {
  t_borrowed = prev_;
}

int gemm(void* stream, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
         const void* A, DType at, int64_t lda, int64_t sA, const void* B, DType bt, int64_t ldb,
         int64_t sB, float beta, void* C, DType ct, int64_t ldc, int64_t sC, int64_t batch,
         bool tf32) {
  ensure_loaded();
  Lib& L = g_lib;
  if (!L.gemm) return kNotUsed;
  if (m <= 0 || n <= 0 || batch <= 0) return 0;
  // cuBLAS takes 32-bit dimensions and leading dims >= 1; k = 0 (C = beta C) and anything larger
  // go to the caller's kernel
  if (k <= 0 || m > INT_MAX || n > INT_MAX || k > INT_MAX || lda > INT_MAX || ldb > INT_MAX ||
      ldc > INT_MAX || batch > INT_MAX || lda < 1 || ldb < 1 || ldc < 1)
    return kNotUsed;
  cublasHandle_t h = t_borrowed;
  if (!h) {
    int dev = 0;
    cudaError_t ce = cudaGetDevice(&dev);
    if (ce != cudaSuccess) return ce;
    if (dev < 0 || dev >= kMaxDevices) return kNotUsed;
    if (!t_own[dev]) {
      const int st = L.create(&t_own[dev]);
      if (st != 0) {
        t_own[dev] = nullptr;
        return fail("cublasCreate", st, m, n, k, batch);
      }
    }
    h = t_own[dev];
  }
  int st = L.set_stream(h, static_cast<cudaStream_t>(stream));
  if (st != 0) return fail("cublasSetStream", st, m, n, k, batch);
  int prev_math = CUBLAS_DEFAULT_MATH;
  st = L.get_math(h, &prev_math);
  if (st != 0) return fail("cublasGetMathMode", st, m, n, k, batch);
  const bool f32 = at == DType::kF32 && bt == DType::kF32;
  const int math = tf32 && f32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH;
  if (prev_math != math) {
    st = L.set_math(h, math);
    if (st != 0) return fail("cublasSetMathMode", st, m, n, k, batch);
  }
  const int compute = tf32 && f32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  // row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLAS gets B first
  st = L.gemm(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
              static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, B,
              cuda_type(bt), static_cast<int>(ldb), static_cast<long long>(sB), A, cuda_type(at),
              static_cast<int>(lda), static_cast<long long>(sA), &beta, C, cuda_type(ct),
              static_cast<int>(ldc), static_cast<long long>(sC), static_cast<int>(batch), compute,
              CUBLAS_GEMM_DEFAULT);
  if (prev_math != math) L.set_math(h, prev_math);
  if (st != 0) return fail("cublasGemmStridedBatchedEx", st, m, n, k, batch);
  return 0;
}

}  // namespace blas
}  // namespace fusecli

// The GEMM path of this process, one line (tests/gpu/run_gpu_checks.sh and `fusecli` print it).
FUSECLI_EXPORT_C const char* fusecli_gemm_path() {
  return fusecli::blas::path();
}
