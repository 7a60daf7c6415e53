#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ferry/options.hpp>

#include "transport/context.hpp"
#include "transport/kit/link_pool.hpp"
#include "transport/kit/registration_cache.hpp"
#include "transport/kit/transfers.hpp"
#include "transport/tcp/tcp_link.hpp"
#include "transport/tcp/tcp_listener.hpp"
#include "transport/tcp/tcp_region.hpp"
#include "transport/tcp/tcp_transfer.hpp"
#include "transport/transport.hpp"

namespace ferry::transport::tcp {

/// ferry's own framed protocol over TCP (docs/protocol.md): a listener (TcpListener) serves
/// exposures; links (TcpLink), one per peer address, carry the active transfers (TcpTransfer),
/// bytes read straight into their destination and written straight from their source. CUDA
/// memory is staged through pinned host chunks (cuda::Stager) where the driver is usable.
class TcpTransport final : public Transport, private kit::TransferHooks<TcpTransfer> {
 public:
  /// Binds and listens at ctx.bind_address. Throws Error(InvalidArgument) for a bad address or
  /// options, Error(Internal) when the socket cannot be bound.
  TcpTransport(const Context& ctx, const TcpOptions& options);
  ~TcpTransport() override;

  const Capabilities& capabilities() const override { return caps_; }
  std::vector<Endpoint> endpoints() const override;
  std::shared_ptr<const Registration> register_memory(const Region& region) override;
  std::string expose(const Exposure& exposure, ExposureObserver& observer) override;
  void revoke(std::uint64_t id, const Error& reason) override;
  std::optional<Error> endpoint_error(const Endpoint& endpoint) const override;
  std::unique_ptr<Transfer> start(TransferSpec spec, TransferObserver& observer) override;
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

 private:
  friend class TcpLink;
  friend class TcpRemoteRegion;

  // kit::TransferHooks
  void stop(TcpTransfer& t) override;
  void tell_peer(TcpTransfer& t, const Error& reason) override;
  void settle(TcpTransfer& t) override;

  /// The link to `address`: the pooled one, or a new one.
  TcpLink& link_to(const wire::SocketAddress& address, const std::string& peer_name);
  /// The link's connection closed: its transfers end with `error`, before any memory was
  /// touched when `setup`.
  void link_lost(TcpLink& link, const std::vector<TcpTransfer*>& on_it, const Error& error,
                 bool setup);
  /// A transfer on `link` (a region's attachment lives on one connection).
  std::unique_ptr<Transfer> start_on(TcpLink& link, TransferSpec spec, TransferObserver& observer);
  /// `region` is going: its link forgets it and, when `detach`, tells the owner.
  void forget_region(TcpRemoteRegion& region, bool detach);
  /// The client's staging, made on the first CUDA memory.
  cuda::Stager& stager();
  void staging_failed(TcpTransfer& t, const Error& error);

  Context ctx_;
  TcpOptions options_;
  Capabilities caps_;
  std::string advertised_;
  bool closed_ = false;

  std::unique_ptr<TcpListener> listener_;
  /// Host memory needs no registration for tcp; the cache still answers for it, so that every
  /// method registers the same way.
  kit::RegistrationCache registrations_{nullptr};
  std::unique_ptr<cuda::Stager> stager_;
  kit::LinkPool<TcpLink> links_;
  std::uint64_t next_link_ = 1;
  std::uint64_t next_region_ = 1;
  kit::TransferTable<TcpTransfer> transfers_;
};

}  // namespace ferry::transport::tcp
