// CUDA kernels of fusecli's fused ops and their plain C launchers (see launchers.h).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attn_batch.h"
#include "launchers.h"

#define FUSECLI_EXPORT extern "C" __attribute__((visibility("default")))
#define RETURN_IF_ERR(expr)             \
  do {                                  \
    cudaError_t e_ = (expr);            \
    if (e_ != cudaSuccess) return e_;   \
  } while (0)

namespace {

constexpr int kRelu = 0, kGelu = 1, kGeluTanh = 2, kSilu = 3, kIdentity = 4;

__device__ __forceinline__ float act_grad(float dy, float x, int act) {
  switch (act) {
    case kRelu: return x > 0.f ? dy : 0.f;
    case kGelu: {
      const float cdf = 0.5f * (1.f + erff(x * 0.70710678118654752f));
      return dy * (cdf + x * expf(-0.5f * x * x) * 0.39894228040143268f);
    }
    case kGeluTanh: {
      const float a = 0.79788456080286536f, c = 0.044715f;
      const float x2 = x * x;
      const float t = tanhf(a * x * (1.f + c * x2));
      return dy * 0.5f * (1.f + t + x * (1.f - t * t) * a * (1.f + 3.f * c * x2));
    }
    case kSilu: {
      const float s = 1.f / (1.f + expf(-x));
      return dy * s * (1.f + x * (1.f - s));
    }
    default: return dy;
  }
}

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

int grid_for(int64_t n, int block, int max_blocks = 65535 * 4) {
  int64_t g = (n + block - 1) / block;
  if (g < 1) g = 1;
  return static_cast<int>(g > max_blocks ? max_blocks : g);
}

int sm_count() {
  static int sms = 0;
  if (!sms) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0)
      sms = 80;
  }
  return sms;
}

// ---- reductions ---------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// Block-wide sum of two values; every thread gets the totals. blockDim.x multiple of 32, <= 1024.
__device__ __forceinline__ float2 block_sum2(float a, float b) {
  __shared__ float sa[32], sb[32];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  a = warp_sum(a);
  b = warp_sum(b);
  __syncthreads();  // previous use of sa/sb is finished
  if (lane == 0) { sa[wid] = a; sb[wid] = b; }
  __syncthreads();
  a = lane < nw ? sa[lane] : 0.f;
  b = lane < nw ? sb[lane] : 0.f;
  a = warp_sum(a);
  b = warp_sum(b);
  return make_float2(a, b);
}

// ---- elementwise activation grad ----------------------------------------------------------
template <typename T>
__global__ void act_grad_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ out,
                                int64_t n, int act) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = from_f<T>(act_grad(to_f(dy[i]), to_f(x[i]), act));
}

__global__ void act_grad_kernel_f4(const float4* __restrict__ dy, const float4* __restrict__ x,
                                   float4* __restrict__ out, int64_t n4, int act) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n4;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float4 d = dy[i], v = x[i];
    out[i] = make_float4(act_grad(d.x, v.x, act), act_grad(d.y, v.y, act), act_grad(d.z, v.z, act),
                         act_grad(d.w, v.w, act));
  }
}

cudaError_t launch_act_f32(cudaStream_t s, const float* dy, const float* x, float* out, int64_t n, int act) {
  if (n <= 0) return cudaSuccess;
  const bool aligned = ((reinterpret_cast<uintptr_t>(dy) | reinterpret_cast<uintptr_t>(x) |
                         reinterpret_cast<uintptr_t>(out)) & 15) == 0;
  const int64_t n4 = aligned ? n / 4 : 0;
  if (n4 > 0)
    act_grad_kernel_f4<<<grid_for(n4, 256), 256, 0, s>>>(
        reinterpret_cast<const float4*>(dy), reinterpret_cast<const float4*>(x),
        reinterpret_cast<float4*>(out), n4, act);
  const int64_t done = n4 * 4;
  if (done < n)
    act_grad_kernel<float><<<grid_for(n - done, 256), 256, 0, s>>>(dy + done, x + done, out + done,
                                                                 n - done, act);
  return cudaGetLastError();
}

// ---- tiled SGEMM: C[m,n] = alpha op(A) op(B) + beta C, row-major, batched over blockIdx.z ----
constexpr int BM = 64, BN = 64, BK = 16;

