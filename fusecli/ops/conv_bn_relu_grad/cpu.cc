// ConvBnReluGrad: CPU kernel.
#include <functional>
#include <memory>

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#include "conv_inputs.h"
#include "cpu_activation.h"
#include "cpu_kernel.h"
#include "cpu_eigen.h"
#include "cpu_gemm.h"
#include "cpu_threads.h"

namespace fusecli {
namespace {

// ================================= ConvBnReluGrad ===========================================
struct ConvKernel : CpuKernel<ConvKernel, kConvBnReluGrad> {  // attributes: see conv_inputs.h
  template <typename TOp>
  ConvKernel(const OrtKernelInfo* info, const TOp* op) : CpuKernel(info, op), mm(info) {
    check_conv_attrs(*this);
  }
  void Compute(Ort::KernelContext& ctx);
  OrtMatMul mm;
};

// row-major blocks of a plane with their row stride (a depthwise tap's rows)
using Arr2 = Eigen::Array<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using CA2 = Eigen::Map<const Arr2, 0, Eigen::OuterStride<>>;
using MA2 = Eigen::Map<Arr2, 0, Eigen::OuterStride<>>;

struct ConvGeom {
  int64_t cin_g, hin, win, kh, kw, ho, wo, sh, sw, pt, pl, dh, dw;
};

// Short rows (feature maps of 2..16 columns) are the common case in deep layers: one masked
// vector operation per 16 floats instead of a scalar remainder loop or a memmove call.
static inline void copy_row(float* __restrict__ d, const float* __restrict__ s, int64_t n) {
#if defined(__AVX512F__)
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(d + i, _mm512_loadu_ps(s + i));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(d + i, m, _mm512_maskz_loadu_ps(m, s + i));
  }
#else
  std::copy(s, s + n, d);
#endif
}
static inline void add_row(float* __restrict__ d, const float* __restrict__ s, int64_t n) {
#if defined(__AVX512F__)
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(d + i, _mm512_add_ps(_mm512_loadu_ps(d + i), _mm512_loadu_ps(s + i)));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(
        d + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, d + i), _mm512_maskz_loadu_ps(m, s + i)));
  }
#else
  for (int64_t i = 0; i < n; ++i) d[i] += s[i];
#endif
}

// d[k] = s[2k] for k < n (a stride-2 convolution's im2col row): 16 outputs from two masked
// loads and one two-source permute.
static inline void copy_row_s2(float* __restrict__ d, const float* __restrict__ s, int64_t n) {
#if defined(__AVX512F__)
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  for (int64_t k = 0; k < n; k += 16) {
    const int64_t m = std::min<int64_t>(16, n - k), span = 2 * m - 1;  // source floats read
    const __mmask16 ma = static_cast<__mmask16>(span >= 16 ? 0xffffu : (1u << span) - 1u);
    const __mmask16 mb = static_cast<__mmask16>(span > 16 ? (1u << (span - 16)) - 1u : 0u);
    const __m512 a = _mm512_maskz_loadu_ps(ma, s + 2 * k);
    const __m512 b = _mm512_maskz_loadu_ps(mb, s + 2 * k + 16);
    _mm512_mask_storeu_ps(d + k, static_cast<__mmask16>(m == 16 ? 0xffffu : (1u << m) - 1u),
                          _mm512_permutex2var_ps(a, even, b));
  }
#elif defined(__ARM_NEON)
  int64_t k =
      0;  // 4 outputs per de-interleaving load of 8 floats; the rest scalar (no read past s[2n-2])
  for (; k + 4 < n; k += 4) vst1q_f32(d + k, vld2q_f32(s + 2 * k).val[0]);
  for (; k < n; ++k) d[k] = s[2 * k];
#else
  for (int64_t k = 0; k < n; ++k) d[k] = s[2 * k];
#endif
}

// Image-major <-> channel-major: dst[r][i*hw + p] = src[i*img + r*hw + p] (pack) and back
// (unpack), rows [r0, r1), images [0, nb), dst rows `ld` floats apart. These move a chunk's
// activations into the [rows, nb*hw] matrices of one GEMM and its results back.
static void pack_rows(const float* src, int64_t img, int64_t nb, int64_t hw, float* dst, int64_t ld,
                      int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t i = 0; i < nb; ++i) copy_row(dst + r * ld + i * hw, src + i * img + r * hw, hw);
}
static void unpack_rows(const float* src, int64_t ld, int64_t nb, int64_t hw, float* dst,
                        int64_t img, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t i = 0; i < nb; ++i) copy_row(dst + i * img + r * hw, src + r * ld + i * hw, hw);
}

