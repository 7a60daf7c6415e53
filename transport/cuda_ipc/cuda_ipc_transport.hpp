#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ferry/options.hpp>

#include "transport/context.hpp"
#include "transport/cuda_ipc/ipc_handles.hpp"
#include "transport/kit/link_pool.hpp"
#include "transport/kit/registration_cache.hpp"
#include "transport/kit/transfers.hpp"
#include "transport/same_host/link.hpp"
#include "transport/same_host/listener.hpp"
#include "transport/same_host/remote_region.hpp"
#include "transport/transport.hpp"

namespace ferry::transport::cuda {
class CopyEngine;
}

namespace ferry::transport::cuda_ipc {

/// An active transfer by cuda_ipc: the claim exchange (same_host::Claimant), then GPU copies of
/// up to chunk_size bytes between this side's memory and the owner's, opened here, `parallel`
/// at once, each under the owner's grant from its start until the driver reports its end.
class CudaIpcTransfer final : public kit::TransferBase<CudaIpcTransfer>,
                              public same_host::Claimant {
 public:
  CudaIpcTransfer(TransferSpec what, TransferObserver& observer)
      : TransferBase(std::move(what), observer) {
    transfer_spec = &this->spec;
  }

  same_host::Link* link = nullptr;  ///< null once its connection closed
  /// The owner's process: its grants are given back after the link may be gone.
  std::shared_ptr<same_host::OwnerProcess> owner;
  std::size_t seg = 0;  ///< the next byte to copy: segment, and offset in it
  std::uint64_t seg_off = 0;
  std::uint64_t done = 0;
  std::map<std::uint64_t, std::uint64_t> copies;  ///< GPU copies under way: id -> bytes
};

/// CUDA memory between two processes of one host, copied by the GPU: the owner shares its
/// allocations (legacy IPC handles, or fds of VMM exports) in CLAIMED's payload; the active
/// side opens them once per owner and allocation (IpcImports) and copies between its own
/// memory (CUDA or host) and the owner's. The claim exchange is the same-host one, shared with
/// cma (same_host::Listener, same_host::Link). Only built with CUDA.
class CudaIpcTransport final : public Transport,
                               private kit::TransferHooks<CudaIpcTransfer>,
                               private same_host::Link::Client {
 public:
  /// Why this process cannot offer cuda_ipc (none: it can).
  static std::optional<Error> unavailable(bool ptracer_any);

  /// Throws Error(Unsupported) when this process cannot offer it (no driver; what cma needs
  /// of the host), Error(InvalidArgument) for bad options.
  CudaIpcTransport(const Context& ctx, const CmaOptions& options,
                   std::uint32_t grant_slots = 16384);
  ~CudaIpcTransport() override;

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

 private:
  friend class same_host::RemoteRegion<CudaIpcTransport>;
  using Attached = same_host::RemoteRegion<CudaIpcTransport>;

  // kit::TransferHooks
  void stop(CudaIpcTransfer& t) override;
  void tell_peer(CudaIpcTransfer& t, const Error& reason) override;
  void settle(CudaIpcTransfer& t) override;

  // same_host::Link::Client
  same_host::Claimant* claimant(std::uint64_t id) override;
  void granted(std::uint64_t id, const Token& secret) override;
  void ended(std::uint64_t id, std::optional<Error> error, bool setup) override;
  void link_closed(same_host::Link& link) override;
  same_host::RegionAttach* attaching(std::uint64_t key) override { return regions_.attaching(key); }
  void region_attached(std::uint64_t key) override { regions_.attached(key); }
  void region_ended(std::uint64_t key, const Error& error, bool setup) override {
    regions_.ended(key, error, setup);
  }

  same_host::Link& link_to(const Endpoint& endpoint, const std::string& peer_name);
  /// A transfer on `region`'s attachment: its grant and the owner's handles are the
  /// attachment's; copies start at once.
  std::unique_ptr<Transfer> start_attached(Attached& region, TransferSpec spec,
                                           TransferObserver& observer);
  void forget_region(Attached& region);
  /// Opens the owner's memory the transfer's payload (CLAIMED's or ATTACHED's) names, then
  /// copies.
  void begin_copies(CudaIpcTransfer& t);
  /// Tells the owner that `t` ended (DONE, or ENDED for a transfer on an attachment).
  void tell_end(CudaIpcTransfer& t, const Error* error);
  void failed(CudaIpcTransfer& t, const Error& error);
  /// The owner's allocations, for CLAIMED's payload; throws Error(Unsupported).
  std::vector<std::byte> handles_of(const Exposure& exposure);
  /// Why `claimant` gets no IPC handles of ours (AccessDenied); none when it may.
  static std::optional<Error> untrusted(const same_host::Listener::Claimant& claimant);
  void pump(CudaIpcTransfer& t);
  void copied(std::uint64_t transfer, std::uint64_t copy, const std::optional<Error>& error);
  void all_copied(CudaIpcTransfer& t);

  Context ctx_;
  CmaOptions options_;
  Capabilities caps_;
  bool closed_ = false;
  kit::Lifetime life_;
  std::unique_ptr<VmmExports> vmm_;  ///< the VMM allocations shared, made on first need
  std::unique_ptr<same_host::Listener> listener_;
  kit::RegistrationCache registrations_{nullptr};
  std::unique_ptr<cuda::CopyEngine> engine_;  ///< made on the first copy
  kit::LinkPool<same_host::Link> links_;
  std::uint64_t next_link_ = 1;
  same_host::RemoteRegions<CudaIpcTransport> regions_;
  kit::TransferTable<CudaIpcTransfer> transfers_;
};

}  // namespace ferry::transport::cuda_ipc
