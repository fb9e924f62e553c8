// AttentionGrad: CUDA kernels and C launchers.
#include "cuda_common.cuh"

namespace {

// ---- softmax backward rows: dS = P * (dP - rowsum(dP * P)), in place over dP ---------------
__global__ void softmax_bwd_rows(float* __restrict__ dp, const float* __restrict__ p, int64_t cols) {
  const int64_t row = blockIdx.x;
  float* d = dp + row * cols;
  const float* pr = p + row * cols;
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) s += d[j] * pr[j];
  const float tot = block_sum2(s, 0.f).x;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) d[j] = pr[j] * (d[j] - tot);
}

}  // namespace

FUSECLI_EXPORT int fusecli_read_scalar(void* stream, const float* p, float* out) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  RETURN_IF_ERR(cudaMemcpyAsync(out, p, sizeof(float), cudaMemcpyDeviceToHost, s));
  return cudaStreamSynchronize(s);
}

FUSECLI_EXPORT int fusecli_launch_attention_grad(void* stream, const float* dO, const float* q,
    const float* k, const float* v, const float* p, float* dq, float* dk, float* dv, int64_t b,
    int64_t sq, int64_t sk, int64_t d, int64_t dvd, float scale_q, float scale_k, int k_transposed) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (b <= 0) return cudaSuccess;
  if (dv)  // dV[sk,dv] = P^T dO
    RETURN_IF_ERR(sgemm(s, true, false, sk, dvd, sq, 1.f, p, sk, sq * sk, dO, dvd, sq * dvd, 0.f,
                        dv, dvd, sk * dvd, b));
  if (!dq && !dk) return cudaSuccess;
  Scratch ws(s);
  RETURN_IF_ERR(ws.alloc(static_cast<size_t>(b * sq * sk) * sizeof(float)));
  float* ds = ws.f();
  // dP[sq,sk] = dO V^T
  RETURN_IF_ERR(sgemm(s, false, true, sq, sk, dvd, 1.f, dO, dvd, sq * dvd, v, dvd, sk * dvd, 0.f,
                      ds, sk, sq * sk, b));
  if (b * sq > 0 && sk > 0) {
    const int block = sk >= 512 ? 256 : 128;
    softmax_bwd_rows<<<static_cast<unsigned>(b * sq), block, 0, s>>>(ds, p, sk);
    RETURN_IF_ERR(cudaGetLastError());
  }
  const int64_t ksz = sk * d;
  if (dq)  // dQ = scale_q dS K (K as [sk,d])
    RETURN_IF_ERR(sgemm(s, false, k_transposed != 0, sq, d, sk, scale_q, ds, sk, sq * sk, k,
                        k_transposed ? sk : d, ksz, 0.f, dq, d, sq * d, b));
  if (dk) {
    if (!k_transposed)  // dK[sk,d] = scale_k dS^T Q
      RETURN_IF_ERR(sgemm(s, true, false, sk, d, sq, scale_k, ds, sk, sq * sk, q, d, sq * d, 0.f,
                          dk, d, ksz, b));
    else  // dK[d,sk] = scale_k Q^T dS
      RETURN_IF_ERR(sgemm(s, true, false, d, sk, sq, scale_k, q, d, sq * d, ds, sk, sq * sk, 0.f,
                          dk, sk, ksz, b));
  }
  return cudaGetLastError();
}

