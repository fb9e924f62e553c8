// CPU kernels: AttentionGrad, ConvBnReluGrad; and add_cpu_ops.
#include <Eigen/Core>

#include "common.h"

namespace fusecli {

void add_cpu_ops_elementwise(Ort::CustomOpDomain& domain);

namespace {

constexpr auto kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
using Arr = Eigen::Array<float, Eigen::Dynamic, 1>;
using CA = Eigen::Map<const Arr>;
using MA = Eigen::Map<Arr>;

// ================================= AttentionGrad ============================================
struct AttnOp;
struct AttnKernel {
  AttnKernel(const OrtKernelInfo* info, const AttnOp*)
      : scale_q(attr_float(info, "scale_q", 1.f)),
        scale_k(attr_float(info, "scale_k", 1.f)),
        k_transposed(attr_int(info, "k_transposed", 0) != 0) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* c) { return guarded([&] { Compute(c); }); }
  void Compute(OrtKernelContext* c);
  float scale_q, scale_k;
  bool k_transposed;
};
struct AttnOp : OpBase<AttnOp, AttnKernel> {
  AttnOp() : OpBase("AttentionGrad", nullptr) {}
  size_t GetInputTypeCount() const { return 7; }
  ONNXTensorElementDataType GetInputType(size_t) const { return kF32; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 5 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL  // q/k_scale
                  : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return kF32; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t) const {
    return OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL;
  }
};

void AttnKernel::Compute(OrtKernelContext* c) {
  count_call(kAttentionGrad);
  Ort::KernelContext ctx(c);
  In dO = get_input(ctx, 0), q = get_input(ctx, 1), k = get_input(ctx, 2), v = get_input(ctx, 3),
     p = get_input(ctx, 4), qs = get_input(ctx, 5), ks = get_input(ctx, 6);
  for (const In* t : {&dO, &q, &k, &v, &p})
    FUSECLI_CHECK(t->shape.size() >= 2, "AttentionGrad: every input needs rank >= 2");
  FUSECLI_CHECK((!qs.present || qs.numel() == 1) && (!ks.present || ks.numel() == 1),
                "AttentionGrad: q_scale and k_scale must be scalars");
  const float scale_q = this->scale_q * (qs.present ? qs.ptr<float>()[0] : 1.f);
  const float scale_k = this->scale_k * (ks.present ? ks.ptr<float>()[0] : 1.f);
  const size_t r = p.shape.size();
  const int64_t Sq = p.shape[r - 2], Sk = p.shape[r - 1];
  const int64_t D = q.shape.back(), Dv = v.shape.back();
  const int64_t B = prod(p.shape, 0, r - 2);
  FUSECLI_CHECK(q.numel() == B * Sq * D, "AttentionGrad: Q must be [..., Sq, D] matching P");
  FUSECLI_CHECK(dO.numel() == B * Sq * Dv, "AttentionGrad: dO must be [..., Sq, Dv]");
  FUSECLI_CHECK(v.numel() == B * Sk * Dv, "AttentionGrad: V must be [..., Sk, Dv]");
  FUSECLI_CHECK(k.numel() == B * Sk * D, "AttentionGrad: K must be [..., Sk, D] or [..., D, Sk]");
  if (k_transposed)
    FUSECLI_CHECK(k.shape[k.shape.size() - 2] == D && k.shape.back() == Sk, "AttentionGrad: K must be [..., D, Sk] (k_transposed=1)");
  else
    FUSECLI_CHECK(k.shape[k.shape.size() - 2] == Sk && k.shape.back() == D, "AttentionGrad: K must be [..., Sk, D]");

  bool want_dq, want_dk, want_dv;
  float* dq = output_or_null<float>(ctx, 0, q.shape, &want_dq);
  float* dk = output_or_null<float>(ctx, 1, k.shape, &want_dk);
  float* dv = output_or_null<float>(ctx, 2, v.shape, &want_dv);
  if (B == 0) return;
  const float* dOp = dO.ptr<float>();
  const float* qp = q.ptr<float>();
  const float* kp = k.ptr<float>();
  const float* vp = v.ptr<float>();
  const float* pp = p.ptr<float>();

  const int T = num_threads();
  const bool outer = B >= T;  // parallel over batch items, else parallel inside the GEMMs
  const int inner_threads = outer ? 1 : T;
  const bool need_ds = want_dq || want_dk;
  parallel_for(B, 1, [&](int, int64_t b0, int64_t b1) {
    std::vector<float> ds(need_ds ? static_cast<size_t>(Sq * Sk) : 0);
    for (int64_t b = b0; b < b1; ++b) {
      const float* dOb = dOp + b * Sq * Dv;
      const float* qb = qp + b * Sq * D;
      const float* kb = kp + b * Sk * D;
      const float* vb = vp + b * Sk * Dv;
      const float* pb = pp + b * Sq * Sk;
      if (want_dv)  // dV[Sk,Dv] = P^T dO
        gemm(true, false, Sk, Dv, Sq, 1.f, pb, Sk, dOb, Dv, 0.f, dv + b * Sk * Dv, Dv, inner_threads);
      if (!need_ds) continue;
      // dP[Sq,Sk] = dO V^T, then dS = P * (dP - rowsum(dP * P)) in place.
      gemm(false, true, Sq, Sk, Dv, 1.f, dOb, Dv, vb, Dv, 0.f, ds.data(), Sk, inner_threads);
      for (int64_t i = 0; i < Sq; ++i) {
        MA d(ds.data() + i * Sk, Sk);
        CA pr(pb + i * Sk, Sk);
        const float rs = (d * pr).sum();
        d = pr * (d - rs);
      }
      if (want_dq) {  // dQ[Sq,D] = scale_q dS K   (K as [Sk, D])
        gemm(false, k_transposed, Sq, D, Sk, scale_q, ds.data(), Sk, kb, k_transposed ? Sk : D, 0.f,
             dq + b * Sq * D, D, inner_threads);
      }
      if (want_dk) {
        if (!k_transposed)  // dK[Sk,D] = scale_k dS^T Q
          gemm(true, false, Sk, D, Sq, scale_k, ds.data(), Sk, qb, D, 0.f, dk + b * Sk * D, D, inner_threads);
        else  // dK[D,Sk] = scale_k Q^T dS
          gemm(true, false, D, Sk, Sq, scale_k, qb, D, ds.data(), Sk, 0.f, dk + b * Sk * D, Sk, inner_threads);
      }
    }
  }, outer ? T : 1);
}

// ================================= ConvBnReluGrad ===========================================
struct ConvOp;
struct ConvKernel {
  ConvKernel(const OrtKernelInfo* info, const ConvOp*)
      : strides(attr_ints(info, "strides", {1, 1})),
        pads(attr_ints(info, "pads", {0, 0, 0, 0})),
        dilations(attr_ints(info, "dilations", {1, 1})),
        group(attr_int(info, "group", 1)),
        relu(attr_int(info, "relu", 1) != 0) {
    FUSECLI_CHECK(strides.size() == 2 && pads.size() == 4 && dilations.size() == 2,
                  "ConvBnReluGrad: strides/dilations need 2 values, pads 4 (2-D convolutions only)");
    FUSECLI_CHECK(group >= 1, "ConvBnReluGrad: group must be >= 1");
  }
  OrtStatusPtr ComputeV2(OrtKernelContext* c) { return guarded([&] { Compute(c); }); }
  void Compute(OrtKernelContext* c);
  std::vector<int64_t> strides, pads, dilations;
  int64_t group;
  bool relu;
};
struct ConvOp : OpBase<ConvOp, ConvKernel> {
  ConvOp() : OpBase("ConvBnReluGrad", nullptr) {}
  size_t GetInputTypeCount() const { return 8; }
  ONNXTensorElementDataType GetInputType(size_t) const { return kF32; }
  size_t GetOutputTypeCount() const { return 5; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return kF32; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t) const {
    return OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL;
  }
};

struct ConvGeom {
  int64_t cin_g, hin, win, kh, kw, ho, wo, sh, sw, pt, pl, dh, dw;
};

// cols[(ci*kh + i)*kw + j][oh*wo + ow] = x[ci][oh*sh - pt + i*dh][ow*sw - pl + j*dw] (0 outside)
static void im2col(const float* x, const ConvGeom& g, float* cols) {
  const int64_t hw = g.ho * g.wo;
  for (int64_t ci = 0; ci < g.cin_g; ++ci)
    for (int64_t i = 0; i < g.kh; ++i)
      for (int64_t j = 0; j < g.kw; ++j) {
        float* dst = cols + ((ci * g.kh + i) * g.kw + j) * hw;
        const float* src = x + ci * g.hin * g.win;
        for (int64_t oh = 0; oh < g.ho; ++oh) {
          const int64_t ih = oh * g.sh - g.pt + i * g.dh;
          float* drow = dst + oh * g.wo;
          if (ih < 0 || ih >= g.hin) {
            std::fill(drow, drow + g.wo, 0.f);
            continue;
          }
          const float* srow = src + ih * g.win;
          for (int64_t ow = 0; ow < g.wo; ++ow) {
            const int64_t iw = ow * g.sw - g.pl + j * g.dw;
            drow[ow] = (iw >= 0 && iw < g.win) ? srow[iw] : 0.f;
          }
        }
      }
}

// dx[ci][ih][iw] += cols[...] (dx pre-zeroed)
static void col2im(const float* cols, const ConvGeom& g, float* dx) {
  const int64_t hw = g.ho * g.wo;
  for (int64_t ci = 0; ci < g.cin_g; ++ci)
    for (int64_t i = 0; i < g.kh; ++i)
      for (int64_t j = 0; j < g.kw; ++j) {
        const float* src = cols + ((ci * g.kh + i) * g.kw + j) * hw;
        float* dst = dx + ci * g.hin * g.win;
        for (int64_t oh = 0; oh < g.ho; ++oh) {
          const int64_t ih = oh * g.sh - g.pt + i * g.dh;
          if (ih < 0 || ih >= g.hin) continue;
          const float* srow = src + oh * g.wo;
          float* drow = dst + ih * g.win;
          for (int64_t ow = 0; ow < g.wo; ++ow) {
            const int64_t iw = ow * g.sw - g.pl + j * g.dw;
            if (iw >= 0 && iw < g.win) drow[iw] += srow[ow];
          }
        }
      }
}

void ConvKernel::Compute(OrtKernelContext* c) {
  count_call(kConvBnReluGrad);
  Ort::KernelContext ctx(c);
  In dy = get_input(ctx, 0), y = get_input(ctx, 1), x = get_input(ctx, 2), w = get_input(ctx, 3),
     cv = get_input(ctx, 4), gamma = get_input(ctx, 5), mean = get_input(ctx, 6),
     istd = get_input(ctx, 7);
  FUSECLI_CHECK(dy.shape.size() == 4 && x.shape.size() == 4 && w.shape.size() == 4,
                "ConvBnReluGrad: dY, X and W must be 4-D");
  const int64_t N = dy.shape[0], C = dy.shape[1], H = dy.shape[2], Wd = dy.shape[3];
  const int64_t Cin = x.shape[1], Hin = x.shape[2], Win = x.shape[3];
  const int64_t kh = w.shape[2], kw = w.shape[3];
  FUSECLI_CHECK(x.shape[0] == N, "ConvBnReluGrad: batch of X and dY differ");
  FUSECLI_CHECK(y.numel() == dy.numel() && cv.numel() == dy.numel(), "ConvBnReluGrad: Y/Cv must match dY");
  FUSECLI_CHECK(gamma.numel() == C && mean.numel() == C && istd.numel() == C, "ConvBnReluGrad: gamma/mean/inv_std must be [C]");
  FUSECLI_CHECK(C % group == 0 && Cin % group == 0, "ConvBnReluGrad: channels not divisible by group");
  FUSECLI_CHECK(w.shape[0] == C && w.shape[1] == Cin / group, "ConvBnReluGrad: W must be [C, Cin/group, kh, kw]");
  ConvGeom g{Cin / group, Hin, Win, kh, kw, H, Wd, strides[0], strides[1], pads[0], pads[1],
             dilations[0], dilations[1]};
  const int64_t eho = (Hin + pads[0] + pads[2] - dilations[0] * (kh - 1) - 1) / strides[0] + 1;
  const int64_t ewo = (Win + pads[1] + pads[3] - dilations[1] * (kw - 1) - 1) / strides[1] + 1;
  FUSECLI_CHECK(eho == H && ewo == Wd, "ConvBnReluGrad: dY spatial size does not match the convolution");

  bool want_dx, want_dw, want_dbc, want_dg, want_db;
  float* dx = output_or_null<float>(ctx, 0, x.shape, &want_dx);
  float* dw = output_or_null<float>(ctx, 1, w.shape, &want_dw);
  float* dbc = output_or_null<float>(ctx, 2, {C}, &want_dbc);
  float* dgo = output_or_null<float>(ctx, 3, {C}, &want_dg);
  float* dbo = output_or_null<float>(ctx, 4, {C}, &want_db);

  const int64_t HW = H * Wd;
  const double R = static_cast<double>(N * HW);
  const float* dyp = dy.ptr<float>();
  const float* yp = y.ptr<float>();
  const float* cvp = cv.ptr<float>();
  const float* gp = gamma.ptr<float>();
  const float* mp = mean.ptr<float>();
  const float* sp = istd.ptr<float>();
  const bool need_dc = want_dx || want_dw || want_dbc;
  std::vector<float> dc(need_dc ? static_cast<size_t>(N * C * HW) : 0);
  std::vector<float> dgam(C), dbet(C), dbias(C);

  // ---- BN + ReLU backward: two passes per channel ----
  parallel_for(C, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, N * HW)),
               [&](int, int64_t c0, int64_t c1) {
    std::vector<float> dzb(HW), xhb(HW);
    MA dz(dzb.data(), HW), xh(xhb.data(), HW);
    for (int64_t ch = c0; ch < c1; ++ch) {
      const float mu = mp[ch], is = sp[ch];
      float sdz = 0.f, sdzx = 0.f;
      for (int64_t n = 0; n < N; ++n) {
        const int64_t off = (n * C + ch) * HW;
        CA d(dyp + off, HW), yy(yp + off, HW), cc(cvp + off, HW);
        if (relu) dz = (yy > 0.f).select(d, 0.f);
        else dz = d;
        xh = (cc - mu) * is;
        sdz += dz.sum();
        sdzx += (dz * xh).sum();
      }
      dbet[ch] = sdz;
      dgam[ch] = sdzx;
      if (!need_dc) continue;
      const float coef = static_cast<float>(gp[ch] * is / R);
      const float rf = static_cast<float>(R);
      float sdc = 0.f;
      for (int64_t n = 0; n < N; ++n) {
        const int64_t off = (n * C + ch) * HW;
        CA d(dyp + off, HW), yy(yp + off, HW), cc(cvp + off, HW);
        MA o(dc.data() + off, HW);
        if (relu) dz = (yy > 0.f).select(d, 0.f);
        else dz = d;
        o = coef * (rf * dz - sdz - (cc - mu) * is * sdzx);
        sdc += o.sum();
      }
      dbias[ch] = sdc;
    }
  });
  if (want_dg) std::copy(dgam.begin(), dgam.end(), dgo);
  if (want_db) std::copy(dbet.begin(), dbet.end(), dbo);
  if (want_dbc) std::copy(dbias.begin(), dbias.end(), dbc);
  if (!want_dx && !want_dw) return;

  // ---- conv dgrad (col2im of W^T dC) and wgrad (dC im2col(X)^T), per (image, group) ----
  const int64_t Cg = C / group, Kc = g.cin_g * kh * kw;
  const bool pointwise = kh == 1 && kw == 1 && g.sh == 1 && g.sw == 1 && pads[0] == 0 &&
                         pads[1] == 0 && pads[2] == 0 && pads[3] == 0 && Hin == H && Win == Wd;
  const int64_t tasks = N * group;
  const int T = num_threads();
  const int outer_t = planned_threads(tasks, 1);
  const int inner_t = tasks >= T ? 1 : T;
  std::vector<float> dw_part(want_dw ? static_cast<size_t>(outer_t * C * Kc) : 0, 0.f);
  if (want_dx) std::fill(dx, dx + x.numel(), 0.f);
  const float* xp = x.ptr<float>();
  const float* wp = w.ptr<float>();
  parallel_for(tasks, 1, [&](int t, int64_t t0, int64_t t1) {
    std::vector<float> cols(pointwise ? 0 : static_cast<size_t>(Kc * HW));
    std::vector<float> gcols(pointwise || !want_dx ? 0 : static_cast<size_t>(Kc * HW));
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t n = task / group, gi = task % group;
      const float* dcg = dc.data() + (n * C + gi * Cg) * HW;  // [Cg, HW]
      const float* xg = xp + (n * Cin + gi * g.cin_g) * Hin * Win;
      const float* wg = wp + gi * Cg * Kc;  // [Cg, Kc]
      if (want_dw) {
        const float* colp = xg;
        if (!pointwise) {
          im2col(xg, g, cols.data());
          colp = cols.data();
        }
        // dW_g[Cg, Kc] += dC_g[Cg, HW] cols^T[HW, Kc]
        gemm(false, true, Cg, Kc, HW, 1.f, dcg, HW, colp, HW, 1.f,
             dw_part.data() + (static_cast<int64_t>(t) * C + gi * Cg) * Kc, Kc, inner_t);
      }
      if (want_dx) {
        float* dxg = dx + (n * Cin + gi * g.cin_g) * Hin * Win;
        if (pointwise) {  // dX_g[Cin_g, HW] = W_g^T dC_g
          gemm(true, false, Kc, HW, Cg, 1.f, wg, Kc, dcg, HW, 0.f, dxg, HW, inner_t);
        } else {
          gemm(true, false, Kc, HW, Cg, 1.f, wg, Kc, dcg, HW, 0.f, gcols.data(), HW, inner_t);
          col2im(gcols.data(), g, dxg);
        }
      }
    }
  }, outer_t);
  if (want_dw) {
    MA out(dw, C * Kc);
    out = CA(dw_part.data(), C * Kc);
    for (int t = 1; t < outer_t; ++t) out += CA(dw_part.data() + static_cast<int64_t>(t) * C * Kc, C * Kc);
  }
}

}  // namespace

void add_cpu_ops(Ort::CustomOpDomain& domain) {
  add_cpu_ops_elementwise(domain);
  static AttnOp attn;
  static ConvOp conv;
  domain.Add(&attn);
  domain.Add(&conv);
}

}  // namespace fusecli
