// AttentionGrad: attributes and input checks (see attention_inputs.h).
#include "attention_inputs.h"

#include <string>

namespace fusecli {

// ---- AttentionGrad -------------------------------------------------------------------------
void check_attn_attrs(const AttnAttrs& a) {
  FUSECLI_CHECK(
      a.dropout_ratio >= 0.f && a.dropout_ratio < 1.f,
      "AttentionGrad: dropout_ratio must be in [0, 1), got " + std::to_string(a.dropout_ratio));
}

static std::string dims_str(const int64_t* d, size_t n) {
  std::string s = "[";
  for (size_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// K's (or V's) batch dims against P's: any layout with P's batch count of [rows, cols]
// matrices (as before grouping existed), else the contract's grouping rule.
static KvMap attn_kv_map(const std::vector<int64_t>& pshape, const In& t, int64_t rows,
                         int64_t cols, const char* what) {
  const size_t nq = pshape.size() - 2, nk = t.shape.size() - 2;
  FUSECLI_CHECK(nq <= static_cast<size_t>(kAttnMaxBatchDims),
                "AttentionGrad: at most 8 batch dims are supported");
  KvMap m;
  m.nd = static_cast<int>(nq);
  for (size_t j = 0; j < nq; ++j) m.q[j] = m.kv[j] = pshape[j];
  if (t.numel() == prod(pshape, 0, nq) * rows * cols) return m;
  FUSECLI_CHECK(t.shape[nk] == rows && t.shape[nk + 1] == cols,
                std::string("AttentionGrad: ") + what + " must be [..., " + std::to_string(rows) +
                    ", " + std::to_string(cols) + "] (from P, Q and dO), got " +
                    dims_str(t.shape.data(), t.shape.size()));
  bool fits = nk <= nq;
  for (size_t j = 0; fits && j < nq; ++j) {
    m.kv[j] = j + nk < nq ? 1 : t.shape[j + nk - nq];
    fits = m.kv[j] == m.q[j] || (m.kv[j] >= 1 && m.q[j] % m.kv[j] == 0);
  }
  FUSECLI_CHECK(fits, std::string("AttentionGrad: ") + what + "'s batch dims " +
                          dims_str(t.shape.data(), nk) + " must equal or divide P's " +
                          dims_str(pshape.data(), nq) +
                          " dim by dim (grouped / multi-query attention: kv index = query index "
                          "// (Hq / Hkv))");
  return m;
}

AttnInputs::AttnInputs(Ort::KernelContext& ctx, const AttnAttrs& a)
    : dO(get_input(ctx, 0)),
      q(get_input(ctx, 1)),
      k(get_input(ctx, 2)),
      v(get_input(ctx, 3)),
      p(get_input(ctx, 4)),
      qs(get_input(ctx, 5)),
      ks(get_input(ctx, 6)),
      mask(get_input(ctx, 7)),
      fill(get_input(ctx, 8)) {
  for (const In* t : {&dO, &q, &k, &v, &p})
    FUSECLI_CHECK(t->shape.size() >= 2, "AttentionGrad: every input needs rank >= 2");
  FUSECLI_CHECK((!qs.present || qs.numel() == 1) && (!ks.present || ks.numel() == 1),
                "AttentionGrad: q_scale and k_scale must be scalars");
  const size_t r = p.shape.size();
  Sq = p.shape[r - 2], Sk = p.shape[r - 1], D = q.shape.back(), Dv = v.shape.back();
  B = prod(p.shape, 0, r - 2);
  FUSECLI_CHECK(q.numel() == B * Sq * D, "AttentionGrad: Q must be [..., Sq, D] matching P");
  FUSECLI_CHECK(dO.numel() == B * Sq * Dv, "AttentionGrad: dO must be [..., Sq, Dv]");
  const int64_t k0 = k.shape[k.shape.size() - 2], k1 = k.shape.back();
  if (a.k_transposed)
    FUSECLI_CHECK(k0 == D && k1 == Sk, "AttentionGrad: K must be [..., D, Sk] (k_transposed=1)");
  else
    FUSECLI_CHECK(k0 == Sk && k1 == D, "AttentionGrad: K must be [..., Sk, D]");
  kmap = attn_kv_map(p.shape, k, k0, k1, "K");
  vmap = attn_kv_map(p.shape, v, Sk, Dv, "V");
  if (mask.present)
    FUSECLI_CHECK(mask.shape == p.shape,
                  "AttentionGrad: dropout_mask must be bool with P's shape " +
                      dims_str(p.shape.data(), r) + ", got " +
                      dims_str(mask.shape.data(), mask.shape.size()));
  else
    FUSECLI_CHECK(a.dropout_ratio == 0.f,
                  "AttentionGrad: dropout_ratio is set but the dropout_mask input is absent");
  if (fill.present) {  // broadcastable to P's shape (right-aligned): strides, 0 where broadcast
    const size_t nf = fill.shape.size();
    bool fits = nf <= r;
    fill_strides.assign(r, 0);
    int64_t st = 1;
    for (size_t i = 0; fits && i < nf; ++i) {
      const size_t jf = nf - 1 - i, jp = r - 1 - i;
      fits = fill.shape[jf] == p.shape[jp] || fill.shape[jf] == 1;
      fill_strides[jp] = fill.shape[jf] == 1 ? 0 : st;
      st *= fill.shape[jf];
    }
    FUSECLI_CHECK(fits, "AttentionGrad: fill_mask " +
                            dims_str(fill.shape.data(), fill.shape.size()) +
                            " must broadcast to P's shape " + dims_str(p.shape.data(), r));
  }
}

}  // namespace fusecli
