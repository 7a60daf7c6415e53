// GPUDirect registration in a build without CUDA: no CUDA memory reaches the verbs method
// (its record moves host memory only there).

#include "transport/verbs/verbs_device.hpp"

namespace ferry::transport::verbs {

namespace {
constexpr const char* kAbsent = "verbs: this ferry was built without CUDA";
}  // namespace

struct GpuDirect::State {};

GpuDirect::GpuDirect(const Context&, const VerbsApi&, Devices&, Counters&) {}
GpuDirect::~GpuDirect() = default;
void* GpuDirect::context(int) { throw Error(ErrorCode::Unsupported, kAbsent); }
Region GpuDirect::allocation_of(const Region&, kit::RegistrationCache&) {
  throw Error(ErrorCode::Unsupported, kAbsent);
}
void GpuDirect::register_cuda(MrSet&, int) { throw Error(ErrorCode::Unsupported, kAbsent); }
Error GpuDirect::unreachable(const MrSet&) const { return Error(ErrorCode::Unsupported, kAbsent); }

}  // namespace ferry::transport::verbs