// cols[(ci*kh + i)*kw + j][oh*wo + ow] = x[ci][oh*sh - pt + i*dh][ow*sw - pl + j*dw] (0 outside);
// rows of the column matrix are `ld` floats apart (ld = ho*wo for one image's own matrix).
static void im2col(const float* x, const ConvGeom& g, float* cols, int64_t ld, int64_t c0,
                   int64_t c1) {
  for (int64_t ci = c0; ci < c1; ++ci)
    for (int64_t i = 0; i < g.kh; ++i)
      for (int64_t j = 0; j < g.kw; ++j) {
        float* dst = cols + ((ci * g.kh + i) * g.kw + j) * ld;
        const float* src = x + ci * g.hin * g.win;
        // output columns whose input column iw = ow*sw - pl + j*dw lies inside [0, win)
        const int64_t off = j * g.dw - g.pl;
        const int64_t lo = std::min(g.wo, std::max<int64_t>(0, (-off + g.sw - 1) / g.sw));
        const int64_t hi = std::max(lo, std::min(g.wo, (g.win - off + g.sw - 1) / g.sw));
        for (int64_t oh = 0; oh < g.ho; ++oh) {
          const int64_t ih = oh * g.sh - g.pt + i * g.dh;
          float* drow = dst + oh * g.wo;
          if (ih < 0 || ih >= g.hin) {
            std::fill(drow, drow + g.wo, 0.f);
            continue;
          }
          const float* srow = src + ih * g.win + off;
          std::fill(drow, drow + lo, 0.f);
          if (g.sw == 1)
            copy_row(drow + lo, srow + lo, hi - lo);
          else if (g.sw == 2)
            copy_row_s2(drow + lo, srow + 2 * lo, hi - lo);
          else
            for (int64_t ow = lo; ow < hi; ++ow) drow[ow] = srow[ow * g.sw];
          std::fill(drow + hi, drow + g.wo, 0.f);
        }
      }
}

// Where each (i, j) tap of a strided convolution lands in a 16-wide block of dX row lanes:
// output column ow feeds iw = ow*sw - pl + j*dw, so a tap reaches every sw-th lane from its first
// one on the grid; `idx` moves the column row's consecutive values onto those lanes.
struct Col2imTap {
  int64_t ow0 = 0;               // first output column of the block
  uint16_t load = 0, lanes = 0;  // masks: values loaded from ow0 on; dX lanes written (0: none)
  int32_t idx[16] = {};
};
struct Col2imPlan {
  int64_t nblk = 0;             // 16-wide blocks of a dX row
  std::vector<int64_t> oh;      // [hin * kh]: output row fed by (ih, i), -1 where none
  std::vector<Col2imTap> taps;  // [nblk * kw]
  explicit Col2imPlan(const ConvGeom& g)
      : nblk((g.win + 15) / 16), oh(g.hin * g.kh, -1), taps(nblk * g.kw) {
    for (int64_t ih = 0; ih < g.hin; ++ih)
      for (int64_t i = 0; i < g.kh; ++i) {
        const int64_t t = ih + g.pt - i * g.dh;  // = oh * sh
        if (t >= 0 && t % g.sh == 0 && t / g.sh < g.ho) oh[ih * g.kh + i] = t / g.sh;
      }
    for (int64_t b = 0; b < nblk; ++b)
      for (int64_t j = 0; j < g.kw; ++j) {
        const int64_t n = std::min<int64_t>(16, g.win - b * 16);
        const int64_t u0 = b * 16 + g.pl - j * g.dw;  // = ow * sw at lane 0
        const int64_t l0 = u0 >= 0 ? (g.sw - u0 % g.sw) % g.sw : -u0;
        if (l0 >= n) continue;
        const int64_t ow0 = (u0 + l0) / g.sw;
        if (ow0 >= g.wo) continue;
        const int64_t cnt = std::min(g.wo - ow0, (n - 1 - l0) / g.sw + 1);
        Col2imTap& t = taps[b * g.kw + j];
        t.ow0 = ow0;
        t.load = static_cast<uint16_t>((1u << cnt) - 1u);
        for (int64_t k = 0; k < cnt; ++k) {
          t.lanes |= static_cast<uint16_t>(1u << (l0 + k * g.sw));
          t.idx[l0 + k * g.sw] = static_cast<int32_t>(k);
        }
      }
  }
};

