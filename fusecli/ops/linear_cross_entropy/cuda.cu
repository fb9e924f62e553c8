// LinearCrossEntropy: CUDA launcher. Per chunk of rows: Z = Hc W^T (SGEMM), one block per row
// for the bias, logit_scale and logit_softcap, log-sum-exp, nll, lp_row and
// dZ = c (softmax - onehot) + a u (1 - V softmax) in place, then dHc = dZ W and dW += dZ^T Hc
// (SGEMM, beta 1 after the first chunk) and dB += column sums. The token count and the loss are
// reduced on the device (reduction none: the rows' losses copied out). With seq_start / seq_end
// the rows read are packed first and their dH put back after (so with seq_index: one row of
// each sequence).
#include "cuda_common.cuh"

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float block_reduce(float v, float* sh, bool is_max) {
  const int t = threadIdx.x;
  sh[t] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s) sh[t] = is_max ? fmaxf(sh[t], sh[t + s]) : sh[t] + sh[t + s];
    __syncthreads();
  }
  const float r = sh[0];
  __syncthreads();
  return r;
}

// count[0] = number of rows whose label is not ignore_index (with row_weight: their sum)
__global__ void lce_count_kernel(const int64_t* labels, int64_t n, int64_t ignore_index,
                                 const float* rw, float* count) {
  __shared__ float sh[kThreads];
  float c = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    c += rw ? rw[i] : (labels[i] != ignore_index ? 1.f : 0.f);
  c = block_reduce(c, sh, false);
  if (threadIdx.x == 0) count[0] = c;
}

__global__ void lce_rows_kernel(float* z, const float* bias, const int64_t* labels, const float* rw,
                                const float* rg, const float* seed, const float* count, float* nll,
                                int64_t r0, int64_t v, int64_t ignore_index, int wrap_negative,
                                int mean, float grad_scale, float logit_scale, float softcap,
                                int want_grad, const float* ug, float* lp_row, float row_a) {
  __shared__ float sh[kThreads];
  const int64_t i = blockIdx.x, g = r0 + i;
  float* row = z + i * v;
  if (bias || logit_scale != 1.f || softcap > 0.f)  // one pass: bias, scale, soft cap
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
      const float x = (row[j] + (bias ? bias[j] : 0.f)) * logit_scale;
      row[j] = softcap > 0.f ? softcap * tanhf(x / softcap) : x;
    }
  __syncthreads();
  const bool valid = rw || labels[g] != ignore_index;
  int64_t t = valid ? labels[g] : 0;
  if (wrap_negative && t < 0) t += v;  // [-V, 0) counts from the end, as ONNX GatherElements
  if (t < 0 || t >= v) t = 0;          // not checked on the device; never read out of range
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = block_reduce(mx, sh, true);
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) s += expf(row[j] - mx);
  s = block_reduce(s, sh, false);
  const float lse = mx + logf(s);
  const float zt = row[t];
  if (lp_row) {  // a sum_j (Z_j - lse)
    float zs = 0.f;
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) zs += row[j] - lse;
    zs = block_reduce(zs, sh, false);
    if (threadIdx.x == 0) lp_row[g] = zs * row_a;
  }
  __syncthreads();
  if (threadIdx.x == 0) nll[g] = valid ? (rw ? rw[g] : 1.f) * (lse - zt) : 0.f;
  if (!want_grad) return;
  const float sc = grad_scale * (seed ? seed[0] : 1.f);
  // the gradient of the unscaled logits, times logit_scale: c (softmax - onehot) + a u (1 - V
  // softmax)
  const float c = (rg ? rg[g] : (valid ? sc / (mean ? count[0] : 1.f) : 0.f)) * logit_scale;
  const float u = ug ? ug[g] * row_a * logit_scale : 0.f;
  const float pc = c - static_cast<float>(v) * u;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x)
    row[j] = c == 0.f && u == 0.f
                 ? 0.f
                 : (pc * expf(row[j] - lse) + u - (j == t ? c : 0.f)) *
                       (softcap > 0.f ? 1.f - (row[j] / softcap) * (row[j] / softcap) : 1.f);
}

__global__ void lce_col_add_kernel(const float* z, float* db, int64_t rows, int64_t v) {
  const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= v) return;
  float s = 0.f;
  for (int64_t r = 0; r < rows; ++r) s += z[r * v + j];
  db[j] += s;
}

