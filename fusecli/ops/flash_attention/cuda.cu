// FlashAttention: CUDA kernels and C launchers (see flash_cuda.cuh for the layout).
#include <math_constants.h>

#include "flash_cuda.cuh"

namespace {

using namespace fusecli_flash;

// One block per query row: key tiles of kFlashT, online softmax; the running O row is in shared
// memory (Dv floats). Tiles whose bias entries (this row's) are all <= kSkipBias are skipped;
// a row whose maximum stays <= kMaskedRow is recomputed without skipping.
__global__ void flash_fwd_rows(const float* __restrict__ q, const float* __restrict__ k,
                               const float* __restrict__ v, Bias bias, float* __restrict__ o,
                               float* __restrict__ lse, fusecli::KvMap km, int64_t sq, int64_t sk,
                               int64_t d, int64_t dv, float scale, int kt) {
  extern __shared__ float sh[];  // acc [dv], p [kFlashT], red [32]
  float* acc = sh;
  float* p = sh + dv;
  float* red = p + kFlashT;
  const int64_t row = blockIdx.x, b = row / sq, i = row % sq;
  const int64_t c = km.kv_of(b);
  const float* qr = q + row * d;
  const float* kc = k + c * sk * d;
  const float* vc = v + c * sk * dv;
  const int64_t boff = bias.p ? bias.item(b) : 0;
  float m = -CUDART_INF_F, l = 0.f;
  for (int pass = 0; pass < 2; ++pass) {
    const bool skip = pass == 0 && bias.p != nullptr;
    m = -CUDART_INF_F;
    l = 0.f;
    for (int64_t x = threadIdx.x; x < dv; x += blockDim.x) acc[x] = 0.f;
    bool skipped = false;
    for (int64_t j0 = 0; j0 < sk; j0 += kFlashT) {
      const int64_t j = j0 + threadIdx.x;
      const bool in = j < sk;
      const float bj = in && bias.p ? bias.at(boff, i, j) : 0.f;
      if (skip && block_reduce(in ? bj : -CUDART_INF_F, red, true) <= kSkipBias) {
        skipped = true;
        continue;
      }
      const float s = in ? score(qr, kc, j, sk, d, kt, scale) + bj : -CUDART_INF_F;
      const float mn = fmaxf(m, block_reduce(s, red, true));
      if (mn == -CUDART_INF_F) continue;
      const float corr = __expf(m - mn);
      const float e = in ? __expf(s - mn) : 0.f;
      __syncthreads();
      p[threadIdx.x] = e;
      l = l * corr + block_reduce(e, red, false);
      m = mn;
      const int64_t nc = sk - j0 < kFlashT ? sk - j0 : kFlashT;
      for (int64_t x = threadIdx.x; x < dv; x += blockDim.x) {
        float a = acc[x] * corr;
        for (int64_t t = 0; t < nc; ++t) a += p[t] * vc[(j0 + t) * dv + x];
        acc[x] = a;
      }
    }
    if (!skipped || m > kMaskedRow) break;
  }
  const bool empty = !(l > 0.f);
  for (int64_t x = threadIdx.x; x < dv; x += blockDim.x)
    o[row * dv + x] = empty ? CUDART_NAN_F : acc[x] / l;
  if (lse && threadIdx.x == 0) lse[row] = empty ? CUDART_NAN_F : m + logf(l);
}

}  // namespace

FUSECLI_EXPORT int fusecli_launch_flash_attention(void* stream, const float* q, const float* k,
                                                  const float* v, const float* bias,
                                                  const int64_t* bias_strides, float* o, float* lse,
                                                  int nd, const int64_t* qdims,
                                                  const int64_t* kdims, int64_t sq, int64_t sk,
                                                  int64_t d, int64_t dv, float scale,
                                                  int k_transposed) {
  fusecli::KvMap km;
  Bias bm;
  if (!make_maps(nd, qdims, kdims, bias, bias_strides, &km, &bm)) return cudaErrorInvalidValue;
  const int64_t rows = km.q_items() * sq;
  if (rows == 0) return cudaSuccess;
  auto s = static_cast<cudaStream_t>(stream);
  const size_t smem = static_cast<size_t>(dv + kFlashT + 32) * sizeof(float);
  flash_fwd_rows<<<static_cast<unsigned>(rows), kFlashT, smem, s>>>(q, k, v, bm, o, lse, km, sq, sk,
                                                                    d, dv, scale, k_transposed);
  return static_cast<int>(cudaGetLastError());
}