template <bool TA, bool TB>
__global__ void __launch_bounds__(256) sgemm_kernel(int64_t m, int64_t n, int64_t k, float alpha,
    const float* __restrict__ A, int64_t lda, int64_t sA, const float* __restrict__ B, int64_t ldb,
    int64_t sB, float beta, float* __restrict__ C, int64_t ldc, int64_t sC) {
  __shared__ float As[BK][BM + 4];
  __shared__ float Bs[BK][BN + 4];
  A += blockIdx.z * sA;
  B += blockIdx.z * sB;
  C += blockIdx.z * sC;
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int64_t row0 = (int64_t)blockIdx.y * BM, col0 = (int64_t)blockIdx.x * BN;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < k; k0 += BK) {
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const int idx = tid + l * 256;
      int ii, kk;
      if (TA) { kk = idx / BM; ii = idx % BM; } else { ii = idx / BK; kk = idx % BK; }
      const int64_t gi = row0 + ii, gk = k0 + kk;
      float va = 0.f;
      if (gi < m && gk < k) va = TA ? A[gk * lda + gi] : A[gi * lda + gk];
      As[kk][ii] = va;
      int jj;
      if (TB) { jj = idx / BK; kk = idx % BK; } else { kk = idx / BN; jj = idx % BN; }
      const int64_t gj = col0 + jj, gk2 = k0 + kk;
      float vb = 0.f;
      if (gj < n && gk2 < k) vb = TB ? B[gj * ldb + gk2] : B[gk2 * ldb + gj];
      Bs[kk][jj] = vb;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) a[r] = As[kk][ty + 16 * r];
#pragma unroll
      for (int c = 0; c < 4; ++c) b[c] = Bs[kk][tx + 16 * c];
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[r][c] = fmaf(a[r], b[c], acc[r][c]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int64_t gi = row0 + ty + 16 * r;
    if (gi >= m) continue;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t gj = col0 + tx + 16 * c;
      if (gj >= n) continue;
      float* p = C + gi * ldc + gj;
      *p = beta == 0.f ? alpha * acc[r][c] : alpha * acc[r][c] + beta * *p;
    }
  }
}

cudaError_t sgemm(cudaStream_t s, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                  const float* A, int64_t lda, int64_t sA, const float* B, int64_t ldb, int64_t sB,
                  float beta, float* C, int64_t ldc, int64_t sC, int64_t batch = 1) {
  if (m <= 0 || n <= 0 || batch <= 0) return cudaSuccess;
  dim3 grid(static_cast<unsigned>((n + BN - 1) / BN), static_cast<unsigned>((m + BM - 1) / BM),
            static_cast<unsigned>(batch));
  if (grid.y > 65535 || grid.z > 65535) return cudaErrorInvalidConfiguration;
  if (!ta && !tb) sgemm_kernel<false, false><<<grid, 256, 0, s>>>(m, n, k, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC);
  else if (!ta && tb) sgemm_kernel<false, true><<<grid, 256, 0, s>>>(m, n, k, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC);
  else if (ta && !tb) sgemm_kernel<true, false><<<grid, 256, 0, s>>>(m, n, k, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC);
  else sgemm_kernel<true, true><<<grid, 256, 0, s>>>(m, n, k, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC);
  return cudaGetLastError();
}

// Column sums of a [rows, cols] row-major float matrix, written as T: block (32, 8) owns 32
// columns. Serves the bias gradient and the reduction of LayerNorm's per-block partials.
template <typename T = float>
__global__ void col_sum_kernel(const float* __restrict__ a, T* __restrict__ out, int64_t rows,
                               int64_t cols) {
  __shared__ float sh[8][33];
  const int64_t j = (int64_t)blockIdx.x * 32 + threadIdx.x;
  float s = 0.f;
  if (j < cols)
    for (int64_t r = threadIdx.y; r < rows; r += 8) s += a[r * cols + j];
  sh[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
    float t = 0.f;
#pragma unroll
    for (int y = 0; y < 8; ++y) t += sh[y][threadIdx.x];
    out[j] = from_f<T>(t);
  }
}

// Stream-ordered scratch buffer.
struct Scratch {
  cudaStream_t s;
  void* p = nullptr;
  explicit Scratch(cudaStream_t st) : s(st) {}
  cudaError_t alloc(size_t bytes) { return bytes ? cudaMallocAsync(&p, bytes, s) : cudaSuccess; }
  ~Scratch() {
    if (p) cudaFreeAsync(p, s);
  }
  float* f() { return static_cast<float*>(p); }
};

