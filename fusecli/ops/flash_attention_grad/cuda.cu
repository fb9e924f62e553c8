// FlashAttentionGrad: CUDA kernels and C launchers (layout: ../flash_attention/flash_cuda.cuh).
#include <math_constants.h>

#include "../flash_attention/flash_cuda.cuh"

namespace {

using namespace fusecli_flash;

// Per query row (one block each): drow = dO_row . O_row, and pscale = 1, or for a row with a
// finite LSE <= kMaskedRow (every score masked by a finfo.min-like bias: S = LSE in float32)
// 1 / rowsum(exp(S - LSE)), the original's uniform softmax.
__global__ void flash_rows(const float* __restrict__ dO, const float* __restrict__ o,
                           const float* __restrict__ q, const float* __restrict__ k,
                           const float* __restrict__ lse, Bias bias, float* __restrict__ drow,
                           float* __restrict__ pscale, fusecli::KvMap km, int64_t sq, int64_t sk,
                           int64_t d, int64_t dv, float scale, int kt) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x, b = row / sq, i = row % sq;
  float a = 0.f;
  for (int64_t x = threadIdx.x; x < dv; x += blockDim.x) a += dO[row * dv + x] * o[row * dv + x];
  a = block_reduce(a, red, false);
  const float li = lse[row];
  float ps = 1.f;
  if (isfinite(li) && !(li > kMaskedRow)) {
    const float* kc = k + km.kv_of(b) * sk * d;
    const int64_t boff = bias.p ? bias.item(b) : 0;
    float sum = 0.f;
    for (int64_t j = threadIdx.x; j < sk; j += blockDim.x)
      sum += __expf(score(q + row * d, kc, j, sk, d, kt, scale) +
                    (bias.p ? bias.at(boff, i, j) : 0.f) - li);
    ps = 1.f / block_reduce(sum, red, false);
  }
  if (threadIdx.x == 0) {
    drow[row] = a;
    pscale[row] = ps;
  }
}

// True when the tile's probabilities are exactly 0 (masked bias, finite LSE above kMaskedRow).
__device__ __forceinline__ bool tile_zero(bool in, float bj, float lse_i, float* red) {
  const bool z = !in || (bj <= kSkipBias && lse_i > kMaskedRow && isfinite(lse_i));
  return block_reduce(z ? 0.f : 1.f, red, true) == 0.f;
}

// dQ: one block per query row, key tiles of kFlashT (one key per thread).
__global__ void flash_bwd_dq(const float* __restrict__ dO, const float* __restrict__ q,
                             const float* __restrict__ k, const float* __restrict__ v,
                             const float* __restrict__ lse, const float* __restrict__ drow,
                             const float* __restrict__ pscale, Bias bias, float* __restrict__ dq,
                             fusecli::KvMap km, int64_t sq, int64_t sk, int64_t d, int64_t dv,
                             float scale, int kt) {
  extern __shared__ float sh[];  // acc [d], ds [kFlashT], red [32]
  float* acc = sh;
  float* ds = sh + d;
  float* red = ds + kFlashT;
  const int64_t row = blockIdx.x, b = row / sq, i = row % sq, c = km.kv_of(b);
  const float* qr = q + row * d;
  const float* dor = dO + row * dv;
  const float* kc = k + c * sk * d;
  const float* vc = v + c * sk * dv;
  const int64_t boff = bias.p ? bias.item(b) : 0;
  const float li = lse[row], di = drow[row];
  for (int64_t x = threadIdx.x; x < d; x += blockDim.x) acc[x] = 0.f;
  for (int64_t j0 = 0; j0 < sk; j0 += kFlashT) {
    const int64_t j = j0 + threadIdx.x;
    const bool in = j < sk;
    const float bj = in && bias.p ? bias.at(boff, i, j) : 0.f;
    if (bias.p && tile_zero(in, bj, li, red)) continue;
    float g = 0.f;
    if (in) {
      const float pj = __expf(score(qr, kc, j, sk, d, kt, scale) + bj - li) * pscale[row];
      float dp = 0.f;
      for (int64_t x = 0; x < dv; ++x) dp += dor[x] * vc[j * dv + x];
      g = pj * (dp - di);
    }
    __syncthreads();
    ds[threadIdx.x] = g;
    __syncthreads();
    const int64_t nc = sk - j0 < kFlashT ? sk - j0 : kFlashT;
    for (int64_t x = threadIdx.x; x < d; x += blockDim.x) {
      float a = acc[x];
      for (int64_t t = 0; t < nc; ++t)
        a += ds[t] * (kt ? kc[x * sk + j0 + t] : kc[(j0 + t) * d + x]);
      acc[x] = a;
    }
  }
  for (int64_t x = threadIdx.x; x < d; x += blockDim.x) dq[row * d + x] = scale * acc[x];
}