// dx[ci] = the sum of the columns' contributions (column rows `ld` floats apart, as in im2col);
// dx points at channel 0 of the group, channels [c0, c1) are written.
static void col2im(const float* cols, const ConvGeom& g, int64_t ld, float* dx, int64_t c0,
                   int64_t c1, const Col2imPlan* plan) {
#if defined(__AVX512F__)
  if (g.sh == 1 && g.sw == 1) {
    // Unit stride: each dX row gathers its kh*kw contributions in a register (masked loads of
    // the column rows at the right shifts) and is stored once, with no read-modify-write
    // chains through memory (those stall on store forwarding when rows are short).
    for (int64_t ci = c0; ci < c1; ++ci) {
      float* dst = dx + ci * g.hin * g.win;
      for (int64_t ih = 0; ih < g.hin; ++ih)
        for (int64_t iw0 = 0; iw0 < g.win; iw0 += 16) {
          const int64_t n = std::min<int64_t>(16, g.win - iw0);
          __m512 acc = _mm512_setzero_ps();
          for (int64_t i = 0; i < g.kh; ++i) {
            const int64_t oh = ih + g.pt - i * g.dh;
            if (oh < 0 || oh >= g.ho) continue;
            for (int64_t j = 0; j < g.kw; ++j) {
              const int64_t off = j * g.dw - g.pl;  // iw = ow + off
              const int64_t lo = std::max<int64_t>(0, off - iw0);
              const int64_t hi = std::min<int64_t>(n, g.wo + off - iw0);
              if (lo >= hi) continue;
              const __mmask16 m = static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
              const float* src = cols + ((ci * g.kh + i) * g.kw + j) * ld + oh * g.wo + iw0 - off;
              acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(m, src));
            }
          }
          _mm512_mask_storeu_ps(dst + ih * g.win + iw0, static_cast<__mmask16>((1u << n) - 1u),
                                acc);
        }
    }
    return;
  }
  if (plan) {
    // Any stride: the same register accumulation per 16-wide dX row block, with the taps'
    // geometry from the plan (no divisions here): each (i, j) tap is a masked load of the column
    // row's consecutive values, spread by a permute onto every sw-th lane from its first one.
    for (int64_t ci = c0; ci < c1; ++ci) {
      float* dst = dx + ci * g.hin * g.win;
      for (int64_t ih = 0; ih < g.hin; ++ih)
        for (int64_t b = 0; b < plan->nblk; ++b) {
          const int64_t iw0 = b * 16, n = std::min<int64_t>(16, g.win - iw0);
          __m512 acc = _mm512_setzero_ps();
          for (int64_t i = 0; i < g.kh; ++i) {
            const int64_t oh = plan->oh[ih * g.kh + i];
            if (oh < 0) continue;
            for (int64_t j = 0; j < g.kw; ++j) {
              const Col2imTap& t = plan->taps[b * g.kw + j];
              if (!t.lanes) continue;
              const float* src = cols + ((ci * g.kh + i) * g.kw + j) * ld + oh * g.wo + t.ow0;
              const __m512 v = _mm512_maskz_loadu_ps(t.load, src);
              acc = _mm512_add_ps(
                  acc, _mm512_maskz_permutexvar_ps(t.lanes, _mm512_loadu_si512(t.idx), v));
            }
          }
          _mm512_mask_storeu_ps(dst + ih * g.win + iw0, static_cast<__mmask16>((1u << n) - 1u),
                                acc);
        }
    }
    return;
  }
#endif
  for (int64_t ci = c0; ci < c1; ++ci) {
    std::fill(dx + ci * g.hin * g.win, dx + (ci + 1) * g.hin * g.win, 0.f);
    for (int64_t i = 0; i < g.kh; ++i)
      for (int64_t j = 0; j < g.kw; ++j) {
        const float* src = cols + ((ci * g.kh + i) * g.kw + j) * ld;
        float* dst = dx + ci * g.hin * g.win;
        const int64_t off = j * g.dw - g.pl;
        const int64_t lo = std::min(g.wo, std::max<int64_t>(0, (-off + g.sw - 1) / g.sw));
        const int64_t hi = std::max(lo, std::min(g.wo, (g.win - off + g.sw - 1) / g.sw));
        for (int64_t oh = 0; oh < g.ho; ++oh) {
          const int64_t ih = oh * g.sh - g.pt + i * g.dh;
          if (ih < 0 || ih >= g.hin) continue;
          const float* srow = src + oh * g.wo;
          float* drow = dst + ih * g.win + off;
          if (g.sw == 1)
            add_row(drow + lo, srow + lo, hi - lo);
          else
            for (int64_t ow = lo; ow < hi; ++ow) drow[ow * g.sw] += srow[ow];
        }
      }
  }
}

#if defined(__AVX512F__)
constexpr int64_t kMaxRegTaps = 49;  // up to 7x7 kernels: one accumulator register per tap