// ---- softmax backward rows: dP = dPd * mask * keep (no mask: dPd), dS = P * (dP - rowsum(dP * P)),
// in place over dPd ----------------------------------------------------------------------------
__global__ void softmax_bwd_rows(float* __restrict__ dp, const float* __restrict__ p,
                                 const uint8_t* __restrict__ mask, float keep, int64_t cols) {
  const int64_t row = blockIdx.x;
  float* d = dp + row * cols;
  const float* pr = p + row * cols;
  const uint8_t* mr = mask ? mask + row * cols : nullptr;
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    float v = d[j];
    if (mr) d[j] = v = v * static_cast<float>(mr[j]) * keep;  // each thread rereads only its own j
    s += v * pr[j];
  }
  const float tot = block_sum2(s, 0.f).x;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) d[j] = pr[j] * (d[j] - tot);
}

// out = p * mask * keep (the dropped probabilities Pd)
__global__ void dropout_apply(const float* __restrict__ p, const uint8_t* __restrict__ mask,
                              float keep, float* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = p[i] * static_cast<float>(mask[i]) * keep;
}

// ---- grouped K / V (attn_batch.h) when the kv items are not consumed in runs, in order ------
// out[b] = in[kv(b)] for every query item b (per = elements of one item)
__global__ void kv_expand(const float* __restrict__ in, float* __restrict__ out, fusecli::KvMap m,
                          int64_t per, int64_t total) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = in[m.kv_of(i / per) * per + i % per];
}
// out[c] = sum over the g query items b of kv item c of in[b]
__global__ void kv_group_sum(const float* __restrict__ in, float* __restrict__ out, fusecli::KvMap m,
                             int64_t per, int64_t total, int64_t g) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = i / per, e = i % per;
    float s = 0.f;
    for (int64_t t = 0; t < g; ++t) s += in[m.member(c, t) * per + e];
    out[i] = s;
  }
}

// ---- BN + ReLU backward -------------------------------------------------------------------
// Per channel c: dbeta = sum dz, dgamma = sum dz * xhat (one block per channel).
__global__ void bn_stats_kernel(const float* __restrict__ dy, const float* __restrict__ y,
                                const float* __restrict__ cv, const float* __restrict__ mean,
                                const float* __restrict__ istd, float* __restrict__ dgamma,
                                float* __restrict__ dbeta, int64_t n, int64_t c, int64_t hw, int relu) {
  const int64_t ch = blockIdx.x;
  const float mu = mean[ch], is = istd[ch];
  float s1 = 0.f, s2 = 0.f;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t off = (b * c + ch) * hw;
    for (int64_t i = threadIdx.x; i < hw; i += blockDim.x) {
      float dz = dy[off + i];
      if (relu && !(y[off + i] > 0.f)) dz = 0.f;
      s1 += dz;
      s2 += dz * (cv[off + i] - mu) * is;
    }
  }
  const float2 t = block_sum2(s1, s2);
  if (threadIdx.x == 0) { dbeta[ch] = t.x; dgamma[ch] = t.y; }
}

// dC = gamma inv_std / R (R dz - dbeta - xhat dgamma); dBc[c] = sum dC (one block per (channel, image-chunk)).
__global__ void bn_dc_kernel(const float* dy, const float* __restrict__ y,
                             const float* __restrict__ cv, const float* __restrict__ gamma,
                             const float* __restrict__ mean, const float* __restrict__ istd,
                             const float* __restrict__ dgamma, const float* __restrict__ dbeta,
                             float* dc, float* __restrict__ dbc, int64_t n, int64_t c,  // dc may be dy
                             int64_t hw, int relu) {
  const int64_t ch = blockIdx.x;
  const float R = static_cast<float>(n * hw);
  const float mu = mean[ch], is = istd[ch], coef = gamma[ch] * is / R;
  const float db = dbeta[ch], dg = dgamma[ch];
  float s = 0.f;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t off = (b * c + ch) * hw;
    for (int64_t i = threadIdx.x; i < hw; i += blockDim.x) {
      float dz = dy[off + i];
      if (relu && !(y[off + i] > 0.f)) dz = 0.f;
      const float v = coef * (R * dz - db - (cv[off + i] - mu) * is * dg);
      if (dc) dc[off + i] = v;
      s += v;
    }
  }
  const float t = block_sum2(s, 0.f).x;
  if (threadIdx.x == 0 && dbc) dbc[ch] = t;
}

