#pragma once

#include <cstdint>
#include <memory>

#include "transport/kit/remote_region.hpp"
#include "transport/same_host/link.hpp"

namespace ferry::transport::cma {

class CmaTransport;

/// An attachment to a peer's region by cma, the active side: ATTACH on the pooled link to the
/// owner (proven as every cma peer is), answered with the attachment's grant; then every
/// transfer copies under that grant at once, with no exchange, and ends with a one-way ENDED
/// (docs/regions.md). Destroying it sends DETACH.
class CmaRemoteRegion final : public kit::RemoteRegionBase {
 public:
  CmaRemoteRegion(CmaTransport& owner, std::uint64_t key, AttachSpec spec,
                  AttachObserver& observer);
  ~CmaRemoteRegion() override;

  std::unique_ptr<Transfer> start(TransferSpec spec, TransferObserver& observer) override;

  std::uint64_t key() const noexcept { return key_; }
  same_host::RegionAttach attach;
  same_host::Link* link = nullptr;

 private:
  CmaTransport& owner_;
  const std::uint64_t key_;
};

}  // namespace ferry::transport::cma