// dW[index_k] += rows_k, k in order: one thread per column (deterministic, no atomics); an
// index outside [-v, v) is skipped
__global__ void lce_dw_add_kernel(const int64_t* idx, const float* rows, int64_t m, int64_t v,
                                  int64_t d, float* dw) {
  const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= d) return;
  for (int64_t k = 0; k < m; ++k) {
    const int64_t t = idx[k] < 0 ? idx[k] + v : idx[k];
    if (t >= 0 && t < v) dw[t * d + j] += rows[k * d + j];
  }
}

int dw_add(cudaStream_t s, const int64_t* idx, const float* rows, int64_t m, int64_t v, int64_t d,
           float* dw) {
  if (!dw || !idx || m <= 0 || d <= 0) return cudaGetLastError();
  lce_dw_add_kernel<<<static_cast<unsigned>((d + 255) / 256), 256, 0, s>>>(idx, rows, m, v, d, dw);
  return cudaGetLastError();
}

// seq_index: group g's row seq_index[g] of H [groups, seq, d] gathered into packed row g
// (h -> hp), or packed row g of dH scattered back to it (dp -> dfull); an index in [-seq, 0)
// counts from the end, one outside [-seq, seq) reads a zero row and writes nothing
__global__ void lce_index_rows_kernel(const int64_t* index, int64_t seq, int64_t d, const float* h,
                                      float* hp, const float* dp, float* dfull) {
  const int64_t g = blockIdx.y, j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= d) return;
  const int64_t t = index[g] < 0 ? index[g] + seq : index[g];
  const bool ok = t >= 0 && t < seq;
  if (hp) hp[g * d + j] = ok ? h[(g * seq + t) * d + j] : 0.f;
  if (dfull && ok) dfull[(g * seq + t) * d + j] = dp[g * d + j];
}

__global__ void lce_loss_kernel(const float* nll, int64_t n, const float* count, int use_count,
                                float* loss) {
  __shared__ float sh[kThreads];
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += nll[i];
  s = block_reduce(s, sh, false);
  if (threadIdx.x == 0) loss[0] = use_count ? s / count[0] : s;
}

}  // namespace

