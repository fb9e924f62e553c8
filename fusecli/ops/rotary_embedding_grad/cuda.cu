// RotaryEmbeddingGrad: CUDA kernel and its C launcher (one thread per output element).
#include "cuda_common.cuh"

namespace {

constexpr int kMaxRank = 8;
struct Bcast {
  int64_t dims[kMaxRank], strides[kMaxRank];
  int rank;
};

__global__ void rope_grad_kernel(const float* __restrict__ dy, const float* __restrict__ cs,
                                 const float* __restrict__ sn, float* __restrict__ dx, int64_t n,
                                 int64_t d, Bcast b, int interleaved) {
  const int64_t h = d / 2;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / d, j = i - r * d;
    int64_t rem = r, off = 0;
    for (int k = b.rank - 2; k >= 0; --k) {
      off += (rem % b.dims[k]) * b.strides[k];
      rem /= b.dims[k];
    }
    const float* c = cs + off;
    const float* s = sn + off;
    const float* g = dy + r * d;
    float v;
    if (interleaved)
      v = (j & 1) ? g[j] * c[j] - g[j - 1] * s[j - 1] : g[j] * c[j] + g[j + 1] * s[j + 1];
    else
      v = j < h ? g[j] * c[j] + g[j + h] * s[j + h] : g[j] * c[j] - g[j - h] * s[j - h];
    dx[i] = v;
  }
}

}  // namespace

FUSECLI_EXPORT int fusecli_launch_rotary_embedding_grad(
    void* stream, const float* dy, const float* cos, const float* sin, float* dx, int64_t rows,
    int64_t d, const int64_t* dims, const int64_t* cs_strides, int rank, int interleaved) {
  if (rank < 1 || rank > kMaxRank || d <= 0 || d % 2) return cudaErrorInvalidValue;
  const int64_t n = rows * d;
  if (n <= 0) return cudaSuccess;
  Bcast b;
  b.rank = rank;
  for (int k = 0; k < rank; ++k) {
    b.dims[k] = dims[k];
    b.strides[k] = cs_strides[k];
  }
  rope_grad_kernel<<<grid_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      dy, cos, sin, dx, n, d, b, interleaved);
  return cudaGetLastError();
}
