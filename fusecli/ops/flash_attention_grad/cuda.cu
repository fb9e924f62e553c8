// FlashAttentionGrad: CUDA kernels and C launchers. A preprocess (flash_rows: D = rowsum(dO O)
// and the masked-row renormalisation), then tensor-core tiles (flash_mma.cuh) for head dims up
// to 256: dK / dV with a block per tile of keys over its group's query tiles, dQ with a block
// per tile of query rows over the key tiles (no atomics: deterministic). Larger head dims and
// float32 without FUSECLI_FLASH_PATH=tc (opt-in until measured) take the one-row-per-block kernels
// (flash_cuda.cuh).
#include <math_constants.h>

#include "../flash_attention/flash_mma.cuh"

namespace {

using namespace fusecli_flash;

// Per query row (one block each): drow = dO_row . O_row (NaN for a row nan_guard guarded), and
// pscale = 1, or for a row with a finite LSE <= kMaskedRow (every score masked by a
// finfo.min-like bias: S = LSE in float32) 1 / rowsum(exp(S - LSE)), the original's uniform
// softmax.
template <typename T>
__global__ void flash_rows(const T* __restrict__ dO, const T* __restrict__ o,
                           const T* __restrict__ q, const T* __restrict__ k,
                           const float* __restrict__ lse, BiasT<T> bias, Mask mk,
                           float* __restrict__ drow, float* __restrict__ pscale, fusecli::KvMap km,
                           int64_t sq, int64_t sk, int64_t d, int64_t dv, float scale, int kt,
                           float cap, int nan_guard) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x, b = row / sq, i = row % sq;
  float a = 0.f;
  for (int64_t x = threadIdx.x; x < dv; x += blockDim.x)
    a += fl_f(dO[row * dv + x]) * fl_f(o[row * dv + x]);
  a = block_reduce(a, red, false);
  const float li = lse[row];
  float ps = 1.f;
  if (isfinite(li) && !(li > kMaskedRow)) {
    const T* kc = k + km.kv_of(b) * sk * d;
    const int64_t boff = bias.p ? bias.item(b) : 0;
    const int64_t moff = mk.p ? mk.item(b) : 0;
    float sum = 0.f;
    for (int64_t j = threadIdx.x; j < sk; j += blockDim.x) {
      const float bj = bias.p ? bias.at(boff, i, j) : 0.f;
      sum +=
          __expf((mk.filled(moff, i, j) ? mk.value(bj, bias.p != nullptr)
                                        : score(q + row * d, kc, j, sk, d, kt, scale, cap) + bj) -
                 li);
    }
    ps = 1.f / block_reduce(sum, red, false);
  }
  if (threadIdx.x == 0) {
    // nan_guard 1: a guarded row (LSE +inf) has P = 0 and a NaN dS, P (dP - NaN); 2: P = 0 and
    // O = 0 there, so dS = 0 (the contract)
    drow[row] = nan_guard == 1 && li == CUDART_INF_F ? CUDART_NAN_F : a;
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
                             const float* __restrict__ pscale, Bias bias, Mask mk,
                             float* __restrict__ dq, fusecli::KvMap km, int64_t sq, int64_t sk,
                             int64_t d, int64_t dv, float scale, int kt, float cap) {
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
  const int64_t moff = mk.p ? mk.item(b) : 0;
  const float li = lse[row], di = drow[row];
  for (int64_t x = threadIdx.x; x < d; x += blockDim.x) acc[x] = 0.f;
  for (int64_t j0 = 0; j0 < sk; j0 += kFlashT) {
    const int64_t j = j0 + threadIdx.x;
    const bool in = j < sk;
    const float bj = in && bias.p ? bias.at(boff, i, j) : 0.f;
    const bool fj = in && mk.filled(moff, i, j);
    const float fv = fj ? mk.value(bj, bias.p != nullptr) : 0.f;
    if ((bias.p || mk.p) && tile_zero(in, fj ? fv : bj, li, red)) continue;
    float g = 0.f;
    if (in && !fj) {  // a filled position's gradient is 0 (Where's)
      const float sc = score(qr, kc, j, sk, d, kt, scale, cap);
      const float pj = __expf(sc + bj - li) * pscale[row];
      float dp = 0.f;
      for (int64_t x = 0; x < dv; ++x) dp += dor[x] * vc[j * dv + x];
      g = pj * (dp - di) * cap_grad(sc, cap);
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
                              const float* __restrict__ pscale, Bias bias, Mask mk,
                              float* __restrict__ dk, float* __restrict__ dvo, fusecli::KvMap km,
                              int64_t sq, int64_t sk, int64_t d, int64_t dv, float scale, int kt,
                              float cap) {
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
    const int64_t moff = mk.p ? mk.item(b) : 0;
    for (int64_t i0 = 0; i0 < sq; i0 += kFlashT) {
      const int64_t i = i0 + threadIdx.x;
      const bool in = i < sq;
      const int64_t row = b * sq + i;
      const float bj = in && bias.p ? bias.at(boff, i, j) : 0.f;
      const bool fj = in && mk.filled(moff, i, j);
      const float fv = fj ? mk.value(bj, bias.p != nullptr) : 0.f;
      const float li = in ? lse[row] : 0.f;
      if ((bias.p || mk.p) && tile_zero(in, fj ? fv : bj, li, red)) continue;
      float pj = 0.f, g2 = 0.f;
      if (in) {
        const float sc = fj ? 0.f : score(q + row * d, kc, j, sk, d, kt, scale, cap);
        pj = __expf((fj ? fv : sc + bj) - li) * pscale[row];
        if (!fj) {  // a filled position's gradient is 0 (Where's); dV still reads its P
          float dp = 0.f;
          for (int64_t x = 0; x < dv; ++x) dp += dO[row * dv + x] * vj[x];
          g2 = pj * (dp - drow[row]) * cap_grad(sc, cap);
        }
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

template <int P, int DP> struct BwdCfg {
  using T = typename PrecOf<P>::T;
  static constexpr int kPad = PrecOf<P>::kPad;
  static constexpr int kWarps = DP >= 256 ? 2 : 4;  // 16 rows (keys or queries) per warp
  static constexpr int kRows = 16 * kWarps;         // keys (dK/dV) or query rows (dQ) per block
  static constexpr int kLd = DP + kPad;
  // dK / dV: query tiles of kBq rows
  static constexpr int kBq = 32;
  static constexpr int kLdq = kBq + kPad;
  static constexpr size_t kSmemKv =
      (static_cast<size_t>(2 * kRows + 2 * kBq) * kLd + 2 * static_cast<size_t>(kRows) * kLdq) *
          sizeof(T) +
      3 * kBq * sizeof(float);
  // dQ: key tiles of kBc keys
  static constexpr int kBc = (sizeof(T) == 4 && DP >= 128) || DP >= 256 ? 32 : 64;
  static constexpr int kLdc = kBc + kPad;
  static constexpr size_t kSmemQ =
      (static_cast<size_t>(2 * kRows + 2 * kBc) * kLd + static_cast<size_t>(kRows) * kLdc) *
      sizeof(T);
};

// dK / dV (MODE bit 1: dV, bit 2: dK): one block per (kv item c, tile of kRows keys); warp w owns
// keys 16 w .. 16 w + 15. Over the query tiles of every query item of c's group: S^T = K Q^T and
// dP^T = V dO^T in registers, P^T = exp(S^T - LSE) (times the masked-row renormalisation),
// dS^T = P^T (dP^T - D), both through the warp's strips of shared memory into dV += P^T dO and
// dK += dS^T Q. Tiles whose P is exactly 0 (bias <= kSkipBias, finite LSE above kMaskedRow)
// are skipped.
template <int P, int DP, int MODE>
__global__ void __launch_bounds__(BwdCfg<P, DP>::kWarps * 32, 1)
    flash_bwd_dkv_tc(const typename PrecOf<P>::T* __restrict__ dO,
                     const typename PrecOf<P>::T* __restrict__ q,
                     const typename PrecOf<P>::T* __restrict__ k,
                     const typename PrecOf<P>::T* __restrict__ v, const float* __restrict__ lse,
                     const float* __restrict__ drow, const float* __restrict__ pscale,
                     BiasT<typename PrecOf<P>::T> bias, typename PrecOf<P>::T* __restrict__ dk,
                     typename PrecOf<P>::T* __restrict__ dvo, fusecli::KvMap km, int64_t sq,
                     int64_t sk, int d, int dv, float scale, int kt, int64_t nkt, int split) {
  using C = BwdCfg<P, DP>;
  using T = typename C::T;
  constexpr int NQ = C::kBq / 8;
  constexpr int NV = (MODE & 1) ? DP / 8 : 1, NK = (MODE & 2) ? DP / 8 : 1;
  extern __shared__ __align__(16) unsigned char fl_smem[];
  T* ks = reinterpret_cast<T*>(fl_smem);
  T* vs = ks + C::kRows * C::kLd;
  T* qs = vs + C::kRows * C::kLd;
  T* dos = qs + C::kBq * C::kLd;
  const int warp = threadIdx.x >> 5;
  T* pw = dos + C::kBq * C::kLd + warp * 16 * C::kLdq;
  T* dw = dos + C::kBq * C::kLd + (C::kWarps + warp) * 16 * C::kLdq;
  float* lse_s = reinterpret_cast<float*>(dos + C::kBq * C::kLd + 2 * C::kRows * C::kLdq);
  float* drow_s = lse_s + C::kBq;
  float* ps_s = drow_s + C::kBq;
  const int64_t c = blockIdx.x / nkt, j0 = (blockIdx.x % nkt) * C::kRows;
  const int64_t nc = sk - j0 < C::kRows ? sk - j0 : C::kRows;
  const T* kc = k + c * sk * d;
  load_tile(ks, C::kRows, DP, C::kLd, kt ? kc + j0 : kc + j0 * d, nc, d, kt ? 1 : d, kt ? sk : 1);
  load_tile(vs, C::kRows, DP, C::kLd, v + (c * sk + j0) * dv, nc, dv, dv, 1);
  float adv[NV][4], adk[NK][4];
#pragma unroll
  for (int n = 0; n < NV; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) adv[n][e] = 0.f;
#pragma unroll
  for (int n = 0; n < NK; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) adk[n][e] = 0.f;
  const int64_t group = km.group();
  for (int64_t gi = 0; gi < group; ++gi) {
    const int64_t b = km.member(c, gi);
    const int64_t boff = bias.p ? bias.item(b) : 0;
    for (int64_t i0 = 0; i0 < sq; i0 += C::kBq) {
      const int64_t nr = sq - i0 < C::kBq ? sq - i0 : C::kBq;
      __syncthreads();  // the previous tile's reads are done
      for (int x = threadIdx.x; x < C::kBq; x += blockDim.x) {
        const int64_t row = b * sq + i0 + x;
        lse_s[x] = x < nr ? lse[row] : 0.f;
        drow_s[x] = x < nr ? drow[row] : 0.f;
        ps_s[x] = x < nr ? pscale[row] : 0.f;
      }
      __syncthreads();
      if (bias.p) {
        bool live = false;
        for (int idx = threadIdx.x; idx < nr * nc; idx += blockDim.x) {
          const int r = idx / static_cast<int>(nc), x = idx - r * static_cast<int>(nc);
          const float li = lse_s[r];
          live |= !(bias.at(boff, i0 + r, j0 + x) <= kSkipBias && isfinite(li) && li > kMaskedRow);
        }
        if (!__syncthreads_or(live)) continue;
      }
      load_tile(qs, C::kBq, DP, C::kLd, q + (b * sq + i0) * d, nr, d, d, 1);
      load_tile(dos, C::kBq, DP, C::kLd, dO + (b * sq + i0) * dv, nr, dv, dv, 1);
      __syncthreads();
      float st[NQ][4], dpt[NQ][4];
#pragma unroll
      for (int n = 0; n < NQ; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
      warp_gemm<P, NQ, true>(st, ks + warp * 16 * C::kLd, C::kLd, qs, C::kLd, DP, split);
      if constexpr ((MODE & 2) != 0)
        warp_gemm<P, NQ, true>(dpt, vs + warp * 16 * C::kLd, C::kLd, dos, C::kLd, DP, split);
#pragma unroll
      for (int n = 0; n < NQ; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n * 8 + c_col(e);
          const int64_t key = j0 + warp * 16 + c_row(e), i = i0 + col;
          float p = 0.f, ds = 0.f;
          if (key < sk && col < nr) {
            const float x = st[n][e] * scale + (bias.p ? bias.at(boff, i, key) : 0.f);
            p = __expf(x - lse_s[col]) * ps_s[col];
            ds = p * (dpt[n][e] - drow_s[col]);
          }
          if constexpr ((MODE & 1) != 0) pw[c_row(e) * C::kLdq + col] = fl_to<T>(p);
          if constexpr ((MODE & 2) != 0) dw[c_row(e) * C::kLdq + col] = fl_to<T>(ds);
        }
      __syncwarp();
      if constexpr ((MODE & 1) != 0)
        warp_gemm<P, NV, false>(adv, pw, C::kLdq, dos, C::kLd, C::kBq, split);
      if constexpr ((MODE & 2) != 0)
        warp_gemm<P, NK, false>(adk, dw, C::kLdq, qs, C::kLd, C::kBq, split);
      __syncwarp();
    }
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int64_t key = j0 + warp * 16 + c_row(e);
    if (key >= sk) continue;
    if constexpr ((MODE & 1) != 0)
      if (dvo)
#pragma unroll
        for (int n = 0; n < NV; ++n) {
          const int col = n * 8 + c_col(e);
          if (col < dv) dvo[(c * sk + key) * dv + col] = fl_to<T>(adv[n][e]);
        }
    if constexpr ((MODE & 2) != 0)
      if (dk)
#pragma unroll
        for (int n = 0; n < NK; ++n) {
          const int col = n * 8 + c_col(e);
          if (col < d)
            dk[kt ? c * sk * d + col * sk + key : (c * sk + key) * d + col] =
                fl_to<T>(scale * adk[n][e]);
        }
  }
}

// dQ: one block per (query item b, tile of kRows query rows); warp w owns rows 16 w ..
// 16 w + 15. Over the key tiles: S = Q K^T, dP = dO V^T in registers, dS = P (dP - D) through
// the warp's strip into dQ += dS K.
template <int P, int DP>
__global__ void __launch_bounds__(BwdCfg<P, DP>::kWarps * 32, 1)
    flash_bwd_dq_tc(const typename PrecOf<P>::T* __restrict__ dO,
                    const typename PrecOf<P>::T* __restrict__ q,
                    const typename PrecOf<P>::T* __restrict__ k,
                    const typename PrecOf<P>::T* __restrict__ v, const float* __restrict__ lse,
                    const float* __restrict__ drow, const float* __restrict__ pscale,
                    BiasT<typename PrecOf<P>::T> bias, typename PrecOf<P>::T* __restrict__ dq,
                    fusecli::KvMap km, int64_t sq, int64_t sk, int d, int dv, float scale, int kt,
                    int64_t nqt, int split) {
  using C = BwdCfg<P, DP>;
  using T = typename C::T;
  constexpr int NT = C::kBc / 8, NO = DP / 8;
  extern __shared__ __align__(16) unsigned char fl_smem[];
  T* qs = reinterpret_cast<T*>(fl_smem);
  T* dos = qs + C::kRows * C::kLd;
  T* ks = dos + C::kRows * C::kLd;
  T* vs = ks + C::kBc * C::kLd;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  T* dw = vs + C::kBc * C::kLd + warp * 16 * C::kLdc;
  const int64_t b = blockIdx.x / nqt, i0 = (blockIdx.x % nqt) * C::kRows;
  const int64_t nr = sq - i0 < C::kRows ? sq - i0 : C::kRows;
  const int64_t c = km.kv_of(b);
  const T* kc = k + c * sk * d;
  const T* vc = v + c * sk * dv;
  const int64_t boff = bias.p ? bias.item(b) : 0;
  load_tile(qs, C::kRows, DP, C::kLd, q + (b * sq + i0) * d, nr, d, d, 1);
  load_tile(dos, C::kRows, DP, C::kLd, dO + (b * sq + i0) * dv, nr, dv, dv, 1);
  float li[2], di[2], pi[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t i = i0 + warp * 16 + (lane >> 2) + 8 * h;
    li[h] = i < sq ? lse[b * sq + i] : 0.f;
    di[h] = i < sq ? drow[b * sq + i] : 0.f;
    pi[h] = i < sq ? pscale[b * sq + i] : 0.f;
  }
  float acc[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
  for (int64_t j0 = 0; j0 < sk; j0 += C::kBc) {
    const int64_t nc = sk - j0 < C::kBc ? sk - j0 : C::kBc;
    __syncthreads();  // the previous tile's reads are done (Q and dO are loaded)
    if (bias.p) {
      bool live = false;
      for (int idx = threadIdx.x; idx < nr * nc; idx += blockDim.x) {
        const int r = idx / static_cast<int>(nc), x = idx - r * static_cast<int>(nc);
        const float l = lse[b * sq + i0 + r];
        live |= !(bias.at(boff, i0 + r, j0 + x) <= kSkipBias && isfinite(l) && l > kMaskedRow);
      }
      if (!__syncthreads_or(live)) continue;
    }
    load_tile(ks, C::kBc, DP, C::kLd, kt ? kc + j0 : kc + j0 * d, nc, d, kt ? 1 : d, kt ? sk : 1);
    load_tile(vs, C::kBc, DP, C::kLd, vc + j0 * dv, nc, dv, dv, 1);
    __syncthreads();
    float s[NT][4], dp[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
    warp_gemm<P, NT, true>(s, qs + warp * 16 * C::kLd, C::kLd, ks, C::kLd, DP, split);
    warp_gemm<P, NT, true>(dp, dos + warp * 16 * C::kLd, C::kLd, vs, C::kLd, DP, split);
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        const int64_t i = i0 + warp * 16 + c_row(e), j = j0 + n * 8 + c_col(e);
        float ds = 0.f;
        if (i < sq && j < sk) {
          const float x = s[n][e] * scale + (bias.p ? bias.at(boff, i, j) : 0.f);
          ds = __expf(x - li[h]) * pi[h] * (dp[n][e] - di[h]);
        }
        dw[c_row(e) * C::kLdc + n * 8 + c_col(e)] = fl_to<T>(ds);
      }
    __syncwarp();
    warp_gemm<P, NO, false>(acc, dw, C::kLdc, ks, C::kLd, C::kBc, split);
    __syncwarp();
  }
#pragma unroll
  for (int n = 0; n < NO; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t i = i0 + warp * 16 + c_row(e);
      const int col = n * 8 + c_col(e);
      if (i < sq && col < d) dq[(b * sq + i) * d + col] = fl_to<T>(scale * acc[n][e]);
    }
}

template <typename T> struct GradArgs {
  cudaStream_t s;
  const T *dO, *q, *k, *v;
  const float *lse, *drow, *pscale;
  BiasT<T> bias;
  T *dq, *dk, *dv;
  fusecli::KvMap km;
  int64_t sq, sk;
  int d, dv_dim;
  float scale;
  int kt, split;
};

template <int P, int DP, int MODE>
cudaError_t launch_dkv(const GradArgs<typename PrecOf<P>::T>& a) {
  using C = BwdCfg<P, DP>;
  auto kern = flash_bwd_dkv_tc<P, DP, MODE>;
  RETURN_IF_ERR(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(C::kSmemKv)));
  const int64_t nkt = (a.sk + C::kRows - 1) / C::kRows;
  kern<<<static_cast<unsigned>(a.km.kv_items() * nkt), C::kWarps * 32, C::kSmemKv, a.s>>>(
      a.dO, a.q, a.k, a.v, a.lse, a.drow, a.pscale, a.bias, a.dk, a.dv, a.km, a.sq, a.sk, a.d,
      a.dv_dim, a.scale, a.kt, nkt, a.split);
  return cudaGetLastError();
}

template <int P, int DP> cudaError_t launch_grad_dp(const GradArgs<typename PrecOf<P>::T>& a) {
  using C = BwdCfg<P, DP>;
  if (a.dq) {
    auto kern = flash_bwd_dq_tc<P, DP>;
    RETURN_IF_ERR(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(C::kSmemQ)));
    const int64_t nqt = (a.sq + C::kRows - 1) / C::kRows;
    kern<<<static_cast<unsigned>(a.km.q_items() * nqt), C::kWarps * 32, C::kSmemQ, a.s>>>(
        a.dO, a.q, a.k, a.v, a.lse, a.drow, a.pscale, a.bias, a.dq, a.km, a.sq, a.sk, a.d, a.dv_dim,
        a.scale, a.kt, nqt, a.split);
    RETURN_IF_ERR(cudaGetLastError());
  }
  if constexpr (DP >= 256) {  // one accumulator per launch keeps the registers in bounds
    if (a.dv) RETURN_IF_ERR((launch_dkv<P, DP, 1>(a)));
    if (a.dk) RETURN_IF_ERR((launch_dkv<P, DP, 2>(a)));
    return cudaSuccess;
  } else {
    if (a.dk || a.dv) return launch_dkv<P, DP, 3>(a);
    return cudaSuccess;
  }
}

template <int P> cudaError_t launch_grad_tc(int dp, const GradArgs<typename PrecOf<P>::T>& a) {
  switch (dp) {
    case 32:
      return launch_grad_dp<P, 32>(a);
    case 64:
      return launch_grad_dp<P, 64>(a);
    case 96:
      return launch_grad_dp<P, 96>(a);
    case 128:
      return launch_grad_dp<P, 128>(a);
    case 256:
      return launch_grad_dp<P, 256>(a);
    default:
      return cudaErrorInvalidValue;
  }
}

// Zero outputs for empty inputs, the preprocess, then the tensor-core kernels (tc) or the
// one-row-per-block kernels (float32 only).
template <int P>
int launch_grad(void* stream, const typename PrecOf<P>::T* dO, const typename PrecOf<P>::T* q,
                const typename PrecOf<P>::T* k, const typename PrecOf<P>::T* v,
                const typename PrecOf<P>::T* o, const float* lse, const typename PrecOf<P>::T* bias,
                const int64_t* bias_strides, typename PrecOf<P>::T* dq, typename PrecOf<P>::T* dk,
                typename PrecOf<P>::T* dv, int nd, const int64_t* qdims, const int64_t* kdims,
                int64_t sq, int64_t sk, int64_t d, int64_t dv_dim, float scale, int k_transposed,
                int split, bool tc, const uint8_t* mask = nullptr,
                const int64_t* mask_strides = nullptr, float fill = 0.f, int fill_kept = 1,
                int bias_first = 0, float softcap = 0.f, int nan_guard = 0) {
  using T = typename PrecOf<P>::T;
  fusecli::KvMap km;
  BiasT<T> bm;
  Mask mk;
  if (!make_maps(nd, qdims, kdims, bias, bias_strides, &km, &bm) ||
      !make_mask(nd, qdims, mask, mask_strides, fill, fill_kept, bias_first, &mk))
    return cudaErrorInvalidValue;
  if (mask || softcap > 0.f) tc = false;  // the tensor-core tiles take no mask, no soft cap
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t rows = km.q_items() * sq, keys = km.kv_items() * sk;
  if (rows == 0 || sk == 0) {
    if (dk) RETURN_IF_ERR(cudaMemsetAsync(dk, 0, keys * d * sizeof(T), s));
    if (dv) RETURN_IF_ERR(cudaMemsetAsync(dv, 0, keys * dv_dim * sizeof(T), s));
    if (dq) RETURN_IF_ERR(cudaMemsetAsync(dq, 0, rows * d * sizeof(T), s));
    return cudaSuccess;
  }
  Scratch ws(s);
  RETURN_IF_ERR(ws.alloc(static_cast<size_t>(rows) * 2 * sizeof(float)));
  float* drow = ws.f();
  float* pscale = drow + rows;
  flash_rows<T><<<static_cast<unsigned>(rows), kFlashT, 0, s>>>(
      dO, o, q, k, lse, bm, mk, drow, pscale, km, sq, sk, d, dv_dim, scale, k_transposed, softcap,
      nan_guard);
  RETURN_IF_ERR(cudaGetLastError());
  if (tc) {
    const GradArgs<T> a{s,
                        dO,
                        q,
                        k,
                        v,
                        lse,
                        drow,
                        pscale,
                        bm,
                        dq,
                        dk,
                        dv,
                        km,
                        sq,
                        sk,
                        static_cast<int>(d),
                        static_cast<int>(dv_dim),
                        scale,
                        k_transposed,
                        split};
    return launch_grad_tc<P>(dp_bucket(d > dv_dim ? d : dv_dim), a);
  }
  if constexpr (P == kF32) {
    if (dq)
      flash_bwd_dq<<<static_cast<unsigned>(rows), kFlashT, (d + kFlashT + 32) * sizeof(float), s>>>(
          dO, q, k, v, lse, drow, pscale, bm, mk, dq, km, sq, sk, d, dv_dim, scale, k_transposed,
          softcap);
    if (dk || dv)
      flash_bwd_dkv<<<static_cast<unsigned>(keys), kFlashT,
                      (d + dv_dim + 2 * kFlashT + 32) * sizeof(float), s>>>(
          dO, q, k, v, lse, drow, pscale, bm, mk, dk, dv, km, sq, sk, d, dv_dim, scale,
          k_transposed, softcap);
    return static_cast<int>(cudaGetLastError());
  }
  return cudaErrorInvalidValue;
}

}  // namespace

FUSECLI_EXPORT int fusecli_launch_flash_attention_grad(
    void* stream, const float* dO, const float* q, const float* k, const float* v, const float* o,
    const float* lse, const float* bias, const int64_t* bias_strides, float* dq, float* dk,
    float* dv, int nd, const int64_t* qdims, const int64_t* kdims, int64_t sq, int64_t sk,
    int64_t d, int64_t dv_dim, float scale, int k_transposed, int tf32, const uint8_t* mask,
    const int64_t* mask_strides, float fill, int fill_kept, int bias_first, float softcap,
    int nan_guard) {
  const bool tc =
      dp_bucket(d > dv_dim ? d : dv_dim) != 0 && flash_tc_enabled() && !mask && !nan_guard;
  return launch_grad<kF32>(stream, dO, q, k, v, o, lse, bias, bias_strides, dq, dk, dv, nd, qdims,
                           kdims, sq, sk, d, dv_dim, scale, k_transposed, tf32 ? 0 : 1, tc, mask,
                           mask_strides, fill, fill_kept, bias_first, softcap, nan_guard);
}

template <int P>
int launch_grad_16(void* stream, const void* dO, const void* q, const void* k, const void* v,
                   const void* o, const float* lse, const void* bias, const int64_t* bias_strides,
                   void* dq, void* dk, void* dv, int nd, const int64_t* qdims, const int64_t* kdims,
                   int64_t sq, int64_t sk, int64_t d, int64_t dv_dim, float scale,
                   int k_transposed) {
  using T = typename PrecOf<P>::T;
  if (dp_bucket(d > dv_dim ? d : dv_dim) == 0) return cudaErrorInvalidValue;
  return launch_grad<P>(stream, static_cast<const T*>(dO), static_cast<const T*>(q),
                        static_cast<const T*>(k), static_cast<const T*>(v),
                        static_cast<const T*>(o), lse, static_cast<const T*>(bias), bias_strides,
                        static_cast<T*>(dq), static_cast<T*>(dk), static_cast<T*>(dv), nd, qdims,
                        kdims, sq, sk, d, dv_dim, scale, k_transposed, 0, true);
}

FUSECLI_EXPORT int fusecli_launch_flash_attention_grad_f16(
    void* stream, const void* dO, const void* q, const void* k, const void* v, const void* o,
    const float* lse, const void* bias, const int64_t* bias_strides, void* dq, void* dk, void* dv,
    int nd, const int64_t* qdims, const int64_t* kdims, int64_t sq, int64_t sk, int64_t d,
    int64_t dv_dim, float scale, int k_transposed) {
  return launch_grad_16<kF16>(stream, dO, q, k, v, o, lse, bias, bias_strides, dq, dk, dv, nd,
                              qdims, kdims, sq, sk, d, dv_dim, scale, k_transposed);
}

FUSECLI_EXPORT int fusecli_launch_flash_attention_grad_bf16(
    void* stream, const void* dO, const void* q, const void* k, const void* v, const void* o,
    const float* lse, const void* bias, const int64_t* bias_strides, void* dq, void* dk, void* dv,
    int nd, const int64_t* qdims, const int64_t* kdims, int64_t sq, int64_t sk, int64_t d,
    int64_t dv_dim, float scale, int k_transposed) {
  return launch_grad_16<kBf16>(stream, dO, q, k, v, o, lse, bias, bias_strides, dq, dk, dv, nd,
                               qdims, kdims, sq, sk, d, dv_dim, scale, k_transposed);
}