struct Geo {
  int64_t cin, hin, win, kh, kw, ho, wo, sh, sw, pt, pl, dh, dw;
};

// cols[(ci*kh + i)*kw + j][oh*wo + ow] for all input channels of one image.
__global__ void im2col_kernel(const float* __restrict__ x, float* __restrict__ cols, Geo g) {
  const int64_t hw = g.ho * g.wo, total = g.cin * g.kh * g.kw * hw;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t p = idx % hw, row = idx / hw;
    const int64_t j = row % g.kw, i = (row / g.kw) % g.kh, ci = row / (g.kw * g.kh);
    const int64_t oh = p / g.wo, ow = p % g.wo;
    const int64_t ih = oh * g.sh - g.pt + i * g.dh, iw = ow * g.sw - g.pl + j * g.dw;
    cols[idx] = (ih >= 0 && ih < g.hin && iw >= 0 && iw < g.win) ? x[(ci * g.hin + ih) * g.win + iw] : 0.f;
  }
}

// Gather-form col2im: dx[ci][ih][iw] = sum of the cols entries that read x[ci][ih][iw].
__global__ void col2im_kernel(const float* __restrict__ cols, float* __restrict__ dx, Geo g) {
  const int64_t hw = g.ho * g.wo, total = g.cin * g.hin * g.win;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t iw = idx % g.win, ih = (idx / g.win) % g.hin, ci = idx / (g.win * g.hin);
    float s = 0.f;
    for (int64_t i = 0; i < g.kh; ++i) {
      const int64_t th = ih + g.pt - i * g.dh;
      if (th < 0 || th % g.sh) continue;
      const int64_t oh = th / g.sh;
      if (oh >= g.ho) continue;
      for (int64_t j = 0; j < g.kw; ++j) {
        const int64_t tw = iw + g.pl - j * g.dw;
        if (tw < 0 || tw % g.sw) continue;
        const int64_t ow = tw / g.sw;
        if (ow >= g.wo) continue;
        s += cols[((ci * g.kh + i) * g.kw + j) * hw + oh * g.wo + ow];
      }
    }
    dx[idx] = s;
  }
}

// ---- LayerNorm backward -------------------------------------------------------------------
// Each block walks rows blockIdx.x, +gridDim.x; dX per row from two block sums; per-block
// partial dgamma/dbeta rows (owned by the block, so no atomics; reduced by col_sum_kernel).
template <typename T, typename S>
__global__ void ln_rows_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                               const T* __restrict__ gamma, const S* __restrict__ mean,
                               const S* __restrict__ istd, const T* __restrict__ dr, T* __restrict__ dx,
                               float* __restrict__ pg, float* __restrict__ pb, int64_t m, int64_t n) {
  const float inv_n = 1.f / static_cast<float>(n);
  float* my_g = pg ? pg + blockIdx.x * n : nullptr;
  float* my_b = pb ? pb + blockIdx.x * n : nullptr;
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    const float mu = to_f(mean[r]), rs = to_f(istd[r]);
    const T* dyr = dy + r * n;
    const T* xr = x + r * n;
    float s1 = 0.f, s2 = 0.f;
    if (dx) {
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
        const float g = to_f(dyr[j]) * (gamma ? to_f(gamma[j]) : 1.f);
        s1 += g * (to_f(xr[j]) - mu) * rs;
        s2 += g;
      }
      const float2 t = block_sum2(s1, s2);
      s1 = t.x * inv_n;
      s2 = t.y * inv_n;
    }
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float d = to_f(dyr[j]);
      const float xh = (to_f(xr[j]) - mu) * rs;
      if (dx) {
        float v = rs * (d * (gamma ? to_f(gamma[j]) : 1.f) - s2 - xh * s1);
        if (dr) v += to_f(dr[r * n + j]);
        dx[r * n + j] = from_f<T>(v);
      }
      if (my_g) my_g[j] += d * xh;
      if (my_b) my_b[j] += d;
    }
  }
}

