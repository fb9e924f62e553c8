// ActivationGrad: CUDA kernel (cuda_common.cuh's act_grad) and its C launchers.
#include "cuda_common.cuh"

FUSECLI_EXPORT int fusecli_launch_activation_grad(void* stream, const float* dy, const float* x,
                                                  float* dx, int64_t n, int act, float alpha) {
  if (act < 0 || act >= FUSECLI_NUM_ACTS) return cudaErrorInvalidValue;
  return launch_act_f32(static_cast<cudaStream_t>(stream), dy, x, dx, n, act, alpha);
}

FUSECLI_EXPORT int fusecli_launch_activation_grad_f16(void* stream, const void* dy, const void* x,
                                                      void* dx, int64_t n, int act, float alpha) {
  if (act < 0 || act >= FUSECLI_NUM_ACTS) return cudaErrorInvalidValue;
  if (n <= 0) return cudaSuccess;
  act_grad_kernel<__half><<<grid_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const __half*>(dy), static_cast<const __half*>(x), static_cast<__half*>(dx), n,
      act, alpha);
  return cudaGetLastError();
}
