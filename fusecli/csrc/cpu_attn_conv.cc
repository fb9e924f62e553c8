// CPU kernels: AttentionGrad, ConvBnReluGrad; and add_cpu_ops.
#include <Eigen/Core>

#include <chrono>
#include <cmath>
#include <memory>
#include <numeric>
#include <vector>

#include "common.h"

namespace fusecli {

void add_cpu_ops_elementwise(Ort::CustomOpDomain& domain);

namespace {

using Arr = Eigen::Array<float, Eigen::Dynamic, 1>;
using CA = Eigen::Map<const Arr>;
using MA = Eigen::Map<Arr>;

// ================================= AttentionGrad ============================================
struct AttnOp;
struct AttnKernel : AttnAttrs {
  AttnKernel(const OrtKernelInfo* info, const AttnOp*) : AttnAttrs(info), mm(info) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* c) { return guarded([&] { Compute(c); }); }
  void Compute(OrtKernelContext* c);
  OrtMatMul mm;
};
struct AttnOp : SigOp<AttnOp, AttnKernel, kAttentionGradSig> {
  AttnOp() : SigOp("AttentionGrad", nullptr) {}
};

// Runs of consecutive query items [b, b + n) that share the kv item `kv`.
struct Seg {
  int64_t b, n, kv;
};
void kv_segments(const KvMap& m, int64_t b0, int64_t nb, std::vector<Seg>& out) {
  out.clear();
  const int64_t L = std::max<int64_t>(1, m.run());
  for (int64_t b = b0; b < b0 + nb;) {
    const int64_t e = std::min(b0 + nb, (b / L + 1) * L);
    const int64_t kv = m.kv_of(b);
    if (!out.empty() && out.back().kv == kv) out.back().n += e - b;
    else out.push_back({b, e - b, kv});
    b = e;
  }
}
// Every segment has the first one's length and they use consecutive kv items: one batched GEMM.
bool batchable(const std::vector<Seg>& s) {
  for (size_t i = 1; i < s.size(); ++i)
    if (s[i].n != s[0].n || s[i].kv != s[0].kv + static_cast<int64_t>(i)) return false;
  return true;
}

// c[b] = a[b] op(w[kv(b)]) for the items of segs (b0 = the item a and c point at):
// a per item [rows, k], c per item [rows, n], w per kv item [k, n] (stored [n, k] when tw).
// A segment of items sharing one kv item is one GEMM of segment * rows rows.
void gemm_gather(const OrtMatMul& mm, const OrtKernelContext* kc, const std::vector<Seg>& segs,
                 int64_t b0, bool tw, int64_t rows, int64_t n, int64_t k, const float* a,
                 const float* w, float* c) {
  auto off = [&](const Seg& s, int64_t per) { return (s.b - b0) * rows * per; };
  if (batchable(segs)) {
    const Seg& s = segs[0];
    mm.run(kc, false, tw, static_cast<int64_t>(segs.size()), s.n * rows, n, k, a + off(s, k),
           w + s.kv * k * n, c + off(s, n));
    return;
  }
  for (const Seg& s : segs)
    mm.run(kc, false, tw, 1, s.n * rows, n, k, a + off(s, k), w + s.kv * k * n, c + off(s, n));
}

// out[kv] = sum over the items b of kv's group of a[b]^T x[b]: a per item [rows, m], x per item
// [rows, n], out per kv item [m, n]. A segment is one GEMM over segment * rows rows; the first
// contribution to a kv item is written in place, later ones (a group split over chunks, or kv
// items shared by non-adjacent query items) go through one [m, n] scratch and are added.
void gemm_scatter(const OrtMatMul& mm, const OrtKernelContext* kc, const std::vector<Seg>& segs,
                  int64_t b0, int64_t rows, int64_t m, int64_t n, const float* a, const float* x,
                  float* out, std::vector<char>& touched, std::vector<float>& tmp) {
  auto at = [&](const Seg& s, const float* base, int64_t per) { return base + (s.b - b0) * rows * per; };
  bool fresh = true;
  for (const Seg& s : segs) fresh = fresh && !touched[s.kv];
  if (fresh && batchable(segs)) {
    const Seg& s = segs[0];
    mm.run(kc, true, false, static_cast<int64_t>(segs.size()), m, n, s.n * rows, at(s, a, m),
           at(s, x, n), out + s.kv * m * n);
    for (const Seg& t : segs) touched[t.kv] = 1;
    return;
  }
  for (const Seg& s : segs) {
    float* dst = out + s.kv * m * n;
    if (!touched[s.kv]) {
      mm.run(kc, true, false, 1, m, n, s.n * rows, at(s, a, m), at(s, x, n), dst);
      touched[s.kv] = 1;
      continue;
    }
    tmp.resize(static_cast<size_t>(m * n));
    mm.run(kc, true, false, 1, m, n, s.n * rows, at(s, a, m), at(s, x, n), tmp.data());
    MA(dst, m * n) += CA(tmp.data(), m * n);
  }
}

void AttnKernel::Compute(OrtKernelContext* c) {
  PoolScope pool(c);
  count_call(kAttentionGrad);
  Ort::KernelContext ctx(c);
  const AttnInputs in(ctx, *this);
  const In &dO = in.dO, &q = in.q, &k = in.k, &v = in.v, &p = in.p;
  const int64_t B = in.B, Sq = in.Sq, Sk = in.Sk, D = in.D, Dv = in.Dv;
  const KvMap &km = in.kmap, &vm = in.vmap;
  const float scale_q = this->scale_q * (in.qs.present ? in.qs.ptr<float>()[0] : 1.f);
  const float scale_k = this->scale_k * (in.ks.present ? in.ks.ptr<float>()[0] : 1.f);

  bool want_dq, want_dk, want_dv, want_ds;
  float* dq = output_or_null<float>(ctx, 0, q.shape, &want_dq);
  float* dk = output_or_null<float>(ctx, 1, k.shape, &want_dk);
  float* dv = output_or_null<float>(ctx, 2, v.shape, &want_dv);
  float* ds_out = output_or_null<float>(ctx, 3, p.shape, &want_ds);
  if (B == 0 || Sq == 0) {  // no query rows: the group sums are empty
    if (want_dk) std::fill(dk, dk + k.numel(), 0.f);
    if (want_dv) std::fill(dv, dv + v.numel(), 0.f);
    return;
  }
  const float* dOp = dO.ptr<float>();
  const float* qp = q.ptr<float>();
  const float* kp = k.ptr<float>();
  const float* vp = v.ptr<float>();
  const float* pp = p.ptr<float>();
  const uint8_t* maskp = in.mask.present ? in.mask.ptr<uint8_t>() : nullptr;
  const float keep = 1.f / (1.f - dropout_ratio);  // the kept probabilities' factor

  const OrtKernelContext* kc = ctx.GetOrtKernelContext();
  const bool need_ds = want_dq || want_dk || want_ds;
  // dS is stored pre-multiplied by f (= scale_q unless dS is an output, or scale_q is 0 or not
  // finite), so dQ needs no extra pass and dK one only when scale_k != scale_q.
  const float f = (!want_ds && std::fabs(scale_q) >= 1e-20f && std::fabs(scale_q) <= 1e20f) ? scale_q : 1.f;
  // Batch items go in chunks whose dS scratch (~2 MiB) stays in cache between the dP GEMM, the
  // softmax-backward pass and the dQ / dK GEMMs; each GEMM is one batched onnxruntime MatMul
  // (a run of query items sharing a kv item is one GEMM of its stacked rows; chunks hold whole
  // runs when one fits, so grouped K / V need no per-head copies).
  const int64_t item = Sq * Sk;
  int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(B, (int64_t(1) << 19) / std::max<int64_t>(1, item)));
  const int64_t lk = std::max<int64_t>(1, km.run()), lv = std::max<int64_t>(1, vm.run());
  const int64_t runs = lk / std::gcd(lk, lv) * lv;
  if (runs <= chunk) chunk = chunk / runs * runs;
  std::unique_ptr<float[]> ds(need_ds && !want_ds ? new float[static_cast<size_t>(chunk * item)] : nullptr);
  std::unique_ptr<float[]> pd(maskp && want_dv ? new float[static_cast<size_t>(chunk * item)] : nullptr);
  std::vector<char> k_touched(want_dk ? km.kv_items() : 0), v_touched(want_dv ? vm.kv_items() : 0);
  std::vector<float> tmp;
  std::vector<Seg> ksegs, vsegs;
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(1, Sk));
  for (int64_t b0 = 0; b0 < B; b0 += chunk) {
    const int64_t nb = std::min(chunk, B - b0);
    kv_segments(km, b0, nb, ksegs);
    kv_segments(vm, b0, nb, vsegs);
    const float* dOb = dOp + b0 * Sq * Dv;
    const float* qb = qp + b0 * Sq * D;
    const float* pb = pp + b0 * item;
    const uint8_t* mb = maskp ? maskp + b0 * item : nullptr;
    const int64_t rows = nb * Sq;
    if (want_dv) {  // dV = sum_group Pd^T dO
      const float* pa = pb;
      if (mb) {
        parallel_for(rows, grain, [&](int, int64_t r0, int64_t r1) {
          const int64_t o = r0 * Sk, len = (r1 - r0) * Sk;
          MA(pd.get() + o, len) = CA(pb + o, len) * Eigen::Map<const Eigen::Array<uint8_t, Eigen::Dynamic, 1>>(mb + o, len).cast<float>() * keep;
        });
        pa = pd.get();
      }
      gemm_scatter(mm, kc, vsegs, b0, Sq, Sk, Dv, pa, dOb, dv, v_touched, tmp);
    }
    if (!need_ds) continue;
    float* dsb = want_ds ? ds_out + b0 * item : ds.get();
    gemm_gather(mm, kc, vsegs, b0, true, Sq, Sk, Dv, dOb, vp, dsb);  // dPd = dO V^T
    // dP = dPd * mask * keep; dS = f * P * (dP - rowsum(dP * P)), in place, rows split over threads
    const auto t0 = std::chrono::steady_clock::now();
    parallel_for(rows, grain, [&](int, int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) {
        MA d(dsb + i * Sk, Sk);
        CA pr(pb + i * Sk, Sk);
        if (mb) d *= Eigen::Map<const Eigen::Array<uint8_t, Eigen::Dynamic, 1>>(mb + i * Sk, Sk).cast<float>() * keep;
        const float rs = (d * pr).sum();
        d = (f * pr) * (d - rs);
      }
    });
    add_phase_ns(kAttnSoftmaxPhase, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now() - t0).count());
    if (want_dq) {  // dQ = dS K (K as [Sk, D])
      float* dqb = dq + b0 * Sq * D;
      gemm_gather(mm, kc, ksegs, b0, k_transposed, Sq, D, Sk, dsb, kp, dqb);
      if (scale_q != f) MA(dqb, rows * D) *= scale_q / f;
    }
    if (want_dk) {  // dK = sum_group dS^T Q ([Sk, D]) | Q^T dS ([D, Sk])
      if (!k_transposed) gemm_scatter(mm, kc, ksegs, b0, Sq, Sk, D, dsb, qb, dk, k_touched, tmp);
      else gemm_scatter(mm, kc, ksegs, b0, Sq, D, Sk, qb, dsb, dk, k_touched, tmp);
    }
  }
  if (want_dk && scale_k != f) MA(dk, k.numel()) *= scale_k / f;
}

