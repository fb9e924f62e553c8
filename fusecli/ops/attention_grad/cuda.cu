// AttentionGrad: CUDA kernels and C launchers.
#include "attn_batch.h"
#include "cuda_common.cuh"

namespace {

// The fill mask's layout over P's dims: row r of P (r in [0, B * sq)) starts at row_off(r), its
// columns are col apart (0: one flag per row).
struct FillMap {
  int nd = 0;
  int64_t dims[fusecli::kAttnMaxBatchDims] = {};
  int64_t strides[fusecli::kAttnMaxBatchDims] = {};
  int64_t sq = 1, row = 0, col = 0;
  __host__ __device__ int64_t row_off(int64_t r) const {
    int64_t off = (r % sq) * row;
    r /= sq;
    for (int j = nd - 1; j >= 0 && r; --j) {
      off += (r % dims[j]) * strides[j];
      r /= dims[j];
    }
    return off;
  }
};

// ---- softmax backward rows: dP = dPd * mask * keep (no mask: dPd), dS = P * (dP - rowsum(dP *
// P)), in place over dPd; with a fill mask, dSm = Where(filled, 0, dS) goes to dsm (dsm == dp:
// in place)
// ----------------------------------------------------------------------------
__global__ void softmax_bwd_rows(float* dp, const float* __restrict__ p,
                                 const uint8_t* __restrict__ mask, float keep, int64_t cols,
                                 float* dsm, const uint8_t* __restrict__ fill, FillMap fm,
                                 int fill_kept) {
  const int64_t row = blockIdx.x;
  float* d = dp + row * cols;
  const float* pr = p + row * cols;
  const uint8_t* mr = mask ? mask + row * cols : nullptr;
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    float v = d[j];
    if (mr) d[j] = v = v * static_cast<float>(mr[j]) * keep;  // each thread rereads only its own j
    s += v * pr[j];
  }
  const float tot = block_sum2(s, 0.f).x;
  if (!fill) {
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) d[j] = pr[j] * (d[j] - tot);
    return;
  }
  const uint8_t* fr = fill + fm.row_off(row);
  float* g = dsm + row * cols;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float v = pr[j] * (d[j] - tot);
    d[j] = v;
    g[j] = ((fr[j * fm.col] != 0) != (fill_kept != 0)) ? 0.f : v;
  }
}

// out = Pg * mask * keep (the probabilities V saw: Pg = P, or P with NaN read as 0 under
// nan_guard; no mask: Pg)
__global__ void guarded_dropout_apply(const float* __restrict__ p, const uint8_t* __restrict__ mask,
                                      float keep, int nan_guard, float* __restrict__ out,
                                      int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    float v = p[i];
    if (nan_guard && isnan(v)) v = 0.f;
    out[i] = mask ? v * static_cast<float>(mask[i]) * keep : v;
  }
}

// ---- grouped K / V (attn_batch.h) when the kv items are not consumed in runs, in order ------
// out[b] = in[kv(b)] for every query item b (per = elements of one item)
__global__ void kv_expand(const float* __restrict__ in, float* __restrict__ out, fusecli::KvMap m,
                          int64_t per, int64_t total) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = in[m.kv_of(i / per) * per + i % per];
}
// out[c] = sum over the g query items b of kv item c of in[b]
__global__ void kv_group_sum(const float* __restrict__ in, float* __restrict__ out,
                             fusecli::KvMap m, int64_t per, int64_t total, int64_t g) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = i / per, e = i % per;
    float s = 0.f;
    for (int64_t t = 0; t < g; ++t) s += in[m.member(c, t) * per + e];
    out[i] = s;
  }
}

