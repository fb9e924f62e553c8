// CPU GEMM: Eigen (gemm) and onnxruntime's own MatMul kernel (OrtMatMul).
#pragma once

#include "op_kernel.h"

namespace fusecli {

// ---- GEMM (row-major, Eigen inside, parallel over output rows) ----------------------------
// C[m,n] = alpha * op(A) op(B) + beta * C ; op(A) is [m,k], op(B) is [k,n].
// lda/ldb/ldc are row strides of the stored (untransposed) row-major matrices.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc,
          int threads = 0);

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

}  // namespace fusecli
