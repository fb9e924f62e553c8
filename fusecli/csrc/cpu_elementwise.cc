// CPU kernels: ActivationGrad, LinearActivationGrad, LayerNormGrad.
#include <Eigen/Core>

#include <memory>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"

namespace fusecli {
namespace {

constexpr auto kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto kF16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
using Arr = Eigen::Array<float, Eigen::Dynamic, 1>;
using CA = Eigen::Map<const Arr>;
using MA = Eigen::Map<Arr>;

// ================================ ActivationGrad ============================================
struct ActOp;
struct ActKernel {
  ActKernel(const OrtKernelInfo* info, const ActOp* op);
  OrtStatusPtr ComputeV2(OrtKernelContext* c) { return guarded([&] { Compute(c); }); }
  void Compute(OrtKernelContext* c);
  Act act;
  bool half;
};
struct ActOp : SigOp<ActOp, ActKernel, kActivationGradSig, kActivationGradInplace> {
  explicit ActOp(bool half) : SigOp("ActivationGrad", nullptr, half) {}
};
ActKernel::ActKernel(const OrtKernelInfo* info, const ActOp* op)
    : act(parse_act(attr_string(info, "activation", ""), false)), half(op->half) {}

void ActKernel::Compute(OrtKernelContext* c) {
  PoolScope pool(c);
  count_call(kActivationGrad);
  Ort::KernelContext ctx(c);
  In dy = get_input(ctx, 0), x = get_input(ctx, 1);
  FUSECLI_CHECK(dy.numel() == x.numel(), "ActivationGrad: dY and X must have the same size");
  bool present;
  const int64_t n = dy.numel();
  if (!half) {
    float* out = output_or_null<float>(ctx, 0, dy.shape, &present);
    if (!present) return;
    if (out == dy.data) count_inplace(kActivationGrad);  // elementwise: dX over dY is safe
    const float* d = dy.ptr<float>();
    const float* v = x.ptr<float>();
    parallel_for(n, 1 << 15, [&](int, int64_t b, int64_t e) {
      act_grad_block(act, d + b, v + b, out + b, e - b);
    });
  } else {
    auto* out = output_or_null<Ort::Float16_t>(ctx, 0, dy.shape, &present);
    if (!present) return;
    if (out == dy.data) count_inplace(kActivationGrad);  // each chunk is read before written
    const auto* d = dy.ptr<Ort::Float16_t>();
    const auto* v = x.ptr<Ort::Float16_t>();
    parallel_for(n, 1 << 15, [&](int, int64_t b, int64_t e) {
      constexpr int64_t kB = 2048;
      alignas(64) float fd[kB], fv[kB];
      for (int64_t i = b; i < e; i += kB) {
        const int64_t len = std::min(kB, e - i);
        half_to_float(d + i, fd, len);
        half_to_float(v + i, fv, len);
        act_grad_block(act, fd, fv, fd, len);
        float_to_half(fd, out + i, len);
      }
    });
  }
}

// ============================= LinearActivationGrad =========================================
struct LinOp;
struct LinKernel {
  LinKernel(const OrtKernelInfo* info, const LinOp*)
      : act(parse_act(attr_string(info, "activation", ""), true)),
        trans_w(attr_int(info, "trans_w", 0) != 0),
        trans_dw(attr_int(info, "trans_dw", trans_w ? 1 : 0) != 0),
        mm(info) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* c) { return guarded([&] { Compute(c); }); }
  void Compute(OrtKernelContext* c);
  Act act;
  bool trans_w, trans_dw;  // layout of the W input / of the dW output ([K, N] when set)
  OrtMatMul mm;
};
struct LinOp : SigOp<LinOp, LinKernel, kLinearActivationGradSig, kLinearActivationGradInplace> {
  LinOp() : SigOp("LinearActivationGrad", nullptr) {}
};

void LinKernel::Compute(OrtKernelContext* c) {
  PoolScope pool(c);
  count_call(kLinearActivationGrad);
  Ort::KernelContext ctx(c);
  In dy = get_input(ctx, 0), x = get_input(ctx, 1), a = get_input(ctx, 2), w = get_input(ctx, 3);
  FUSECLI_CHECK(!dy.shape.empty() && !a.shape.empty(), "LinearActivationGrad: dY and A need rank >= 1");
  const int64_t N = dy.shape.back(), K = a.shape.back();
  const int64_t M = N ? dy.numel() / N : 0;
  FUSECLI_CHECK(x.numel() == dy.numel(), "LinearActivationGrad: X and dY must have the same size");
  FUSECLI_CHECK(a.numel() == M * K, "LinearActivationGrad: A rows must match dY rows");
  if (w.present) {
    FUSECLI_CHECK(w.shape.size() == 2, "LinearActivationGrad: W must be 2-D");
    if (!trans_w)
      FUSECLI_CHECK(w.shape[0] == N && w.shape[1] == K, "LinearActivationGrad: W must be [N, K] (trans_w=0)");
    else
      FUSECLI_CHECK(w.shape[0] == K && w.shape[1] == N, "LinearActivationGrad: W must be [K, N] (trans_w=1)");
  }
  const std::vector<int64_t> w_shape = trans_dw ? std::vector<int64_t>{K, N} : std::vector<int64_t>{N, K};
  std::vector<int64_t> da_shape = a.shape;
  da_shape.back() = K;

  bool want_da, want_dw, want_db;
  float* da = output_or_null<float>(ctx, 0, da_shape, &want_da);
  FUSECLI_CHECK(!want_da || w.present, "LinearActivationGrad: dA is requested but W is absent");
  float* dw = output_or_null<float>(ctx, 1, w_shape, &want_dw);
  float* db = output_or_null<float>(ctx, 2, {N}, &want_db);
  // dZ is written to output 3 when the node names it. The runtime may have placed that output in
  // dY's buffer (in-place pair dY -> dZ): the activation pass reads and writes each element at
  // the same position, so that is safe. Otherwise a GEMM that needs dZ gets a scratch buffer;
  // identity needs none (dZ is dY).
  bool have_dz_out;
  float* dz_out = output_or_null<float>(ctx, 3, dy.shape, &have_dz_out);
  const bool need_gemm = want_da || want_dw;
  const bool store_dz = have_dz_out || (need_gemm && act != Act::kIdentity);
  if (!want_da && !want_dw && !want_db && !have_dz_out) return;

  const float* dyp = dy.ptr<float>();
  const float* xp = x.ptr<float>();
  const float* ap = a.ptr<float>();
  const float* wp = w.present ? w.ptr<float>() : nullptr;
  if (M == 0) {
    if (want_da) std::fill(da, da + M * K, 0.f);
    if (want_dw) std::fill(dw, dw + N * K, 0.f);
    if (want_db) std::fill(db, db + N, 0.f);
    return;
  }
  if (have_dz_out && dz_out == dyp) count_inplace(kLinearActivationGrad);
  if (have_dz_out && act == Act::kIdentity && dz_out != dyp) std::copy(dyp, dyp + M * N, dz_out);
  // One pass over (dY, X): dZ = dY * act'(X) in row tiles that stay in L1/L2 while dB's per-thread
  // partial sums read them back. dZ is stored only when a GEMM needs it or output 3 asks for it.
  std::unique_ptr<float[]> dz_buf(store_dz && !have_dz_out ? new float[static_cast<size_t>(M * N)]
                                                              : nullptr);
  float* dz_store = have_dz_out ? dz_out : dz_buf.get();
  const float* dz = store_dz ? dz_store : dyp;
  if (store_dz || want_db) {
    const int64_t tile_rows = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, N));
    const int64_t grain = std::max<int64_t>(tile_rows, (1 << 15) / std::max<int64_t>(1, N));
    const int T = planned_threads(M, grain);
    std::vector<float> part(want_db ? static_cast<size_t>(T * N) : 0, 0.f);
    parallel_for(M, grain, [&](int t, int64_t r0, int64_t r1) {
      std::unique_ptr<float[]> tmp(!store_dz && act != Act::kIdentity ? new float[tile_rows * N] : nullptr);
      MA acc(want_db ? part.data() + t * N : nullptr, want_db ? N : 0);
      for (int64_t i = r0; i < r1; i += tile_rows) {
        const int64_t rows = std::min(tile_rows, r1 - i);
        const float* src = dyp + i * N;
        if (act != Act::kIdentity) {
          float* dst = store_dz ? dz_store + i * N : tmp.get();
          act_grad_block(act, dyp + i * N, xp + i * N, dst, rows * N);
          src = dst;
        }
        if (want_db)
          for (int64_t r = 0; r < rows; ++r) acc += CA(src + r * N, N);
      }
    }, T);
    if (want_db) {
      MA out(db, N);
      out = CA(part.data(), N);
      for (int t = 1; t < T; ++t) out += CA(part.data() + t * N, N);
    }
  }
  const OrtKernelContext* kc = ctx.GetOrtKernelContext();
  if (want_da)  // dA[M,K] = dZ[M,N] W[N,K]  |  dZ W^T with W stored [K,N]
    mm.run(kc, false, trans_w, 1, M, K, N, dz, wp, da);
  if (want_dw) {
    if (!trans_dw) mm.run(kc, true, false, 1, N, K, M, dz, ap, dw);  // dW[N,K] = dZ^T A
    else mm.run(kc, true, false, 1, K, N, M, ap, dz, dw);           // dW[K,N] = A^T dZ
  }
}

