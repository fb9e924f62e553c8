// ConvBnReluGrad: CUDA kernels and C launcher.
#include "cuda_common.cuh"
#include "cuda_dnn.h"

namespace {

// ---- BN + activation backward -------------------------------------------------------------------
// Per channel c: dbeta = sum dz, dgamma = sum dz * xhat (one block per channel), with
// dz = act'(y) dy (y unread for identity).
__global__ void bn_stats_kernel(const float* __restrict__ dy, const float* __restrict__ y,
                                const float* __restrict__ cv, const float* __restrict__ mean,
                                const float* __restrict__ istd, float* __restrict__ dgamma,
                                float* __restrict__ dbeta, int64_t n, int64_t c, int64_t hw,
                                int act) {
  const int64_t ch = blockIdx.x;
  const float mu = mean[ch], is = istd[ch];
  float s1 = 0.f, s2 = 0.f;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t off = (b * c + ch) * hw;
    for (int64_t i = threadIdx.x; i < hw; i += blockDim.x) {
      const float dz = act == kIdentity ? dy[off + i] : act_grad(dy[off + i], y[off + i], act);
      s1 += dz;
      s2 += dz * (cv[off + i] - mu) * is;
    }
  }
  const float2 t = block_sum2(s1, s2);
  if (threadIdx.x == 0) {
    dbeta[ch] = t.x;
    dgamma[ch] = t.y;
  }
}

// dC = gamma inv_std / R (R dz - dbeta - xhat dgamma); dBc[c] = sum dC (one block per (channel,
// image-chunk)).
__global__ void bn_dc_kernel(const float* dy, const float* __restrict__ y,
                             const float* __restrict__ cv, const float* __restrict__ gamma,
                             const float* __restrict__ mean, const float* __restrict__ istd,
                             const float* __restrict__ dgamma, const float* __restrict__ dbeta,
                             float* dc, float* __restrict__ dbc, int64_t n,
                             int64_t c,  // dc may be dy
                             int64_t hw, int act) {
  const int64_t ch = blockIdx.x;
  const float R = static_cast<float>(n * hw);
  const float mu = mean[ch], is = istd[ch], coef = gamma[ch] * is / R;
  const float db = dbeta[ch], dg = dgamma[ch];
  float s = 0.f;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t off = (b * c + ch) * hw;
    for (int64_t i = threadIdx.x; i < hw; i += blockDim.x) {
      const float dz = act == kIdentity ? dy[off + i] : act_grad(dy[off + i], y[off + i], act);
      const float v = coef * (R * dz - db - (cv[off + i] - mu) * is * dg);
      if (dc) dc[off + i] = v;
      s += v;
    }
  }
  const float t = block_sum2(s, 0.f).x;
  if (threadIdx.x == 0 && dbc) dbc[ch] = t;
}

struct Geo {
  int64_t cin, hin, win, kh, kw, ho, wo, sh, sw, pt, pl, dh, dw;
};

// cols[(ci*kh + i)*kw + j][oh*wo + ow] for all input channels of one image.
__global__ void im2col_kernel(const float* __restrict__ x, float* __restrict__ cols, Geo g) {
  const int64_t hw = g.ho * g.wo, total = g.cin * g.kh * g.kw * hw;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t p = idx % hw, row = idx / hw;
    const int64_t j = row % g.kw, i = (row / g.kw) % g.kh, ci = row / (g.kw * g.kh);
    const int64_t oh = p / g.wo, ow = p % g.wo;
    const int64_t ih = oh * g.sh - g.pt + i * g.dh, iw = ow * g.sw - g.pl + j * g.dw;
    cols[idx] =
        (ih >= 0 && ih < g.hin && iw >= 0 && iw < g.win) ? x[(ci * g.hin + ih) * g.win + iw] : 0.f;
  }
}

// Gather-form col2im: dx[ci][ih][iw] = sum of the cols entries that read x[ci][ih][iw].
__global__ void col2im_kernel(const float* __restrict__ cols, float* __restrict__ dx, Geo g) {
  const int64_t hw = g.ho * g.wo, total = g.cin * g.hin * g.win;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t iw = idx % g.win, ih = (idx / g.win) % g.hin, ci = idx / (g.win * g.hin);
    float s = 0.f;
    for (int64_t i = 0; i < g.kh; ++i) {
      const int64_t th = ih + g.pt - i * g.dh;
      if (th < 0 || th % g.sh) continue;
      const int64_t oh = th / g.sh;
      if (oh >= g.ho) continue;
      for (int64_t j = 0; j < g.kw; ++j) {
        const int64_t tw = iw + g.pl - j * g.dw;
        if (tw < 0 || tw % g.sw) continue;
        const int64_t ow = tw / g.sw;
        if (ow >= g.wo) continue;
        s += cols[((ci * g.kh + i) * g.kw + j) * hw + oh * g.wo + ow];
      }
    }
    dx[idx] = s;
  }
}

}  // namespace

