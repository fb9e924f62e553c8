// cuDNN for the fused convolutions' gradients, loaded at run time (dlopen) like cuBLAS
// (cuda_blas.h): where it is absent the launchers keep their own kernels.
//
// Which library: $FUSECLI_CUDNN_DIR/libcudnn.so.9 when that variable names a folder, then
// libcudnn.so.9 by soname (cuDNN 9's front library; it loads its parts, libcudnn_cnn.so.9 with the
// convolutions among them, itself). FUSECLI_CONV=direct or FUSECLI_GEMM_PATH=simt forces the
// built-in kernels.
// Handles: one per device and thread; inside an onnxruntime session the CUDA execution provider's
// own (BorrowHandle). Precision: float32 FMA math (CUDNN_FMA_MATH, no TF32) unless tf32.
#pragma once

#include <cstdint>

namespace fusecli {
namespace dnn {

constexpr int kNotUsed = -1;        // cuDNN absent, forced off, or a geometry it does not take
constexpr int kStatusBase = 20000;  // + cudnnStatus_t of a failed call (reported on stderr)

// The gradients of Y = conv2d(X, W) (NCHW, float32, cross-correlation, `group` groups, symmetric
// padding pad_h / pad_w; Y [n, c, ho, wo]) for the output gradient dY: dX [n, cin, hin, win]
// and dW [c, cin/group, kh, kw], each skipped when null. kNotUsed when cuDNN cannot do it here.
int conv2d_backward(void* stream, const float* x, const float* w, const float* dy, float* dx,
                    float* dw, int64_t n, int64_t cin, int64_t hin, int64_t win, int64_t c,
                    int64_t kh, int64_t kw, int64_t ho, int64_t wo, int64_t stride_h,
                    int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dil_h, int64_t dil_w,
                    int64_t group, bool tf32);

// One line: the convolution path ("cuDNN 9.14.0 (libcudnn.so.9)" or "built-in direct kernels
// (cuDNN not loaded: ...)"). Loads cuDNN if not tried yet.
const char* path();

// While alive, conv2d_backward() on this thread uses `handle` (a cudnnHandle_t, e.g.
// onnxruntime's) instead of its own. A null handle changes nothing.
class BorrowHandle {
 public:
  explicit BorrowHandle(void* handle);
  ~BorrowHandle();
  BorrowHandle(const BorrowHandle&) = delete;
  BorrowHandle& operator=(const BorrowHandle&) = delete;

 private:
  void* prev_;
};

}  // namespace dnn
}  // namespace fusecli