// ================================ LayerNormGrad =============================================
struct LnOp;
struct LnKernel {
  LnKernel(const OrtKernelInfo* info, const LnOp* op);
  OrtStatusPtr ComputeV2(OrtKernelContext* c) { return guarded([&] { Compute(c); }); }
  void Compute(OrtKernelContext* c);
  template <typename T> void Run(Ort::KernelContext& ctx);
  int64_t axis;
  bool half;
};
struct LnOp : SigOp<LnOp, LnKernel, kLayerNormGradSig, kLayerNormGradInplace> {
  explicit LnOp(bool half) : SigOp("LayerNormGrad", nullptr, half) {}
};
LnKernel::LnKernel(const OrtKernelInfo* info, const LnOp* op)
    : axis(attr_int(info, "axis", -1)), half(op->half) {}

void LnKernel::Compute(OrtKernelContext* c) {
  PoolScope pool(c);
  count_call(kLayerNormGrad);
  Ort::KernelContext ctx(c);
  if (half) Run<Ort::Float16_t>(ctx);
  else Run<float>(ctx);
}

static inline float stat_at(const In& t, int64_t i) {
  if (t.type == kF32) return t.ptr<float>()[i];
  return static_cast<float>(t.ptr<Ort::Float16_t>()[i]);
}