// lanes [lo, hi) of a 16-lane block (none when hi <= lo)
static inline __mmask16 lane_range(int64_t lo, int64_t hi) {
  lo = std::max<int64_t>(lo, 0);
  hi = std::min<int64_t>(hi, 16);
  if (hi <= lo) return 0;
  return static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

// A unit-stride depthwise convolution's dW and dX for one channel of one image in registers:
// dW: per 16-wide block of a dC row, each tap's input run is one masked load (zero outside the
// image) and one FMA into that tap's accumulator (reduced once per image into dwacc); dX: each
// 16-wide block of a dX row sums its taps' masked dC loads times the tap weight and is stored
// once (no zero fill, no read-modify-write per tap).
static void dw_unit_image(const ConvGeom& g, const float* dc, const float* x, const float* w,
                          float* dx, double* dwacc) {
  const int64_t kh = g.kh, kw = g.kw;
  if (dwacc) {
    __m512 acc[kMaxRegTaps];
    for (int64_t t = 0; t < kh * kw; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t oh = 0; oh < g.ho; ++oh)
      for (int64_t ow0 = 0; ow0 < g.wo; ow0 += 16) {
        const __m512 d = _mm512_maskz_loadu_ps(lane_range(0, g.wo - ow0), dc + oh * g.wo + ow0);
        for (int64_t i = 0; i < kh; ++i) {
          const int64_t ih = oh + i * g.dh - g.pt;
          if (ih < 0 || ih >= g.hin) continue;
          for (int64_t j = 0; j < kw; ++j) {
            const int64_t iw0 = ow0 + j * g.dw - g.pl;  // input column of lane 0
            const __mmask16 m = lane_range(-iw0, g.win - iw0) & lane_range(0, g.wo - ow0);
            const __m512 xv = _mm512_maskz_loadu_ps(m, x + ih * g.win + iw0);
            acc[i * kw + j] = _mm512_fmadd_ps(d, xv, acc[i * kw + j]);
          }
        }
      }
    for (int64_t t = 0; t < kh * kw; ++t) dwacc[t] += _mm512_reduce_add_ps(acc[t]);
  }
  if (!dx) return;
  for (int64_t ih = 0; ih < g.hin; ++ih)
    for (int64_t iw0 = 0; iw0 < g.win; iw0 += 16) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < kh; ++i) {
        const int64_t oh = ih + g.pt - i * g.dh;
        if (oh < 0 || oh >= g.ho) continue;
        for (int64_t j = 0; j < kw; ++j) {
          const int64_t ow0 = iw0 - j * g.dw + g.pl;  // output column of lane 0
          const __mmask16 m = lane_range(-ow0, g.wo - ow0) & lane_range(0, g.win - iw0);
          acc = _mm512_fmadd_ps(_mm512_set1_ps(w[i * kw + j]),
                                _mm512_maskz_loadu_ps(m, dc + oh * g.wo + ow0), acc);
        }
      }
      _mm512_mask_storeu_ps(dx + ih * g.win + iw0, lane_range(0, g.win - iw0), acc);
    }
}

// The same for any stride (sw <= 16), by input rows with the col2im plan's taps: a tap's dC
// values for a 16-wide input block are one masked load spread by a permute onto the lanes of
// the input columns they feed (zero elsewhere); dX sums them times the tap weight, dW[tap]
// accumulates them times the input block (loaded once per block).
static void dw_strided_image(const ConvGeom& g, const Col2imPlan& plan, const float* dc,
                             const float* x, const float* w, float* dx, double* dwacc) {
  const int64_t kh = g.kh, kw = g.kw;
  __m512 acc[kMaxRegTaps];
  for (int64_t t = 0; t < kh * kw; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t ih = 0; ih < g.hin; ++ih)
    for (int64_t b = 0; b < plan.nblk; ++b) {
      const int64_t iw0 = b * 16;
      const __mmask16 nm = lane_range(0, g.win - iw0);
      const __m512 xv =
          dwacc ? _mm512_maskz_loadu_ps(nm, x + ih * g.win + iw0) : _mm512_setzero_ps();
      __m512 sum = _mm512_setzero_ps();
      for (int64_t i = 0; i < kh; ++i) {
        const int64_t oh = plan.oh[ih * kh + i];
        if (oh < 0) continue;
        for (int64_t j = 0; j < kw; ++j) {
          const Col2imTap& t = plan.taps[b * kw + j];
          if (!t.lanes) continue;
          const __m512 v = _mm512_maskz_loadu_ps(t.load, dc + oh * g.wo + t.ow0);
          const __m512 pv = _mm512_maskz_permutexvar_ps(t.lanes, _mm512_loadu_si512(t.idx), v);
          sum = _mm512_fmadd_ps(_mm512_set1_ps(w[i * kw + j]), pv, sum);
          if (dwacc) acc[i * kw + j] = _mm512_fmadd_ps(xv, pv, acc[i * kw + j]);
        }
      }
      if (dx) _mm512_mask_storeu_ps(dx + ih * g.win + iw0, nm, sum);
    }
  if (dwacc)
    for (int64_t t = 0; t < kh * kw; ++t) dwacc[t] += _mm512_reduce_add_ps(acc[t]);
}
#endif

