/* Plain C launchers of fusecli's CUDA kernels (exported from libfusecli_ops.so when it was built
 * with nvcc). Every pointer is a device pointer (e.g. torch's tensor.data_ptr()), every tensor is
 * contiguous row-major, `stream` is a cudaStream_t (NULL: the legacy default stream). Each returns
 * the cudaError_t of its launches as an int (0 = cudaSuccess; 35 = no CUDA driver). Output
 * pointers marked "nullable" may be NULL: that output is then not computed. Scratch memory comes
 * from cudaMallocAsync on `stream`.
 *
 * Activation codes: 0 relu, 1 gelu (erf), 2 gelu_tanh, 3 silu, 4 identity (LinearActivationGrad
 * only). Half tensors are IEEE binary16 (torch.float16) passed as void*.
 * Shapes follow fusecli/ops/contracts.yaml with leading dims flattened into rows / batches. */
#ifndef FUSECLI_LAUNCHERS_H_
#define FUSECLI_LAUNCHERS_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* dX[n] = dY * act'(X), n elements (float32). */
int fusecli_launch_activation_grad(void* stream, const float* dy, const float* x, float* dx,
                                   int64_t n, int act);
/* Same for float16 tensors (math in float32). */
int fusecli_launch_activation_grad_f16(void* stream, const void* dy, const void* x, void* dx,
                                       int64_t n, int act);

/* dY, X: [m, n]; A: [m, k]; W: [n, k] (trans_w=0) or [k, n] (trans_w=1).
 * dA [m, k], dW (shape of W), dB [n], dZ [m, n]: all nullable; dZ may be dY itself. */
int fusecli_launch_linear_activation_grad(void* stream, const float* dy, const float* x,
                                          const float* a, const float* w, float* da, float* dw,
                                          float* db, float* dz, int64_t m, int64_t n, int64_t k,
                                          int act, int trans_w, int trans_dw);

/* AttentionGrad (fusecli/ops/contracts.yaml). Query side: dO [b, sq, dv]; Q [b, sq, d];
 * P, dS and mask [b, sq, sk], with b = prod(qdims[0..nd)) (nd <= 8; nd = 0: one item).
 * K [bk, sk, d] (k_transposed=0) or [bk, d, sk], bk = prod(kdims); V [bv, sk, dv], bv = prod(vdims);
 * kdims[j] and vdims[j] each equal qdims[j] or divide it: query index i of dim j uses kv index
 * i / (qdims[j] / kdims[j]) (grouped / multi-query attention); dK and dV sum over the group.
 * mask: nullable, bool bytes (1 = kept): the forward's Pd = P * mask * keep (keep = 1 / (1 -
 * dropout_ratio)). dQ, dK (shape of K), dV (shape of V), dS (unscaled): nullable.
 * Returns cudaErrorInvalidValue (1) for dims outside the grouping rule. */
int fusecli_launch_attention_grad(void* stream, const float* dO, const float* q, const float* k,
                                  const float* v, const float* p, const uint8_t* mask, float* dq,
                                  float* dk, float* dv, float* ds, int nd, const int64_t* qdims,
                                  const int64_t* kdims, const int64_t* vdims, int64_t sq,
                                  int64_t sk, int64_t d, int64_t dv_dim, float scale_q,
                                  float scale_k, float keep, int k_transposed);

/* dY, Y, Cv: [n, c, h, w]; X: [n, cin, hin, win]; W: [c, cin/group, kh, kw];
 * gamma, mean, inv_std: [c]. pads = (top, left, bottom, right).
 * dX (shape of X), dW (shape of W), dBc, dGamma, dBeta [c]: nullable. */
int fusecli_launch_conv_bn_relu_grad(void* stream, const float* dy, const float* y,
                                     const float* x, const float* w, const float* cv,
                                     const float* gamma, const float* mean, const float* inv_std,
                                     float* dx, float* dw, float* dbc, float* dgamma, float* dbeta,
                                     float* dc, int64_t n, int64_t c, int64_t h, int64_t wd, int64_t cin,
                                     int64_t hin, int64_t win, int64_t kh, int64_t kw,
                                     int64_t stride_h, int64_t stride_w, int64_t pad_t,
                                     int64_t pad_l, int64_t pad_b, int64_t pad_r, int64_t dil_h,
                                     int64_t dil_w, int64_t group, int relu);

/* dY, X, dR (nullable), dX: [m, n]; gamma [n]; mean, inv_std [m] (float32).
 * dX, dGamma [n], dBeta [n]: nullable. */
int fusecli_launch_layer_norm_grad(void* stream, const float* dy, const float* x,
                                   const float* gamma /* nullable: 1 */, const float* mean, const float* inv_std,
                                   const float* dr, float* dx, float* dgamma, float* dbeta,
                                   int64_t m, int64_t n);
/* float16 dY, X, gamma, dR, dX, dGamma, dBeta; mean/inv_std float16 when stats_f16 != 0,
 * else float32. Math and reductions in float32. */
int fusecli_launch_layer_norm_grad_f16(void* stream, const void* dy, const void* x,
                                       const void* gamma, const void* mean, const void* inv_std,
                                       int stats_f16, const void* dr, void* dx, void* dgamma,
                                       void* dbeta, int64_t m, int64_t n);

/* Copies one float from device memory (a run-time scale tensor) and waits for it. */
int fusecli_read_scalar(void* stream, const float* p, float* out);

/* Kernel-call counters of the onnxruntime kernels (CPU and CUDA Compute calls per op name;
 * -1 for an unknown name), their reset, and whether the CUDA kernels were compiled in. */
int64_t fusecli_kernel_calls(const char* op_name);
void fusecli_reset_kernel_calls(void);
int fusecli_has_cuda(void);

#ifdef __cplusplus
}
#endif

#endif /* FUSECLI_LAUNCHERS_H_ */