template <typename T>
static inline const float* row_as_float(const T* p, float* buf, int64_t n) {
  if constexpr (std::is_same<T, float>::value) {
    (void)buf; (void)n;
    return p;
  } else {
    half_to_float(p, buf, n);
    return buf;
  }
}

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
    const __m512 xh = _mm512_maskz_mul_ps(tail, _mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + j), vmu), vrs);
    const __m512 g = _mm512_mul_ps(vd, _mm512_maskz_loadu_ps(tail, gm + j));
    s1 = _mm512_fmadd_ps(g, xh, s1);
    s2 = _mm512_add_ps(s2, g);
    if (pg) _mm512_mask_storeu_ps(pg + j, tail, _mm512_fmadd_ps(vd, xh, _mm512_maskz_loadu_ps(tail, pg + j)));
    if (pb) _mm512_mask_storeu_ps(pb + j, tail, _mm512_add_ps(vd, _mm512_maskz_loadu_ps(tail, pb + j)));
  }
  if (!dx) return;
  const float inv_n = 1.f / static_cast<float>(N);
  const __m512 c1 = _mm512_set1_ps(_mm512_reduce_add_ps(s1) * inv_n);
  const __m512 c2 = _mm512_set1_ps(_mm512_reduce_add_ps(s2) * inv_n);
  const bool nt = stream && (reinterpret_cast<uintptr_t>(dx) % 64 == 0);
  auto value = [&](int64_t jj, __mmask16 m) {
    const __m512 xh = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + jj), vmu), vrs);
    const __m512 g = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, d + jj), _mm512_maskz_loadu_ps(m, gm + jj));
    __m512 o = _mm512_mul_ps(vrs, _mm512_sub_ps(_mm512_sub_ps(g, c2), _mm512_mul_ps(xh, c1)));
    if (dr) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(m, dr + jj));
    return o;
  };
  j = 0;
  for (; j + 16 <= N; j += 16) {
    const __m512 o = value(j, 0xFFFF);
    if (nt) _mm512_stream_ps(dx + j, o);
    else _mm512_storeu_ps(dx + j, o);
  }
  if (j < N) _mm512_mask_storeu_ps(dx + j, tail, value(j, tail));
}
#endif