// dK, dV: one block per key row j of kv item c, over the query rows of its group (tiles of
// kFlashT rows, one per thread).
__global__ void flash_bwd_dkv(const float* __restrict__ dO, const float* __restrict__ q,
                              const float* __restrict__ k, const float* __restrict__ v,
                              const float* __restrict__ lse, const float* __restrict__ drow,
                              const float* __restrict__ pscale, Bias bias, float* __restrict__ dk,
                              float* __restrict__ dvo, fusecli::KvMap km, int64_t sq, int64_t sk,
                              int64_t d, int64_t dv, float scale, int kt) {
  extern __shared__ float sh[];  // ak [d], av [dv], p [kFlashT], ds [kFlashT], red [32]
  float* ak = sh;
  float* av = ak + d;
  float* p = av + dv;
  float* ds = p + kFlashT;
  float* red = ds + kFlashT;
  const int64_t c = blockIdx.x / sk, j = blockIdx.x % sk;
  const float* kc = k + c * sk * d;
  const float* vj = v + (c * sk + j) * dv;
  for (int64_t x = threadIdx.x; x < d; x += blockDim.x) ak[x] = 0.f;
  for (int64_t x = threadIdx.x; x < dv; x += blockDim.x) av[x] = 0.f;
  const int64_t group = km.group();
  for (int64_t g = 0; g < group; ++g) {
    const int64_t b = km.member(c, g);
    const int64_t boff = bias.p ? bias.item(b) : 0;
    for (int64_t i0 = 0; i0 < sq; i0 += kFlashT) {
      const int64_t i = i0 + threadIdx.x;
      const bool in = i < sq;
      const int64_t row = b * sq + i;
      const float bj = in && bias.p ? bias.at(boff, i, j) : 0.f;
      const float li = in ? lse[row] : 0.f;
      if (bias.p && tile_zero(in, bj, li, red)) continue;
      float pj = 0.f, g2 = 0.f;
      if (in) {
        pj = __expf(score(q + row * d, kc, j, sk, d, kt, scale) + bj - li) * pscale[row];
        float dp = 0.f;
        for (int64_t x = 0; x < dv; ++x) dp += dO[row * dv + x] * vj[x];
        g2 = pj * (dp - drow[row]);
      }
      __syncthreads();
      p[threadIdx.x] = pj;
      ds[threadIdx.x] = g2;
      __syncthreads();
      const int64_t nr = sq - i0 < kFlashT ? sq - i0 : kFlashT;
      for (int64_t x = threadIdx.x; x < dv; x += blockDim.x) {
        float a = av[x];
        for (int64_t t = 0; t < nr; ++t) a += p[t] * dO[(b * sq + i0 + t) * dv + x];
        av[x] = a;
      }
      for (int64_t x = threadIdx.x; x < d; x += blockDim.x) {
        float a = ak[x];
        for (int64_t t = 0; t < nr; ++t) a += ds[t] * q[(b * sq + i0 + t) * d + x];
        ak[x] = a;
      }
    }
  }
  if (dvo)
    for (int64_t x = threadIdx.x; x < dv; x += blockDim.x) dvo[(c * sk + j) * dv + x] = av[x];
  if (dk)
    for (int64_t x = threadIdx.x; x < d; x += blockDim.x)
      (kt ? dk[c * sk * d + x * sk + j] : dk[(c * sk + j) * d + x]) = scale * ak[x];
}

}  // namespace

FUSECLI_EXPORT int fusecli_launch_flash_attention_grad(
    void* stream, const float* dO, const float* q, const float* k, const float* v, const float* o,
    const float* lse, const float* bias, const int64_t* bias_strides, float* dq, float* dk,
    float* dv, int nd, const int64_t* qdims, const int64_t* kdims, int64_t sq, int64_t sk,
    int64_t d, int64_t dv_dim, float scale, int k_transposed) {
  fusecli::KvMap km;
  Bias bm;
  if (!make_maps(nd, qdims, kdims, bias, bias_strides, &km, &bm)) return cudaErrorInvalidValue;
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t rows = km.q_items() * sq, keys = km.kv_items() * sk;
  if (rows == 0 || sk == 0) {
    if (dk) RETURN_IF_ERR(cudaMemsetAsync(dk, 0, keys * d * sizeof(float), s));
    if (dv) RETURN_IF_ERR(cudaMemsetAsync(dv, 0, keys * dv_dim * sizeof(float), s));
    if (dq) RETURN_IF_ERR(cudaMemsetAsync(dq, 0, rows * d * sizeof(float), s));
    return cudaSuccess;
  }
  Scratch ws(s);
  RETURN_IF_ERR(ws.alloc(static_cast<size_t>(rows) * 2 * sizeof(float)));
  float* drow = ws.f();
  float* pscale = drow + rows;
  flash_rows<<<static_cast<unsigned>(rows), kFlashT, 0, s>>>(
      dO, o, q, k, lse, bm, drow, pscale, km, sq, sk, d, dv_dim, scale, k_transposed);
  if (dq)
    flash_bwd_dq<<<static_cast<unsigned>(rows), kFlashT, (d + kFlashT + 32) * sizeof(float), s>>>(
        dO, q, k, v, lse, drow, pscale, bm, dq, km, sq, sk, d, dv_dim, scale, k_transposed);
  if (dk || dv)
    flash_bwd_dkv<<<static_cast<unsigned>(keys), kFlashT,
                    (d + dv_dim + 2 * kFlashT + 32) * sizeof(float), s>>>(
        dO, q, k, v, lse, drow, pscale, bm, dk, dv, km, sq, sk, d, dv_dim, scale, k_transposed);
  return static_cast<int>(cudaGetLastError());
}
