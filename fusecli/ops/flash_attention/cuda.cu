// FlashAttention: CUDA kernels and C launchers. Tensor-core tiles (flash_fwd_tc, see
// flash_mma.cuh) for head dims up to 256; the one-row-per-block kernel (flash_fwd_rows, see
// flash_cuda.cuh) for larger head dims and for float32 unless FUSECLI_FLASH_PATH=tc (opt-in until
// measured on a GPU).
#include <math_constants.h>

#include "flash_mma.cuh"

namespace {

using namespace fusecli_flash;

// One block per query row: key tiles of kFlashT, online softmax; the running O row is in shared
// memory (Dv floats). Tiles whose bias entries (this row's) are all <= kSkipBias are skipped;
// a row whose maximum stays <= kMaskedRow is recomputed without skipping.
__global__ void flash_fwd_rows(const float* __restrict__ q, const float* __restrict__ k,
                               const float* __restrict__ v, Bias bias, Mask mk,
                               float* __restrict__ o, float* __restrict__ lse, fusecli::KvMap km,
                               int64_t sq, int64_t sk, int64_t d, int64_t dv, float scale, int kt,
                               float cap, int nan_guard) {
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
  const int64_t moff = mk.p ? mk.item(b) : 0;
  float m = -CUDART_INF_F, l = 0.f;
  for (int pass = 0; pass < 2; ++pass) {
    const bool skip = pass == 0 && (bias.p != nullptr || mk.p != nullptr);
    m = -CUDART_INF_F;
    l = 0.f;
    for (int64_t x = threadIdx.x; x < dv; x += blockDim.x) acc[x] = 0.f;
    bool skipped = false;
    for (int64_t j0 = 0; j0 < sk; j0 += kFlashT) {
      const int64_t j = j0 + threadIdx.x;
      const bool in = j < sk;
      const float bj = in && bias.p ? bias.at(boff, i, j) : 0.f;
      const bool fj = in && mk.filled(moff, i, j);  // Where replaced this score
      const float fv = fj ? mk.value(bj, bias.p != nullptr) : 0.f;
      // a tile is skipped when every position is filled with, or biased to, <= kSkipBias
      if (skip && block_reduce(in ? (fj ? fv : bj) : -CUDART_INF_F, red, true) <= kSkipBias) {
        skipped = true;
        continue;
      }
      const float s = !in ? -CUDART_INF_F : fj ? fv : score(qr, kc, j, sk, d, kt, scale, cap) + bj;
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
  const float lv = empty ? CUDART_NAN_F : m + logf(l);
  // P = 0 (O = 0), LSE +inf: the contract (2: only a row whose every score is -inf)
  const bool guarded = nan_guard == 2 ? m == -CUDART_INF_F : nan_guard && !isfinite(lv);
  for (int64_t x = threadIdx.x; x < dv; x += blockDim.x)
    o[row * dv + x] = guarded ? 0.f : empty ? CUDART_NAN_F : acc[x] / l;
  if (lse && threadIdx.x == 0) lse[row] = guarded ? CUDART_INF_F : lv;
}

template <int P, int DP> struct FwdCfg {
  using T = typename PrecOf<P>::T;
  static constexpr int kWarps = 4;
  static constexpr int kBr = 16 * kWarps;  // query rows per block (16 per warp)
  static constexpr int kBc = (sizeof(T) == 4 && DP >= 128) || DP >= 256 ? 32 : 64;  // keys/tile
  static constexpr int kLd = DP + PrecOf<P>::kPad;                                  // Q, K, V tiles
  static constexpr int kLdp = kBc + PrecOf<P>::kPad;  // each warp's P strip [16, kBc]
  static constexpr size_t kSmem =
      (static_cast<size_t>(kBr + 2 * kBc) * kLd + static_cast<size_t>(kBr) * kLdp) * sizeof(T);
};

// One block per (query item b, tile of kBr query rows); warp w owns rows 16 w .. 16 w + 15 of the
// tile. Per key tile (K, V staged in shared memory): S = scale Q K^T (+ bias) in registers, the
// online softmax per row (a row's 4 lanes reduce with shuffles), P through the warp's strip of
// shared memory into O += P V. Tiles whose bias entries are all <= kSkipBias are skipped; when
// skipping left a valid row with max <= kMaskedRow, the tile is recomputed without skipping.
template <int P, int DP>
__global__ void __launch_bounds__(128, 1)
    flash_fwd_tc(const typename PrecOf<P>::T* __restrict__ q,
                 const typename PrecOf<P>::T* __restrict__ k,
                 const typename PrecOf<P>::T* __restrict__ v, BiasT<typename PrecOf<P>::T> bias,
                 typename PrecOf<P>::T* __restrict__ o, float* __restrict__ lse, fusecli::KvMap km,
                 int64_t sq, int64_t sk, int d, int dv, float scale, int kt, int64_t nqt,
                 int split) {
  using C = FwdCfg<P, DP>;
  using T = typename C::T;
  constexpr int NT = C::kBc / 8, NO = DP / 8;
  extern __shared__ __align__(16) unsigned char fl_smem[];
  T* qs = reinterpret_cast<T*>(fl_smem);
  T* ks = qs + C::kBr * C::kLd;
  T* vs = ks + C::kBc * C::kLd;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  T* pw = vs + C::kBc * C::kLd + warp * 16 * C::kLdp;
  const int64_t b = blockIdx.x / nqt, i0 = (blockIdx.x % nqt) * C::kBr;
  const int64_t nr = sq - i0 < C::kBr ? sq - i0 : C::kBr;
  const int64_t c = km.kv_of(b);
  const T* kc = k + c * sk * d;
  const T* vc = v + c * sk * dv;
  const int64_t boff = bias.p ? bias.item(b) : 0;
  load_tile(qs, C::kBr, DP, C::kLd, q + (b * sq + i0) * d, nr, d, d, 1);
  float m[2], l[2], acc[NO][4];
  for (int pass = 0; pass < 2; ++pass) {
    const bool skip = pass == 0 && bias.p != nullptr;
    bool skipped = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m[h] = -CUDART_INF_F;
      l[h] = 0.f;
    }
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
    for (int64_t j0 = 0; j0 < sk; j0 += C::kBc) {
      const int64_t nc = sk - j0 < C::kBc ? sk - j0 : C::kBc;
      __syncthreads();  // the previous tile's K / V reads are done (Q is loaded)
      if (skip) {
        bool live = false;
        for (int idx = threadIdx.x; idx < nr * nc; idx += blockDim.x) {
          const int r = idx / static_cast<int>(nc), x = idx - r * static_cast<int>(nc);
          live |= bias.at(boff, i0 + r, j0 + x) > kSkipBias;
        }
        if (!__syncthreads_or(live)) {
          skipped = true;
          continue;
        }
      }
      load_tile(ks, C::kBc, DP, C::kLd, kt ? kc + j0 : kc + j0 * d, nc, d, kt ? 1 : d, kt ? sk : 1);
      load_tile(vs, C::kBc, DP, C::kLd, vc + j0 * dv, nc, dv, dv, 1);
      __syncthreads();
      float s[NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
      warp_gemm<P, NT, true>(s, qs + warp * 16 * C::kLd, C::kLd, ks, C::kLd, DP, split);
      float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t i = i0 + warp * 16 + c_row(e), j = j0 + n * 8 + c_col(e);
          float x = -CUDART_INF_F;
          if (j < sk) {
            x = s[n][e] * scale;
            if (bias.p && i < sq) x += bias.at(boff, i, j);
          }
          s[n][e] = x;
          mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
      float corr[2], sum[2] = {0.f, 0.f};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float mn = fmaxf(m[h], quad_max(mx[h]));
        corr[h] = 1.f;
        if (mn != -CUDART_INF_F) {      // else every score so far is -inf: nothing to add yet
          corr[h] = __expf(m[h] - mn);  // 0 for the first finite tile
          m[h] = mn;
        }
      }
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1;
          const float p = m[h] == -CUDART_INF_F ? 0.f : __expf(s[n][e] - m[h]);
          sum[h] += p;
          pw[c_row(e) * C::kLdp + n * 8 + c_col(e)] = fl_to<T>(p);
        }
#pragma unroll
      for (int h = 0; h < 2; ++h) l[h] = l[h] * corr[h] + quad_sum(sum[h]);
#pragma unroll
      for (int n = 0; n < NO; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] *= corr[e >> 1];
      __syncwarp();
      warp_gemm<P, NO, false>(acc, pw, C::kLdp, vs, C::kLd, C::kBc, split);
      __syncwarp();
    }
    if (!skipped) break;
    bool low = false;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      low |= i0 + warp * 16 + (lane >> 2) + 8 * h < sq && !(m[h] > kMaskedRow);
    if (!__syncthreads_or(low)) break;
  }
#pragma unroll
  for (int n = 0; n < NO; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = e >> 1;
      const int64_t i = i0 + warp * 16 + c_row(e);
      const int col = n * 8 + c_col(e);
      if (i < sq && col < dv)
        o[(b * sq + i) * dv + col] = fl_to<T>(l[h] > 0.f ? acc[n][e] / l[h] : CUDART_NAN_F);
    }
  if (lse && (lane & 3) == 0)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i = i0 + warp * 16 + (lane >> 2) + 8 * h;
      if (i < sq) lse[b * sq + i] = l[h] > 0.f ? m[h] + logf(l[h]) : CUDART_NAN_F;
    }
}

