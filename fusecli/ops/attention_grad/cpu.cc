// AttentionGrad: CPU kernel.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <numeric>
#include <vector>

#include "attention_inputs.h"
#include "cpu_eigen.h"
#include "cpu_gemm.h"
#include "cpu_kernel.h"

namespace fusecli {
namespace {

// ================================= AttentionGrad ============================================
struct AttnKernel : CpuKernel<AttnKernel, kAttentionGrad> {  // attributes: see AttnAttrs
  template <typename TOp>
  AttnKernel(const OrtKernelInfo* info, const TOp* op) : CpuKernel(info, op), mm(info) {
    check_attn_attrs(*this);
  }
  void Compute(Ort::KernelContext& ctx);
  OrtMatMul mm;
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
    if (!out.empty() && out.back().kv == kv)
      out.back().n += e - b;
    else
      out.push_back({b, e - b, kv});
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
  auto at = [&](const Seg& s, const float* base, int64_t per) {
    return base + (s.b - b0) * rows * per;
  };
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

void AttnKernel::Compute(Ort::KernelContext& ctx) {
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
  const float f =
      (!want_ds && std::fabs(scale_q) >= 1e-20f && std::fabs(scale_q) <= 1e20f) ? scale_q : 1.f;
  // Batch items go in chunks whose dS scratch (~2 MiB) stays in cache between the dP GEMM, the
  // softmax-backward pass and the dQ / dK GEMMs; each GEMM is one batched onnxruntime MatMul
  // (a run of query items sharing a kv item is one GEMM of its stacked rows; chunks hold whole
  // runs when one fits, so grouped K / V need no per-head copies).
  const int64_t item = Sq * Sk;
  int64_t chunk =
      std::max<int64_t>(1, std::min<int64_t>(B, (int64_t(1) << 19) / std::max<int64_t>(1, item)));
  const int64_t lk = std::max<int64_t>(1, km.run()), lv = std::max<int64_t>(1, vm.run());
  const int64_t runs = lk / std::gcd(lk, lv) * lv;
  if (runs <= chunk) chunk = chunk / runs * runs;
  // the fill mask: dQ and dK read dS as 0 at filled positions; the dS output is not zeroed,
  // so with both a dS output and dQ / dK the zeroed dS goes to the scratch
  const uint8_t* fillp = in.fill.present && (want_dq || want_dk) ? in.fill.ptr<uint8_t>() : nullptr;
  const int64_t fill_cs = fillp ? in.fill_strides.back() : 0;  // 0: one flag per row
  const bool fill_kept_ = fill_kept != 0;
  const bool split_ds = fillp && want_ds && (want_dq || want_dk);
  std::unique_ptr<float[]> ds(
      need_ds && (!want_ds || split_ds) ? new float[static_cast<size_t>(chunk * item)] : nullptr);
  const bool guard = nan_guard != 0;  // dV reads P's NaN entries (fully masked rows) as 0
  std::unique_ptr<float[]> pd(
      (maskp || guard) && want_dv ? new float[static_cast<size_t>(chunk * item)] : nullptr);
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
    if (want_dv) {  // dV = sum_group Pd^T dO; Pd = Pg * mask * keep, Pg = P (NaN -> 0: guard)
      const float* pa = pb;
      if (mb || guard) {
        parallel_for(rows, grain, [&](int, int64_t r0, int64_t r1) {
          const int64_t o = r0 * Sk, len = (r1 - r0) * Sk;
          MA out(pd.get() + o, len);
          if (guard)
            out = CA(pb + o, len).isNaN().select(0.f, CA(pb + o, len));
          else
            out = CA(pb + o, len);
          if (mb)
            out *= Eigen::Map<const Eigen::Array<uint8_t, Eigen::Dynamic, 1>>(mb + o, len)
                       .cast<float>() *
                   keep;
        });
        pa = pd.get();
      }
      gemm_scatter(mm, kc, vsegs, b0, Sq, Sk, Dv, pa, dOb, dv, v_touched, tmp);
    }
    if (!need_ds) continue;
    float* dsb = want_ds ? ds_out + b0 * item : ds.get();
    float* dsg = split_ds ? ds.get() : dsb;  // the dS dQ and dK read (fill-zeroed)
    gemm_gather(mm, kc, vsegs, b0, true, Sq, Sk, Dv, dOb, vp, dsb);  // dPd = dO V^T
    // dP = dPd * mask * keep; dS = f * P * (dP - rowsum(dP * P)), in place, rows split over
    // threads; dSm = Where(filled, 0, dS) (in dsg: in place unless dS is an output too)
    const auto t0 = std::chrono::steady_clock::now();
    parallel_for(rows, grain, [&](int, int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) {
        MA d(dsb + i * Sk, Sk);
        CA pr(pb + i * Sk, Sk);
        if (mb)
          d *= Eigen::Map<const Eigen::Array<uint8_t, Eigen::Dynamic, 1>>(mb + i * Sk, Sk)
                   .cast<float>() *
               keep;
        const float rs = (d * pr).sum();
        d = (f * pr) * (d - rs);
        if (!fillp) continue;
        float* g = dsg + i * Sk;
        if (split_ds) std::copy(d.data(), d.data() + Sk, g);
        const uint8_t* fr = fillp + in.fill_row((b0 * Sq) + i);
        if (fill_cs == 0) {
          if ((fr[0] != 0) != fill_kept_) std::fill(g, g + Sk, 0.f);
        } else {
          for (int64_t j = 0; j < Sk; ++j)
            if ((fr[j] != 0) != fill_kept_) g[j] = 0.f;
        }
      }
    });
    add_phase_ns(kAttnSoftmaxPhase, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now() - t0)
                                        .count());
    if (want_dq) {  // dQ = dS K (K as [Sk, D])
      float* dqb = dq + b0 * Sq * D;
      gemm_gather(mm, kc, ksegs, b0, k_transposed, Sq, D, Sk, dsg, kp, dqb);
      if (scale_q != f) MA(dqb, rows * D) *= scale_q / f;
    }
    if (want_dk) {  // dK = sum_group dS^T Q ([Sk, D]) | Q^T dS ([D, Sk])
      if (!k_transposed)
        gemm_scatter(mm, kc, ksegs, b0, Sq, Sk, D, dsg, qb, dk, k_touched, tmp);
      else
        gemm_scatter(mm, kc, ksegs, b0, Sq, D, Sk, qb, dsg, dk, k_touched, tmp);
    }
  }
  if (want_dk && scale_k != f) MA(dk, k.numel()) *= scale_k / f;
}

}  // namespace

void add_attention_grad_cpu_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<AttnKernel>>(domain);
}

}  // namespace fusecli
