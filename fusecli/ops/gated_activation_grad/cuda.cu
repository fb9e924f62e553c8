// GatedActivationGrad: CUDA kernel and its C launchers. dA may be dH and dB may be B (each
// element is read before it is written), so the pointers are not __restrict__.
#include "cuda_common.cuh"

namespace {

// (act(v), act'(v)) for silu, gelu (erf) and gelu_tanh
__device__ __forceinline__ float2 act_and_grad(float v, int act) {
  switch (act) {
    case kGelu: {
      const float cdf = 0.5f * (1.f + erff(v * 0.70710678118654752f));
      return make_float2(v * cdf, cdf + v * expf(-0.5f * v * v) * 0.39894228040143268f);
    }
    case kGeluTanh: {
      const float k = 0.79788456080286536f, c = 0.044715f;
      const float v2 = v * v;
      const float t = tanhf(k * v * (1.f + c * v2));
      return make_float2(0.5f * v * (1.f + t),
                         0.5f * (1.f + t + v * (1.f - t * t) * k * (1.f + 3.f * c * v2)));
    }
    default: {  // kSilu
      const float e = expf(fminf(-v, 88.f));
      const float s = 1.f / (1.f + e);
      return make_float2(v * s, s * (1.f + v * (e * s)));
    }
  }
}

template <typename T>
__global__ void gated_act_grad_kernel(const T* dh, const T* __restrict__ a, const T* b, T* da,
                                      T* db, int64_t n, int act, float alpha) {
  const float inv_alpha = 1.f / alpha;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float d = to_f(dh[i]), y = to_f(b[i]);
    const float2 fg = act_and_grad(alpha * to_f(a[i]), act);
    if (da) da[i] = from_f<T>(d * y * fg.y);
    if (db) db[i] = from_f<T>(d * fg.x * inv_alpha);
  }
}

template <typename T>
int launch(void* stream, const void* dh, const void* a, const void* b, void* da, void* db,
           int64_t n, int act, float alpha) {
  if (act != kGelu && act != kGeluTanh && act != kSilu) return cudaErrorInvalidValue;
  if (n <= 0 || (!da && !db)) return cudaSuccess;
  gated_act_grad_kernel<T><<<grid_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const T*>(dh), static_cast<const T*>(a), static_cast<const T*>(b),
      static_cast<T*>(da), static_cast<T*>(db), n, act, alpha);
  return cudaGetLastError();
}

}  // namespace

FUSECLI_EXPORT int fusecli_launch_gated_activation_grad(void* stream, const float* dh,
                                                        const float* a, const float* b, float* da,
                                                        float* db, int64_t n, int act,
                                                        float alpha) {
  return launch<float>(stream, dh, a, b, da, db, n, act, alpha);
}

FUSECLI_EXPORT int fusecli_launch_gated_activation_grad_f16(void* stream, const void* dh,
                                                            const void* a, const void* b, void* da,
                                                            void* db, int64_t n, int act,
                                                            float alpha) {
  return launch<__half>(stream, dh, a, b, da, db, n, act, alpha);
}