template <typename T, typename S>
cudaError_t launch_ln(cudaStream_t s, const T* dy, const T* x, const T* gamma, const S* mean,
                      const S* istd, const T* dr, T* dx, T* dgamma, T* dbeta, int64_t m, int64_t n) {
  if (m <= 0 || n <= 0) {
    if (n > 0) {
      if (dgamma) RETURN_IF_ERR(cudaMemsetAsync(dgamma, 0, n * sizeof(T), s));
      if (dbeta) RETURN_IF_ERR(cudaMemsetAsync(dbeta, 0, n * sizeof(T), s));
    }
    return cudaSuccess;
  }
  int block = n >= 1024 ? 256 : n >= 256 ? 128 : 64;
  int64_t grid = static_cast<int64_t>(sm_count()) * 4;
  if (grid > m) grid = m;
  const bool reduce = dgamma || dbeta;
  Scratch ws(s);
  float* pg = nullptr;
  float* pb = nullptr;
  if (reduce) {
    const size_t bytes = static_cast<size_t>(2 * grid * n) * sizeof(float);
    RETURN_IF_ERR(ws.alloc(bytes));
    RETURN_IF_ERR(cudaMemsetAsync(ws.p, 0, bytes, s));
    if (dgamma) pg = ws.f();
    if (dbeta) pb = ws.f() + grid * n;
  }
  ln_rows_kernel<T, S><<<static_cast<unsigned>(grid), block, 0, s>>>(dy, x, gamma, mean, istd, dr, dx, pg, pb, m, n);
  RETURN_IF_ERR(cudaGetLastError());
  const dim3 rb(32, 8);
  const unsigned rg = static_cast<unsigned>((n + 31) / 32);
  if (dgamma) col_sum_kernel<T><<<rg, rb, 0, s>>>(pg, dgamma, grid, n);
  if (dbeta) col_sum_kernel<T><<<rg, rb, 0, s>>>(pb, dbeta, grid, n);
  return cudaGetLastError();
}

}  // namespace

// =================================== C launchers ===============================================

FUSECLI_EXPORT int fusecli_launch_activation_grad(void* stream, const float* dy, const float* x,
                                                  float* dx, int64_t n, int act) {
  if (act < 0 || act > kSilu) return cudaErrorInvalidValue;
  return launch_act_f32(static_cast<cudaStream_t>(stream), dy, x, dx, n, act);
}

FUSECLI_EXPORT int fusecli_launch_activation_grad_f16(void* stream, const void* dy, const void* x,
                                                      void* dx, int64_t n, int act) {
  if (act < 0 || act > kSilu) return cudaErrorInvalidValue;
  if (n <= 0) return cudaSuccess;
  act_grad_kernel<__half><<<grid_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const __half*>(dy), static_cast<const __half*>(x), static_cast<__half*>(dx), n, act);
  return cudaGetLastError();
}

FUSECLI_EXPORT int fusecli_read_scalar(void* stream, const float* p, float* out) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  RETURN_IF_ERR(cudaMemcpyAsync(out, p, sizeof(float), cudaMemcpyDeviceToHost, s));
  return cudaStreamSynchronize(s);
}

FUSECLI_EXPORT int fusecli_launch_linear_activation_grad(void* stream, const float* dy,
    const float* x, const float* a, const float* w, float* da, float* dw, float* db, float* dz_out,
    int64_t m, int64_t n, int64_t k, int act, int trans_w, int trans_dw) {
  if (act < 0 || act > kIdentity) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  Scratch ws(s);
  const float* dz = dy;
  if (dz_out && m * n > 0) {  // dZ asked for (possibly in dY's own buffer: elementwise, safe)
    if (act != kIdentity) RETURN_IF_ERR(launch_act_f32(s, dy, x, dz_out, m * n, act));
    else if (dz_out != dy)
      RETURN_IF_ERR(cudaMemcpyAsync(dz_out, dy, m * n * sizeof(float), cudaMemcpyDeviceToDevice, s));
    dz = dz_out;
  } else if (act != kIdentity && (da || dw || db) && m * n > 0) {
    RETURN_IF_ERR(ws.alloc(static_cast<size_t>(m * n) * sizeof(float)));
    RETURN_IF_ERR(launch_act_f32(s, dy, x, ws.f(), m * n, act));
    dz = ws.f();
  }
  if (db) {
    if (m <= 0) RETURN_IF_ERR(cudaMemsetAsync(db, 0, n * sizeof(float), s));
    else if (n > 0) col_sum_kernel<<<static_cast<unsigned>((n + 31) / 32), dim3(32, 8), 0, s>>>(dz, db, m, n);
    RETURN_IF_ERR(cudaGetLastError());
  }
  if (da && !w) return cudaErrorInvalidValue;
  if (da)  // dA[m,k] = dZ W  (W [n,k])  |  dZ W^T  (W [k,n])
    RETURN_IF_ERR(sgemm(s, false, trans_w != 0, m, k, n, 1.f, dz, n, 0, w, trans_w ? n : k, 0, 0.f, da, k, 0));
  if (dw) {
    if (!trans_dw)  // dW[n,k] = dZ^T A
      RETURN_IF_ERR(sgemm(s, true, false, n, k, m, 1.f, dz, n, 0, a, k, 0, 0.f, dw, k, 0));
    else  // dW[k,n] = A^T dZ
      RETURN_IF_ERR(sgemm(s, true, false, k, n, m, 1.f, a, k, 0, dz, n, 0, 0.f, dw, n, 0));
  }
  return cudaGetLastError();
}

