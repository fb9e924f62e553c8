// CPU threading of the kernels: parallel_for on onnxruntime's intra-op pool or own threads.
#pragma once

#include "op_kernel.h"

namespace fusecli {

// ---- threading ----------------------------------------------------------------------------
int num_threads();  // FUSECLI_NUM_THREADS or hardware_concurrency
// Splits [0, n) into at most min(num_threads(), ceil(n / grain)) contiguous chunks;
// fn(thread_index, begin, end). Chunk 0 runs on the calling thread.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int, int64_t, int64_t)>& fn,
                  int max_threads = 0);
int planned_threads(int64_t n, int64_t grain, int max_threads = 0);
// Subnormal floats take a microcode slow path on x86 (~100x per operation; many ARM cores trap
// them too): the exp/erf tails of activation gradients and tiny variances produce them.
// FlushDenormals sets FTZ (results flushed to zero) and DAZ (subnormal inputs read as zero) in
// this thread's MXCSR (AArch64: FPCR.FZ, both at once) for its lifetime and restores the
// previous value after, so onnxruntime's threads keep their own mode outside fusecli's kernels.
// Results change by less than the smallest normal float (1.2e-38).
class FlushDenormals {
 public:
  FlushDenormals();
  ~FlushDenormals();
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned saved_;
};
// While a CPU kernel's Compute runs inside a PoolScope (which also flushes denormals on the
// calling thread; parallel_for does so in every chunk), parallel_for runs its chunks on
// onnxruntime's intra-op thread pool (KernelContext_ParallelFor, API 17, used when the runtime
// serves it) instead of starting threads: no thread start-up per call, and the session's
// thread count and spinning policy apply. Nested parallel_for calls run serially.
class PoolScope {
 public:
  explicit PoolScope(const OrtKernelContext* ctx);
  ~PoolScope();
  PoolScope(const PoolScope&) = delete;
  PoolScope& operator=(const PoolScope&) = delete;

 private:
  const OrtKernelContext* prev_;
  FlushDenormals ftz_;
};
void set_pool_api(const OrtApi* api);  // the API struct that has KernelContext_ParallelFor

}  // namespace fusecli
