#pragma once

#include <cstdint>
#include <memory>

#include "transport/kit/lifetime.hpp"
#include "transport/region.hpp"

namespace ferry::transport::tcp {

class TcpLink;
class TcpTransport;

/// An attachment to a peer's region, the active side: ATTACH on the pooled link to the owner,
/// then transfers on that link with the attachment's id and secret, each ending with an ENDED
/// notice (docs/regions.md). Destroying it sends DETACH.
class TcpRemoteRegion final : public RemoteRegion {
 public:
  TcpRemoteRegion(TcpTransport& owner, std::uint64_t id, AttachSpec spec, AttachObserver& observer);
  ~TcpRemoteRegion() override;

  std::unique_ptr<Transfer> start(TransferSpec spec, TransferObserver& observer) override;

  /// Called by the link.
  void attached(std::uint64_t attachment, const Token& secret);
  void refused(const Error& error);
  /// The owner ended the attachment (revoked it, or ended the region).
  void ended(const Error& error);
  /// The link's connection closed; `setup`: before the owner's HELLO.
  void lost(const Error& error, bool setup);

  std::uint64_t id() const noexcept { return id_; }
  std::uint64_t attachment() const noexcept { return attachment_; }
  const Token& secret() const noexcept { return secret_; }
  const AttachSpec& spec() const noexcept { return spec_; }
  TcpLink* link = nullptr;

 private:
  enum class State { attaching, attached, over };
  void report(std::function<void(AttachObserver&)> call);

  TcpTransport& owner_;
  const std::uint64_t id_;
  AttachSpec spec_;
  AttachObserver* observer_;
  State state_ = State::attaching;
  std::uint64_t attachment_ = 0;
  Token secret_{};
  kit::Lifetime life_;
};

}  // namespace ferry::transport::tcp