FUSECLI_EXPORT int fusecli_launch_conv_bn_relu_grad(
    void* stream, const float* dy, const float* y, const float* x, const float* w, const float* cv,
    const float* gamma, const float* mean, const float* inv_std, float* dx, float* dw, float* dbc,
    float* dgamma, float* dbeta, float* dc_out, int64_t n, int64_t c, int64_t h, int64_t wd,
    int64_t cin, int64_t hin, int64_t win, int64_t kh, int64_t kw, int64_t stride_h,
    int64_t stride_w, int64_t pad_t, int64_t pad_l, int64_t pad_b, int64_t pad_r, int64_t dil_h,
    int64_t dil_w, int64_t group, int act) {
  const int tf32 = 0;  // TF32 not exposed yet: strict float32 GEMMs
  (void)pad_b;
  (void)pad_r;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (group < 1 || c % group || cin % group || act < 0 || act >= FUSECLI_NUM_ACTS)
    return cudaErrorInvalidValue;
  const int64_t hw = h * wd;
  const bool need_dc = dx || dw || dc_out;
  Scratch ws_stats(s), ws_dc(s), ws_cols(s);
  RETURN_IF_ERR(ws_stats.alloc(static_cast<size_t>(2 * c) * sizeof(float)));
  float* sg = ws_stats.f();
  float* sb = sg + c;
  if (c > 0) {
    bn_stats_kernel<<<static_cast<unsigned>(c), 256, 0, s>>>(dy, y, cv, mean, inv_std, sg, sb, n, c,
                                                             hw, act);
    RETURN_IF_ERR(cudaGetLastError());
    if (dgamma)
      RETURN_IF_ERR(cudaMemcpyAsync(dgamma, sg, c * sizeof(float), cudaMemcpyDeviceToDevice, s));
    if (dbeta)
      RETURN_IF_ERR(cudaMemcpyAsync(dbeta, sb, c * sizeof(float), cudaMemcpyDeviceToDevice, s));
  }
  if (!need_dc && !dbc) return cudaSuccess;
  float* dc = nullptr;
  if (dc_out) {  // asked for; may be dY's own buffer (each element is read, then written)
    dc = dc_out;
  } else if (need_dc) {
    RETURN_IF_ERR(ws_dc.alloc(static_cast<size_t>(n * c * hw) * sizeof(float)));
    dc = ws_dc.f();
  }
  if (c > 0) {
    bn_dc_kernel<<<static_cast<unsigned>(c), 256, 0, s>>>(dy, y, cv, gamma, mean, inv_std, sg, sb,
                                                          dc, dbc, n, c, hw, act);
    RETURN_IF_ERR(cudaGetLastError());
  }
  if (!dx && !dw) return cudaSuccess;
  // the convolution's gradients on cuDNN where it is loaded and takes the geometry (symmetric
  // padding as far as the output reaches); else the im2col GEMMs below
  const int r = fusecli::dnn::conv2d_backward(s, x, w, dc, dx, dw, n, cin, hin, win, c, kh, kw, h,
                                              wd, stride_h, stride_w, pad_t, pad_l, dil_h, dil_w,
                                              group, tf32 != 0);
  if (r != fusecli::dnn::kNotUsed) return static_cast<cudaError_t>(r);
  const int64_t cg = c / group, cin_g = cin / group, kc = cin_g * kh * kw;
  Geo g{cin, hin, win, kh, kw, h, wd, stride_h, stride_w, pad_t, pad_l, dil_h, dil_w};
  RETURN_IF_ERR(ws_cols.alloc(static_cast<size_t>(cin * kh * kw * hw) * sizeof(float)));
  float* cols = ws_cols.f();
  if (dw) RETURN_IF_ERR(cudaMemsetAsync(dw, 0, static_cast<size_t>(c * kc) * sizeof(float), s));
  const int64_t cols_total = cin * kh * kw * hw;
  for (int64_t b = 0; b < n; ++b) {
    const float* dcb = dc + b * c * hw;
    if (dw) {
      im2col_kernel<<<grid_for(cols_total, 256), 256, 0, s>>>(x + b * cin * hin * win, cols, g);
      RETURN_IF_ERR(cudaGetLastError());
      // dW_g[cg,kc] += dC_g[cg,hw] cols_g^T[hw,kc], batched over groups
      RETURN_IF_ERR(gemm(s, false, true, cg, kc, hw, 1.f, dcb, hw, cg * hw, cols, hw, kc * hw, 1.f,
                         dw, kc, cg * kc, group, tf32 != 0));
    }
    if (dx) {
      // cols_g[kc,hw] = W_g^T[kc,cg] dC_g[cg,hw], batched over groups; then col2im
      RETURN_IF_ERR(gemm(s, true, false, kc, hw, cg, 1.f, w, kc, cg * kc, dcb, hw, cg * hw, 0.f,
                         cols, hw, kc * hw, group, tf32 != 0));
      col2im_kernel<<<grid_for(cin * hin * win, 256), 256, 0, s>>>(cols, dx + b * cin * hin * win,
                                                                   g);
      RETURN_IF_ERR(cudaGetLastError());
    }
  }
  return cudaGetLastError();
}
