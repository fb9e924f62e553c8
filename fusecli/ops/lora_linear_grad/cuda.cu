// LoraLinearGrad: CUDA launcher (activation grad, column sums, SGEMMs).
#include "cuda_common.cuh"

FUSECLI_EXPORT int fusecli_launch_lora_linear_grad(
    void* stream, const float* dy, const float* x, const float* a, const float* w, const float* la,
    const float* lb, const float* h, const float* xd, float* dx, float* dxa, float* dla, float* dlb,
    float* dw, float* db, float* dz_out, int64_t m, int64_t n, int64_t k, int64_t r, int act,
    float alpha, float scale, int trans_w, int split_dx) {
  const int tf32 = 0;  // TF32 not exposed yet: strict float32 GEMMs
  if (act < 0 || act >= FUSECLI_NUM_ACTS) return cudaErrorInvalidValue;
  if ((dx && !w) || (act != kIdentity && !x)) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (!xd) xd = a;
  if (m <= 0) {
    if (dla) RETURN_IF_ERR(cudaMemsetAsync(dla, 0, r * k * sizeof(float), s));
    if (dlb) RETURN_IF_ERR(cudaMemsetAsync(dlb, 0, n * r * sizeof(float), s));
    if (dw) RETURN_IF_ERR(cudaMemsetAsync(dw, 0, n * k * sizeof(float), s));
    if (db) RETURN_IF_ERR(cudaMemsetAsync(db, 0, n * sizeof(float), s));
    return cudaGetLastError();
  }
  Scratch ws(s), gs(s);
  const float* dz = dy;
  if (dz_out && n > 0) {  // dZ asked for (possibly in dY's own buffer: elementwise, safe)
    if (act != kIdentity)
      RETURN_IF_ERR(launch_act_f32(s, dy, x, dz_out, m * n, act, alpha));
    else if (dz_out != dy)
      RETURN_IF_ERR(
          cudaMemcpyAsync(dz_out, dy, m * n * sizeof(float), cudaMemcpyDeviceToDevice, s));
    dz = dz_out;
  } else if (act != kIdentity && n > 0) {
    RETURN_IF_ERR(ws.alloc(static_cast<size_t>(m * n) * sizeof(float)));
    RETURN_IF_ERR(launch_act_f32(s, dy, x, ws.f(), m * n, act, alpha));
    dz = ws.f();
  }
  // G[m,r] = s dZ Lb
  const bool need_g = dla || dxa || (dx && !split_dx);
  if (need_g) {
    RETURN_IF_ERR(gs.alloc(static_cast<size_t>(m * r) * sizeof(float)));
    RETURN_IF_ERR(
        gemm(s, false, false, m, r, n, scale, dz, n, 0, lb, r, 0, 0.f, gs.f(), r, 0, 1, tf32 != 0));
  }
  if (dx) {  // dX[m,k] = dZ W (+ G La)  |  dZ W^T (W [k,n])
    RETURN_IF_ERR(gemm(s, false, trans_w != 0, m, k, n, 1.f, dz, n, 0, w, trans_w ? n : k, 0, 0.f,
                       dx, k, 0, 1, tf32 != 0));
    if (!split_dx)
      RETURN_IF_ERR(
          gemm(s, false, false, m, k, r, 1.f, gs.f(), r, 0, la, k, 0, 1.f, dx, k, 0, 1, tf32 != 0));
  }
  if (dxa)
    RETURN_IF_ERR(
        gemm(s, false, false, m, k, r, 1.f, gs.f(), r, 0, la, k, 0, 0.f, dxa, k, 0, 1, tf32 != 0));
  if (dla)  // dLa[r,k] = G^T Xd
    RETURN_IF_ERR(
        gemm(s, true, false, r, k, m, 1.f, gs.f(), r, 0, xd, k, 0, 0.f, dla, k, 0, 1, tf32 != 0));
  if (dlb)  // dLb[n,r] = s dZ^T H
    RETURN_IF_ERR(
        gemm(s, true, false, n, r, m, scale, dz, n, 0, h, r, 0, 0.f, dlb, r, 0, 1, tf32 != 0));
  if (dw && !trans_w)  // dW[n,k] = dZ^T A
    RETURN_IF_ERR(
        gemm(s, true, false, n, k, m, 1.f, dz, n, 0, a, k, 0, 0.f, dw, k, 0, 1, tf32 != 0));
  if (dw && trans_w)  // dW[k,n] = A^T dZ
    RETURN_IF_ERR(
        gemm(s, true, false, k, n, m, 1.f, a, k, 0, dz, n, 0, 0.f, dw, n, 0, 1, tf32 != 0));
  if (db && n > 0) {
    col_sum_kernel<<<static_cast<unsigned>((n + 31) / 32), dim3(32, 8), 0, s>>>(dz, db, m, n);
    RETURN_IF_ERR(cudaGetLastError());
  }
  return cudaGetLastError();
}