// ================================= ConvBnReluGrad ===========================================
struct ConvOp;
struct ConvKernel : ConvAttrs {
  ConvKernel(const OrtKernelInfo* info, const ConvOp*) : ConvAttrs(info), mm(info) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* c) { return guarded([&] { Compute(c); }); }
  void Compute(OrtKernelContext* c);
  OrtMatMul mm;
};
struct ConvOp : SigOp<ConvOp, ConvKernel, kConvBnReluGradSig, kConvBnReluGradInplace> {
  ConvOp() : SigOp("ConvBnReluGrad", nullptr) {}
};

struct ConvGeom {
  int64_t cin_g, hin, win, kh, kw, ho, wo, sh, sw, pt, pl, dh, dw;
};

// cols[(ci*kh + i)*kw + j][oh*wo + ow] = x[ci][oh*sh - pt + i*dh][ow*sw - pl + j*dw] (0 outside)
static void im2col(const float* x, const ConvGeom& g, float* cols, int64_t c0, int64_t c1) {
  const int64_t hw = g.ho * g.wo;
  for (int64_t ci = c0; ci < c1; ++ci)
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
static void col2im(const float* cols, const ConvGeom& g, float* dx, int64_t c0, int64_t c1) {
  const int64_t hw = g.ho * g.wo;
  for (int64_t ci = c0; ci < c1; ++ci)
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
  PoolScope pool(c);
  count_call(kConvBnReluGrad);
  Ort::KernelContext ctx(c);
  const ConvInputs in(ctx, *this);
  const In &dy = in.dy, &y = in.y, &x = in.x, &w = in.w, &cv = in.cv, &gamma = in.gamma,
           &mean = in.mean, &istd = in.istd;
  const int64_t N = in.N, C = in.C, H = in.H, Wd = in.W, Cin = in.Cin, Hin = in.Hin,
                Win = in.Win, kh = in.kh, kw = in.kw;
  ConvGeom g{Cin / group, Hin, Win, kh, kw, H, Wd, strides[0], strides[1], pads[0], pads[1],
             dilations[0], dilations[1]};

  bool want_dx, want_dw, want_dbc, want_dg, want_db;
  float* dx = output_or_null<float>(ctx, 0, x.shape, &want_dx);
  float* dw = output_or_null<float>(ctx, 1, w.shape, &want_dw);
  float* dbc = output_or_null<float>(ctx, 2, {C}, &want_dbc);
  float* dgo = output_or_null<float>(ctx, 3, {C}, &want_dg);
  float* dbo = output_or_null<float>(ctx, 4, {C}, &want_db);
  // dC goes to output 5 when the node names it (fusecli always does: the runtime may have put
  // it in dY's buffer, the in-place pair dY -> dC; each dC element is written after the sums of
  // step 1 read all of dY, from the dY element at the same position), else to a chunk scratch.
  bool have_dc;
  float* dc_out = output_or_null<float>(ctx, 5, dy.shape, &have_dc);
  if (have_dc && dc_out == dy.data) count_inplace(kConvBnReluGrad);

  const int64_t HW = H * Wd;
  const double R = static_cast<double>(N * HW);
  const float* dyp = dy.ptr<float>();
  const float* yp = y.ptr<float>();
  const float* cvp = cv.ptr<float>();
  const float* gp = gamma.ptr<float>();
  const float* mp = mean.ptr<float>();
  const float* sp = istd.ptr<float>();
  // BN + ReLU backward in two steps that never hold a full-size dC:
  // 1. one read of dY, Y, Cv per channel gives the per-channel sums (dBeta, dGamma, and dBc,
  //    which follows from the sums: sum dC = -coef * sum(dZ xhat) * sum(xhat));
  // 2. dC is formed image chunk by image chunk right before the conv GEMMs that consume it.
  std::vector<float> dgam(C), dbet(C), dbias(C), cfv(C), a0v(C), a1v(C);
  parallel_for(C, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, N * HW)),
               [&](int, int64_t c0, int64_t c1) {
    std::vector<float> dzb(relu ? HW : 0);  // one row of dZ, stays in L1
    for (int64_t ch = c0; ch < c1; ++ch) {
      const float mu = mp[ch], is = sp[ch];
      double sdz = 0, sdzc = 0, scv = 0;
      for (int64_t n = 0; n < N; ++n) {
        const int64_t off = (n * C + ch) * HW;
        CA d(dyp + off, HW), yy(yp + off, HW), cc(cvp + off, HW);
        if (relu) MA(dzb.data(), HW) = (yy > 0.f).select(d, 0.f);
        CA dz(relu ? dzb.data() : dyp + off, HW);
        sdz += dz.sum();
        sdzc += (dz * (cc - mu)).sum();
        if (want_dbc) scv += cc.sum() - mu * static_cast<float>(HW);
      }
      const double sdzx = sdzc * is;  // sum dZ * xhat
      const double coef = static_cast<double>(gp[ch]) * is / R;
      dbet[ch] = static_cast<float>(sdz);
      dgam[ch] = static_cast<float>(sdzx);
      dbias[ch] = static_cast<float>(-coef * sdzx * scv * is);
      cfv[ch] = static_cast<float>(coef);
      a0v[ch] = static_cast<float>(sdz);
      a1v[ch] = static_cast<float>(sdzx) * is;
    }
  });
  if (want_dg) std::copy(dgam.begin(), dgam.end(), dgo);
  if (want_db) std::copy(dbet.begin(), dbet.end(), dbo);
  if (want_dbc) std::copy(dbias.begin(), dbias.end(), dbc);
  if (!want_dx && !want_dw && !have_dc) return;

  // ---- conv dgrad (col2im of W^T dC) and wgrad (dC im2col(X)^T), per (image, group) ----
  // GEMMs through onnxruntime's MatMul (MLAS on the intra-op pool); im2col / col2im split over
  // input channels on our threads.
  const OrtKernelContext* kc = ctx.GetOrtKernelContext();
  const int64_t Cg = C / group, Kc = g.cin_g * kh * kw;
  const bool pointwise = kh == 1 && kw == 1 && g.sh == 1 && g.sw == 1 && pads[0] == 0 &&
                         pads[1] == 0 && pads[2] == 0 && pads[3] == 0 && Hin == H && Win == Wd;
  const float* xp = x.ptr<float>();
  const float* wp = w.ptr<float>();
  const int64_t khw = kh * kw;
  // Images go in chunks of nb: im2col / col2im run over (image, input channel) pairs on the
  // threads, each GEMM is one batched MatMul over the chunk (W broadcast for dgrad; wgrad
  // partials [nb, Cg, Kc] summed after). At most ~512 KiB of columns per chunk (one image when
  // an image's columns are larger): the scratch stays small next to the activations (the fused
  // CNN step's peak then matches the unfused one; 2 MiB chunks were no faster).
  const int64_t col_sz = Kc * HW;
  const bool direct = pointwise && group == 1;  // X and dX serve as the column matrices
  const int64_t per_image = std::max<int64_t>(1, std::max(direct ? Cg * HW : col_sz, Cg * Kc));
  const int64_t nb_max = std::min<int64_t>(N, std::max<int64_t>(1, (int64_t(1) << 17) / per_image));
  std::unique_ptr<float[]> cols(direct ? nullptr : new float[static_cast<size_t>(nb_max * col_sz)]);
  std::unique_ptr<float[]> dcc(have_dc ? nullptr : new float[static_cast<size_t>(nb_max * C * HW)]);
  const float rf = static_cast<float>(R);
  std::unique_ptr<float[]> dwt(want_dw ? new float[static_cast<size_t>(nb_max * Cg * Kc)] : nullptr);
  std::unique_ptr<float[]> dcs(group > 1 ? new float[static_cast<size_t>(nb_max * Cg * HW)] : nullptr);
  if (want_dw) std::fill(dw, dw + C * Kc, 0.f);
  for (int64_t n0 = 0; n0 < N; n0 += nb_max) {
    const int64_t nb = std::min(nb_max, N - n0);
    float* dcn = have_dc ? dc_out + n0 * C * HW : dcc.get();  // the chunk's dC
    // dC = gamma inv_std / R (R dZ - sum dZ - xhat sum(dZ xhat)) for the chunk's images
    parallel_for(nb * C, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, HW)),
                 [&](int, int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t ch = j % C, off = (n0 * C + j) * HW;
        CA d(dyp + off, HW), yy(yp + off, HW), cc(cvp + off, HW);
        MA o(dcn + j * HW, HW);
        if (relu) o = cfv[ch] * (rf * (yy > 0.f).select(d, 0.f) - a0v[ch] - (cc - mp[ch]) * a1v[ch]);
        else o = cfv[ch] * (rf * d - a0v[ch] - (cc - mp[ch]) * a1v[ch]);
      }
    });
    if (!want_dx && !want_dw) continue;
    for (int64_t gi = 0; gi < group; ++gi) {
      // dC_g for the chunk as [nb, Cg, HW] (a view when group == 1, else a copy)
      const float* dcg = dcn;
      if (group > 1) {
        for (int64_t i = 0; i < nb; ++i)
          std::copy(dcn + (i * C + gi * Cg) * HW, dcn + (i * C + gi * Cg + Cg) * HW,
                    dcs.get() + i * Cg * HW);
        dcg = dcs.get();
      }
      const float* wg = wp + gi * Cg * Kc;  // [Cg, Kc]
      auto x_img = [&](int64_t i) { return xp + ((n0 + i) * Cin + gi * g.cin_g) * Hin * Win; };
      if (want_dw) {
        const float* colp = nullptr;
        if (!pointwise) {
          parallel_for(nb * g.cin_g, 1, [&](int, int64_t u0, int64_t u1) {
            for (int64_t u = u0; u < u1; ++u) {
              const int64_t i = u / g.cin_g, ci = u % g.cin_g;
              im2col(x_img(i), g, cols.get() + i * col_sz, ci, ci + 1);
            }
          });
          colp = cols.get();
        } else if (group == 1) {
          colp = x_img(0);  // X chunk is [nb, Cin, HW]
        } else {
          parallel_for(nb, 1, [&](int, int64_t i0, int64_t i1) {
            for (int64_t i = i0; i < i1; ++i) std::copy(x_img(i), x_img(i) + Kc * HW, cols.get() + i * Kc * HW);
          });
          colp = cols.get();
        }
        // dWt[i][Cg, Kc] = dC_g[i][Cg, HW] cols[i]^T
        mm.run(kc, false, true, nb, Cg, Kc, HW, dcg, colp, dwt.get());
        MA acc(dw + gi * Cg * Kc, Cg * Kc);
        for (int64_t i = 0; i < nb; ++i) acc += CA(dwt.get() + i * Cg * Kc, Cg * Kc);
      }
      if (want_dx) {
        if (pointwise && group == 1) {  // dX[i][Cin, HW] = W^T dC[i], straight into dX
          mm.run(kc, true, false, nb, Kc, HW, Cg, wg, dcg, dx + n0 * Cin * HW, false, true);
          continue;
        }
        float* gcols = cols.get();
        mm.run(kc, true, false, nb, Kc, HW, Cg, wg, dcg, gcols, false, true);  // W_g^T dC_g[i]
        parallel_for(nb * g.cin_g, 1, [&](int, int64_t u0, int64_t u1) {
          for (int64_t u = u0; u < u1; ++u) {
            const int64_t i = u / g.cin_g, ci = u % g.cin_g;
            float* dxc = dx + ((n0 + i) * Cin + gi * g.cin_g + ci) * Hin * Win;  // one channel
            if (pointwise) {
              std::copy(gcols + i * Kc * HW + ci * HW, gcols + i * Kc * HW + (ci + 1) * HW, dxc);
            } else {
              std::fill(dxc, dxc + Hin * Win, 0.f);
              col2im(gcols + i * col_sz, g, dxc - ci * Hin * Win, ci, ci + 1);
            }
          }
        });
      }
    }
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