template <int P, int DP>
cudaError_t launch_fwd_dp(cudaStream_t s, const typename PrecOf<P>::T* q,
                          const typename PrecOf<P>::T* k, const typename PrecOf<P>::T* v,
                          const BiasT<typename PrecOf<P>::T>& bias, typename PrecOf<P>::T* o,
                          float* lse, const fusecli::KvMap& km, int64_t sq, int64_t sk, int d,
                          int dv, float scale, int kt, int split) {
  using C = FwdCfg<P, DP>;
  auto kern = flash_fwd_tc<P, DP>;
  RETURN_IF_ERR(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(C::kSmem)));
  const int64_t nqt = (sq + C::kBr - 1) / C::kBr;
  kern<<<static_cast<unsigned>(km.q_items() * nqt), C::kWarps * 32, C::kSmem, s>>>(
      q, k, v, bias, o, lse, km, sq, sk, d, dv, scale, kt, nqt, split);
  return cudaGetLastError();
}

// The tensor-core forward for head-dim bucket dp (dp_bucket).
template <int P>
cudaError_t launch_fwd_tc(cudaStream_t s, int dp, const typename PrecOf<P>::T* q,
                          const typename PrecOf<P>::T* k, const typename PrecOf<P>::T* v,
                          const BiasT<typename PrecOf<P>::T>& bias, typename PrecOf<P>::T* o,
                          float* lse, const fusecli::KvMap& km, int64_t sq, int64_t sk, int64_t d,
                          int64_t dv, float scale, int kt, int split) {
  const int di = static_cast<int>(d), dvi = static_cast<int>(dv);
  switch (dp) {
    case 32:
      return launch_fwd_dp<P, 32>(s, q, k, v, bias, o, lse, km, sq, sk, di, dvi, scale, kt, split);
    case 64:
      return launch_fwd_dp<P, 64>(s, q, k, v, bias, o, lse, km, sq, sk, di, dvi, scale, kt, split);
    case 96:
      return launch_fwd_dp<P, 96>(s, q, k, v, bias, o, lse, km, sq, sk, di, dvi, scale, kt, split);
    case 128:
      return launch_fwd_dp<P, 128>(s, q, k, v, bias, o, lse, km, sq, sk, di, dvi, scale, kt, split);
    case 256:
      return launch_fwd_dp<P, 256>(s, q, k, v, bias, o, lse, km, sq, sk, di, dvi, scale, kt, split);
    default:
      return cudaErrorInvalidValue;
  }
}

