#include "transport/region.hpp"

namespace ferry::transport {

namespace {

[[noreturn]] void no_regions(const Capabilities& caps) {
  throw Error(ErrorCode::Unsupported, caps.method + " does not serve regions");
}

}  // namespace

std::string Transport::serve_region(const RegionExposure&, RegionObserver&) {
  no_regions(capabilities());
}

void Transport::revoke_attachment(std::uint64_t, const Error&) {}

void Transport::end_region(std::uint64_t, const Error&) {}

std::unique_ptr<RemoteRegion> Transport::attach(AttachSpec, AttachObserver&) {
  no_regions(capabilities());
}

}  // namespace ferry::transport
