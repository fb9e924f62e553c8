// AttentionGrad's grouped / multi-query batch mapping (fusecli/ops/contracts.yaml), shared by
// the CPU kernel (host) and the CUDA kernels (host and device): plain C++, no onnxruntime.
//
// The query side (dO, Q, P) has batch dims q[0..nd); K (or V) has kv[0..nd) (left-padded with
// 1s), each kv[j] equal to q[j] or dividing it. Query index i_j uses kv index i_j / (q[j]/kv[j]):
// size 1 is a plain broadcast (multi-query), size Hkv with q[j] = g*Hkv is repeat_kv's grouping.
#ifndef FUSECLI_ATTN_BATCH_H_
#define FUSECLI_ATTN_BATCH_H_

#include <stdint.h>

#ifdef __CUDACC__
#define FUSECLI_HD __host__ __device__
#else
#define FUSECLI_HD
#endif

namespace fusecli {

constexpr int kAttnMaxBatchDims = 8;

struct KvMap {
  int nd = 0;                          // batch dims (0: one item)
  int64_t q[kAttnMaxBatchDims] = {};   // query-side sizes
  int64_t kv[kAttnMaxBatchDims] = {};  // K- or V-side sizes (each equal to q[j] or dividing it)

  FUSECLI_HD int64_t q_items() const {
    int64_t n = 1;
    for (int j = 0; j < nd; ++j) n *= q[j];
    return n;
  }
  FUSECLI_HD int64_t kv_items() const {
    int64_t n = 1;
    for (int j = 0; j < nd; ++j) n *= kv[j];
    return n;
  }
  // How many query items share one kv item (the product of q[j]/kv[j]).
  FUSECLI_HD int64_t group() const {
    int64_t n = 1;
    for (int j = 0; j < nd; ++j) n *= kv[j] ? q[j] / kv[j] : 0;
    return n;
  }
  // The kv item of query item b (flat, row-major).
  FUSECLI_HD int64_t kv_of(int64_t b) const {
    int64_t out = 0, stride = 1;
    for (int j = nd - 1; j >= 0; --j) {
      const int64_t i = b % q[j];
      b /= q[j];
      out += (i / (q[j] / kv[j])) * stride;
      stride *= kv[j];
    }
    return out;
  }
  // The t-th (0 <= t < group()) query item that uses kv item c.
  FUSECLI_HD int64_t member(int64_t c, int64_t t) const {
    int64_t out = 0, stride = 1;
    for (int j = nd - 1; j >= 0; --j) {
      const int64_t r = q[j] / kv[j];
      const int64_t cj = c % kv[j], tj = t % r;
      c /= kv[j];
      t /= r;
      out += (cj * r + tj) * stride;
      stride *= q[j];
    }
    return out;
  }
  // Length of the runs of consecutive query items that share a kv item: the kv side's trailing
  // broadcast dims times the first grouped dim's ratio.
  FUSECLI_HD int64_t run() const {
    int64_t n = 1;
    for (int j = nd - 1; j >= 0; --j) {
      if (kv[j] == 1) {
        n *= q[j];
        continue;
      }
      n *= q[j] / kv[j];
      break;
    }
    return n;
  }
  // True when run r (items [r*run(), (r+1)*run())) uses kv item r for every r: the kv items
  // are consumed in order, one run each (no grouping, repeat_kv grouping, one shared kv head).
  FUSECLI_HD bool runs_in_order() const {
    const int64_t L = run();
    return L > 0 && q_items() == L * kv_items();
  }
};

}  // namespace fusecli

#endif  // FUSECLI_ATTN_BATCH_H_
