#pragma once

#include <cstdint>
#include <memory>

#include "transport/kit/remote_region.hpp"

namespace ferry::transport::tcp {

class TcpLink;
class TcpTransport;

/// An attachment to a peer's region, the active side: ATTACH on the pooled link to the owner,
/// then transfers on that link with the attachment's id and secret, each ending with an ENDED
/// (a write's awaited: its answer says the bytes are in) (docs/regions.md). Destroying it
/// sends DETACH.
class TcpRemoteRegion final : public kit::RemoteRegionBase {
 public:
  TcpRemoteRegion(TcpTransport& owner, std::uint64_t id, AttachSpec spec, AttachObserver& observer);
  ~TcpRemoteRegion() override;

  std::unique_ptr<Transfer> start(TransferSpec spec, TransferObserver& observer) override;

  /// The owner's ATTACHED.
  void granted(std::uint64_t attachment, const Token& secret);

  std::uint64_t id() const noexcept { return id_; }
  std::uint64_t attachment() const noexcept { return attachment_; }
  const Token& secret() const noexcept { return secret_; }
  TcpLink* link = nullptr;

 private:
  TcpTransport& owner_;
  const std::uint64_t id_;
  std::uint64_t attachment_ = 0;
  Token secret_{};
};

}  // namespace ferry::transport::tcp
