// LayerNormGrad: CPU kernel.
#include <memory>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_rows.h"
#include "cpu_eigen.h"
#include "cpu_kernel.h"

namespace fusecli {
namespace {

// ================================ LayerNormGrad =============================================
struct LnKernel : TypedCpuKernel<LnKernel, kLayerNormGrad> {  // attributes: axis
  using TypedCpuKernel::TypedCpuKernel;
  template <typename T> void Run(Ort::KernelContext& ctx);
};

#if defined(__AVX512F__)
// One float32 row of LayerNormGrad in two sweeps over L1-resident data: (1) xhat, g = dY gamma,
// the row sums c1 / c2 and the dGamma / dBeta partials; (2) dX, written with non-temporal stores
// when `stream` (large outputs: no read-for-ownership of dX lines) and the row is 64-byte aligned.
static void ln_row_avx512(const float* d, const float* x, const float* gm, const float* dr,
                          float* dx, float* pg, float* pb, int64_t N, float mu, float rs,
                          bool stream) {
  const __m512 vmu = _mm512_set1_ps(mu), vrs = _mm512_set1_ps(rs);
  __m512 s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= N; j += 16) {
    const __m512 vd = _mm512_loadu_ps(d + j);
    const __m512 xh = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + j), vmu), vrs);
    const __m512 g = _mm512_mul_ps(vd, _mm512_loadu_ps(gm + j));
    s1 = _mm512_fmadd_ps(g, xh, s1);
    s2 = _mm512_add_ps(s2, g);
    if (pg) _mm512_storeu_ps(pg + j, _mm512_fmadd_ps(vd, xh, _mm512_loadu_ps(pg + j)));
    if (pb) _mm512_storeu_ps(pb + j, _mm512_add_ps(vd, _mm512_loadu_ps(pb + j)));
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (N - j)) - 1u);
  if (j < N) {
    const __m512 vd = _mm512_maskz_loadu_ps(tail, d + j);
    const __m512 xh =
        _mm512_maskz_mul_ps(tail, _mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + j), vmu), vrs);
    const __m512 g = _mm512_mul_ps(vd, _mm512_maskz_loadu_ps(tail, gm + j));
    s1 = _mm512_fmadd_ps(g, xh, s1);
    s2 = _mm512_add_ps(s2, g);
    if (pg)
      _mm512_mask_storeu_ps(pg + j, tail,
                            _mm512_fmadd_ps(vd, xh, _mm512_maskz_loadu_ps(tail, pg + j)));
    if (pb)
      _mm512_mask_storeu_ps(pb + j, tail, _mm512_add_ps(vd, _mm512_maskz_loadu_ps(tail, pb + j)));
  }
  if (!dx) return;
  const float inv_n = 1.f / static_cast<float>(N);
  const __m512 c1 = _mm512_set1_ps(_mm512_reduce_add_ps(s1) * inv_n);
  const __m512 c2 = _mm512_set1_ps(_mm512_reduce_add_ps(s2) * inv_n);
  store_row_avx512(dx, N, stream, [&](int64_t jj, __mmask16 m) {
    const __m512 xh = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + jj), vmu), vrs);
    const __m512 g =
        _mm512_mul_ps(_mm512_maskz_loadu_ps(m, d + jj), _mm512_maskz_loadu_ps(m, gm + jj));
    __m512 o = _mm512_mul_ps(vrs, _mm512_sub_ps(_mm512_sub_ps(g, c2), _mm512_mul_ps(xh, c1)));
    if (dr) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(m, dr + jj));
    return o;
  });
}
#elif defined(__ARM_NEON)
// ln_row_avx512 on 4 NEON lanes (no non-temporal stores)
static void ln_row_neon(const float* d, const float* x, const float* gm, const float* dr, float* dx,
                        float* pg, float* pb, int64_t N, float mu, float rs) {
  const float32x4_t vmu = vdupq_n_f32(mu), vrs = vdupq_n_f32(rs);
  float32x4_t s1 = vdupq_n_f32(0.f), s2 = vdupq_n_f32(0.f);
  for (int64_t j = 0; j < N; j += 4) {
    const int64_t m = N - j;
    const float32x4_t vd = load4(d + j, m);
    const float32x4_t xh = vmulq_f32(vsubq_f32(load4(x + j, m), vmu), vrs);
    const float32x4_t g = vmulq_f32(vd, load4(gm + j, m));
    // padded lanes: vd = 0 makes g = 0, and xh's (0 - mu) rs is multiplied by it
    s1 = vfmaq_f32(s1, g, xh);
    s2 = vaddq_f32(s2, g);
    if (pg) store4(pg + j, vfmaq_f32(load4(pg + j, m), vd, xh), m);
    if (pb) store4(pb + j, vaddq_f32(vd, load4(pb + j, m)), m);
  }
  if (!dx) return;
  const float inv_n = 1.f / static_cast<float>(N);
  const float32x4_t c1 = vdupq_n_f32(vaddvq_f32(s1) * inv_n);
  const float32x4_t c2 = vdupq_n_f32(vaddvq_f32(s2) * inv_n);
  store_row_neon(dx, N, [&](int64_t jj, int64_t m) {
    const float32x4_t xh = vmulq_f32(vsubq_f32(load4(x + jj, m), vmu), vrs);
    const float32x4_t g = vmulq_f32(load4(d + jj, m), load4(gm + jj, m));
    float32x4_t o = vmulq_f32(vrs, vsubq_f32(vsubq_f32(g, c2), vmulq_f32(xh, c1)));
    if (dr) o = vaddq_f32(o, load4(dr + jj, m));
    return o;
  });
}
#endif

