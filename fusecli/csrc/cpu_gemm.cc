// CPU GEMM: Eigen and onnxruntime's MatMul kernels (see cpu_gemm.h).
#include "cpu_gemm.h"

#include <Eigen/Core>

#include <cstring>

#include "cpu_threads.h"

namespace fusecli {

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
          if (!ta && !tb)
            gemm_block(A.middleRows(s0, len), B, alpha, beta, Cb);
          else if (!ta && tb)
            gemm_block(A.middleRows(s0, len), B.transpose(), alpha, beta, Cb);
          else if (ta && !tb)
            gemm_block(A.middleCols(s0, len).transpose(), B, alpha, beta, Cb);
          else
            gemm_block(A.middleCols(s0, len).transpose(), B.transpose(), alpha, beta, Cb);
        } else {
          MMap Cb(c + s0, m, len, Eigen::OuterStride<>(ldc));
          if (!ta && !tb)
            gemm_block(A, B.middleCols(s0, len), alpha, beta, Cb);
          else if (!ta && tb)
            gemm_block(A, B.middleRows(s0, len).transpose(), alpha, beta, Cb);
          else if (ta && !tb)
            gemm_block(A.transpose(), B.middleCols(s0, len), alpha, beta, Cb);
          else
            gemm_block(A.transpose(), B.middleRows(s0, len).transpose(), alpha, beta, Cb);
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
      OrtStatus* st = api.CreateOp(info, "FusedMatMul", "com.microsoft", 1, tnames, tvals, 1, attrs,
                                   3, 2, 1, &ops_[i]);
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
                    int64_t n, int64_t k, const float* a, const float* b, float* c, bool a_batched,
                    bool b_batched) const {
  if (batch <= 0 || m <= 0 || n <= 0) return;
  add_work(kWorkGemmCalls, 1);
  add_work(kWorkGemmMacs, batch * m * n * k);
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
    return batch == 1 || !batched ? std::vector<int64_t>{r, cc}
                                  : std::vector<int64_t>{batch, r, cc};
  };
  const auto sa = ta ? shape(k, m, a_batched) : shape(m, k, a_batched);
  const auto sb = tb ? shape(n, k, b_batched) : shape(k, n, b_batched);
  const auto sc = shape(m, n, true);
  Ort::Value va = Ort::Value::CreateTensor<float>(
      mem, const_cast<float*>(a), (a_batched ? batch : 1) * m * k, sa.data(), sa.size());
  Ort::Value vb = Ort::Value::CreateTensor<float>(
      mem, const_cast<float*>(b), (b_batched ? batch : 1) * k * n, sb.data(), sb.size());
  Ort::Value vc = Ort::Value::CreateTensor<float>(mem, c, batch * m * n, sc.data(), sc.size());
  const OrtValue* ins[2] = {va, vb};
  OrtValue* outs[1] = {vc};
  Ort::ThrowOnError(Ort::GetApi().InvokeOp(ctx, op, ins, 2, outs, 1));
}

}  // namespace fusecli
