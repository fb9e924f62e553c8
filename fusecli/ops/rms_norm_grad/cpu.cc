// RMSNormGrad: CPU kernel.
#include <cmath>
#include <memory>

#include "cpu_rows.h"
#include "cpu_eigen.h"
#include "cpu_kernel.h"

namespace fusecli {
namespace {

struct RmsKernel : TypedCpuKernel<RmsKernel, kRMSNormGrad> {  // attributes: axis, epsilon
  using TypedCpuKernel::TypedCpuKernel;
  template <typename T> void Run(Ort::KernelContext& ctx);
};

#if defined(__AVX512F__)
// 1/sqrt(mean(x^2) + eps) of one float32 row (when the graph does not save it).
static float inv_rms_avx512(const float* x, int64_t N, float eps) {
  __m512 s = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= N; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    s = _mm512_fmadd_ps(v, v, s);
  }
  if (j < N) {
    const __m512 v = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (N - j)) - 1u), x + j);
    s = _mm512_fmadd_ps(v, v, s);
  }
  return 1.f / std::sqrt(_mm512_reduce_add_ps(s) / static_cast<float>(N) + eps);
}

// One float32 row of RMSNormGrad in two sweeps over L1-resident data: (1) xhat, g = dY gamma,
// the row sum c1 = sum(g xhat) and the dGamma partial; (2) dX, written with non-temporal stores
// when `stream` (large outputs: no read-for-ownership of dX lines) and the row is 64-byte aligned.
static void rms_row_avx512(const float* d, const float* x, const float* gm, const float* dr,
                           float* dx, float* pg, int64_t N, float rs, bool stream) {
  const __m512 vrs = _mm512_set1_ps(rs);
  __m512 s1 = _mm512_setzero_ps();
  const __mmask16 tail = static_cast<__mmask16>((1u << (N % 16)) - 1u);
  auto sweep1 = [&](int64_t j, __mmask16 m) {
    const __m512 vd = _mm512_maskz_loadu_ps(m, d + j);
    const __m512 xh = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + j), vrs);
    const __m512 g = gm ? _mm512_mul_ps(vd, _mm512_maskz_loadu_ps(m, gm + j)) : vd;
    s1 = _mm512_fmadd_ps(g, xh, s1);
    if (pg)
      _mm512_mask_storeu_ps(pg + j, m, _mm512_fmadd_ps(vd, xh, _mm512_maskz_loadu_ps(m, pg + j)));
  };
  int64_t j = 0;
  for (; j + 16 <= N; j += 16) sweep1(j, 0xFFFF);
  if (j < N) sweep1(j, tail);
  if (!dx) return;
  const __m512 c1 = _mm512_set1_ps(_mm512_reduce_add_ps(s1) / static_cast<float>(N));
  store_row_avx512(dx, N, stream, [&](int64_t jj, __mmask16 m) {
    const __m512 xh = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + jj), vrs);
    const __m512 vd = _mm512_maskz_loadu_ps(m, d + jj);
    const __m512 g = gm ? _mm512_mul_ps(vd, _mm512_maskz_loadu_ps(m, gm + jj)) : vd;
    __m512 o = _mm512_mul_ps(vrs, _mm512_fnmadd_ps(xh, c1, g));
    if (dr) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(m, dr + jj));
    return o;
  });
}
#elif defined(__ARM_NEON)
// inv_rms_avx512 and rms_row_avx512 on 4 NEON lanes (no non-temporal stores)
static float inv_rms_neon(const float* x, int64_t N, float eps) {
  float32x4_t s = vdupq_n_f32(0.f);
  for (int64_t j = 0; j < N; j += 4) {
    const float32x4_t v = load4(x + j, N - j);
    s = vfmaq_f32(s, v, v);
  }
  return 1.f / std::sqrt(vaddvq_f32(s) / static_cast<float>(N) + eps);
}
static void rms_row_neon(const float* d, const float* x, const float* gm, const float* dr,
                         float* dx, float* pg, int64_t N, float rs) {
  const float32x4_t vrs = vdupq_n_f32(rs);
  float32x4_t s1 = vdupq_n_f32(0.f);
  for (int64_t j = 0; j < N; j += 4) {
    const int64_t m = N - j;
    const float32x4_t vd = load4(d + j, m);
    const float32x4_t xh = vmulq_f32(load4(x + j, m), vrs);
    const float32x4_t g = gm ? vmulq_f32(vd, load4(gm + j, m)) : vd;
    s1 = vfmaq_f32(s1, g, xh);
    if (pg) store4(pg + j, vfmaq_f32(load4(pg + j, m), vd, xh), m);
  }
  if (!dx) return;
  const float32x4_t c1 = vdupq_n_f32(vaddvq_f32(s1) / static_cast<float>(N));
  store_row_neon(dx, N, [&](int64_t jj, int64_t m) {
    const float32x4_t xh = vmulq_f32(load4(x + jj, m), vrs);
    const float32x4_t vd = load4(d + jj, m);
    const float32x4_t g = gm ? vmulq_f32(vd, load4(gm + jj, m)) : vd;
    float32x4_t o = vmulq_f32(vrs, vfmsq_f32(g, xh, c1));
    if (dr) o = vaddq_f32(o, load4(dr + jj, m));
    return o;
  });
}
#endif