template <typename T>
void LnKernel::Run(Ort::KernelContext& ctx) {
  In dy = get_input(ctx, 0), x = get_input(ctx, 1), gamma = get_input(ctx, 2);
  In mean = get_input(ctx, 3), rstd = get_input(ctx, 4), dr = get_input(ctx, 5);
  const int64_t rank = static_cast<int64_t>(x.shape.size());
  const int64_t ax = axis < 0 ? axis + rank : axis;
  FUSECLI_CHECK(ax >= 0 && ax <= rank, "LayerNormGrad: axis out of range");
  FUSECLI_CHECK(dy.numel() == x.numel(), "LayerNormGrad: dY and X must have the same size");
  const int64_t N = prod(x.shape, static_cast<size_t>(ax));
  const int64_t M = prod(x.shape, 0, static_cast<size_t>(ax));
  FUSECLI_CHECK(!gamma.present || gamma.numel() == N,
                "LayerNormGrad: gamma must have prod(shape[axis:]) elements");
  const std::vector<int64_t> pshape(x.shape.begin() + ax, x.shape.end());
  FUSECLI_CHECK(mean.numel() == M && rstd.numel() == M, "LayerNormGrad: mean/inv_std need one value per row");
  FUSECLI_CHECK((mean.type == kF32 || mean.type == kF16) && (rstd.type == kF32 || rstd.type == kF16),
                "LayerNormGrad: mean/inv_std must be float32 or float16");
  FUSECLI_CHECK(!dr.present || dr.numel() == M * N, "LayerNormGrad: dR must have the shape of dY");

  bool want_dx, want_dg, want_db;
  T* dx = output_or_null<T>(ctx, 0, x.shape, &want_dx);
  FUSECLI_CHECK(!want_dx || gamma.present, "LayerNormGrad: dX is requested but gamma is absent");
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
  const float* gam = gamma.present ? row_as_float(gamma.ptr<T>(), gam_buf.data(), N) : gam_buf.data();
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
  parallel_for(M, grain, [&](int t, int64_t r0, int64_t r1) {
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
                      want_db ? pb.data() : nullptr, N, stat_at(mean, r), stat_at(rstd, r), stream);
      if (stream) _mm_sfence();
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
          if (drp) o = rs * (gv - c2 - xhv * c1) + CA(drp + r * N, N);
          else o = rs * (gv - c2 - xhv * c1);
        } else {
          if (drp) ov = rs * (gv - c2 - xhv * c1) + CA(row_as_float(drp + r * N, bdr.data(), N), N);
          else ov = rs * (gv - c2 - xhv * c1);
          float_to_half(out.data(), dx + r * N, N);
        }
      }
    }
  }, nt);
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

void add_cpu_ops_elementwise(Ort::CustomOpDomain& domain) {
  static ActOp act_f32(false), act_f16(true);
  static LinOp lin;
  static LnOp ln_f32(false), ln_f16(true);
  domain.Add(&act_f32);
  domain.Add(&act_f16);
  domain.Add(&lin);
  domain.Add(&ln_f32);
  domain.Add(&ln_f16);
}

}  // namespace fusecli
