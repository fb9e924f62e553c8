// ActivationGrad: CUDA kernels (cuda_common.cuh's act_grad) and their C launchers. With
// FUSECLI_MEMK_PATH=vec (opt-in until measured on a GPU): 16-byte packs per thread when every
// pointer is 16-byte aligned (a scalar kernel takes the tail and
// misaligned tensors); dX may be dY (the in-place pair: each pack is read before it is written).
#include "cuda_mem.cuh"

namespace {

// ACT >= 0: the activation is a compile-time constant; -1: the run-time `act` (any code).
template <typename T, int ACT>
__global__ void act_grad_vec_kernel(const T* dy, const T* __restrict__ x, T* dx, int64_t npk,
                                    int act, float alpha) {
  constexpr int V = Pack<T>::kN;
  const int a = ACT >= 0 ? ACT : act;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < npk;
       i += (int64_t)gridDim.x * blockDim.x) {
    const Pack<T> d = ld_pack(dy + i * V), v = ld_pack(x + i * V);
    Pack<T> o;
#pragma unroll
    for (int e = 0; e < V; ++e) o.v[e] = from_f<T>(act_grad(to_f(d.v[e]), alpha * to_f(v.v[e]), a));
    st_pack(dx + i * V, o);
  }
}

template <typename T, int ACT>
cudaError_t launch_vec(cudaStream_t s, const T* dy, const T* x, T* dx, int64_t npk, int act,
                       float alpha) {
  auto k = act_grad_vec_kernel<T, ACT>;
  const int64_t grid = resident_grid(k, 256, 0, npk, 256);
  k<<<static_cast<unsigned>(grid), 256, 0, s>>>(dy, x, dx, npk, act, alpha);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_act(cudaStream_t s, const T* dy, const T* x, T* dx, int64_t n, int act,
                       float alpha) {
  if (n <= 0) return cudaSuccess;
  if (!memk_vec()) {  // the kernels before the vectorised path (the default until measured)
    if constexpr (sizeof(T) == 4) return launch_act_f32(s, dy, x, dx, n, act, alpha);
    act_grad_kernel<T><<<grid_for(n, 256), 256, 0, s>>>(dy, x, dx, n, act, alpha);
    return cudaGetLastError();
  }
  constexpr int V = Pack<T>::kN;
  const int64_t npk = aligned16({dy, x, dx}) ? n / V : 0;
  if (npk > 0) {
    cudaError_t e;
    switch (act) {
      case kRelu:
        e = launch_vec<T, kRelu>(s, dy, x, dx, npk, act, alpha);
        break;
      case kGelu:
        e = launch_vec<T, kGelu>(s, dy, x, dx, npk, act, alpha);
        break;
      case kGeluTanh:
        e = launch_vec<T, kGeluTanh>(s, dy, x, dx, npk, act, alpha);
        break;
      case kSilu:
        e = launch_vec<T, kSilu>(s, dy, x, dx, npk, act, alpha);
        break;
      default:
        e = launch_vec<T, -1>(s, dy, x, dx, npk, act, alpha);
    }
    RETURN_IF_ERR(e);
  }
  const int64_t done = npk * V;
  if (done < n)
    act_grad_kernel<T><<<grid_for(n - done, 256), 256, 0, s>>>(dy + done, x + done, dx + done,
                                                               n - done, act, alpha);
  return cudaGetLastError();
}

}  // namespace

FUSECLI_EXPORT int fusecli_launch_activation_grad(void* stream, const float* dy, const float* x,
                                                  float* dx, int64_t n, int act, float alpha) {
  if (act < 0 || act >= FUSECLI_NUM_ACTS) return cudaErrorInvalidValue;
  return launch_act<float>(static_cast<cudaStream_t>(stream), dy, x, dx, n, act, alpha);
}

FUSECLI_EXPORT int fusecli_launch_activation_grad_f16(void* stream, const void* dy, const void* x,
                                                      void* dx, int64_t n, int act, float alpha) {
  if (act < 0 || act >= FUSECLI_NUM_ACTS) return cudaErrorInvalidValue;
  return launch_act<__half>(static_cast<cudaStream_t>(stream), static_cast<const __half*>(dy),
                            static_cast<const __half*>(x), static_cast<__half*>(dx), n, act, alpha);
}

FUSECLI_EXPORT int fusecli_launch_activation_grad_bf16(void* stream, const void* dy, const void* x,
                                                       void* dx, int64_t n, int act, float alpha) {
  if (act < 0 || act >= FUSECLI_NUM_ACTS) return cudaErrorInvalidValue;
  return launch_act<__nv_bfloat16>(
      static_cast<cudaStream_t>(stream), static_cast<const __nv_bfloat16*>(dy),
      static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(dx), n, act, alpha);
}