namespace {

// c[b] = alpha a[b] op(w[kv(b)]) over the query items: a per item [rows, k], c per item
// [rows, n], w per kv item [k, n] (stored [n, k] when tw). A run of query items sharing a kv item
// is one GEMM of its stacked rows; other groupings read an expanded copy of w.
cudaError_t attn_gather(cudaStream_t s, const fusecli::KvMap& m, bool tw, int64_t rows, int64_t n,
                        int64_t k, float alpha, const float* a, const float* w, float* c) {
  const int64_t B = m.q_items(), ldw = tw ? k : n;
  if (m.runs_in_order()) {
    const int64_t L = m.run();
    return sgemm(s, false, tw, L * rows, n, k, alpha, a, k, L * rows * k, w, ldw, k * n, 0.f, c, n,
                 L * rows * n, B / L);
  }
  Scratch wf(s);
  RETURN_IF_ERR(wf.alloc(static_cast<size_t>(B * k * n) * sizeof(float)));
  kv_expand<<<grid_for(B * k * n, 256), 256, 0, s>>>(w, wf.f(), m, k * n, B * k * n);
  RETURN_IF_ERR(cudaGetLastError());
  return sgemm(s, false, tw, rows, n, k, alpha, a, k, rows * k, wf.f(), ldw, k * n, 0.f, c, n,
               rows * n, B);
}

// out[kv] = alpha sum over kv's query items b of a[b]^T x[b]: a per item [rows, m], x per item
// [rows, n], out per kv item [m, n]. A run of query items sharing a kv item is one GEMM over its
// stacked rows; other groupings go through per-item products and a group sum.
cudaError_t attn_scatter(cudaStream_t s, const fusecli::KvMap& km, int64_t rows, int64_t m,
                         int64_t n, float alpha, const float* a, const float* x, float* out) {
  const int64_t B = km.q_items();
  if (km.runs_in_order()) {
    const int64_t L = km.run();
    return sgemm(s, true, false, m, n, L * rows, alpha, a, m, L * rows * m, x, n, L * rows * n, 0.f,
                 out, n, m * n, B / L);
  }
  Scratch full(s);
  RETURN_IF_ERR(full.alloc(static_cast<size_t>(B * m * n) * sizeof(float)));
  RETURN_IF_ERR(sgemm(s, true, false, m, n, rows, alpha, a, m, rows * m, x, n, rows * n, 0.f,
                      full.f(), n, m * n, B));
  const int64_t total = km.kv_items() * m * n;
  kv_group_sum<<<grid_for(total, 256), 256, 0, s>>>(full.f(), out, km, m * n, total, km.group());
  return cudaGetLastError();
}

bool make_kv_map(int nd, const int64_t* qdims, const int64_t* kvdims, fusecli::KvMap* m) {
  if (nd < 0 || nd > fusecli::kAttnMaxBatchDims || (nd > 0 && (!qdims || !kvdims))) return false;
  m->nd = nd;
  for (int j = 0; j < nd; ++j) {
    m->q[j] = qdims[j];
    m->kv[j] = kvdims[j];
    if (qdims[j] < 0 || !(kvdims[j] == qdims[j] || (kvdims[j] >= 1 && qdims[j] % kvdims[j] == 0)))
      return false;
  }
  return true;
}

}  // namespace

