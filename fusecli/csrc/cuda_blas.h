// cuBLAS for the fused ops' GEMMs, loaded at run time (dlopen), so that the library loads and runs
// its CPU kernels (and its CUDA kernels, on the built-in SIMT GEMM) where cuBLAS is absent.
// Plain C++ (no CUDA header): included by the CUDA launchers (cuda.cu, through cuda_common.cuh)
// and by the onnxruntime CUDA kernels (cuda_op.cc, through cuda_op_kernel.h).
//
// Which library: $FUSECLI_CUBLAS_DIR/libcublas.so.{13,12} when that variable names a folder, then
// libcublas.so.13 and libcublas.so.12 by soname (the loader's path; a process that already loaded
// cuBLAS, as torch does, gets that copy). FUSECLI_GEMM_PATH=simt forces the built-in SIMT GEMM
// (the path before cuBLAS; also the convolutions' im2col path, cuda_dnn.h).
// Handles: one per device and thread, created on first use; inside an onnxruntime session the
// CUDA execution provider's own handle (BorrowHandle) for the duration of a kernel call.
// Precision: float32 by default (CUBLAS_COMPUTE_32F, TF32 never used); tf32 = 1 allows TF32
// tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32) for float32 inputs.
#pragma once

#include <cstdint>

namespace fusecli {
namespace blas {

enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// gemm()'s result besides 0 (done): cuBLAS is not in use (not found, forced off, or a dimension
// beyond its 32-bit int) and the caller runs its own kernel; a cuBLAS failure is reported on
// stderr and returned as kStatusBase + its cublasStatus_t (the launchers return it as their error).
constexpr int kNotUsed = -1;
constexpr int kStatusBase = 10000;

// C[m,n] = alpha op(A) op(B) + beta C, row-major, `batch` matrices `sA`, `sB`, `sC` elements
// apart; op(A) = A^T when ta (A stored [k,m]), op(B) = B^T when tb (B stored [n,k]). alpha, beta
// are float; accumulation in float32.
int gemm(void* stream, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
         const void* A, DType at, int64_t lda, int64_t sA, const void* B, DType bt, int64_t ldb,
         int64_t sB, float beta, void* C, DType ct, int64_t ldc, int64_t sC, int64_t batch,
         bool tf32);

// One line: the GEMM path this process uses ("cuBLAS 13.1.0 (libcublas.so.13)" or "built-in
// SIMT GEMM (cuBLAS not loaded: ...)"). Loads cuBLAS if not tried yet.
const char* path();

// While alive, gemm() on this thread uses `handle` (a cublasHandle_t, e.g. onnxruntime's CUDA
// execution provider's) instead of its own; its math mode is set for each call and restored.
// A null handle changes nothing.
class BorrowHandle {
 public:
  explicit BorrowHandle(void* handle);
  ~BorrowHandle();
  BorrowHandle(const BorrowHandle&) = delete;
  BorrowHandle& operator=(const BorrowHandle&) = delete;

 private:
  void* prev_;
};

}  // namespace blas
}  // namespace fusecli
