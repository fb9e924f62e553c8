// RMSNormGrad: CUDA kernels and C launchers. The vectorised row kernel of cuda_norm.cuh when it
// applies (16-byte aligned tensors, N a multiple of the pack, N <= 8192), else the scalar
// rms_rows_kernel below.
#include "cuda_norm.cuh"

namespace {

// ---- RMSNorm backward, scalar fallback ----------------------------------------------------
// Each block walks rows blockIdx.x, +gridDim.x; per row one block sum (x^2 too when inv_rms is
// not saved), then dX; per-block partial dGamma rows (owned by the block, so no atomics; reduced
// by col_sum_kernel).
template <typename T, typename S>
__global__ void rms_rows_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                const T* __restrict__ gamma, const S* __restrict__ istd, float eps,
                                const T* __restrict__ dr, T* __restrict__ dx,
                                float* __restrict__ pg, int64_t m, int64_t n) {
  const float inv_n = 1.f / static_cast<float>(n);
  float* my_g = pg ? pg + blockIdx.x * n : nullptr;
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    const T* dyr = dy + r * n;
    const T* xr = x + r * n;
    // sum(g x) and sum(x^2) in one sweep: c1 = mean(g xhat) = rs mean(g x)
    float sgx = 0.f, sxx = 0.f;
    if (dx || !istd) {
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
        const float xv = to_f(xr[j]);
        sgx += to_f(dyr[j]) * (gamma ? to_f(gamma[j]) : 1.f) * xv;
        sxx += xv * xv;
      }
      const float2 t = block_sum2(sgx, sxx);
      sgx = t.x;
      sxx = t.y;
    }
    const float rs = istd ? to_f(istd[r]) : rsqrtf(sxx * inv_n + eps);
    const float c1 = sgx * rs * inv_n;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float d = to_f(dyr[j]);
      const float xh = to_f(xr[j]) * rs;
      if (dx) {
        float v = rs * (d * (gamma ? to_f(gamma[j]) : 1.f) - xh * c1);
        if (dr) v += to_f(dr[r * n + j]);
        dx[r * n + j] = from_f<T>(v);
      }
      if (my_g) my_g[j] += d * xh;
    }
  }
}

template <typename T, typename S>
cudaError_t launch_rms(cudaStream_t s, const T* dy, const T* x, const T* gamma, const S* istd,
                       float eps, const T* dr, T* dx, T* dgamma, int64_t m, int64_t n) {
  if (m <= 0 || n <= 0) {
    if (n > 0 && dgamma) RETURN_IF_ERR(cudaMemsetAsync(dgamma, 0, n * sizeof(T), s));
    return cudaSuccess;
  }
  bool launched = false;
  RETURN_IF_ERR(
      (norm_grad_vec<T, S, true>(s, dy, x, gamma, static_cast<const S*>(nullptr), istd, eps, dr, dx,
                                 dgamma, static_cast<T*>(nullptr), m, n, &launched)));
  if (launched) return cudaSuccess;
  int block = n >= 1024 ? 256 : n >= 256 ? 128 : 64;
  int64_t grid = static_cast<int64_t>(sm_count()) * 4;
  if (grid > m) grid = m;
  Scratch ws(s);
  float* pg = nullptr;
  if (dgamma) {
    const size_t bytes = static_cast<size_t>(grid * n) * sizeof(float);
    RETURN_IF_ERR(ws.alloc(bytes));
    RETURN_IF_ERR(cudaMemsetAsync(ws.p, 0, bytes, s));
    pg = ws.f();
  }
  rms_rows_kernel<T, S>
      <<<static_cast<unsigned>(grid), block, 0, s>>>(dy, x, gamma, istd, eps, dr, dx, pg, m, n);
  RETURN_IF_ERR(cudaGetLastError());
  if (dgamma) {
    const dim3 rb(32, 8);
    col_sum_kernel<T><<<static_cast<unsigned>((n + 31) / 32), rb, 0, s>>>(pg, dgamma, grid, n);
  }
  return cudaGetLastError();
}

}  // namespace

FUSECLI_EXPORT int fusecli_launch_rms_norm_grad(void* stream, const float* dy, const float* x,
                                                const float* gamma, const float* inv_rms,
                                                float epsilon, const float* dr, float* dx,
                                                float* dgamma, int64_t m, int64_t n) {
  return launch_rms<float, float>(static_cast<cudaStream_t>(stream), dy, x, gamma, inv_rms, epsilon,
                                  dr, dx, dgamma, m, n);
}

FUSECLI_EXPORT int fusecli_launch_rms_norm_grad_f16(void* stream, const void* dy, const void* x,
                                                    const void* gamma, const void* inv_rms,
                                                    int stats_f16, float epsilon, const void* dr,
                                                    void* dx, void* dgamma, int64_t m, int64_t n) {
  auto H = [](const void* p) { return static_cast<const __half*>(p); };
  auto HM = [](void* p) { return static_cast<__half*>(p); };
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (stats_f16)
    return launch_rms<__half, __half>(s, H(dy), H(x), H(gamma), H(inv_rms), epsilon, H(dr), HM(dx),
                                      HM(dgamma), m, n);
  return launch_rms<__half, float>(s, H(dy), H(x), H(gamma), static_cast<const float*>(inv_rms),
                                   epsilon, H(dr), HM(dx), HM(dgamma), m, n);
}

FUSECLI_EXPORT int fusecli_launch_rms_norm_grad_bf16(void* stream, const void* dy, const void* x,
                                                     const void* gamma, const void* inv_rms,
                                                     int stats_bf16, float epsilon, const void* dr,
                                                     void* dx, void* dgamma, int64_t m, int64_t n) {
  using B = __nv_bfloat16;
  auto H = [](const void* p) { return static_cast<const B*>(p); };
  auto HM = [](void* p) { return static_cast<B*>(p); };
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (stats_bf16)
    return launch_rms<B, B>(s, H(dy), H(x), H(gamma), H(inv_rms), epsilon, H(dr), HM(dx),
                            HM(dgamma), m, n);
  return launch_rms<B, float>(s, H(dy), H(x), H(gamma), static_cast<const float*>(inv_rms), epsilon,
                              H(dr), HM(dx), HM(dgamma), m, n);
}
