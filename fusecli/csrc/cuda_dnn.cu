// cuDNN loaded at run time for the fused convolutions' gradients (see cuda_dnn.h).
#include "cuda_dnn.h"

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#define FUSECLI_EXPORT_C extern "C" __attribute__((visibility("default")))

namespace fusecli {
namespace dnn {
namespace {

// ---- the few cuDNN declarations used, as in cudnn_graph.h / cudnn_ops.h / cudnn_cnn.h (cuDNN 9)
// (declared here so the build needs no cuDNN headers; the values are the headers')
using Handle = void*;  // cudnnHandle_t
using Desc = void*;    // cudnnTensorDescriptor_t, cudnnFilterDescriptor_t, ...
using Status = int;    // cudnnStatus_t, CUDNN_STATUS_SUCCESS = 0
enum : int { CUDNN_DATA_FLOAT = 0, CUDNN_TENSOR_NCHW = 0, CUDNN_CROSS_CORRELATION = 1 };
enum : int { CUDNN_TENSOR_OP_MATH = 1, CUDNN_FMA_MATH = 3 };
// cudnnConvolutionBwdDataAlgoPerf_t and cudnnConvolutionBwdFilterAlgoPerf_t (same layout)
struct AlgoPerf {
  int algo;
  Status status;
  float time;
  size_t memory;
  int determinism;
  int math_type;
  int reserved[3];
};

struct Lib {
  void* so = nullptr;
  size_t (*get_version)() = nullptr;
  const char* (*error_string)(Status) = nullptr;
  Status (*create)(Handle*) = nullptr;
  Status (*set_stream)(Handle, cudaStream_t) = nullptr;
  Status (*create_tensor)(Desc*) = nullptr;
  Status (*destroy_tensor)(Desc) = nullptr;
  Status (*set_tensor4d)(Desc, int, int, int, int, int, int) = nullptr;
  Status (*create_filter)(Desc*) = nullptr;
  Status (*destroy_filter)(Desc) = nullptr;
  Status (*set_filter4d)(Desc, int, int, int, int, int, int) = nullptr;
  Status (*create_conv)(Desc*) = nullptr;
  Status (*destroy_conv)(Desc) = nullptr;
  Status (*set_conv2d)(Desc, int, int, int, int, int, int, int, int) = nullptr;
  Status (*set_group_count)(Desc, int) = nullptr;
  Status (*set_math_type)(Desc, int) = nullptr;
  Status (*bwd_data_algo)(Handle, Desc, Desc, Desc, Desc, int, int*, AlgoPerf*) = nullptr;
  Status (*bwd_data_ws)(Handle, Desc, Desc, Desc, Desc, int, size_t*) = nullptr;
  Status (*bwd_data)(Handle, const void*, Desc, const void*, Desc, const void*, Desc, int, void*,
                     size_t, const void*, Desc, void*) = nullptr;
  Status (*bwd_filter_algo)(Handle, Desc, Desc, Desc, Desc, int, int*, AlgoPerf*) = nullptr;
  Status (*bwd_filter_ws)(Handle, Desc, Desc, Desc, Desc, int, size_t*) = nullptr;
  Status (*bwd_filter)(Handle, const void*, Desc, const void*, Desc, const void*, Desc, int, void*,
                       size_t, const void*, Desc, void*) = nullptr;
  bool ok = false;
  std::string path;
};

Lib g_lib;
std::once_flag g_once;
thread_local Handle t_borrowed = nullptr;
constexpr int kMaxDevices = 64;
thread_local Handle t_own[kMaxDevices] = {};

template <typename F> bool bind(void* so, const char* name, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(dlsym(so, name));
  if (!*out) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *out != nullptr;
}

void load() {
  Lib& L = g_lib;
  // FUSECLI_GEMM_PATH=simt (the whole previous path) or FUSECLI_CONV=direct
  const char* gemm = std::getenv("FUSECLI_GEMM_PATH");
  const char* force = std::getenv("FUSECLI_CONV");
  if ((gemm && std::strcmp(gemm, "simt") == 0) || (force && std::strcmp(force, "direct") == 0)) {
    L.path = "built-in im2col kernels (FUSECLI_GEMM_PATH=simt or FUSECLI_CONV=direct)";
    return;
  }
  std::string tried, err, opened;
  auto try_open = [&](const std::string& name) {
    void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    tried += (tried.empty() ? "" : ", ") + name;
    if (!h) {
      const char* e = dlerror();
      if (e) err = e;
    } else {
      opened = name;
    }
    return h;
  };
  const char* dir = std::getenv("FUSECLI_CUDNN_DIR");
  if (dir && *dir) L.so = try_open(std::string(dir) + "/libcudnn.so.9");
  if (!L.so) L.so = try_open("libcudnn.so.9");
  if (!L.so) {
    L.path = "built-in direct kernels (cuDNN not found: tried " + tried +
             (err.empty() ? "" : "; last error: " + err) +
             "; set FUSECLI_CUDNN_DIR to the folder of libcudnn.so.9)";
    return;
  }
  std::string missing;
  void* so = L.so;
  bind(so, "cudnnGetVersion", &L.get_version, &missing);
  bind(so, "cudnnGetErrorString", &L.error_string, &missing);
  bind(so, "cudnnCreate", &L.create, &missing);
  bind(so, "cudnnSetStream", &L.set_stream, &missing);
  bind(so, "cudnnCreateTensorDescriptor", &L.create_tensor, &missing);
  bind(so, "cudnnDestroyTensorDescriptor", &L.destroy_tensor, &missing);
  bind(so, "cudnnSetTensor4dDescriptor", &L.set_tensor4d, &missing);
  bind(so, "cudnnCreateFilterDescriptor", &L.create_filter, &missing);
  bind(so, "cudnnDestroyFilterDescriptor", &L.destroy_filter, &missing);
  bind(so, "cudnnSetFilter4dDescriptor", &L.set_filter4d, &missing);
  bind(so, "cudnnCreateConvolutionDescriptor", &L.create_conv, &missing);
  bind(so, "cudnnDestroyConvolutionDescriptor", &L.destroy_conv, &missing);
  bind(so, "cudnnSetConvolution2dDescriptor", &L.set_conv2d, &missing);
  bind(so, "cudnnSetConvolutionGroupCount", &L.set_group_count, &missing);
  bind(so, "cudnnSetConvolutionMathType", &L.set_math_type, &missing);
  bind(so, "cudnnGetConvolutionBackwardDataAlgorithm_v7", &L.bwd_data_algo, &missing);
  bind(so, "cudnnGetConvolutionBackwardDataWorkspaceSize", &L.bwd_data_ws, &missing);
  bind(so, "cudnnConvolutionBackwardData", &L.bwd_data, &missing);
  bind(so, "cudnnGetConvolutionBackwardFilterAlgorithm_v7", &L.bwd_filter_algo, &missing);
  bind(so, "cudnnGetConvolutionBackwardFilterWorkspaceSize", &L.bwd_filter_ws, &missing);
  bind(so, "cudnnConvolutionBackwardFilter", &L.bwd_filter, &missing);
  if (!missing.empty()) {
    L.path = "built-in direct kernels (" + opened + " lacks " + missing + ")";
    return;
  }
  const size_t v = L.get_version();  // 9.14.0 -> 91400
  L.path = "cuDNN " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
           std::to_string(v % 100) + " (" + opened + ")";
  L.ok = true;
}

void ensure_loaded() {
  std::call_once(g_once, [] {
    load();
    if (!std::getenv("FUSECLI_QUIET_GEMM"))
      std::fprintf(stderr, "fusecli: CUDA convolution gradients on %s\n", g_lib.path.c_str());
  });
}

int fail(const char* what, Status st) {
  std::fprintf(stderr, "fusecli: %s failed: %s (%d) on %s\n", what,
               g_lib.error_string ? g_lib.error_string(st) : "?", st, g_lib.path.c_str());
  return kStatusBase + st;
}

// descriptors of one call, destroyed with it
struct Descs {
  Desc x = nullptr, y = nullptr, w = nullptr, conv = nullptr;
  ~Descs() {
    if (x) g_lib.destroy_tensor(x);
    if (y) g_lib.destroy_tensor(y);
    if (w) g_lib.destroy_filter(w);
    if (conv) g_lib.destroy_conv(conv);
  }
};

struct Workspace {
  cudaStream_t s;
  void* p = nullptr;
  explicit Workspace(cudaStream_t st) : s(st) {}
  ~Workspace() {
    if (p) cudaFreeAsync(p, s);
  }
};

// the first algorithm cuDNN's heuristics rank (of those that succeed), with its workspace
template <typename GetAlgo> int pick(GetAlgo get_algo, const char* what, int* algo) {
  AlgoPerf perf[8];
  std::memset(perf, 0, sizeof(perf));
  int got = 0;
  const Status st = get_algo(8, &got, perf);
  if (st != 0) return fail(what, st);
  // deterministic algorithms first (the same gradient every run), then any that succeeds
  for (int want_det = 1; want_det >= 0; --want_det) {
    for (int i = 0; i < got && i < 8; ++i) {
      if (perf[i].status == 0 && (!want_det || perf[i].determinism == 1)) {
        *algo = perf[i].algo;
        return 0;
      }
    }
  }
  std::fprintf(stderr, "fusecli: %s returned no usable algorithm (%d ranked)\n", what, got);
  return kStatusBase + 3000;
}

}  // namespace

const char* path() {
  ensure_loaded();
  return g_lib.path.c_str();
}

BorrowHandle::BorrowHandle(void* handle) : prev_(t_borrowed) {
  if (handle) t_borrowed = handle;
}
BorrowHandle::~BorrowHandle() {
  t_borrowed = prev_;
}

#define DNN_CHECK(what, expr)             \
  do {                                    \
    const Status st_ = (expr);            \
    if (st_ != 0) return fail(what, st_); \
  } while (0)

int conv2d_backward(void* stream, const float* x, const float* w, const float* dy, float* dx,
                    float* dw, int64_t n, int64_t cin, int64_t hin, int64_t win, int64_t c,
                    int64_t kh, int64_t kw, int64_t ho, int64_t wo, int64_t stride_h,
                    int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dil_h, int64_t dil_w,
                    int64_t group, bool tf32) {
  ensure_loaded();
  Lib& L = g_lib;
  if (!L.ok) return kNotUsed;
  if (!dx && !dw) return 0;
  const int64_t dims[] = {n,  cin,      hin,      win,   c,     kh,    kw,    ho,
                          wo, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, group};
  for (int64_t d : dims)
    if (d < 0 || d > INT_MAX) return kNotUsed;
  if (n == 0 || cin == 0 || c == 0 || ho == 0 || wo == 0 || kh == 0 || kw == 0 || group < 1 ||
      stride_h < 1 || stride_w < 1 || dil_h < 1 || dil_w < 1 || cin % group || c % group)
    return kNotUsed;
  // the output size cuDNN derives from symmetric padding must be the graph's
  if ((hin + 2 * pad_h - dil_h * (kh - 1) - 1) / stride_h + 1 != ho ||
      (win + 2 * pad_w - dil_w * (kw - 1) - 1) / stride_w + 1 != wo)
    return kNotUsed;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  Handle h = t_borrowed;
  if (!h) {
    int dev = 0;
    const cudaError_t ce = cudaGetDevice(&dev);
    if (ce != cudaSuccess) return ce;
    if (dev < 0 || dev >= kMaxDevices) return kNotUsed;
    if (!t_own[dev]) {
      const Status st = L.create(&t_own[dev]);
      if (st != 0) {
        t_own[dev] = nullptr;
        return fail("cudnnCreate", st);
      }
    }
    h = t_own[dev];
  }
  DNN_CHECK("cudnnSetStream", L.set_stream(h, s));
  Descs d;
  const int ni = static_cast<int>(n);
  DNN_CHECK("cudnnCreateTensorDescriptor", L.create_tensor(&d.x));
  DNN_CHECK("cudnnSetTensor4dDescriptor (X)",
            L.set_tensor4d(d.x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, ni, static_cast<int>(cin),
                           static_cast<int>(hin), static_cast<int>(win)));
  DNN_CHECK("cudnnCreateTensorDescriptor", L.create_tensor(&d.y));
  DNN_CHECK("cudnnSetTensor4dDescriptor (dY)",
            L.set_tensor4d(d.y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, ni, static_cast<int>(c),
                           static_cast<int>(ho), static_cast<int>(wo)));
  DNN_CHECK("cudnnCreateFilterDescriptor", L.create_filter(&d.w));
  DNN_CHECK(
      "cudnnSetFilter4dDescriptor",
      L.set_filter4d(d.w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, static_cast<int>(c),
                     static_cast<int>(cin / group), static_cast<int>(kh), static_cast<int>(kw)));
  DNN_CHECK("cudnnCreateConvolutionDescriptor", L.create_conv(&d.conv));
  DNN_CHECK(
      "cudnnSetConvolution2dDescriptor",
      L.set_conv2d(d.conv, static_cast<int>(pad_h), static_cast<int>(pad_w),
                   static_cast<int>(stride_h), static_cast<int>(stride_w), static_cast<int>(dil_h),
                   static_cast<int>(dil_w), CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  DNN_CHECK("cudnnSetConvolutionGroupCount", L.set_group_count(d.conv, static_cast<int>(group)));
  DNN_CHECK("cudnnSetConvolutionMathType",
            L.set_math_type(d.conv, tf32 ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH));
  const float one = 1.f, zero = 0.f;
  if (dx) {
    int algo = 0;
    int r =
        pick([&](int req, int* got,
                 AlgoPerf* p) { return L.bwd_data_algo(h, d.w, d.y, d.conv, d.x, req, got, p); },
             "cudnnGetConvolutionBackwardDataAlgorithm_v7", &algo);
    if (r) return r;
    size_t bytes = 0;
    DNN_CHECK("cudnnGetConvolutionBackwardDataWorkspaceSize",
              L.bwd_data_ws(h, d.w, d.y, d.conv, d.x, algo, &bytes));
    Workspace ws(s);
    if (bytes) {
      const cudaError_t ce = cudaMallocAsync(&ws.p, bytes, s);
      if (ce != cudaSuccess) return ce;
    }
    DNN_CHECK("cudnnConvolutionBackwardData",
              L.bwd_data(h, &one, d.w, w, d.y, dy, d.conv, algo, ws.p, bytes, &zero, d.x, dx));
  }
  if (dw) {
    int algo = 0;
    int r =
        pick([&](int req, int* got,
                 AlgoPerf* p) { return L.bwd_filter_algo(h, d.x, d.y, d.conv, d.w, req, got, p); },
             "cudnnGetConvolutionBackwardFilterAlgorithm_v7", &algo);
    if (r) return r;
    size_t bytes = 0;
    DNN_CHECK("cudnnGetConvolutionBackwardFilterWorkspaceSize",
              L.bwd_filter_ws(h, d.x, d.y, d.conv, d.w, algo, &bytes));
    Workspace ws(s);
    if (bytes) {
      const cudaError_t ce = cudaMallocAsync(&ws.p, bytes, s);
      if (ce != cudaSuccess) return ce;
    }
    DNN_CHECK("cudnnConvolutionBackwardFilter",
              L.bwd_filter(h, &one, d.x, x, d.y, dy, d.conv, algo, ws.p, bytes, &zero, d.w, dw));
  }
  return 0;
}

}  // namespace dnn
}  // namespace fusecli

// The convolution path of this process, one line (like fusecli_gemm_path).
FUSECLI_EXPORT_C const char* fusecli_conv_path() {
  return fusecli::dnn::path();
}