FUSECLI_EXPORT int fusecli_launch_attention_grad(void* stream, const float* dO, const float* q,
    const float* k, const float* v, const float* p, const uint8_t* mask, float* dq, float* dk,
    float* dv, float* ds_out, int nd, const int64_t* qdims, const int64_t* kdims,
    const int64_t* vdims, int64_t sq, int64_t sk, int64_t d, int64_t dvd, float scale_q,
    float scale_k, float keep, int k_transposed) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  fusecli::KvMap km, vm;
  if (!make_kv_map(nd, qdims, kdims, &km) || !make_kv_map(nd, qdims, vdims, &vm))
    return cudaErrorInvalidValue;
  const int64_t b = km.q_items();
  if (b <= 0 || sq <= 0) {  // no query rows: the group sums are empty
    if (dk) RETURN_IF_ERR(cudaMemsetAsync(dk, 0, km.kv_items() * sk * d * sizeof(float), s));
    if (dv) RETURN_IF_ERR(cudaMemsetAsync(dv, 0, vm.kv_items() * sk * dvd * sizeof(float), s));
    return cudaSuccess;
  }
  const int64_t n_p = b * sq * sk;
  Scratch ws_pd(s), ws(s);
  if (dv) {  // dV = sum_group Pd^T dO
    const float* pa = p;
    if (mask) {
      RETURN_IF_ERR(ws_pd.alloc(static_cast<size_t>(n_p) * sizeof(float)));
      dropout_apply<<<grid_for(n_p, 256), 256, 0, s>>>(p, mask, keep, ws_pd.f(), n_p);
      RETURN_IF_ERR(cudaGetLastError());
      pa = ws_pd.f();
    }
    RETURN_IF_ERR(attn_scatter(s, vm, sq, sk, dvd, 1.f, pa, dO, dv));
  }
  if (!dq && !dk && !ds_out) return cudaSuccess;
  float* ds = ds_out;
  if (!ds) {
    RETURN_IF_ERR(ws.alloc(static_cast<size_t>(n_p) * sizeof(float)));
    ds = ws.f();
  }
  RETURN_IF_ERR(attn_gather(s, vm, true, sq, sk, dvd, 1.f, dO, v, ds));  // dPd = dO V^T
  if (sk > 0) {
    const int block = sk >= 512 ? 256 : 128;
    softmax_bwd_rows<<<static_cast<unsigned>(b * sq), block, 0, s>>>(ds, p, mask, keep, sk);
    RETURN_IF_ERR(cudaGetLastError());
  }
  if (dq)  // dQ = scale_q dS K (K as [sk,d])
    RETURN_IF_ERR(attn_gather(s, km, k_transposed != 0, sq, d, sk, scale_q, ds, k, dq));
  if (dk) {
    if (!k_transposed)  // dK[sk,d] = scale_k sum_group dS^T Q
      RETURN_IF_ERR(attn_scatter(s, km, sq, sk, d, scale_k, ds, q, dk));
    else  // dK[d,sk] = scale_k sum_group Q^T dS
      RETURN_IF_ERR(attn_scatter(s, km, sq, d, sk, scale_k, q, ds, dk));
  }
  return cudaGetLastError();
}

