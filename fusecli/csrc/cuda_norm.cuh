// The vectorised backward of a row normalisation (LayerNorm, RMSNorm) over rows of n values,
// shared by layer_norm_grad/cuda.cu and rms_norm_grad/cuda.cu (docs/gpu-kernels-memory.md):
//
// - A row is held in registers by a team: one warp (n <= 32 * kMaxPPT * V: several rows per
//   block, one per warp) or one block (up to kNormMaxBlock threads); each thread owns PPT 16-byte
//   packs of the row at pack k = lane + i * team, the same columns in every row it visits. dY, X
//   (and dR) are read once, dX written once, all as 16-byte accesses.
// - Teams walk rows with a grid stride over a grid of resident blocks; each thread sums its
//   columns' dGamma (dY * xhat) and dBeta (dY) contributions in registers across its rows, and
//   each block writes one row of per-block partials (a warp-mode block adds its warps' rows in
//   shared memory first, in warp order). col_sum_rows_kernel reduces the partials in a second
//   small pass. No atomics: the result depends only on the grid, the same in every run on a
//   device.
// - Opt-in until measured on a GPU: only with FUSECLI_MEMK_PATH=vec (cuda_mem.cuh: memk_vec).
// - norm_grad_vec returns false (nothing launched) when n is not a multiple of the pack, a
//   pointer is not 16-byte aligned or n > kNormMaxBlock * 16: the caller's scalar kernel runs.
#pragma once

#include "cuda_mem.cuh"

namespace {

// most packs per thread: 16 values (4 float packs, 2 half packs) keep dY, X, dR and the
// dGamma / dBeta sums of a thread in registers
template <typename T> constexpr int kMaxPPT = 16 / Pack<T>::kN;
constexpr int kNormWarpBlock = 256;  // warp mode: 8 rows in flight per block
constexpr int kNormWarpMaxN = 512;   // 32 lanes * kMaxPPT * V for float, half and bfloat16
constexpr int kNormMaxBlock = 512;   // block mode: rows up to 512 * 16 = 8192 values

template <typename T, typename S, int PPT, bool WARP, bool RMS>
__global__ void __launch_bounds__(WARP ? kNormWarpBlock : kNormMaxBlock)
    norm_grad_vec_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                         const T* __restrict__ gamma, const S* __restrict__ mean,
                         const S* __restrict__ istd, float eps, const T* __restrict__ dr,
                         T* __restrict__ dx, float* __restrict__ pg, float* __restrict__ pb,
                         int64_t m, int n) {
  constexpr int V = Pack<T>::kN;
  const int npk = n / V;
  const int lane = WARP ? (threadIdx.x & 31) : threadIdx.x;
  const int team = WARP ? 32 : blockDim.x;
  const int teams = WARP ? (blockDim.x >> 5) : 1;
  const int64_t first = WARP ? (int64_t)blockIdx.x * teams + (threadIdx.x >> 5) : blockIdx.x;
  const int64_t stride = (int64_t)gridDim.x * teams;
  const float inv_n = 1.f / static_cast<float>(n);
  const bool sums = dx != nullptr || (RMS && istd == nullptr);

  float gm[PPT][V], ag[PPT][V], ab[PPT][V];
#pragma unroll
  for (int i = 0; i < PPT; ++i) {
    const int k = lane + i * team;
    Pack<T> g = zero_pack<T>();
    if (gamma && k < npk) g = ld_pack(gamma + (int64_t)k * V);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      gm[i][e] = gamma ? to_f(g.v[e]) : 1.f;
      ag[i][e] = 0.f;
      ab[i][e] = 0.f;
    }
  }

  for (int64_t r = first; r < m; r += stride) {
    const int64_t base = r * n;
    Pack<T> pd[PPT], px[PPT], pr[PPT];
#pragma unroll
    for (int i = 0; i < PPT; ++i) {
      const int k = lane + i * team;
      const bool in = k < npk;  // a pack past the row contributes 0 to every sum
      pd[i] = in ? ld_pack(dy + base + (int64_t)k * V) : zero_pack<T>();
      px[i] = in ? ld_pack(x + base + (int64_t)k * V) : zero_pack<T>();
      pr[i] = in && dr && dx ? ld_pack(dr + base + (int64_t)k * V) : zero_pack<T>();
    }
    const float mu = RMS ? 0.f : to_f(mean[r]);
    float rs = istd ? to_f(istd[r]) : 0.f;
    float s1 = 0.f, s2 = 0.f;
    if (sums) {
#pragma unroll
      for (int i = 0; i < PPT; ++i)
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float d = to_f(pd[i].v[e]), xv = to_f(px[i].v[e]);
          const float g = d * gm[i][e];
          if (RMS) {
            s1 += g * xv;  // mean(g xhat) = rs mean(g x)
            s2 += xv * xv;
          } else {
            s1 += g * ((xv - mu) * rs);
            s2 += g;
          }
        }
      if constexpr (WARP) {
        s1 = warp_sum(s1);
        s2 = warp_sum(s2);
      } else {
        const float2 t = block_sum2(s1, s2);
        s1 = t.x;
        s2 = t.y;
      }
    }
    if (RMS && !istd) rs = rsqrtf(s2 * inv_n + eps);
    const float c1 = RMS ? s1 * rs * inv_n : s1 * inv_n;
    const float c2 = RMS ? 0.f : s2 * inv_n;