template <typename T> void LnKernel::Run(Ort::KernelContext& ctx) {
  In dy = get_input(ctx, 0), x = get_input(ctx, 1), gamma = get_input(ctx, 2);
  In mean = get_input(ctx, 3), rstd = get_input(ctx, 4), dr = get_input(ctx, 5);
  const AxisRows rows = rows_from_axis(x.shape, axis, "LayerNormGrad");
  const size_t ax = rows.ax;
  const int64_t M = rows.M, N = rows.N;
  FUSECLI_CHECK(dy.numel() == x.numel(), "LayerNormGrad: dY and X must have the same size");
  FUSECLI_CHECK(!gamma.present || gamma.numel() == N,
                "LayerNormGrad: gamma must have prod(shape[axis:]) elements");
  const std::vector<int64_t> pshape(x.shape.begin() + ax, x.shape.end());
  FUSECLI_CHECK(mean.numel() == M && rstd.numel() == M,
                "LayerNormGrad: mean/inv_std need one value per row");
  FUSECLI_CHECK(
      (mean.type == kF32 || mean.type == kF16) && (rstd.type == kF32 || rstd.type == kF16),
      "LayerNormGrad: mean/inv_std must be float32 or float16");
  FUSECLI_CHECK(!dr.present || dr.numel() == M * N, "LayerNormGrad: dR must have the shape of dY");

  bool want_dx, want_dg, want_db;
  T* dx = output_or_null<T>(ctx, 0, x.shape, &want_dx);
  T* dg = output_or_null<T>(ctx, 1, gamma.present ? gamma.shape : pshape, &want_dg);
  T* dbeta = output_or_null<T>(ctx, 2, gamma.present ? gamma.shape : pshape, &want_db);
  // dX may be in dY's or dR's buffer (in-place pairs): every row reads its dY / dR values (and
  // adds their dGamma / dBeta partials) before it writes dX at the same positions.
  if (want_dx && (dx == dy.data || (dr.present && dx == dr.data))) count_inplace(kLayerNormGrad);
  if (M == 0 || N == 0) {
    if (want_dg) std::fill(dg, dg + N, T(0.f));
    if (want_db) std::fill(dbeta, dbeta + N, T(0.f));
    return;
  }
  std::vector<float> gam_buf(static_cast<size_t>(N), 1.f);
  const float* gam =
      gamma.present ? row_as_float(gamma.ptr<T>(), gam_buf.data(), N) : gam_buf.data();
  const T* dyp = dy.ptr<T>();
  const T* xp = x.ptr<T>();
  const T* drp = dr.present ? dr.ptr<T>() : nullptr;
  const bool reduce = want_dg || want_db;

  const int64_t grain = std::max<int64_t>(1, (1 << 14) / N);
  const int nt = planned_threads(M, grain);
  std::vector<float> part(reduce ? static_cast<size_t>(2 * nt * N) : 0, 0.f);
  const float inv_n = 1.f / static_cast<float>(N);
  // Non-temporal dX stores once the output is far larger than the caches would keep anyway.
  const bool stream = want_dx && M * N * static_cast<int64_t>(sizeof(T)) >= (int64_t(16) << 20) &&
                      std::getenv("FUSECLI_NO_STREAM") == nullptr;
  (void)stream;
  parallel_for(
      M, grain,
      [&](int t, int64_t r0, int64_t r1) {
        const bool conv = !std::is_same<T, float>::value;
        std::vector<float> xh(N), g(N), out(N);
        std::vector<float> bdy(conv ? N : 0), bx(conv ? N : 0), bdr(conv && drp ? N : 0);
        MA pg(reduce ? part.data() + (2 * t) * N : nullptr, reduce ? N : 0);
        MA pb(reduce ? part.data() + (2 * t + 1) * N : nullptr, reduce ? N : 0);
        MA xhv(xh.data(), N), gv(g.data(), N), ov(out.data(), N);
        CA gm(gam, N);
#if defined(__AVX512F__)
        if constexpr (std::is_same<T, float>::value) {
          for (int64_t r = r0; r < r1; ++r)
            ln_row_avx512(dyp + r * N, xp + r * N, gam, drp ? drp + r * N : nullptr,
                          want_dx ? dx + r * N : nullptr, want_dg ? pg.data() : nullptr,
                          want_db ? pb.data() : nullptr, N, stat_at(mean, r), stat_at(rstd, r),
                          stream);
          if (stream) _mm_sfence();
          return;
        }
#elif defined(__ARM_NEON)
        if constexpr (std::is_same<T, float>::value) {
          for (int64_t r = r0; r < r1; ++r)
            ln_row_neon(dyp + r * N, xp + r * N, gam, drp ? drp + r * N : nullptr,
                        want_dx ? dx + r * N : nullptr, want_dg ? pg.data() : nullptr,
                        want_db ? pb.data() : nullptr, N, stat_at(mean, r), stat_at(rstd, r));
          return;
        }
#endif
        for (int64_t r = r0; r < r1; ++r) {
          const float mu = stat_at(mean, r), rs = stat_at(rstd, r);
          CA d(row_as_float(dyp + r * N, bdy.data(), N), N);
          CA xv(row_as_float(xp + r * N, bx.data(), N), N);
          xhv = (xv - mu) * rs;
          gv = d * gm;
          if (want_dg) pg += d * xhv;  // before dX is written: dX may be in dY's buffer
          if (want_db) pb += d;
          if (want_dx) {
            const float c1 = (gv * xhv).sum() * inv_n;
            const float c2 = gv.sum() * inv_n;
            if constexpr (std::is_same<T, float>::value) {
              MA o(dx + r * N, N);
              if (drp)
                o = rs * (gv - c2 - xhv * c1) + CA(drp + r * N, N);
              else
                o = rs * (gv - c2 - xhv * c1);
            } else {
              if (drp)
                ov = rs * (gv - c2 - xhv * c1) + CA(row_as_float(drp + r * N, bdr.data(), N), N);
              else
                ov = rs * (gv - c2 - xhv * c1);
              float_to_half(out.data(), dx + r * N, N);
            }
          }
        }
      },
      nt);
  if (reduce) {
    std::vector<float> sg(N, 0.f), sb(N, 0.f);
    MA sgv(sg.data(), N), sbv(sb.data(), N);
    for (int t = 0; t < nt; ++t) {
      sgv += CA(part.data() + (2 * t) * N, N);
      sbv += CA(part.data() + (2 * t + 1) * N, N);
    }
    if constexpr (std::is_same<T, float>::value) {
      if (want_dg) std::copy(sg.begin(), sg.end(), dg);
      if (want_db) std::copy(sb.begin(), sb.end(), dbeta);
    } else {
      if (want_dg) float_to_half(sg.data(), dg, N);
      if (want_db) float_to_half(sb.data(), dbeta, N);
    }
  }
}

}  // namespace

void add_layer_norm_grad_cpu_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<LnKernel>>(domain);
}

}  // namespace fusecli