// c[b] = alpha a[b] op(w[kv(b)]) over the query items: a per item [rows, k], c per item
// [rows, n], w per kv item [k, n] (stored [n, k] when tw). A run of query items sharing a kv item
// is one GEMM of its stacked rows; other groupings read an expanded copy of w.
cudaError_t attn_gather(cudaStream_t s, const fusecli::KvMap& m, bool tw, int64_t rows, int64_t n,
                        int64_t k, float alpha, const float* a, const float* w, float* c,
                        int tf32) {
  const int64_t B = m.q_items(), ldw = tw ? k : n;
  if (m.runs_in_order()) {
    const int64_t L = m.run();
    return gemm(s, false, tw, L * rows, n, k, alpha, a, k, L * rows * k, w, ldw, k * n, 0.f, c, n,
                L * rows * n, B / L, tf32 != 0);
  }
  Scratch wf(s);
  RETURN_IF_ERR(wf.alloc(static_cast<size_t>(B * k * n) * sizeof(float)));
  kv_expand<<<grid_for(B * k * n, 256), 256, 0, s>>>(w, wf.f(), m, k * n, B * k * n);
  RETURN_IF_ERR(cudaGetLastError());
  return gemm(s, false, tw, rows, n, k, alpha, a, k, rows * k, wf.f(), ldw, k * n, 0.f, c, n,
              rows * n, B, tf32 != 0);
}

// out[kv] = alpha sum over kv's query items b of a[b]^T x[b]: a per item [rows, m], x per item
// [rows, n], out per kv item [m, n]. A run of query items sharing a kv item is one GEMM over its
// stacked rows; other groupings go through per-item products and a group sum.
cudaError_t attn_scatter(cudaStream_t s, const fusecli::KvMap& km, int64_t rows, int64_t m,
                         int64_t n, float alpha, const float* a, const float* x, float* out,
                         int tf32) {
  const int64_t B = km.q_items();
  if (km.runs_in_order()) {
    const int64_t L = km.run();
    return gemm(s, true, false, m, n, L * rows, alpha, a, m, L * rows * m, x, n, L * rows * n, 0.f,
                out, n, m * n, B / L, tf32 != 0);
  }
  Scratch full(s);
  RETURN_IF_ERR(full.alloc(static_cast<size_t>(B * m * n) * sizeof(float)));
  RETURN_IF_ERR(gemm(s, true, false, m, n, rows, alpha, a, m, rows * m, x, n, rows * n, 0.f,
                     full.f(), n, m * n, B, tf32 != 0));
  const int64_t total = km.kv_items() * m * n;
  kv_group_sum<<<grid_for(total, 256), 256, 0, s>>>(full.f(), out, km, m * n, total, km.group());
  return cudaGetLastError();
}

bool make_kv_map(int nd, const int64_t* qdims, const int64_t* kvdims, fusecli::KvMap* m) {
  if (nd < 0 || nd > fusecli::kAttnMaxBatchDims || (nd > 0 && (!qdims || !kvdims))) return false;
  m->nd = nd;
  for (int j = 0; j < nd; ++j) {
    m->q[j] = qdims[j];
    m->kv[j] = kvdims[j];
    if (qdims[j] < 0 || !(kvdims[j] == qdims[j] || (kvdims[j] >= 1 && qdims[j] % kvdims[j] == 0)))
      return false;
  }
  return true;
}

}  // namespace

FUSECLI_EXPORT int fusecli_read_scalar(void* stream, const float* p, float* out) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  RETURN_IF_ERR(cudaMemcpyAsync(out, p, sizeof(float), cudaMemcpyDeviceToHost, s));
  return cudaStreamSynchronize(s);
}

