// The library: per-op call counters, the exported C entry points and RegisterCustomOps.
#include "cpu_threads.h"
#include "op_kernel.h"

#include <cstring>
#include <memory>
#include <mutex>

#define FUSECLI_EXPORT extern "C" __attribute__((visibility("default")))

namespace fusecli {

static std::atomic<int64_t> g_calls[kNumOps];
static std::atomic<int64_t> g_inplace[kNumOps];

void count_call(OpId op) {
  g_calls[op].fetch_add(1, std::memory_order_relaxed);
}
void count_inplace(OpId op) {
  g_inplace[op].fetch_add(1, std::memory_order_relaxed);
}
static const char* const kPhaseNames[kNumPhases] = {"AttentionGrad/softmax_ns"};
static std::atomic<int64_t> g_phase_ns[kNumPhases];
void add_phase_ns(PhaseId phase, int64_t ns) {
  g_phase_ns[phase].fetch_add(ns, std::memory_order_relaxed);
}
static const char* const kWorkNames[kNumWork] = {"cpu/gemm_calls", "cpu/gemm_macs",
                                                 "LinearActivationGrad/db_rows"};
static std::atomic<int64_t> g_work[kNumWork];
void add_work(WorkId work, int64_t n) {
  g_work[work].fetch_add(n, std::memory_order_relaxed);
}

}  // namespace fusecli

// ---- exported C entry points ----------------------------------------------------------------
// Counters: "Op": calls of the op's kernels; "Op/inplace": calls whose in-place output
// (GetMayInplace) the runtime had placed in the input's own buffer; "Op/<phase>_ns": wall time
// spent in a timed phase (see PhaseId); "cpu/gemm_calls" etc.: work counters (see WorkId).
// -1 for an unknown name.
FUSECLI_EXPORT int64_t fusecli_kernel_calls(const char* op_name) {
  if (!op_name) return -1;
  for (int i = 0; i < fusecli::kNumPhases; ++i)
    if (std::strcmp(op_name, fusecli::kPhaseNames[i]) == 0) return fusecli::g_phase_ns[i].load();
  for (int i = 0; i < fusecli::kNumWork; ++i)
    if (std::strcmp(op_name, fusecli::kWorkNames[i]) == 0) return fusecli::g_work[i].load();
  static const char kSuffix[] = "/inplace";
  const size_t len = std::strlen(op_name), sl = sizeof(kSuffix) - 1;
  const bool inplace = len > sl && std::strcmp(op_name + len - sl, kSuffix) == 0;
  const std::string base(op_name, inplace ? len - sl : len);
  for (int i = 0; i < fusecli::kNumOps; ++i)
    if (base == fusecli::kOpNames[i])
      return inplace ? fusecli::g_inplace[i].load() : fusecli::g_calls[i].load();
  return -1;
}

FUSECLI_EXPORT void fusecli_reset_kernel_calls(void) {
  for (auto& c : fusecli::g_calls) c.store(0);
  for (auto& c : fusecli::g_inplace) c.store(0);
  for (auto& c : fusecli::g_phase_ns) c.store(0);
  for (auto& c : fusecli::g_work) c.store(0);
}

FUSECLI_EXPORT int fusecli_has_cuda(void) {
#ifdef FUSECLI_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

FUSECLI_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                         const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(fusecli::kOrtApiVersion);
  if (!api) {
    const OrtApi* v1 = api_base->GetApi(1);
    return v1 ? v1->CreateStatus(ORT_FAIL, "fusecli: onnxruntime does not serve API version 16")
              : nullptr;
  }
  Ort::InitApi(api);
  // KernelContext_ParallelFor is API 17: use it where the runtime serves it (1.17 and newer).
  // (FUSECLI_OWN_THREADS=1 keeps the library's own threads, for A/B measurements.)
  if (!std::getenv("FUSECLI_OWN_THREADS")) fusecli::set_pool_api(api_base->GetApi(17));
  // One domain object for the library's lifetime, shared by every session that registers it.
  static std::mutex mu;
  static std::unique_ptr<Ort::CustomOpDomain> domain;
  std::lock_guard<std::mutex> lock(mu);
  try {
    if (!domain) {
      domain = std::make_unique<Ort::CustomOpDomain>(fusecli::kDomain);
      fusecli::add_cpu_ops(*domain);
      fusecli::add_cuda_ops(*domain);
    }
    Ort::UnownedSessionOptions(options).Add(*domain);
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
