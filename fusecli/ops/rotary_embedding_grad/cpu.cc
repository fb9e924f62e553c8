// RotaryEmbeddingGrad: CPU kernel (rows in parallel; each row's halves / pairs vectorize).
#include "cpu_kernel.h"
#include "rope_bcast.h"

namespace fusecli {
namespace {

struct RopeKernel : CpuKernel<RopeKernel, kRotaryEmbeddingGrad> {  // interleaved, axis
  using CpuKernel::CpuKernel;
  void Compute(Ort::KernelContext& ctx);
};

// one row: dx = dy c + rot^T(dy s)
void rope_row(const float* dy, const float* c, const float* s, float* dx, int64_t d,
              bool interleaved) {
  if (interleaved) {
    for (int64_t k = 0; k < d; k += 2) {
      const float y0 = dy[k], y1 = dy[k + 1];
      dx[k] = y0 * c[k] + y1 * s[k + 1];
      dx[k + 1] = y1 * c[k + 1] - y0 * s[k];
    }
    return;
  }
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) dx[i] = dy[i] * c[i] + dy[i + h] * s[i + h];
  for (int64_t i = h; i < d; ++i) dx[i] = dy[i] * c[i] - dy[i - h] * s[i - h];
}

void RopeKernel::Compute(Ort::KernelContext& ctx) {
  In dy = get_input(ctx, 0), cos = get_input(ctx, 1), sin = get_input(ctx, 2);
  const RopeBcast b = rope_bcast(dy, cos, sin, axis, interleaved);
  bool present;
  float* dx = output_or_null<float>(ctx, 0, dy.shape, &present);
  if (!present || b.rows == 0) return;
  const float *g = dy.ptr<float>(), *c = cos.ptr<float>(), *s = sin.ptr<float>();
  const int rank = static_cast<int>(b.dims.size());
  const bool inter = interleaved != 0;
  parallel_for(b.rows, std::max<int64_t>(1, (1 << 14) / b.d), [&](int, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      // cos / sin row of dY row r: its multi-index over dims[:-1], times the broadcast strides
      int64_t rem = r, off = 0;
      for (int k = rank - 2; k >= 0; --k) {
        off += (rem % b.dims[k]) * b.cs_strides[k];
        rem /= b.dims[k];
      }
      rope_row(g + r * b.d, c + off, s + off, dx + r * b.d, b.d, inter);
    }
  });
}

}  // namespace

void add_rotary_embedding_grad_cpu_ops(Ort::CustomOpDomain& domain) {
  add_op<FusedOp<RopeKernel>>(domain);
}

}  // namespace fusecli
