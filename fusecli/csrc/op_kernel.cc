// onnxruntime custom-op plumbing: attributes and tensor access.
#include "op_kernel.h"

namespace fusecli {

// ---- attributes ---------------------------------------------------------------------------
int64_t attr_int(const OrtKernelInfo* info, const char* name, int64_t dflt) {
  int64_t v = 0;
  OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_int64(info, name, &v);
  if (st) {
    Ort::GetApi().ReleaseStatus(st);
    return dflt;
  }
  return v;
}
float attr_float(const OrtKernelInfo* info, const char* name, float dflt) {
  float v = 0;
  OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_float(info, name, &v);
  if (st) {
    Ort::GetApi().ReleaseStatus(st);
    return dflt;
  }
  return v;
}
Act attr_act(const OrtKernelInfo* info, const char* name, uint32_t allowed, const char* dflt) {
  const std::string s = attr_string(info, name, dflt);
  for (int i = 0; i < FUSECLI_NUM_ACTS; ++i)
    if (s == kActNames[i] && (allowed >> i & 1u)) return static_cast<Act>(i);
  throw OpError("fusecli: unsupported activation '" + s + "'");
}
std::string attr_string(const OrtKernelInfo* info, const char* name, const std::string& dflt) {
  size_t size = 0;
  OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_string(info, name, nullptr, &size);
  if (st) {
    Ort::GetApi().ReleaseStatus(st);
    return dflt;
  }
  std::string s(size, '\0');
  st = Ort::GetApi().KernelInfoGetAttribute_string(info, name, &s[0], &size);
  if (st) {
    Ort::GetApi().ReleaseStatus(st);
    return dflt;
  }
  if (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}
std::vector<int64_t> attr_ints(const OrtKernelInfo* info, const char* name,
                               const std::vector<int64_t>& dflt) {
  size_t size = 0;
  OrtStatus* st = Ort::GetApi().KernelInfoGetAttributeArray_int64(info, name, nullptr, &size);
  if (st) {
    Ort::GetApi().ReleaseStatus(st);
    return dflt;
  }
  std::vector<int64_t> v(size);
  if (size == 0) return v;
  st = Ort::GetApi().KernelInfoGetAttributeArray_int64(info, name, v.data(), &size);
  if (st) {
    Ort::GetApi().ReleaseStatus(st);
    return dflt;
  }
  return v;
}

// ---- tensors ------------------------------------------------------------------------------
In get_input(Ort::KernelContext& ctx, size_t i) {
  In r;
  if (i >= ctx.GetInputCount()) return r;
  Ort::ConstValue v = ctx.GetInput(i);
  if (static_cast<const OrtValue*>(v) == nullptr) return r;
  auto info = v.GetTensorTypeAndShapeInfo();
  r.shape = info.GetShape();
  r.type = info.GetElementType();
  r.data = v.GetTensorRawData();
  r.present = true;
  return r;
}

bool get_output(Ort::KernelContext& ctx, size_t i, const std::vector<int64_t>& shape, void** data) {
  *data = nullptr;
  if (i >= ctx.GetOutputCount()) return false;
  Ort::UnownedValue v = ctx.GetOutput(i, shape);
  if (static_cast<OrtValue*>(v) == nullptr) return false;
  *data = v.GetTensorMutableRawData();
  return true;
}

AxisRows rows_from_axis(const std::vector<int64_t>& shape, int64_t axis, const char* op) {
  const int64_t rank = static_cast<int64_t>(shape.size());
  const int64_t ax = axis < 0 ? axis + rank : axis;
  FUSECLI_CHECK(ax >= 0 && ax <= rank, std::string(op) + ": axis out of range");
  const size_t a = static_cast<size_t>(ax);
  return {a, prod(shape, 0, a), prod(shape, a)};
}

int64_t prod(const std::vector<int64_t>& v, size_t from, size_t to) {
  int64_t p = 1;
  for (size_t i = from; i < v.size() && i < to; ++i) p *= v[i];
  return p;
}

}  // namespace fusecli