// 16-bit inputs: the tensor-core kernel only (head dims up to 256).
template <int P>
int launch_fwd_16(void* stream, const void* q, const void* k, const void* v, const void* bias,
                  const int64_t* bias_strides, void* o, float* lse, int nd, const int64_t* qdims,
                  const int64_t* kdims, int64_t sq, int64_t sk, int64_t d, int64_t dv, float scale,
                  int k_transposed) {
  using T = typename PrecOf<P>::T;
  fusecli::KvMap km;
  BiasT<T> bm;
  if (!make_maps(nd, qdims, kdims, static_cast<const T*>(bias), bias_strides, &km, &bm))
    return cudaErrorInvalidValue;
  const int dp = dp_bucket(d > dv ? d : dv);
  if (dp == 0) return cudaErrorInvalidValue;
  if (km.q_items() * sq == 0) return cudaSuccess;
  return launch_fwd_tc<P>(static_cast<cudaStream_t>(stream), dp, static_cast<const T*>(q),
                          static_cast<const T*>(k), static_cast<const T*>(v), bm,
                          static_cast<T*>(o), lse, km, sq, sk, d, dv, scale, k_transposed, 0);
}

}  // namespace

FUSECLI_EXPORT int fusecli_launch_flash_attention(
    void* stream, const float* q, const float* k, const float* v, const float* bias,
    const int64_t* bias_strides, float* o, float* lse, int nd, const int64_t* qdims,
    const int64_t* kdims, int64_t sq, int64_t sk, int64_t d, int64_t dv, float scale,
    int k_transposed, int tf32, const uint8_t* mask, const int64_t* mask_strides, float fill,
    int fill_kept, int bias_first, float softcap, int nan_guard) {
  fusecli::KvMap km;
  Bias bm;
  Mask mk;
  if (!make_maps(nd, qdims, kdims, bias, bias_strides, &km, &bm) ||
      !make_mask(nd, qdims, mask, mask_strides, fill, fill_kept, bias_first, &mk))
    return cudaErrorInvalidValue;
  const int64_t rows = km.q_items() * sq;
  if (rows == 0) return cudaSuccess;
  auto s = static_cast<cudaStream_t>(stream);
  const int dp = dp_bucket(d > dv ? d : dv);
  // the tensor-core tiles take no mask, no soft cap and no NaN guard
  if (dp != 0 && flash_tc_enabled() && !mask && !(softcap > 0.f) && !nan_guard)
    return launch_fwd_tc<kF32>(s, dp, q, k, v, bm, o, lse, km, sq, sk, d, dv, scale, k_transposed,
                               tf32 ? 0 : 1);
  const size_t smem = static_cast<size_t>(dv + kFlashT + 32) * sizeof(float);
  flash_fwd_rows<<<static_cast<unsigned>(rows), kFlashT, smem, s>>>(
      q, k, v, bm, mk, o, lse, km, sq, sk, d, dv, scale, k_transposed, softcap, nan_guard);
  return static_cast<int>(cudaGetLastError());
}

FUSECLI_EXPORT int fusecli_launch_flash_attention_f16(void* stream, const void* q, const void* k,
                                                      const void* v, const void* bias,
                                                      const int64_t* bias_strides, void* o,
                                                      float* lse, int nd, const int64_t* qdims,
                                                      const int64_t* kdims, int64_t sq, int64_t sk,
                                                      int64_t d, int64_t dv, float scale,
                                                      int k_transposed) {
  return launch_fwd_16<kF16>(stream, q, k, v, bias, bias_strides, o, lse, nd, qdims, kdims, sq, sk,
                             d, dv, scale, k_transposed);
}

FUSECLI_EXPORT int fusecli_launch_flash_attention_bf16(void* stream, const void* q, const void* k,
                                                       const void* v, const void* bias,
                                                       const int64_t* bias_strides, void* o,
                                                       float* lse, int nd, const int64_t* qdims,
                                                       const int64_t* kdims, int64_t sq, int64_t sk,
                                                       int64_t d, int64_t dv, float scale,
                                                       int k_transposed) {
  return launch_fwd_16<kBf16>(stream, q, k, v, bias, bias_strides, o, lse, nd, qdims, kdims, sq, sk,
                              d, dv, scale, k_transposed);
}