FUSECLI_EXPORT int fusecli_launch_linear_cross_entropy(
    void* stream, const float* h, const float* w, const float* bias, const int64_t* labels,
    const float* row_weight, const float* row_grad, const float* grad_seed, float* loss, float* dh,
    float* dw, float* db, int64_t n, int64_t v, int64_t d, int64_t ignore_index, int wrap_negative,
    int reduction, float grad_scale, float logit_scale, float logit_softcap, int64_t chunk_rows,
    int64_t groups, int64_t seq, int64_t seq_start, int64_t seq_end, const int64_t* dw_add_index,
    const float* dw_add_rows, int64_t dw_add_count, const float* lp_row_grad, float* lp_row,
    int lp_row_mean, const int64_t* seq_index) {
  const int tf32 = 0;  // TF32 not exposed yet: strict float32 GEMMs
  if (n < 0 || v < 0 || d < 0) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // seq > 0: H and dH [groups, seq, d], the rows seq_start .. seq_end - 1 of each group read,
  // or with seq_index its row of each group (packed into scratch); dH 0 in the others
  const int64_t used = seq_end - seq_start;
  if (seq > 0) {
    if (seq_start < 0 || used < 0 || seq_end > seq || groups < 0 || n != groups * used ||
        (seq_index && used != 1))
      return cudaErrorInvalidValue;
    if (dh) RETURN_IF_ERR(cudaMemsetAsync(dh, 0, groups * seq * d * sizeof(float), s));
  }
  Scratch hs(s), dhs(s);
  float* dh_full = dh;
  if (seq > 0 && n > 0 && d > 0) {
    const size_t row = static_cast<size_t>(d) * sizeof(float);
    RETURN_IF_ERR(hs.alloc(static_cast<size_t>(n) * row));
    if (seq_index) {
      lce_index_rows_kernel<<<
          dim3(static_cast<unsigned>((d + 255) / 256), static_cast<unsigned>(groups)), 256, 0, s>>>(
          seq_index, seq, d, h, hs.f(), nullptr, nullptr);
      RETURN_IF_ERR(cudaGetLastError());
    } else {
      RETURN_IF_ERR(cudaMemcpy2DAsync(hs.f(), used * row, h + seq_start * d, seq * row, used * row,
                                      groups, cudaMemcpyDeviceToDevice, s));
    }
    h = hs.f();
    if (dh) {
      RETURN_IF_ERR(dhs.alloc(static_cast<size_t>(n) * row));
      dh = dhs.f();
    }
  }
  if (dw) RETURN_IF_ERR(cudaMemsetAsync(dw, 0, v * d * sizeof(float), s));
  if (db) RETURN_IF_ERR(cudaMemsetAsync(db, 0, v * sizeof(float), s));
  const bool want_grad = dh || dw || db;
  if (n == 0 || v == 0) {  // (none: n rows of loss 0)
    if (loss) RETURN_IF_ERR(cudaMemsetAsync(loss, 0, (reduction == 2 ? n : 1) * sizeof(float), s));
    if (lp_row) RETURN_IF_ERR(cudaMemsetAsync(lp_row, 0, n * sizeof(float), s));
    return dw_add(s, dw_add_index, dw_add_rows, dw_add_count, v, d, dw);
  }
  // 256 MiB of logits by default: fewer chunks re-read and re-write dW less often (each chunk's
  // dW GEMM accumulates into it), and the chunk's GEMMs are large enough for cuBLAS
  int64_t c = chunk_rows > 0 ? chunk_rows : (int64_t{256} << 20) / (4 * v);
  c = c < 16 ? 16 : c;
  c = c > n ? n : c;
  Scratch zs(s), ns(s);
  RETURN_IF_ERR(zs.alloc(static_cast<size_t>(c * v) * sizeof(float)));
  RETURN_IF_ERR(ns.alloc(static_cast<size_t>(n + 1) * sizeof(float)));
  float* nll = ns.f();
  float* count = nll + n;
  lce_count_kernel<<<1, kThreads, 0, s>>>(labels, n, ignore_index, row_weight, count);
  RETURN_IF_ERR(cudaGetLastError());
  for (int64_t r0 = 0; r0 < n; r0 += c) {
    const int64_t m = n - r0 < c ? n - r0 : c;
    const float* hc = h + r0 * d;
    RETURN_IF_ERR(
        gemm(s, false, true, m, v, d, 1.f, hc, d, 0, w, d, 0, 0.f, zs.f(), v, 0, 1, tf32 != 0));
    lce_rows_kernel<<<static_cast<unsigned>(m), kThreads, 0, s>>>(
        zs.f(), bias, labels, row_weight, row_grad, grad_seed, count, nll, r0, v, ignore_index,
        wrap_negative, reduction == 0, grad_scale, logit_scale, logit_softcap, want_grad,
        lp_row_grad, lp_row, lp_row_mean ? 1.f / static_cast<float>(v) : 1.f);
    RETURN_IF_ERR(cudaGetLastError());
    if (dh)
      RETURN_IF_ERR(gemm(s, false, false, m, d, v, 1.f, zs.f(), v, 0, w, d, 0, 0.f, dh + r0 * d, d,
                         0, 1, tf32 != 0));
    if (dw)
      RETURN_IF_ERR(
          gemm(s, true, false, v, d, m, 1.f, zs.f(), v, 0, hc, d, 0, 1.f, dw, d, 0, 1, tf32 != 0));
    if (db) {
      lce_col_add_kernel<<<static_cast<unsigned>((v + 255) / 256), 256, 0, s>>>(zs.f(), db, m, v);
      RETURN_IF_ERR(cudaGetLastError());
    }
  }
  if (dh && dh != dh_full && seq_index) {  // the rows read back into their place
    lce_index_rows_kernel<<<
        dim3(static_cast<unsigned>((d + 255) / 256), static_cast<unsigned>(groups)), 256, 0, s>>>(
        seq_index, seq, d, nullptr, nullptr, dh, dh_full);
    RETURN_IF_ERR(cudaGetLastError());
  } else if (dh && dh != dh_full) {
    const size_t row = static_cast<size_t>(d) * sizeof(float);
    RETURN_IF_ERR(cudaMemcpy2DAsync(dh_full + seq_start * d, seq * row, dh, used * row, used * row,
                                    groups, cudaMemcpyDeviceToDevice, s));
  }
  if (loss && reduction == 2) {  // none: each row's loss
    RETURN_IF_ERR(cudaMemcpyAsync(loss, nll, static_cast<size_t>(n) * sizeof(float),
                                  cudaMemcpyDeviceToDevice, s));
  } else if (loss) {
    lce_loss_kernel<<<1, kThreads, 0, s>>>(nll, n, count, reduction == 0, loss);
    RETURN_IF_ERR(cudaGetLastError());
  }
  return dw_add(s, dw_add_index, dw_add_rows, dw_add_count, v, d, dw);
}
