// ConvBnReluGrad: CPU kernel.
#include <memory>

#include "conv_inputs.h"
#include "cpu_eigen.h"
#include "cpu_gemm.h"
#include "cpu_threads.h"

namespace fusecli {
namespace {

// ================================= ConvBnReluGrad ===========================================
struct ConvOp;
struct ConvKernel : ConvAttrs {
  ConvKernel(const OrtKernelInfo* info, const ConvOp*) : ConvAttrs(info), mm(info) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* c) { return guarded([&] { Compute(c); }); }
  void Compute(OrtKernelContext* c);
  OrtMatMul mm;
};
struct ConvOp : SigOp<ConvOp, ConvKernel, kConvBnReluGrad> {
  explicit ConvOp(bool half) : SigOp(nullptr, half) {}
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

void add_conv_bn_relu_grad_cpu_ops(Ort::CustomOpDomain& domain) {
  add_op<ConvOp>(domain);
}

}  // namespace fusecli
