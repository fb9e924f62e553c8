// CPU threading of the kernels (see cpu_threads.h).
#include "cpu_threads.h"

#include <exception>
#if defined(__SSE__) || defined(__x86_64__)
#include <immintrin.h>
#endif

namespace fusecli {

// ---- threading ----------------------------------------------------------------------------
int num_threads() {
  static const int n = [] {
    if (const char* e = std::getenv("FUSECLI_NUM_THREADS")) {
      int v = std::atoi(e);
      if (v > 0) return v;
    }
    unsigned h = std::thread::hardware_concurrency();
    return h ? static_cast<int>(h) : 1;
  }();
  return n;
}

int planned_threads(int64_t n, int64_t grain, int max_threads) {
  int t = max_threads > 0 ? std::min(max_threads, num_threads()) : num_threads();
  if (grain < 1) grain = 1;
  int64_t chunks = (n + grain - 1) / grain;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(t, chunks)));
}

namespace {
const OrtApi* g_pool_api = nullptr;                     // serves KernelContext_ParallelFor
thread_local const OrtKernelContext* tl_ctx = nullptr;  // the running kernel's context
thread_local bool tl_in_chunk = false;                  // inside a parallel_for chunk

struct ChunkJob {
  const std::function<void(int)>* run;
};
void run_chunk(void* data, size_t i) {
  const bool prev = tl_in_chunk;
  tl_in_chunk = true;
  (*static_cast<ChunkJob*>(data)->run)(static_cast<int>(i));
  tl_in_chunk = prev;
}
}  // namespace

void set_pool_api(const OrtApi* api) {
  g_pool_api = api;
}

#if defined(__SSE__) || defined(__x86_64__)
constexpr unsigned kFtzDaz = 0x8040u;  // MXCSR bit 15 (flush to zero) | bit 6 (denormals are zero)
FlushDenormals::FlushDenormals() : saved_(_mm_getcsr()) {
  if ((saved_ & kFtzDaz) != kFtzDaz) _mm_setcsr(saved_ | kFtzDaz);
}
FlushDenormals::~FlushDenormals() {
  if ((saved_ & kFtzDaz) != kFtzDaz) _mm_setcsr(saved_);
}
#elif defined(__aarch64__)
// AArch64: FPCR bit 24 (FZ) flushes subnormal inputs and results of float operations, NEON's
// included, to zero: FTZ and DAZ in one bit. Set and restored like MXCSR above.
constexpr unsigned kFz = 1u << 24;
static inline unsigned get_fpcr() {
  uint64_t v;
  asm volatile("mrs %0, fpcr" : "=r"(v));
  return static_cast<unsigned>(v);
}
static inline void set_fpcr(unsigned v) {
  asm volatile("msr fpcr, %0" : : "r"(static_cast<uint64_t>(v)));
}
FlushDenormals::FlushDenormals() : saved_(get_fpcr()) {
  if (!(saved_ & kFz)) set_fpcr(saved_ | kFz);
}
FlushDenormals::~FlushDenormals() {
  if (!(saved_ & kFz)) set_fpcr(saved_);
}
#else
FlushDenormals::FlushDenormals() : saved_(0) {}
FlushDenormals::~FlushDenormals() {}
#endif

PoolScope::PoolScope(const OrtKernelContext* ctx) : prev_(tl_ctx) {
  tl_ctx = ctx;
}
PoolScope::~PoolScope() {
  tl_ctx = prev_;
}

void parallel_for(int64_t n, int64_t grain, const std::function<void(int, int64_t, int64_t)>& fn,
                  int max_threads) {
  if (n <= 0) return;
  int t = tl_in_chunk ? 1 : planned_threads(n, grain, max_threads);
  if (t == 1) {
    FlushDenormals ftz;
    fn(0, 0, n);
    return;
  }
  std::vector<std::exception_ptr> errs(t);
  std::function<void(int)> run = [&](int i) {
    int64_t b = n * i / t, e = n * (i + 1) / t;
    FlushDenormals ftz;  // onnxruntime's pool threads: restored when the chunk ends
    try {
      if (b < e) fn(i, b, e);
    } catch (...) {
      errs[i] = std::current_exception();
    }
  };
  if (tl_ctx != nullptr && g_pool_api != nullptr) {
    ChunkJob job{&run};
    OrtStatus* st = g_pool_api->KernelContext_ParallelFor(tl_ctx, run_chunk, static_cast<size_t>(t),
                                                          static_cast<size_t>(t), &job);
    if (st == nullptr) {
      for (auto& e : errs)
        if (e) std::rethrow_exception(e);
      return;
    }
    g_pool_api->ReleaseStatus(st);  // pool unavailable: fall back to our own threads
    std::fill(errs.begin(), errs.end(), nullptr);
  }
  std::vector<std::thread> pool;
  pool.reserve(t - 1);
  auto run_marked = [&](int i) {
    tl_in_chunk = true;
    run(i);
  };
  for (int i = 1; i < t; ++i) pool.emplace_back(run_marked, i);
  tl_in_chunk = true;
  run(0);
  tl_in_chunk = false;
  for (auto& th : pool) th.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
}

}  // namespace fusecli
