// LayerNormGrad: CUDA kernels and C launchers. The vectorised row kernel of cuda_norm.cuh when
// it applies (16-byte aligned tensors, N a multiple of the pack, N <= 8192), else the scalar
// ln_rows_kernel below.
#include "cuda_norm.cuh"

namespace {

// ---- LayerNorm backward, scalar fallback ---------------------------------------------------
// Each block walks rows blockIdx.x, +gridDim.x; dX per row from two block sums; per-block
// partial dgamma/dbeta rows (owned by the block, so no atomics; reduced by col_sum_kernel).
template <typename T, typename S>
__global__ void ln_rows_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                               const T* __restrict__ gamma, const S* __restrict__ mean,
                               const S* __restrict__ istd, const T* __restrict__ dr,
                               T* __restrict__ dx, float* __restrict__ pg, float* __restrict__ pb,
                               int64_t m, int64_t n) {
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
                      const S* istd, const T* dr, T* dx, T* dgamma, T* dbeta, int64_t m,
                      int64_t n) {
  if (m <= 0 || n <= 0) {
    if (n > 0) {
      if (dgamma) RETURN_IF_ERR(cudaMemsetAsync(dgamma, 0, n * sizeof(T), s));
      if (dbeta) RETURN_IF_ERR(cudaMemsetAsync(dbeta, 0, n * sizeof(T), s));
    }
    return cudaSuccess;
  }
  bool launched = false;
  RETURN_IF_ERR((norm_grad_vec<T, S, false>(s, dy, x, gamma, mean, istd, 0.f, dr, dx, dgamma, dbeta,
                                            m, n, &launched)));
  if (launched) return cudaSuccess;
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
  ln_rows_kernel<T, S><<<static_cast<unsigned>(grid), block, 0, s>>>(dy, x, gamma, mean, istd, dr,
                                                                     dx, pg, pb, m, n);
  RETURN_IF_ERR(cudaGetLastError());
  const dim3 rb(32, 8);
  const unsigned rg = static_cast<unsigned>((n + 31) / 32);
  if (dgamma) col_sum_kernel<T><<<rg, rb, 0, s>>>(pg, dgamma, grid, n);
  if (dbeta) col_sum_kernel<T><<<rg, rb, 0, s>>>(pb, dbeta, grid, n);
  return cudaGetLastError();
}

}  // namespace

FUSECLI_EXPORT int fusecli_launch_layer_norm_grad(void* stream, const float* dy, const float* x,
                                                  const float* gamma, const float* mean,
                                                  const float* inv_std, const float* dr, float* dx,
                                                  float* dgamma, float* dbeta, int64_t m,
                                                  int64_t n) {
  return launch_ln<float, float>(static_cast<cudaStream_t>(stream), dy, x, gamma, mean, inv_std, dr,
                                 dx, dgamma, dbeta, m, n);
}

FUSECLI_EXPORT int fusecli_launch_layer_norm_grad_f16(void* stream, const void* dy, const void* x,
                                                      const void* gamma, const void* mean,
                                                      const void* inv_std, int stats_f16,
                                                      const void* dr, void* dx, void* dgamma,
                                                      void* dbeta, int64_t m, int64_t n) {
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

FUSECLI_EXPORT int fusecli_launch_layer_norm_grad_bf16(void* stream, const void* dy, const void* x,
                                                       const void* gamma, const void* mean,
                                                       const void* inv_std, int stats_bf16,
                                                       const void* dr, void* dx, void* dgamma,
                                                       void* dbeta, int64_t m, int64_t n) {
  using B = __nv_bfloat16;
  auto H = [](const void* p) { return static_cast<const B*>(p); };
  auto HM = [](void* p) { return static_cast<B*>(p); };
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (stats_bf16)
    return launch_ln<B, B>(s, H(dy), H(x), H(gamma), H(mean), H(inv_std), H(dr), HM(dx), HM(dgamma),
                           HM(dbeta), m, n);
  return launch_ln<B, float>(s, H(dy), H(x), H(gamma), static_cast<const float*>(mean),
                             static_cast<const float*>(inv_std), H(dr), HM(dx), HM(dgamma),
                             HM(dbeta), m, n);
}