template <typename T> void RmsKernel::Run(Ort::KernelContext& ctx) {
  In dy = get_input(ctx, 0), x = get_input(ctx, 1), gamma = get_input(ctx, 2);
  In rstd = get_input(ctx, 3), dr = get_input(ctx, 4);
  const AxisRows rows = rows_from_axis(x.shape, axis, "RMSNormGrad");
  const size_t ax = rows.ax;
  const int64_t M = rows.M, N = rows.N;
  FUSECLI_CHECK(dy.numel() == x.numel(), "RMSNormGrad: dY and X must have the same size");
  FUSECLI_CHECK(!gamma.present || gamma.numel() == N,
                "RMSNormGrad: gamma must have prod(shape[axis:]) elements");
  FUSECLI_CHECK(!rstd.present || rstd.numel() == M, "RMSNormGrad: inv_rms needs one value per row");
  FUSECLI_CHECK(!rstd.present || rstd.type == kF32 || rstd.type == kF16,
                "RMSNormGrad: inv_rms must be float32 or float16");
  FUSECLI_CHECK(!dr.present || dr.numel() == M * N, "RMSNormGrad: dR must have the shape of dY");
  const std::vector<int64_t> pshape(x.shape.begin() + ax, x.shape.end());

  bool want_dx, want_dg;
  T* dx = output_or_null<T>(ctx, 0, x.shape, &want_dx);
  T* dg = output_or_null<T>(ctx, 1, gamma.present ? gamma.shape : pshape, &want_dg);
  // dX may be in dY's or dR's buffer (in-place pairs): every row reads its dY / dR values (and
  // adds its dGamma partial) before it writes dX at the same positions.
  if (want_dx && (dx == dy.data || (dr.present && dx == dr.data))) count_inplace(kRMSNormGrad);
  if (M == 0 || N == 0) {
    if (want_dg) std::fill(dg, dg + N, T(0.f));
    return;
  }
  std::vector<float> gam_buf(gamma.present && !std::is_same<T, float>::value ? N : 0);
  const float* gam = gamma.present ? row_as_float(gamma.ptr<T>(), gam_buf.data(), N) : nullptr;
  const T* dyp = dy.ptr<T>();
  const T* xp = x.ptr<T>();
  const T* drp = dr.present ? dr.ptr<T>() : nullptr;
  const float eps = epsilon;
  auto row_rs = [&](int64_t r, const float* xrow) {
    if (rstd.present) return stat_at(rstd, r);
    CA xv(xrow, N);
    return 1.f / std::sqrt(xv.square().sum() / static_cast<float>(N) + eps);
  };

  const int64_t grain = std::max<int64_t>(1, (1 << 14) / N);
  const int nt = planned_threads(M, grain);
  std::vector<float> part(want_dg ? static_cast<size_t>(nt * N) : 0, 0.f);
  const float inv_n = 1.f / static_cast<float>(N);
  // Non-temporal dX stores once the output is far larger than the caches would keep anyway.
  const bool stream = want_dx && M * N * static_cast<int64_t>(sizeof(T)) >= (int64_t(16) << 20) &&
                      std::getenv("FUSECLI_NO_STREAM") == nullptr;
  (void)stream;
  parallel_for(
      M, grain,
      [&](int t, int64_t r0, int64_t r1) {
        MA pg(want_dg ? part.data() + t * N : nullptr, want_dg ? N : 0);
#if defined(__AVX512F__)
        if constexpr (std::is_same<T, float>::value) {
          for (int64_t r = r0; r < r1; ++r) {
            const float* xr = xp + r * N;
            const float rs = rstd.present ? stat_at(rstd, r) : inv_rms_avx512(xr, N, eps);
            rms_row_avx512(dyp + r * N, xr, gam, drp ? drp + r * N : nullptr,
                           want_dx ? dx + r * N : nullptr, want_dg ? pg.data() : nullptr, N, rs,
                           stream);
          }
          if (stream) _mm_sfence();
          return;
        }
#elif defined(__ARM_NEON)
        if constexpr (std::is_same<T, float>::value) {
          for (int64_t r = r0; r < r1; ++r) {
            const float* xr = xp + r * N;
            const float rs = rstd.present ? stat_at(rstd, r) : inv_rms_neon(xr, N, eps);
            rms_row_neon(dyp + r * N, xr, gam, drp ? drp + r * N : nullptr,
                         want_dx ? dx + r * N : nullptr, want_dg ? pg.data() : nullptr, N, rs);
          }
          return;
        }
#endif
        const bool conv = !std::is_same<T, float>::value;
        std::vector<float> xh(N), g(N), out(N);
        std::vector<float> bdy(conv ? N : 0), bx(conv ? N : 0), bdr(conv && drp ? N : 0);
        MA xhv(xh.data(), N), gv(g.data(), N), ov(out.data(), N);
        for (int64_t r = r0; r < r1; ++r) {
          CA d(row_as_float(dyp + r * N, bdy.data(), N), N);
          const float* xrow = row_as_float(xp + r * N, bx.data(), N);
          const float rs = row_rs(r, xrow);
          xhv = CA(xrow, N) * rs;
          if (gam)
            gv = d * CA(gam, N);
          else
            gv = d;
          if (want_dg) pg += d * xhv;  // before dX is written: dX may be in dY's buffer
          if (want_dx) {
            const float c1 = (gv * xhv).sum() * inv_n;
            if constexpr (std::is_same<T, float>::value) {
              MA o(dx + r * N, N);
              if (drp)
                o = rs * (gv - xhv * c1) + CA(drp + r * N, N);
              else
                o = rs * (gv - xhv * c1);
            } else {
              if (drp)
                ov = rs * (gv - xhv * c1) + CA(row_as_float(drp + r * N, bdr.data(), N), N);
              else
                ov = rs * (gv - xhv * c1);
              float_to_half(out.data(), dx + r * N, N);
            }
          }
        }
      },
      nt);
  if (want_dg) {
    std::vector<float> sg(N, 0.f);
    MA sgv(sg.data(), N);
    for (int t = 0; t < nt; ++t) sgv += CA(part.data() + t * N, N);
    if constexpr (std::is_same<T, float>::value)
      std::copy(sg.begin(), sg.end(), dg);
    else
      float_to_half(sg.data(), dg, N);
  }
}

}  // namespace

void add_rms_norm_grad_cpu_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<RmsKernel>>(domain);
}

}  // namespace fusecli