#pragma unroll
    for (int i = 0; i < PPT; ++i) {
      const int k = lane + i * team;
      if (k >= npk) continue;
      Pack<T> o;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float d = to_f(pd[i].v[e]), xv = to_f(px[i].v[e]);
        const float xh = RMS ? xv * rs : (xv - mu) * rs;
        if (dx) {
          float v = rs * (d * gm[i][e] - c2 - xh * c1);
          if (dr) v += to_f(pr[i].v[e]);
          o.v[e] = from_f<T>(v);
        }
        ag[i][e] += d * xh;
        if (!RMS) ab[i][e] += d;
      }
      if (dx) st_pack(dx + base + (int64_t)k * V, o);
    }
  }

  // this block's row of partials
  float* my_g = pg ? pg + (int64_t)blockIdx.x * n : nullptr;
  float* my_b = pb ? pb + (int64_t)blockIdx.x * n : nullptr;
  if constexpr (WARP) {
    __shared__ float sg[kNormWarpMaxN], sb[kNormWarpMaxN];
    const int w = threadIdx.x >> 5;
    for (int step = 0; step < teams; ++step) {  // warp order: deterministic
      if (w == step) {
#pragma unroll
        for (int i = 0; i < PPT; ++i) {
          const int k = lane + i * team;
          if (k >= npk) continue;
#pragma unroll
          for (int e = 0; e < V; ++e) {
            const int j = k * V + e;
            sg[j] = (step ? sg[j] : 0.f) + ag[i][e];
            sb[j] = (step ? sb[j] : 0.f) + ab[i][e];
          }
        }
      }
      __syncthreads();
    }
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
      if (my_g) my_g[j] = sg[j];
      if (my_b) my_b[j] = sb[j];
    }
  } else {
#pragma unroll
    for (int i = 0; i < PPT; ++i) {
      const int k = lane + i * team;
      if (k >= npk) continue;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        if (my_g) my_g[k * V + e] = ag[i][e];
        if (my_b) my_b[k * V + e] = ab[i][e];
      }
    }
  }
}

// out[j] = sum over r < rows of p[r * cols + j], in a fixed order. Block (32, 32): 32 columns,
// 32 row-threads each summing rows ty, ty + 32, ... with four loads in flight, then the 32
// partial sums added in row-thread order.
template <typename T>
__global__ void __launch_bounds__(1024)
    col_sum_rows_kernel(const float* __restrict__ p, T* __restrict__ out, int64_t rows,
                        int64_t cols) {
  __shared__ float sh[32][33];
  const int64_t j = (int64_t)blockIdx.x * 32 + threadIdx.x;
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
  if (j < cols) {
    int64_t r = threadIdx.y;
    for (; r + 96 < rows; r += 128) {
      a0 += p[r * cols + j];
      a1 += p[(r + 32) * cols + j];
      a2 += p[(r + 64) * cols + j];
      a3 += p[(r + 96) * cols + j];
    }
    for (; r < rows; r += 32) a0 += p[r * cols + j];
  }
  sh[threadIdx.y][threadIdx.x] = (a0 + a1) + (a2 + a3);
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
    float t = 0.f;
#pragma unroll
    for (int y = 0; y < 32; ++y) t += sh[y][threadIdx.x];
    out[j] = from_f<T>(t);
  }
}

