// Device helpers shared by the ops' CUDA kernels (each op's cuda.cu): activation gradients,
// half/float conversion, launch geometry, block reductions, the GEMM (cuBLAS, or a tiled SIMT
// SGEMM where cuBLAS is absent), column sums and a stream-ordered scratch buffer.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_blas.h"
#include "op_launchers.h"

#define FUSECLI_EXPORT extern "C" __attribute__((visibility("default")))
#define RETURN_IF_ERR(expr)           \
  do {                                \
    cudaError_t e_ = (expr);          \
    if (e_ != cudaSuccess) return e_; \
  } while (0)

namespace {

constexpr int kRelu = FUSECLI_ACT_RELU, kGelu = FUSECLI_ACT_GELU, kGeluTanh = FUSECLI_ACT_GELU_TANH,
              kSilu = FUSECLI_ACT_SILU, kIdentity = FUSECLI_ACT_IDENTITY,
              kRelu6 = FUSECLI_ACT_RELU6, kHardswish = FUSECLI_ACT_HARDSWISH;

__device__ __forceinline__ float act_grad(float dy, float x, int act) {
  switch (act) {
    case kRelu:
      return x > 0.f ? dy : 0.f;
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
    case kRelu6:  // Clip(x, 0, 6): bounds kept, as in onnxruntime-training's Clip gradient
      return x >= 0.f && x <= 6.f ? dy : 0.f;
    case kHardswish: {  // (relu6(a) + x [0 <= a <= 6]) / 6 with a = x + 3 (see cpu_activation)
      const float a = x + 3.f;
      return dy * (fminf(fmaxf(a, 0.f), 6.f) + (a >= 0.f && a <= 6.f ? x : 0.f)) * (1.f / 6.f);
    }
    default:
      return dy;
  }
}

__device__ __forceinline__ float to_f(float v) {
  return v;
}
__device__ __forceinline__ float to_f(__half v) {
  return __half2float(v);
}
__device__ __forceinline__ float to_f(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) {
  return v;
}
template <> __device__ __forceinline__ __half from_f<__half>(float v) {
  return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

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
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        sms <= 0)
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
  if (lane == 0) {
    sa[wid] = a;
    sb[wid] = b;
  }
  __syncthreads();
  a = lane < nw ? sa[lane] : 0.f;
  b = lane < nw ? sb[lane] : 0.f;
  a = warp_sum(a);
  b = warp_sum(b);
  return make_float2(a, b);
}

// ---- elementwise activation grad ----------------------------------------------------------
template <typename T>
__global__ void act_grad_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                T* __restrict__ out, int64_t n, int act, float alpha) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = from_f<T>(act_grad(to_f(dy[i]), alpha * to_f(x[i]), act));
}

__global__ void act_grad_kernel_f4(const float4* __restrict__ dy, const float4* __restrict__ x,
                                   float4* __restrict__ out, int64_t n4, int act, float alpha) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n4;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float4 d = dy[i], v = x[i];
    out[i] = make_float4(act_grad(d.x, alpha * v.x, act), act_grad(d.y, alpha * v.y, act),
                         act_grad(d.z, alpha * v.z, act), act_grad(d.w, alpha * v.w, act));
  }
}

// dY * act'(alpha X): the gradient of the activation at input scale alpha, act(alpha x) / alpha
cudaError_t launch_act_f32(cudaStream_t s, const float* dy, const float* x, float* out, int64_t n,
                           int act, float alpha) {
  if (n <= 0) return cudaSuccess;
  const bool aligned = ((reinterpret_cast<uintptr_t>(dy) | reinterpret_cast<uintptr_t>(x) |
                         reinterpret_cast<uintptr_t>(out)) &
                        15) == 0;
  const int64_t n4 = aligned ? n / 4 : 0;
  if (n4 > 0)
    act_grad_kernel_f4<<<grid_for(n4, 256), 256, 0, s>>>(
        reinterpret_cast<const float4*>(dy), reinterpret_cast<const float4*>(x),
        reinterpret_cast<float4*>(out), n4, act, alpha);
  const int64_t done = n4 * 4;
  if (done < n)
    act_grad_kernel<float><<<grid_for(n - done, 256), 256, 0, s>>>(dy + done, x + done, out + done,
                                                                   n - done, act, alpha);
  return cudaGetLastError();
}

// ---- tiled SGEMM: C[m,n] = alpha op(A) op(B) + beta C, row-major, batched over blockIdx.z ----
constexpr int BM = 64, BN = 64, BK = 16;

template <bool TA, bool TB>
__global__ void __launch_bounds__(256)
    sgemm_kernel(int64_t m, int64_t n, int64_t k, float alpha, const float* __restrict__ A,
                 int64_t lda, int64_t sA, const float* __restrict__ B, int64_t ldb, int64_t sB,
                 float beta, float* __restrict__ C, int64_t ldc, int64_t sC) {
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
      if (TA) {
        kk = idx / BM;
        ii = idx % BM;
      } else {
        ii = idx / BK;
        kk = idx % BK;
      }
      const int64_t gi = row0 + ii, gk = k0 + kk;
      float va = 0.f;
      if (gi < m && gk < k) va = TA ? A[gk * lda + gi] : A[gi * lda + gk];
      As[kk][ii] = va;
      int jj;
      if (TB) {
        jj = idx / BK;
        kk = idx % BK;
      } else {
        kk = idx / BN;
        jj = idx % BN;
      }
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
  if (!ta && !tb)
    sgemm_kernel<false, false>
        <<<grid, 256, 0, s>>>(m, n, k, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC);
  else if (!ta && tb)
    sgemm_kernel<false, true>
        <<<grid, 256, 0, s>>>(m, n, k, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC);
  else if (ta && !tb)
    sgemm_kernel<true, false>
        <<<grid, 256, 0, s>>>(m, n, k, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC);
  else
    sgemm_kernel<true, true>
        <<<grid, 256, 0, s>>>(m, n, k, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC);
  return cudaGetLastError();
}

// The fused ops' float32 GEMM (same arguments as sgemm): cuBLAS when it is loaded (cuda_blas.h:
// float32 accumulation, TF32 only with tf32), else the SIMT kernel above. A cuBLAS failure
// comes back as blas::kStatusBase + its status (reported on stderr).
cudaError_t gemm(cudaStream_t s, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                 const float* A, int64_t lda, int64_t sA, const float* B, int64_t ldb, int64_t sB,
                 float beta, float* C, int64_t ldc, int64_t sC, int64_t batch = 1,
                 bool tf32 = false) {
  if (m <= 0 || n <= 0 || batch <= 0) return cudaSuccess;
  using fusecli::blas::DType;
  const int r =
      fusecli::blas::gemm(s, ta, tb, m, n, k, alpha, A, DType::kF32, lda, sA, B, DType::kF32, ldb,
                          sB, beta, C, DType::kF32, ldc, sC, batch, tf32);
  if (r != fusecli::blas::kNotUsed) return static_cast<cudaError_t>(r);
  return sgemm(s, ta, tb, m, n, k, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC, batch);
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

}  // namespace
