// FlashAttention / FlashAttentionGrad tensor-core kernels: what they share. Warp-level matrix
// products with mma.sync (PTX ISA "Matrix Fragments for mma.m16n8k8" (.tf32) and
// "mma.m16n8k16" (.f16 / .bf16)), operands read from shared memory, float32 accumulation.
//
// Precisions (template parameter P):
//   kF32    float32 inputs; with `split` (the default) each product as split TF32 ("3xTF32":
//           x = big + small with big = tf32(x), small = tf32(x - big);
//           a b ~ a_s b_b + a_b b_s + a_b b_b), which keeps float32 accuracy (NOTES.md and
//           test_split_tf32.py: the error model); without it one TF32 product (the `tf32`
//           attribute: faster, ~1e-3 relative)
//   kF16 / kBf16  16-bit inputs (m16n8k16), float32 accumulation
//
// Fragment layout (lane = 4 * g + t; g = lane >> 2 "groupID", t = lane & 3):
//   tf32 m16n8k8   A (16x8): a0 (g, t) a1 (g+8, t) a2 (g, t+4) a3 (g+8, t+4)
//                  B (8x8):  b0 (t, g) b1 (t+4, g)
//   16-bit m16n8k16 A (16x16): register r holds the pair (row g + 8 (r & 1), cols 2t + 8 (r >> 1)
//                  + {0, 1}), the lower column in the low half
//                  B (16x8): register r holds rows 2t + 8 r + {0, 1} of column g
//   C / D (16x8, f32): c0 (g, 2t) c1 (g, 2t+1) c2 (g+8, 2t) c3 (g+8, 2t+1)
// Shared-memory tiles are row-major with a padded leading dimension (bank spread); the head
// dims are zero-padded to the kernel's bucket DP so the k loops need no bounds.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "flash_cuda.cuh"

namespace fusecli_flash {

enum Prec { kF32 = 0, kF16 = 2, kBf16 = 3 };

template <int P> struct PrecOf;
template <> struct PrecOf<kF32> {
  using T = float;  // element type of the inputs and of the shared-memory tiles
  static constexpr int kK = 8;
  static constexpr int kPad = 4;  // leading-dimension padding, elements
};
template <> struct PrecOf<kF16> {
  using T = __half;
  static constexpr int kK = 16;
  static constexpr int kPad = 8;
};
template <> struct PrecOf<kBf16> {
  using T = __nv_bfloat16;
  static constexpr int kK = 16;
  static constexpr int kPad = 8;
};

template <typename T> __device__ __forceinline__ uint32_t bits16(T v) {
  return static_cast<uint32_t>(*reinterpret_cast<const unsigned short*>(&v));
}

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_16(float (&c)[4], const uint32_t (&a)[4],
                                       const uint32_t (&b)[2], __half) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_16(float (&c)[4], const uint32_t (&a)[4],
                                       const uint32_t (&b)[2], __nv_bfloat16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c[n] (16 x 8 tiles n = 0..NT) += A[16 x kdim] B[kdim x 8 NT] for one warp. A(r, k) =
// a[r * lda + k]; B(k, n) = b[n * ldb + k] when BN ("n-major", e.g. K for Q K^T) else
// b[k * ldb + n]. kdim is a multiple of the instruction's k (8 or 16); lda, ldb even. `split`
// (float32 only): three TF32 products per multiply instead of one.
template <int P, int NT, bool BN, typename T>
__device__ __forceinline__ void warp_gemm(float (&c)[NT][4], const T* __restrict__ a, int lda,
                                          const T* __restrict__ b, int ldb, int kdim, bool split) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if constexpr (P == kF32) {
#pragma unroll 2
    for (int k0 = 0; k0 < kdim; k0 += 8) {
      const float ax[4] = {a[g * lda + k0 + t], a[(g + 8) * lda + k0 + t], a[g * lda + k0 + t + 4],
                           a[(g + 8) * lda + k0 + t + 4]};
      uint32_t ab[4], as[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        ab[i] = to_tf32(ax[i]);
        as[i] = to_tf32(ax[i] - __uint_as_float(ab[i]));
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int col = n * 8 + g;
        const float bx[2] = {BN ? b[col * ldb + k0 + t] : b[(k0 + t) * ldb + col],
                             BN ? b[col * ldb + k0 + t + 4] : b[(k0 + t + 4) * ldb + col]};
        const uint32_t bb[2] = {to_tf32(bx[0]), to_tf32(bx[1])};
        if (split) {
          const uint32_t bs[2] = {to_tf32(bx[0] - __uint_as_float(bb[0])),
                                  to_tf32(bx[1] - __uint_as_float(bb[1]))};
          mma_tf32(c[n], as, bb);  // the small terms first, then the big product
          mma_tf32(c[n], ab, bs);
        }
        mma_tf32(c[n], ab, bb);
      }
    }
  } else {
#pragma unroll 2
    for (int k0 = 0; k0 < kdim; k0 += 16) {
      const uint32_t* a32 = reinterpret_cast<const uint32_t*>(a);
      uint32_t af[4];
#pragma unroll
      for (int r = 0; r < 4; ++r)
        af[r] = a32[((g + 8 * (r & 1)) * lda + k0 + 2 * t + 8 * (r >> 1)) >> 1];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int col = n * 8 + g;
        uint32_t bf[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int k = k0 + 2 * t + 8 * r;
          if constexpr (BN)
            bf[r] = reinterpret_cast<const uint32_t*>(b)[(col * ldb + k) >> 1];
          else
            bf[r] = bits16(b[k * ldb + col]) | (bits16(b[(k + 1) * ldb + col]) << 16);
        }
        mma_16(c[n], af, bf, T());
      }
    }
  }
}