template <typename T, typename S, int PPT, bool WARP, bool RMS>
cudaError_t norm_grad_vec_run(cudaStream_t s, const T* dy, const T* x, const T* gamma,
                              const S* mean, const S* istd, float eps, const T* dr, T* dx,
                              T* dgamma, T* dbeta, int64_t m, int n, int threads) {
  auto k = norm_grad_vec_kernel<T, S, PPT, WARP, RMS>;
  const int64_t per_block = WARP ? threads / 32 : 1;
  const int64_t grid = resident_grid(k, threads, 0, m, per_block);
  Scratch ws(s);
  float* pg = nullptr;
  float* pb = nullptr;
  if (dgamma || dbeta) {
    RETURN_IF_ERR(ws.alloc(static_cast<size_t>(2 * grid * n) * sizeof(float)));
    if (dgamma) pg = ws.f();
    if (dbeta) pb = ws.f() + grid * n;
  }
  k<<<static_cast<unsigned>(grid), threads, 0, s>>>(dy, x, gamma, mean, istd, eps, dr, dx, pg, pb,
                                                    m, n);
  RETURN_IF_ERR(cudaGetLastError());
  const dim3 rb(32, 32);
  const unsigned rg = static_cast<unsigned>((n + 31) / 32);
  if (dgamma) col_sum_rows_kernel<T><<<rg, rb, 0, s>>>(pg, dgamma, grid, n);
  if (dbeta) col_sum_rows_kernel<T><<<rg, rb, 0, s>>>(pb, dbeta, grid, n);
  return cudaGetLastError();
}

// The vectorised kernel when it applies (*launched = true), else nothing (*launched = false).
// m > 0 and n > 0.
template <typename T, typename S, bool RMS>
cudaError_t norm_grad_vec(cudaStream_t s, const T* dy, const T* x, const T* gamma, const S* mean,
                          const S* istd, float eps, const T* dr, T* dx, T* dgamma, T* dbeta,
                          int64_t m, int64_t n, bool* launched) {
  constexpr int V = Pack<T>::kN, P = kMaxPPT<T>;
  *launched = false;
  if (!memk_vec()) return cudaSuccess;  // opt-in until measured on a GPU
  static_assert(32 * P * V == kNormWarpMaxN, "warp-mode row");
  if (n % V || n > kNormMaxBlock * P * V || !aligned16({dy, x, gamma, dr, dx})) return cudaSuccess;
  *launched = true;
  const int npk = static_cast<int>(n / V), ni = static_cast<int>(n);
  if (npk <= 32 * P) {  // one warp per row
    if (npk <= 32)
      return norm_grad_vec_run<T, S, 1, true, RMS>(s, dy, x, gamma, mean, istd, eps, dr, dx, dgamma,
                                                   dbeta, m, ni, kNormWarpBlock);
    if (npk <= 64 || P == 2)
      return norm_grad_vec_run<T, S, (P < 2 ? P : 2), true, RMS>(
          s, dy, x, gamma, mean, istd, eps, dr, dx, dgamma, dbeta, m, ni, kNormWarpBlock);
    return norm_grad_vec_run<T, S, P, true, RMS>(s, dy, x, gamma, mean, istd, eps, dr, dx, dgamma,
                                                 dbeta, m, ni, kNormWarpBlock);
  }
  const int threads = ((npk + P - 1) / P + 31) / 32 * 32;  // one block per row
  return norm_grad_vec_run<T, S, P, false, RMS>(s, dy, x, gamma, mean, istd, eps, dr, dx, dgamma,
                                                dbeta, m, ni, threads);
}

}  // namespace