void ConvKernel::Compute(Ort::KernelContext& ctx) {
  const ConvInputs in(ctx, *this);
  const In &dy = in.dy, &y = in.y, &x = in.x, &w = in.w, &cv = in.cv, &gamma = in.gamma,
           &mean = in.mean, &istd = in.istd;
  const int64_t N = in.N, C = in.C, H = in.H, Wd = in.W, Cin = in.Cin, Hin = in.Hin, Win = in.Win,
                kh = in.kh, kw = in.kw;
  ConvGeom g{Cin / group, Hin,        Win,     kh,      kw,           H,           Wd,
             strides[0],  strides[1], pads[0], pads[1], dilations[0], dilations[1]};

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
  // BN + activation backward per channel. Its sums (dBeta, dGamma, and dBc, which follows from
  // them: sum dC = -coef * sum(dZ xhat) * sum(xhat)) need one read of dY, Y, Cv; dC needs a
  // second read. Two ways:
  // - channel slab (`slab` below: the depthwise path, and every path when dC has a full-size
  //   home): per channel, dZ = act'(Y) dY goes to the channel's dC planes while the sums are
  //   taken, and dC is formed over it right after, while the channel's planes are still in
  //   cache: dY, Y, Cv read once, dC written once (~4T floats instead of ~7T).
  // - chunked (no full-size dC: the node leaves dC unnamed): the sums first, then dC image
  //   chunk by image chunk right before the conv GEMMs that consume it, with dZ recomputed per
  //   row (cheaper than a full-size dZ buffer).
  const bool has_act = activation != Act::kIdentity;
  // dZ of one row (n, ch) into buf (HW floats), or dY's row itself for identity
  auto dz_row = [&](int64_t off, float* buf) -> const float* {
    if (!has_act) return dyp + off;
    act_grad_block(activation, 1.f, dyp + off, yp + off, buf, HW);
    return buf;
  };
  // the same into dst always (dst may be dY's row: each element is written after it is read)
  auto dz_into = [&](int64_t off, float* dst) -> const float* {
    if (has_act)
      act_grad_block(activation, 1.f, dyp + off, yp + off, dst, HW);
    else if (dst != dyp + off)
      copy_row(dst, dyp + off, HW);
    return dst;
  };
  std::vector<float> dgam(C), dbet(C), dbias(C), cfv(C), a0v(C), a1v(C);
  // channel ch: its sums and coefficients; with `planes` (n -> the channel's dC plane of image
  // n) also its dC, formed in place over dZ
  auto bn_channel = [&](int64_t ch, float* row, const std::function<float*(int64_t)>* planes) {
    const float mu = mp[ch], is = sp[ch];
    double sdz = 0, sdzc = 0, scv = 0;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t off = (n * C + ch) * HW;
      const float* dzp = planes ? dz_into(off, (*planes)(n)) : dz_row(off, row);
      CA dz(dzp, HW), cc(cvp + off, HW);
      sdz += dz.sum();
      sdzc += (dz * (cc - mu)).sum();
      if (want_dbc) scv += cc.sum() - mu * static_cast<float>(HW);
    }
    const double sdzx = sdzc * is;  // sum dZ * xhat
    const double coef = static_cast<double>(gp[ch]) * is / R;
    dbet[ch] = static_cast<float>(sdz);
    dgam[ch] = static_cast<float>(sdzx);
    dbias[ch] = static_cast<float>(-coef * sdzx * scv * is);
    const float cf = cfv[ch] = static_cast<float>(coef), a0 = a0v[ch] = static_cast<float>(sdz),
                a1 = a1v[ch] = static_cast<float>(sdzx) * is, rf = static_cast<float>(R);
    if (!planes) return;
    for (int64_t n = 0; n < N; ++n) {
      MA d((*planes)(n), HW);
      d = cf * (rf * d - a0 - (CA(cvp + (n * C + ch) * HW, HW) - mu) * a1);
    }
  };
  auto write_sums = [&] {
    if (want_dg) std::copy(dgam.begin(), dgam.end(), dgo);
    if (want_db) std::copy(dbet.begin(), dbet.end(), dbo);
    if (want_dbc) std::copy(dbias.begin(), dbias.end(), dbc);
  };

  // ---- depthwise (one input channel per output channel: MobileNet's 3x3 / 5x5 convs, any
  // stride) ----
  // Every channel is independent: per channel, its BN + activation backward (channel slab),
  // then per tap the direct correlation (dW) and the direct scatter (dX) of the whole plane
  // block at once: no column matrix and no per-group GEMM (a 1 x kh*kw GEMM per group and
  // chunk costs more in calls than in flops).
  if (group == C && Cin == C && g.cin_g == 1) {
    const float* xp = x.ptr<float>();
    const float* wp = w.ptr<float>();
    const int64_t Khw = kh * kw, HWin = Hin * Win, sh = g.sh, sw = g.sw;
    using SA2 = Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>;  // a tap's strided input grid
    using CS2 = Eigen::Map<const Arr2, 0, SA2>;
    using MS2 = Eigen::Map<Arr2, 0, SA2>;
    // each tap's block of output positions whose input lies inside the image (the same for
    // every channel and image): rows [r0, r1), columns [lo, hi), first input at xoff
    struct Tap {
      int64_t k, r0, rows, lo, len, xoff;
    };
    std::vector<Tap> taps;
    for (int64_t i = 0; i < kh; ++i)
      for (int64_t j = 0; j < kw; ++j) {
        const int64_t offw = j * g.dw - g.pl, offh = i * g.dh - g.pt;
        const int64_t lo = std::min(g.wo, std::max<int64_t>(0, (-offw + sw - 1) / sw));
        const int64_t hi = std::max(lo, std::min(g.wo, (Win - offw + sw - 1) / sw));
        const int64_t r0 = std::min(H, std::max<int64_t>(0, (-offh + sh - 1) / sh));
        const int64_t r1 = std::max(r0, std::min(H, (Hin - offh + sh - 1) / sh));
        if (hi > lo && r1 > r0)
          taps.push_back(
              {i * kw + j, r0, r1 - r0, lo, hi - lo, (r0 * sh + offh) * Win + lo * sw + offw});
      }
    const bool unit = sh == 1 && sw == 1;
    const SA2 st(sh * Win, sw);
    std::unique_ptr<Col2imPlan> plan;  // strided taps in registers (AVX-512, sw <= 16)
#if defined(__AVX512F__)
    if (!unit && sw <= 16) plan.reset(new Col2imPlan(g));
#endif
    parallel_for(C, 1, [&](int, int64_t c0, int64_t c1) {
      std::vector<float> slab(have_dc ? 0 : N * HW);
      std::vector<double> dwacc(Khw);
      for (int64_t ch = c0; ch < c1; ++ch) {
        const std::function<float*(int64_t)> planes = [&](int64_t n) {
          return have_dc ? dc_out + (n * C + ch) * HW : slab.data() + n * HW;
        };
        bn_channel(ch, nullptr, &planes);
        if (!want_dx && !want_dw) continue;
        std::fill(dwacc.begin(), dwacc.end(), 0.0);
        const float* wc = wp + ch * Khw;
        for (int64_t n = 0; n < N; ++n) {
          const float* dcp = planes(n);
          const float* xc = xp + (n * C + ch) * HWin;
          float* dxc = want_dx ? dx + (n * C + ch) * HWin : nullptr;
#if defined(__AVX512F__)
          if (unit && Khw <= kMaxRegTaps) {
            dw_unit_image(g, dcp, xc, wc, dxc, want_dw ? dwacc.data() : nullptr);
            continue;
          }
          if (plan && Khw <= kMaxRegTaps) {
            dw_strided_image(g, *plan, dcp, xc, wc, dxc, want_dw ? dwacc.data() : nullptr);
            continue;
          }
#endif
          if (dxc) std::fill(dxc, dxc + HWin, 0.f);
          for (const Tap& t : taps) {
            const CA2 D(dcp + t.r0 * Wd + t.lo, t.rows, t.len, Eigen::OuterStride<>(Wd));
            if (unit) {
              const Eigen::OuterStride<> os(Win);
              if (want_dw) dwacc[t.k] += (D * CA2(xc + t.xoff, t.rows, t.len, os)).sum();
              if (dxc) MA2(dxc + t.xoff, t.rows, t.len, os) += wc[t.k] * D;
            } else {
              if (want_dw) dwacc[t.k] += (D * CS2(xc + t.xoff, t.rows, t.len, st)).sum();
              if (dxc) MS2(dxc + t.xoff, t.rows, t.len, st) += wc[t.k] * D;
            }
          }
        }
        if (want_dw)
          for (int64_t k = 0; k < Khw; ++k) dw[ch * Khw + k] = static_cast<float>(dwacc[k]);
      }
    });
    write_sums();
    return;
  }
  // a full-size dC (the node names it): every channel's dC is formed with its sums (slab)
  if (have_dc) {
    parallel_for(C, 1, [&](int, int64_t c0, int64_t c1) {
      for (int64_t ch = c0; ch < c1; ++ch) {
        const std::function<float*(int64_t)> planes = [&](int64_t n) {
          return dc_out + (n * C + ch) * HW;
        };
        bn_channel(ch, nullptr, &planes);
      }
    });
  } else {
    parallel_for(C, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, N * HW)),
                 [&](int, int64_t c0, int64_t c1) {
                   std::vector<float> dzb(has_act ? HW : 0);  // one row of dZ, stays in L1
                   for (int64_t ch = c0; ch < c1; ++ch) bn_channel(ch, dzb.data(), nullptr);
                 });
  }
  write_sums();
  if (!want_dx && !want_dw) return;
  const float rf = static_cast<float>(R);

  // ---- conv dgrad (col2im of W^T dC) and wgrad (dC im2col(X)^T), per (image chunk, group) ----
  // Images go in chunks of nb, laid out channel-major across the chunk: the columns are
  // [Kc, nb*HW] and dC_g is [Cg, nb*HW], so wgrad is ONE GEMM per chunk with inner dimension
  // nb*HW (accumulating over images inside the GEMM) and dgrad one GEMM that reads W once.
  // Deep-channel, small-map layers (ResNet-50's last stage: 512 channels, 2x2 maps) need this:
  // a GEMM per image there has an inner dimension of 4 and a [Cg, Kc] partial to add per image,
  // twice onnxruntime's ConvGrad time. At most ~1 MiB of columns per chunk (one image when an
  // image's columns are larger: the layout is then the image's own, and X, dC and dX serve as
  // the matrices where they can), so the scratch stays small next to the activations.
  // GEMMs run through onnxruntime's MatMul (MLAS on the intra-op pool); im2col / col2im split
  // over (image, input channel) pairs on our threads.
  const OrtKernelContext* kc = ctx.GetOrtKernelContext();
  const int64_t Cg = C / group, Kc = g.cin_g * kh * kw;
  const bool pointwise = kh == 1 && kw == 1 && g.sh == 1 && g.sw == 1 && pads[0] == 0 &&
                         pads[1] == 0 && pads[2] == 0 && pads[3] == 0 && Hin == H && Win == Wd;
  const float* xp = x.ptr<float>();
  const float* wp = w.ptr<float>();
  const int64_t col_sz = Kc * HW;
  // images per chunk: at most ~1 MiB of columns, in chunks of equal size (8 images in chunks
  // of 7 would leave a one-image GEMM behind)
  const int64_t nb_cap =
      std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, std::max(col_sz, Cg * HW)));
  const int64_t n_chunks = (N + nb_cap - 1) / nb_cap;
  const int64_t nb_max = n_chunks ? (N + n_chunks - 1) / n_chunks : 0;
  const bool one_image = nb_max == 1;
  // X (pointwise) and dX (pointwise dgrad, group 1) serve as the column matrices of one image
  const bool x_is_cols = pointwise && one_image && group == 1;
  // dX[i] = W^T dC[i] batched over the chunk's images (W broadcast), straight into dX, where an
  // image's map is wide enough for MLAS to run at speed (>= 64 columns) or the chunk is one
  // image; else (deep layers with small maps: ResNet-50's layer3/4, 4x4 and 2x2) ONE GEMM
  // W^T dC_g over all nb*HW columns of the chunk, unpacked into dX after: a per-image GEMM
  // there has 4 or 16 columns and leaves most of each MLAS vector register idle.
  const bool dx_direct = pointwise && group == 1 && (one_image || HW >= 64);
  const bool need_cols = (want_dw && !x_is_cols) || (want_dx && !dx_direct);
  std::unique_ptr<float[]> cols(need_cols ? new float[static_cast<size_t>(nb_max * col_sz)]
                                          : nullptr);
  std::unique_ptr<float[]> dcc(have_dc ? nullptr : new float[static_cast<size_t>(nb_max * C * HW)]);
  std::unique_ptr<float[]> dct(one_image ? nullptr
                                         : new float[static_cast<size_t>(nb_max * Cg * HW)]);
  const bool many_chunks = nb_max < N;
  std::unique_ptr<float[]> dwt(want_dw && many_chunks ? new float[static_cast<size_t>(Cg * Kc)]
                                                      : nullptr);
  std::unique_ptr<Col2imPlan> c2i_plan;
