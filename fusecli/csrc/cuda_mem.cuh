// Helpers of the memory-bound CUDA kernels (elementwise ops, row norms, RoPE): 16-byte packs
// of float / __half / __nv_bfloat16, their loads and stores, the alignment test that chooses a
// vectorised kernel over its scalar fallback, the 16-bit element types of the launchers and a
// grid size from the occupancy of a kernel. See docs/gpu-kernels-memory.md.
#pragma once

#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "cuda_common.cuh"

namespace {

// 16 bytes of T: 4 floats or 8 halves. Loaded and stored as one 128-bit access (LDG.128 /
// STG.128); the pointer must be 16-byte aligned (aligned16).
template <typename T> struct alignas(16) Pack {
  static constexpr int kN = 16 / static_cast<int>(sizeof(T));
  T v[kN];
};

template <typename T> __device__ __forceinline__ Pack<T> ld_pack(const T* p) {
  Pack<T> r;
  *reinterpret_cast<uint4*>(&r) = *reinterpret_cast<const uint4*>(p);
  return r;
}
template <typename T> __device__ __forceinline__ void st_pack(T* p, const Pack<T>& v) {
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&v);
}
template <typename T> __device__ __forceinline__ Pack<T> zero_pack() {
  Pack<T> r;
  *reinterpret_cast<uint4*>(&r) = make_uint4(0u, 0u, 0u, 0u);
  return r;
}

// The vectorised kernels are opt-in until measured on a GPU: FUSECLI_MEMK_PATH=vec selects
// them, anything else (unset) the scalar kernels. Read at every launch (a test may switch it).
inline bool memk_vec() {
  const char* v = std::getenv("FUSECLI_MEMK_PATH");
  return v && std::strcmp(v, "vec") == 0;
}

// true when every non-null pointer is 16-byte aligned
inline bool aligned16(std::initializer_list<const void*> ps) {
  uintptr_t bits = 0;
  for (const void* p : ps) bits |= reinterpret_cast<uintptr_t>(p);
  return (bits & 15u) == 0;
}

// Blocks for a grid-stride kernel over `work` items of `per_block` each: enough to fill every SM
// to the kernel's occupancy (all of them resident: one wave), never more than the work needs.
template <typename K>
int64_t resident_grid(K kernel, int threads, size_t smem, int64_t work, int64_t per_block) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) !=
          cudaSuccess ||
      per_sm < 1)
    per_sm = 1;
  int64_t g = static_cast<int64_t>(per_sm) * sm_count();
  const int64_t need = (work + per_block - 1) / per_block;
  if (g > need) g = need;
  return g < 1 ? 1 : g;
}

// A launcher's 16-bit element type (the _f16 / _bf16 launchers share their kernels).
enum class Half16 { kF16, kBF16 };

}  // namespace