FUSECLI_EXPORT int fusecli_launch_conv_bn_relu_grad(void* stream, const float* dy, const float* y,
    const float* x, const float* w, const float* cv, const float* gamma, const float* mean,
    const float* inv_std, float* dx, float* dw, float* dbc, float* dgamma, float* dbeta, float* dc_out, int64_t n,
    int64_t c, int64_t h, int64_t wd, int64_t cin, int64_t hin, int64_t win, int64_t kh, int64_t kw,
    int64_t stride_h, int64_t stride_w, int64_t pad_t, int64_t pad_l, int64_t pad_b, int64_t pad_r,
    int64_t dil_h, int64_t dil_w, int64_t group, int relu) {
  (void)pad_b; (void)pad_r;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (group < 1 || c % group || cin % group) return cudaErrorInvalidValue;
  const int64_t hw = h * wd;
  const bool need_dc = dx || dw || dc_out;
  Scratch ws_stats(s), ws_dc(s), ws_cols(s);
  RETURN_IF_ERR(ws_stats.alloc(static_cast<size_t>(2 * c) * sizeof(float)));
  float* sg = ws_stats.f();
  float* sb = sg + c;
  if (c > 0) {
    bn_stats_kernel<<<static_cast<unsigned>(c), 256, 0, s>>>(dy, y, cv, mean, inv_std, sg, sb, n, c, hw, relu);
    RETURN_IF_ERR(cudaGetLastError());
    if (dgamma) RETURN_IF_ERR(cudaMemcpyAsync(dgamma, sg, c * sizeof(float), cudaMemcpyDeviceToDevice, s));
    if (dbeta) RETURN_IF_ERR(cudaMemcpyAsync(dbeta, sb, c * sizeof(float), cudaMemcpyDeviceToDevice, s));
  }
  if (!need_dc && !dbc) return cudaSuccess;
  float* dc = nullptr;
  if (dc_out) {  // asked for; may be dY's own buffer (each element is read, then written)
    dc = dc_out;
  } else if (need_dc) {
    RETURN_IF_ERR(ws_dc.alloc(static_cast<size_t>(n * c * hw) * sizeof(float)));
    dc = ws_dc.f();
  }
  if (c > 0) {
    bn_dc_kernel<<<static_cast<unsigned>(c), 256, 0, s>>>(dy, y, cv, gamma, mean, inv_std, sg, sb, dc, dbc, n, c, hw, relu);
    RETURN_IF_ERR(cudaGetLastError());
  }
  if (!dx && !dw) return cudaSuccess;
  const int64_t cg = c / group, cin_g = cin / group, kc = cin_g * kh * kw;
  Geo g{cin, hin, win, kh, kw, h, wd, stride_h, stride_w, pad_t, pad_l, dil_h, dil_w};
  RETURN_IF_ERR(ws_cols.alloc(static_cast<size_t>(cin * kh * kw * hw) * sizeof(float)));
  float* cols = ws_cols.f();
  if (dw) RETURN_IF_ERR(cudaMemsetAsync(dw, 0, static_cast<size_t>(c * kc) * sizeof(float), s));
  const int64_t cols_total = cin * kh * kw * hw;
  for (int64_t b = 0; b < n; ++b) {
    const float* dcb = dc + b * c * hw;
    if (dw) {
      im2col_kernel<<<grid_for(cols_total, 256), 256, 0, s>>>(x + b * cin * hin * win, cols, g);
      RETURN_IF_ERR(cudaGetLastError());
      // dW_g[cg,kc] += dC_g[cg,hw] cols_g^T[hw,kc], batched over groups
      RETURN_IF_ERR(sgemm(s, false, true, cg, kc, hw, 1.f, dcb, hw, cg * hw, cols, hw, kc * hw, 1.f,
                          dw, kc, cg * kc, group));
    }
    if (dx) {
      // cols_g[kc,hw] = W_g^T[kc,cg] dC_g[cg,hw], batched over groups; then col2im
      RETURN_IF_ERR(sgemm(s, true, false, kc, hw, cg, 1.f, w, kc, cg * kc, dcb, hw, cg * hw, 0.f,
                          cols, hw, kc * hw, group));
      col2im_kernel<<<grid_for(cin * hin * win, 256), 256, 0, s>>>(cols, dx + b * cin * hin * win, g);
      RETURN_IF_ERR(cudaGetLastError());
    }
  }
  return cudaGetLastError();
}

FUSECLI_EXPORT int fusecli_launch_layer_norm_grad(void* stream, const float* dy, const float* x,
    const float* gamma, const float* mean, const float* inv_std, const float* dr, float* dx,
    float* dgamma, float* dbeta, int64_t m, int64_t n) {
  return launch_ln<float, float>(static_cast<cudaStream_t>(stream), dy, x, gamma, mean, inv_std, dr,
                                 dx, dgamma, dbeta, m, n);
}

FUSECLI_EXPORT int fusecli_launch_layer_norm_grad_f16(void* stream, const void* dy, const void* x,
    const void* gamma, const void* mean, const void* inv_std, int stats_f16, const void* dr, void* dx,
    void* dgamma, void* dbeta, int64_t m, int64_t n) {
  auto H = [](const void* p) { return static_cast<const __half*>(p); };
  auto HM = [](void* p) { return static_cast<__half*>(p); };
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (stats_f16)
    return launch_ln<__half, __half>(s, H(dy), H(x), H(gamma), H(mean), H(inv_std), H(dr), HM(dx),
                                     HM(dgamma), HM(dbeta), m, n);
  return launch_ln<__half, float>(s, H(dy), H(x), H(gamma), static_cast<const float*>(mean),
                                  static_cast<const float*>(inv_std), H(dr), HM(dx), HM(dgamma),
                                  HM(dbeta), m, n);
}
