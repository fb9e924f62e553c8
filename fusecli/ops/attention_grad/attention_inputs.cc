// AttentionGrad: attributes and input checks (see attention_inputs.h).
#include "attention_inputs.h"

namespace fusecli {

// ---- AttentionGrad -------------------------------------------------------------------------
AttnAttrs::AttnAttrs(const OrtKernelInfo* info)
    : scale_q(attr_float(info, "scale_q", 1.f)),
      scale_k(attr_float(info, "scale_k", 1.f)),
      k_transposed(attr_int(info, "k_transposed", 0) != 0) {}

AttnInputs::AttnInputs(Ort::KernelContext& ctx, const AttnAttrs& a)
    : dO(get_input(ctx, 0)), q(get_input(ctx, 1)), k(get_input(ctx, 2)), v(get_input(ctx, 3)),
      p(get_input(ctx, 4)), qs(get_input(ctx, 5)), ks(get_input(ctx, 6)) {
  for (const In* t : {&dO, &q, &k, &v, &p})
    FUSECLI_CHECK(t->shape.size() >= 2, "AttentionGrad: every input needs rank >= 2");
  FUSECLI_CHECK((!qs.present || qs.numel() == 1) && (!ks.present || ks.numel() == 1),
                "AttentionGrad: q_scale and k_scale must be scalars");
  const size_t r = p.shape.size();
  Sq = p.shape[r - 2], Sk = p.shape[r - 1], D = q.shape.back(), Dv = v.shape.back();
  B = prod(p.shape, 0, r - 2);
  FUSECLI_CHECK(q.numel() == B * Sq * D, "AttentionGrad: Q must be [..., Sq, D] matching P");
  FUSECLI_CHECK(dO.numel() == B * Sq * Dv, "AttentionGrad: dO must be [..., Sq, Dv]");
  FUSECLI_CHECK(v.numel() == B * Sk * Dv, "AttentionGrad: V must be [..., Sk, Dv]");
  FUSECLI_CHECK(k.numel() == B * Sk * D, "AttentionGrad: K must be [..., Sk, D] or [..., D, Sk]");
  const int64_t k0 = k.shape[k.shape.size() - 2], k1 = k.shape.back();
  if (a.k_transposed)
    FUSECLI_CHECK(k0 == D && k1 == Sk, "AttentionGrad: K must be [..., D, Sk] (k_transposed=1)");
  else
    FUSECLI_CHECK(k0 == Sk && k1 == D, "AttentionGrad: K must be [..., Sk, D]");
}

}  // namespace fusecli
