// LinearActivationGrad: CUDA launcher (activation grad, column sums, SGEMMs).
#include "cuda_common.cuh"

FUSECLI_EXPORT int fusecli_launch_linear_activation_grad(void* stream, const float* dy,
                                                         const float* x, const float* a,
                                                         const float* w, float* da, float* dw,
                                                         float* db, float* dz_out, int64_t m,
                                                         int64_t n, int64_t k, int act, float alpha,
                                                         int trans_w, int trans_dw) {
  const int tf32 = 0;  // TF32 not exposed yet: strict float32 GEMMs
  if (act < 0 || act >= FUSECLI_NUM_ACTS) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  Scratch ws(s);
  const float* dz = dy;
  if (dz_out && m * n > 0) {  // dZ asked for (possibly in dY's own buffer: elementwise, safe)
    if (act != kIdentity)
      RETURN_IF_ERR(launch_act_f32(s, dy, x, dz_out, m * n, act, alpha));
    else if (dz_out != dy)
      RETURN_IF_ERR(
          cudaMemcpyAsync(dz_out, dy, m * n * sizeof(float), cudaMemcpyDeviceToDevice, s));
    dz = dz_out;
  } else if (act != kIdentity && (da || dw || db) && m * n > 0) {
    RETURN_IF_ERR(ws.alloc(static_cast<size_t>(m * n) * sizeof(float)));
    RETURN_IF_ERR(launch_act_f32(s, dy, x, ws.f(), m * n, act, alpha));
    dz = ws.f();
  }
  if (db) {
    if (m <= 0)
      RETURN_IF_ERR(cudaMemsetAsync(db, 0, n * sizeof(float), s));
    else if (n > 0)
      col_sum_kernel<<<static_cast<unsigned>((n + 31) / 32), dim3(32, 8), 0, s>>>(dz, db, m, n);
    RETURN_IF_ERR(cudaGetLastError());
  }
  if ((da && !w) || (dw && !a)) return cudaErrorInvalidValue;
  if (da)  // dA[m,k] = dZ W  (W [n,k])  |  dZ W^T  (W [k,n])
    RETURN_IF_ERR(gemm(s, false, trans_w != 0, m, k, n, 1.f, dz, n, 0, w, trans_w ? n : k, 0, 0.f,
                       da, k, 0, 1, tf32 != 0));
  if (dw) {
    if (!trans_dw)  // dW[n,k] = dZ^T A
      RETURN_IF_ERR(
          gemm(s, true, false, n, k, m, 1.f, dz, n, 0, a, k, 0, 0.f, dw, k, 0, 1, tf32 != 0));
    else  // dW[k,n] = A^T dZ
      RETURN_IF_ERR(
          gemm(s, true, false, k, n, m, 1.f, a, k, 0, dz, n, 0, 0.f, dw, n, 0, 1, tf32 != 0));
  }
  return cudaGetLastError();
}
