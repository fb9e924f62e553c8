// GatedActivationGrad: CUDA kernels and their C launchers. dA may be dH and dB may be B (each
// element is read before it is written), so the pointers are not __restrict__. With
// FUSECLI_MEMK_PATH=vec (opt-in until measured on a GPU): 16-byte packs per thread when every
// pointer is 16-byte aligned; a scalar kernel takes the tail and
// misaligned tensors.
#include "cuda_mem.cuh"

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

// The same over npk 16-byte packs, the activation a compile-time constant.
template <typename T, int ACT>
__global__ void gated_act_grad_vec_kernel(const T* dh, const T* __restrict__ a, const T* b, T* da,
                                          T* db, int64_t npk, float alpha) {
  constexpr int V = Pack<T>::kN;
  const float inv_alpha = 1.f / alpha;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < npk;
       i += (int64_t)gridDim.x * blockDim.x) {
    const Pack<T> d = ld_pack(dh + i * V), av = ld_pack(a + i * V), bv = ld_pack(b + i * V);
    Pack<T> oa, ob;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float dv = to_f(d.v[e]);
      const float2 fg = act_and_grad(alpha * to_f(av.v[e]), ACT);
      oa.v[e] = from_f<T>(dv * to_f(bv.v[e]) * fg.y);
      ob.v[e] = from_f<T>(dv * fg.x * inv_alpha);
    }
    if (da) st_pack(da + i * V, oa);
    if (db) st_pack(db + i * V, ob);
  }
}

template <typename T, int ACT>
cudaError_t launch_vec(cudaStream_t s, const T* dh, const T* a, const T* b, T* da, T* db,
                       int64_t npk, float alpha) {
  auto k = gated_act_grad_vec_kernel<T, ACT>;
  const int64_t grid = resident_grid(k, 256, 0, npk, 256);
  k<<<static_cast<unsigned>(grid), 256, 0, s>>>(dh, a, b, da, db, npk, alpha);
  return cudaGetLastError();
}

template <typename T>
int launch(void* stream, const void* dh_, const void* a_, const void* b_, void* da_, void* db_,
           int64_t n, int act, float alpha) {
  if (act != kGelu && act != kGeluTanh && act != kSilu) return cudaErrorInvalidValue;
  if (n <= 0 || (!da_ && !db_)) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const T* dh = static_cast<const T*>(dh_);
  const T* a = static_cast<const T*>(a_);
  const T* b = static_cast<const T*>(b_);
  T* da = static_cast<T*>(da_);
  T* db = static_cast<T*>(db_);
  constexpr int V = Pack<T>::kN;
  const int64_t npk = memk_vec() && aligned16({dh, a, b, da, db}) ? n / V : 0;
  if (npk > 0) {
    cudaError_t e = act == kGelu       ? launch_vec<T, kGelu>(s, dh, a, b, da, db, npk, alpha)
                    : act == kGeluTanh ? launch_vec<T, kGeluTanh>(s, dh, a, b, da, db, npk, alpha)
                                       : launch_vec<T, kSilu>(s, dh, a, b, da, db, npk, alpha);
    RETURN_IF_ERR(e);
  }
  const int64_t done = npk * V;
  if (done < n)
    gated_act_grad_kernel<T><<<grid_for(n - done, 256), 256, 0, s>>>(
        dh + done, a + done, b + done, da ? da + done : nullptr, db ? db + done : nullptr, n - done,
        act, alpha);
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

FUSECLI_EXPORT int fusecli_launch_gated_activation_grad_bf16(void* stream, const void* dh,
                                                             const void* a, const void* b, void* da,
                                                             void* db, int64_t n, int act,
                                                             float alpha) {
  return launch<__nv_bfloat16>(stream, dh, a, b, da, db, n, act, alpha);
}