#if defined(__AVX512F__)
  if (want_dx && !pointwise && (g.sh != 1 || g.sw != 1) && g.sw <= 16)
    c2i_plan.reset(new Col2imPlan(g));
#endif
  if (want_dw && N == 0) std::fill(dw, dw + C * Kc, 0.f);
  for (int64_t n0 = 0; n0 < N; n0 += nb_max) {
    const int64_t nb = std::min(nb_max, N - n0), L = nb * HW;
    const int64_t rows_grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, L));
    float* dcn = have_dc ? dc_out + n0 * C * HW : dcc.get();  // the chunk's dC, [nb, C, HW]
    // dC = gamma inv_std / R (R dZ - sum dZ - xhat sum(dZ xhat)) for the chunk's images
    // (formed already when it has a full-size home)
    if (!have_dc)
      parallel_for(nb * C, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, HW)),
                   [&](int, int64_t j0, int64_t j1) {
                     std::vector<float> dzb(has_act ? HW : 0);
                     for (int64_t j = j0; j < j1; ++j) {
                       const int64_t ch = j % C, off = (n0 * C + j) * HW;
                       CA d(dz_row(off, dzb.data()), HW), cc(cvp + off, HW);
                       MA o(dcn + j * HW, HW);
                       o = cfv[ch] * (rf * d - a0v[ch] - (cc - mp[ch]) * a1v[ch]);
                     }
                   });
    for (int64_t gi = 0; gi < group; ++gi) {
      // dC_g as [Cg, nb*HW]: a view of the chunk for one image, else gathered
      const float* dcg = dcn + gi * Cg * HW;
      if (!one_image && (want_dw || !dx_direct)) {
        parallel_for(Cg, rows_grain, [&](int, int64_t r0, int64_t r1) {
          pack_rows(dcn + gi * Cg * HW, C * HW, nb, HW, dct.get(), L, r0, r1);
        });
        dcg = dct.get();
      }
      const float* wg = wp + gi * Cg * Kc;  // [Cg, Kc]
      auto x_img = [&](int64_t i) { return xp + ((n0 + i) * Cin + gi * g.cin_g) * Hin * Win; };
      if (want_dw) {
        const float* colp = x_img(0);
        if (pointwise && !x_is_cols) {  // cols[ci][i*HW + p] = X[i][ci][p]
          parallel_for(g.cin_g, rows_grain, [&](int, int64_t r0, int64_t r1) {
            pack_rows(x_img(0), Cin * HW, nb, HW, cols.get(), L, r0, r1);
          });
          colp = cols.get();
        } else if (!x_is_cols) {  // cols[(ci*kh + ki)*kw + kj][i*HW + p]
          parallel_for(nb * g.cin_g, 1, [&](int, int64_t u0, int64_t u1) {
            for (int64_t u = u0; u < u1; ++u) {
              const int64_t i = u / g.cin_g, ci = u % g.cin_g;
              im2col(x_img(i), g, cols.get() + i * HW, L, ci, ci + 1);
            }
          });
          colp = cols.get();
        }
        // dW_g[Cg, Kc] (+)= dC_g[Cg, L] cols[Kc, L]^T: the first chunk writes dW, later ones add
        float* dwg = dw + gi * Cg * Kc;
        if (n0 == 0) {
          mm.run(kc, false, true, 1, Cg, Kc, L, dcg, colp, dwg);
        } else {
          mm.run(kc, false, true, 1, Cg, Kc, L, dcg, colp, dwt.get());
          MA(dwg, Cg * Kc) += CA(dwt.get(), Cg * Kc);
        }
      }
      if (want_dx) {
        if (dx_direct) {  // dX[i][Cin, HW] = W^T dC[i], straight into dX
          mm.run(kc, true, false, nb, Kc, HW, Cg, wg, dcn, dx + n0 * Cin * HW, false, true);
          continue;
        }
        float* gcols = cols.get();
        mm.run(kc, true, false, 1, Kc, L, Cg, wg, dcg, gcols);  // W_g^T dC_g: [Kc, L]
        if (pointwise) {  // dX[i][gi*cin_g + ci][p] = gcols[ci][i*HW + p]
          parallel_for(g.cin_g, rows_grain, [&](int, int64_t r0, int64_t r1) {
            unpack_rows(gcols, L, nb, HW, dx + (n0 * Cin + gi * g.cin_g) * HW, Cin * HW, r0, r1);
          });
          continue;
        }
        parallel_for(nb * g.cin_g, 1, [&](int, int64_t u0, int64_t u1) {
          for (int64_t u = u0; u < u1; ++u) {
            const int64_t i = u / g.cin_g, ci = u % g.cin_g;
            float* dxg = dx + ((n0 + i) * Cin + gi * g.cin_g) * Hin * Win;  // the image's group
            col2im(gcols + i * HW, g, L, dxg, ci, ci + 1, c2i_plan.get());
          }
        });
      }
    }
  }
}

}  // namespace

void add_conv_bn_relu_grad_cpu_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<ConvKernel>>(domain);
}

}  // namespace fusecli
