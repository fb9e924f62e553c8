// FlashAttention / FlashAttentionGrad: shape checks (see flash_inputs.h).
#include "flash_inputs.h"

namespace fusecli {

static std::string dims_str(const std::vector<int64_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// Element strides of `t` broadcast (right-aligned) to `full` (0 for a broadcast dim), or
// throws OpError naming `what`.
static std::vector<int64_t> broadcast_strides(const In& t, const std::vector<int64_t>& full,
                                              const std::string& name, const char* what) {
  const size_t r = full.size(), nb = t.shape.size();
  bool ok = nb <= r;
  std::vector<int64_t> strides(r, 0);
  int64_t st = 1;
  for (size_t i = 0; ok && i < nb; ++i) {
    const size_t jb = nb - 1 - i, jf = r - 1 - i;
    ok = t.shape[jb] == full[jf] || t.shape[jb] == 1;
    strides[jf] = t.shape[jb] == 1 ? 0 : st;
    st *= t.shape[jb];
  }
  FUSECLI_CHECK(ok, name + ": " + what + " " + dims_str(t.shape) +
                        " must broadcast to the scores' shape " + dims_str(full));
  return strides;
}

FlashInputs::FlashInputs(Ort::KernelContext& ctx, int iq, int ik, int iv, int ibias, int imask,
                         int k_transposed, const char* op)
    : q(get_input(ctx, iq)), k(get_input(ctx, ik)), v(get_input(ctx, iv)) {
  if (ibias >= 0) bias = get_input(ctx, ibias);
  if (imask >= 0) mask = get_input(ctx, imask);
  const std::string name(op);
  for (const In* t : {&q, &k, &v})
    FUSECLI_CHECK(t->shape.size() >= 2, name + ": Q, K and V need rank >= 2");
  const size_t r = q.shape.size(), nd = r - 2;
  FUSECLI_CHECK(nd <= static_cast<size_t>(kAttnMaxBatchDims),
                name + ": at most 8 batch dims are supported");
  Sq = q.shape[r - 2], D = q.shape[r - 1];
  const size_t rk = k.shape.size();
  const int64_t k0 = k.shape[rk - 2], k1 = k.shape[rk - 1];
  Sk = k_transposed ? k1 : k0;
  FUSECLI_CHECK((k_transposed ? k0 : k1) == D,
                name + ": K must be [..., " + (k_transposed ? "D, Sk" : "Sk, D") + "] with Q's D " +
                    std::to_string(D) + ", got " + dims_str(k.shape));
  Dv = v.shape.back();
  FUSECLI_CHECK(v.shape[v.shape.size() - 2] == Sk,
                name + ": V must be [..., Sk, Dv] with K's Sk, got " + dims_str(v.shape));
  const size_t nk = rk - 2;
  FUSECLI_CHECK(
      v.shape.size() == rk && std::equal(k.shape.begin(), k.shape.begin() + nk, v.shape.begin()),
      name + ": V must have K's batch dims");
  kmap.nd = static_cast<int>(nd);
  bool fits = nk <= nd;
  for (size_t j = 0; fits && j < nd; ++j) {
    kmap.q[j] = q.shape[j];
    kmap.kv[j] = j + nk < nd ? 1 : k.shape[j + nk - nd];
    fits = kmap.kv[j] == kmap.q[j] || (kmap.kv[j] >= 1 && kmap.q[j] % kmap.kv[j] == 0);
  }
  FUSECLI_CHECK(fits, name + ": K's batch dims " + dims_str(k.shape) +
                          " must equal or divide Q's " + dims_str(q.shape) +
                          " dim by dim (grouped / multi-query attention)");
  B = kmap.q_items();
  std::vector<int64_t> full(q.shape.begin(), q.shape.end());  // [qdims..., Sq, Sk]
  full.back() = Sk;
  if (bias.present) bias_strides = broadcast_strides(bias, full, name, "bias");
  if (mask.present) {
    FUSECLI_CHECK(mask.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL, name + ": mask must be bool");
    mask_strides = broadcast_strides(mask, full, name, "mask");
  }
}

std::vector<int64_t> FlashInputs::o_shape() const {
  std::vector<int64_t> s(q.shape);
  s.back() = Dv;
  return s;
}

std::vector<int64_t> FlashInputs::lse_shape() const {
  return std::vector<int64_t>(q.shape.begin(), q.shape.end() - 1);
}

}  // namespace fusecli