FUSECLI_EXPORT int fusecli_launch_attention_grad(
    void* stream, const float* dO, const float* q, const float* k, const float* v, const float* p,
    const uint8_t* mask, float* dq, float* dk, float* dv, float* ds_out, int nd,
    const int64_t* qdims, const int64_t* kdims, const int64_t* vdims, int64_t sq, int64_t sk,
    int64_t d, int64_t dvd, float scale_q, float scale_k, float keep, int k_transposed,
    int nan_guard, const uint8_t* fill, const int64_t* fill_strides, int fill_kept) {
  const int tf32 = 0;  // TF32 not exposed yet: strict float32 GEMMs
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  fusecli::KvMap km, vm;
  if (!make_kv_map(nd, qdims, kdims, &km) || !make_kv_map(nd, qdims, vdims, &vm))
    return cudaErrorInvalidValue;
  const int64_t b = km.q_items();
  if (b <= 0 || sq <= 0) {  // no query rows: the group sums are empty
    if (dk) RETURN_IF_ERR(cudaMemsetAsync(dk, 0, km.kv_items() * sk * d * sizeof(float), s));
    if (dv) RETURN_IF_ERR(cudaMemsetAsync(dv, 0, vm.kv_items() * sk * dvd * sizeof(float), s));
    return cudaSuccess;
  }
  const int64_t n_p = b * sq * sk;
  Scratch ws_pd(s), ws(s);
  if (dv) {  // dV = sum_group Pd^T dO
    const float* pa = p;
    if (mask || nan_guard) {
      RETURN_IF_ERR(ws_pd.alloc(static_cast<size_t>(n_p) * sizeof(float)));
      guarded_dropout_apply<<<grid_for(n_p, 256), 256, 0, s>>>(p, mask, keep, nan_guard, ws_pd.f(),
                                                               n_p);
      RETURN_IF_ERR(cudaGetLastError());
      pa = ws_pd.f();
    }
    RETURN_IF_ERR(attn_scatter(s, vm, sq, sk, dvd, 1.f, pa, dO, dv, tf32));
  }
  if (!dq && !dk && !ds_out) return cudaSuccess;
  if (fill && !fill_strides) return cudaErrorInvalidValue;
  if (!dq && !dk) fill = nullptr;  // only dQ and dK read the zeroed dS
  FillMap fm;
  if (fill) {
    fm.nd = nd;
    for (int j = 0; j < nd; ++j) fm.dims[j] = qdims[j], fm.strides[j] = fill_strides[j];
    fm.sq = sq, fm.row = fill_strides[nd], fm.col = fill_strides[nd + 1];
  }
  float* ds = ds_out;
  if (!ds) {
    RETURN_IF_ERR(ws.alloc(static_cast<size_t>(n_p) * sizeof(float)));
    ds = ws.f();
  }
  // the dS dQ and dK read: fill-zeroed, in place unless dS is an output (not zeroed) too
  float* dsg = ds;
  Scratch ws_m(s);
  if (fill && ds_out && (dq || dk)) {
    RETURN_IF_ERR(ws_m.alloc(static_cast<size_t>(n_p) * sizeof(float)));
    dsg = ws_m.f();
  }
  RETURN_IF_ERR(attn_gather(s, vm, true, sq, sk, dvd, 1.f, dO, v, ds, tf32));  // dPd = dO V^T
  if (sk > 0) {
    const int block = sk >= 512 ? 256 : 128;
    softmax_bwd_rows<<<static_cast<unsigned>(b * sq), block, 0, s>>>(ds, p, mask, keep, sk, dsg,
                                                                     fill, fm, fill_kept);
    RETURN_IF_ERR(cudaGetLastError());
  }
  if (dq)  // dQ = scale_q dSm K (K as [sk,d])
    RETURN_IF_ERR(attn_gather(s, km, k_transposed != 0, sq, d, sk, scale_q, dsg, k, dq, tf32));
  if (dk) {
    if (!k_transposed)  // dK[sk,d] = scale_k sum_group dSm^T Q
      RETURN_IF_ERR(attn_scatter(s, km, sq, sk, d, scale_k, dsg, q, dk, tf32));
    else  // dK[d,sk] = scale_k sum_group Q^T dSm
      RETURN_IF_ERR(attn_scatter(s, km, sq, d, sk, scale_k, q, dsg, dk, tf32));
  }
  return cudaGetLastError();
}