// Row (r) and column (c) of accumulator element e (0..3) of a 16 x 8 tile, for this lane.
__device__ __forceinline__ int c_row(int e) {
  return ((threadIdx.x & 31) >> 2) + 8 * (e >> 1);
}
__device__ __forceinline__ int c_col(int e) {
  return 2 * (threadIdx.x & 3) + (e & 1);
}

// Max / sum over the 4 lanes of a quad (the lanes holding one accumulator row).
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Copies rows [r0, r0 + nr) of a [*, n] row-major matrix (T) into a [rows, DP] tile with leading
// dimension ld, zero beyond nr rows and n columns. `stride_r` / `stride_c` address element
// (r, x) at src[r * stride_r + x * stride_c] (K stored [D, Sk] is stride_r 1, stride_c Sk).
template <typename T>
__device__ __forceinline__ void load_tile(T* __restrict__ dst, int rows, int dp, int ld,
                                          const T* __restrict__ src, int64_t nr, int64_t n,
                                          int64_t stride_r, int64_t stride_c) {
  const T zero = fl_to<T>(0.f);
  if (stride_c == 1) {
    for (int idx = threadIdx.x; idx < rows * dp; idx += blockDim.x) {
      const int r = idx / dp, x = idx - r * dp;
      dst[r * ld + x] = r < nr && x < n ? src[r * stride_r + x] : zero;
    }
  } else {  // walk along r (contiguous in memory) first
    for (int idx = threadIdx.x; idx < rows * dp; idx += blockDim.x) {
      const int x = idx / rows, r = idx - x * rows;
      dst[r * ld + x] = r < nr && x < n ? src[r * stride_r + x * stride_c] : zero;
    }
  }
}

// The head-dim bucket of the tensor-core kernels for max(D, Dv), 0 when none applies.
inline int dp_bucket(int64_t d) {
  return d <= 32 ? 32 : d <= 64 ? 64 : d <= 96 ? 96 : d <= 128 ? 128 : d <= 256 ? 256 : 0;
}

}  // namespace fusecli_flash
