// FlashAttention / FlashAttentionGrad CUDA kernels: what both share (batch mapping, bias,
// block reductions). One thread block per query row (forward, dQ) or per key row (dK, dV):
// the scores of a tile of kFlashT keys (or query rows) are one per thread, the softmax state
// lives in shared memory and the D / Dv wide accumulators are split over the threads, so no
// Sq x Sk buffer exists on the device either.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "../attention_grad/attn_batch.h"
#include "cuda_common.cuh"

namespace fusecli_flash {

constexpr int kFlashT = 128;  // threads per block = keys (or query rows) per tile
constexpr float kSkipBias = -1e30f;
constexpr float kMaskedRow = -5e29f;

// Element conversions (float32, float16, bfloat16 inputs; math in float32).
__device__ __forceinline__ float fl_f(float v) {
  return v;
}
__device__ __forceinline__ float fl_f(__half v) {
  return __half2float(v);
}
__device__ __forceinline__ float fl_f(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <typename T> __device__ __forceinline__ T fl_to(float v);
template <> __device__ __forceinline__ float fl_to<float>(float v) {
  return v;
}
template <> __device__ __forceinline__ __half fl_to<__half>(float v) {
  return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 fl_to<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// The additive bias (element type T, read as float): entry (item b, row i, key j).
template <typename T> struct BiasT {
  const T* p = nullptr;
  int nd = 0;
  int64_t qdims[fusecli::kAttnMaxBatchDims] = {};
  int64_t strides[fusecli::kAttnMaxBatchDims + 2] = {};
  __device__ int64_t item(int64_t b) const {
    int64_t off = 0;
    for (int j = nd - 1; j >= 0; --j) {
      off += (b % qdims[j]) * strides[j];
      b /= qdims[j];
    }
    return off;
  }
  __device__ float at(int64_t item_off, int64_t i, int64_t j) const {
    return fl_f(p[item_off + i * strides[nd] + j * strides[nd + 1]]);
  }
};
using Bias = BiasT<float>;

template <typename T>
inline bool make_maps(int nd, const int64_t* qdims, const int64_t* kdims, const T* bias,
                      const int64_t* bias_strides, fusecli::KvMap* m, BiasT<T>* b) {
  if (nd < 0 || nd > fusecli::kAttnMaxBatchDims || (bias && !bias_strides)) return false;
  m->nd = b->nd = nd;
  b->p = bias;
  for (int j = 0; j < nd; ++j) {
    m->q[j] = b->qdims[j] = qdims[j];
    m->kv[j] = kdims[j];
    if (kdims[j] < 1 || qdims[j] % kdims[j] != 0) return false;
  }
  if (bias)
    for (int j = 0; j < nd + 2; ++j) b->strides[j] = bias_strides[j];
  return true;
}

// The bool mask (Where, see the contract): a filled position's score is replaced by `fill`
// (bias_first = 1, or no bias) or fill + bias (bias_first = 0). Only the float32-core kernels
// take it (a masked call never takes the tensor-core tiles).
struct Mask {
  const uint8_t* p = nullptr;
  int nd = 0;
  int64_t qdims[fusecli::kAttnMaxBatchDims] = {};
  int64_t strides[fusecli::kAttnMaxBatchDims + 2] = {};
  float fill = 0.f;
  int kept = 1, bias_first = 0;
  __device__ int64_t item(int64_t b) const {
    int64_t off = 0;
    for (int j = nd - 1; j >= 0; --j) {
      off += (b % qdims[j]) * strides[j];
      b /= qdims[j];
    }
    return off;
  }
  __device__ bool filled(int64_t item_off, int64_t i, int64_t j) const {
    return p && (p[item_off + i * strides[nd] + j * strides[nd + 1]] != 0) != (kept != 0);
  }
  // A filled position's score, given its bias bj (0 without a bias).
  __device__ float value(float bj, bool has_bias) const {
    return bias_first || !has_bias ? fill : fill + bj;
  }
};

inline bool make_mask(int nd, const int64_t* qdims, const uint8_t* mask,
                      const int64_t* mask_strides, float fill, int kept, int bias_first, Mask* m) {
  if (nd < 0 || nd > fusecli::kAttnMaxBatchDims || (mask && !mask_strides)) return false;
  m->p = mask;
  m->nd = nd;
  m->fill = fill;
  m->kept = kept;
  m->bias_first = bias_first;
  for (int j = 0; j < nd; ++j) m->qdims[j] = qdims[j];
  if (mask)
    for (int j = 0; j < nd + 2; ++j) m->strides[j] = mask_strides[j];
  return true;
}

// FUSECLI_FLASH_PATH=tc opts the float32 launchers into the tensor-core kernels (not yet run on a
// GPU); by default they take the one-row-per-block kernels.
inline bool flash_tc_enabled() {
  const char* e = std::getenv("FUSECLI_FLASH_PATH");
  return e && std::strcmp(e, "tc") == 0;
}

__device__ __forceinline__ float block_reduce(float v, float* red, bool is_max) {
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) red[wid] = v;
  __syncthreads();
  float r = red[0];
  for (int i = 1; i < (int)(blockDim.x >> 5); ++i) r = is_max ? fmaxf(r, red[i]) : r + red[i];
  return r;
}

// s = scale * q . k_j for key j of kv item c (K [Sk, D] or [D, Sk]), soft-capped to
// cap tanh(s / cap) when cap > 0 (the caller adds the bias).
template <typename T>
__device__ __forceinline__ float score(const T* q, const T* kc, int64_t j, int64_t sk, int64_t d,
                                       int kt, float scale, float cap = 0.f) {
  float acc = 0.f;
  if (kt)
    for (int64_t x = 0; x < d; ++x) acc += fl_f(q[x]) * fl_f(kc[x * sk + j]);
  else
    for (int64_t x = 0; x < d; ++x) acc += fl_f(q[x]) * fl_f(kc[j * d + x]);
  return cap > 0.f ? cap * tanhf(acc * scale / cap) : acc * scale;
}

// The soft cap's derivative at a capped score sc: 1 - (sc / cap)^2 (1 without a cap).
__device__ __forceinline__ float cap_grad(float sc, float cap) {
  return cap > 0.f ? 1.f - (sc / cap) * (sc / cap) : 1.f;
}

}  // namespace fusecli_flash
