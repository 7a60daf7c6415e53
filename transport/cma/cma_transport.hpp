#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ferry/options.hpp>

#include "transport/cma/cma_copier.hpp"
#include "transport/cma/cma_transfer.hpp"
#include "transport/context.hpp"
#include "transport/kit/link_pool.hpp"
#include "transport/kit/registration_cache.hpp"
#include "transport/kit/transfers.hpp"
#include "transport/same_host/link.hpp"
#include "transport/same_host/listener.hpp"
#include "transport/same_host/remote_region.hpp"
#include "transport/transport.hpp"

namespace ferry::transport::cma {

/// The same-host method: the active side copies straight between the two address spaces with
/// process_vm_readv / process_vm_writev. Three parts: the claim exchange is the same-host one
/// (same_host::Listener on the owner's side, same_host::Link on the active side's), and the
/// copies are CmaCopier's (jobs under the owner's grant; CUDA memory of the active side staged
/// through pinned host chunks). The owner's memory is host memory.
class CmaTransport final : public Transport,
                           private kit::TransferHooks<CmaTransfer>,
                           private same_host::Link::Client,
                           private CmaCopier::Owner {
 public:
  /// Why this process cannot offer cma (none: it can).
  static std::optional<Error> unavailable(bool ptracer_any);

  /// Listens on a fresh abstract Unix socket. Throws Error(Unsupported) when this process
  /// cannot offer cma, Error(InvalidArgument) for bad options, Error(Internal) when the socket
  /// or the grant table cannot be made. `grant_slots`: operations claimed at once, at most.
  CmaTransport(const Context& ctx, const CmaOptions& options, std::uint32_t grant_slots = 16384);
  ~CmaTransport() override;

  const Capabilities& capabilities() const override { return caps_; }
  std::vector<Endpoint> endpoints() const override;
  std::shared_ptr<const Registration> register_memory(const Region& region) override;
  std::shared_ptr<const Registration> register_exposed(const Region& region) override;
  std::string expose(const Exposure& exposure, ExposureObserver& observer) override;
  void revoke(std::uint64_t id, const Error& reason) override;
  std::optional<Error> endpoint_error(const Endpoint& endpoint) const override;
  std::unique_ptr<Transfer> start(TransferSpec spec, TransferObserver& observer) override;
  std::optional<Error> unreachable(const Endpoint& endpoint) const override;
  void close() override;

  bool serves_regions() const override { return true; }
  std::string serve_region(const RegionExposure& region, RegionObserver& observer) override;
  void revoke_attachment(std::uint64_t attachment, const Error& reason) override;
  void end_region(std::uint64_t id, const Error& reason) override;
  std::vector<std::uint64_t> attachments_of_peer(std::uint64_t id,
                                                 const std::string& peer_id) const override {
    return listener_->attachments_of_peer(id, peer_id);
  }
  std::size_t connections() const override {
    return links_.size() + (listener_ ? listener_->connections() : 0);
  }
  std::unique_ptr<RemoteRegion> attach(AttachSpec spec, AttachObserver& observer) override;

  /// Grants given up because a peer's copy outlived peer_timeout after a revoke (for tests).
  std::uint32_t quarantined_grants() const noexcept { return listener_->quarantined_grants(); }

 private:
  friend class same_host::RemoteRegion<CmaTransport>;
  using Attached = same_host::RemoteRegion<CmaTransport>;

  // kit::TransferHooks
  void stop(CmaTransfer& t) override;
  void tell_peer(CmaTransfer& t, const Error& reason) override;
  void settle(CmaTransfer& t) override;

  // same_host::Link::Client
  same_host::Claimant* claimant(std::uint64_t id) override;
  void granted(std::uint64_t id, const Token& secret) override;
  void ended(std::uint64_t id, std::optional<Error> error, bool setup) override;
  void link_closed(same_host::Link& link) override;
  same_host::RegionAttach* attaching(std::uint64_t key) override { return regions_.attaching(key); }
  void region_attached(std::uint64_t key) override;
  void region_ended(std::uint64_t key, const Error& error, bool setup) override {
    regions_.ended(key, error, setup);
  }

  // CmaCopier::Owner
  CmaTransfer* transfer(std::uint64_t id) override;
  void copied(CmaTransfer& t) override;
  void failed(CmaTransfer& t, const Error& error) override;

  same_host::Link& link_to(const Endpoint& endpoint, const std::string& peer_name);
  /// A transfer on `region`'s attachment: copies under its grant at once.
  std::unique_ptr<Transfer> start_attached(Attached& region, TransferSpec spec,
                                           TransferObserver& observer);
  /// `region` is going: its link forgets it (and tells the owner, if it was attached).
  void forget_region(Attached& region);
  /// Tells the owner that `t` ended (DONE, or ENDED for a transfer on an attachment).
  void tell_end(CmaTransfer& t, const Error* error);

  Context ctx_;
  CmaOptions options_;
  Capabilities caps_;
  bool closed_ = false;
  kit::Lifetime life_;
  std::unique_ptr<same_host::Listener> listener_;
  kit::RegistrationCache registrations_{nullptr};
  CmaCopier copier_;
  kit::LinkPool<same_host::Link> links_;
  std::uint64_t next_link_ = 1;
  same_host::RemoteRegions<CmaTransport> regions_;
  kit::TransferTable<CmaTransfer> transfers_;
};

}  // namespace ferry::transport::cma
