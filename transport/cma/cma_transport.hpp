#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ferry/options.hpp>

#include "transport/cma/cma_transfer.hpp"
#include "transport/context.hpp"
#include "transport/kit/link_pool.hpp"
#include "transport/kit/registration_cache.hpp"
#include "transport/kit/transfers.hpp"
#include "transport/same_host/link.hpp"
#include "transport/same_host/listener.hpp"
#include "transport/transport.hpp"

namespace ferry::transport::cuda {
class Stager;
}

namespace ferry::transport::cma {

/// The same-host method: the active side copies straight between the two address spaces with
/// process_vm_readv / process_vm_writev, on libuv's thread pool, one copy job per chunk, each
/// under a grant from the owner. The claim exchange is the same-host one (same_host::Listener
/// on the owner's side, same_host::Link on the active side's). CUDA memory of the active side
/// is staged through pinned host chunks (cuda::Stager); the owner's memory is host memory.
class CmaTransport final : public Transport,
                           private kit::TransferHooks<CmaTransfer>,
                           private same_host::Link::Client {
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

  /// Grants given up because a peer's copy outlived peer_timeout after a revoke (for tests).
  std::uint32_t quarantined_grants() const noexcept { return listener_->quarantined_grants(); }

 private:
  // kit::TransferHooks
  void stop(CmaTransfer& t) override;
  void tell_peer(CmaTransfer& t, const Error& reason) override;
  void settle(CmaTransfer& t) override;

  // same_host::Link::Client
  same_host::Claimant* claimant(std::uint64_t id) override;
  void granted(std::uint64_t id, const Token& secret) override;
  void ended(std::uint64_t id, std::optional<Error> error, bool setup) override;
  void link_closed(same_host::Link& link) override;

  same_host::Link& link_to(const TransferSpec& spec);
  /// The transfer failed while copying: it ends, and the owner hears why.
  void failed(CmaTransfer& t, const Error& error);

  // Copies (cma_jobs.cpp).
  void pump(CmaTransfer& t);
  std::unique_ptr<Job> new_job(CmaTransfer& t);
  /// Queues one copy job of the transfer's next pieces, up to a chunk (`host_only`: up to the
  /// next segment of CUDA memory).
  void queue_job(CmaTransfer& t, bool host_only);
  void queue(std::unique_ptr<Job> job, CmaTransfer& t);
  void copy_inline(CmaTransfer& t);
  static void after_job(uv_work_t* req, int status);
  void job_done(Job& job);
  void all_copied(CmaTransfer& t);

  // CUDA memory of the active side (cma_staging.cpp).
  cuda::Stager& stager();
  void pump_staged(CmaTransfer& t);
  /// Unit `unit`'s process_vm_* job ended: a read's bytes go on to the device, a write's unit
  /// is done.
  void unit_moved(CmaTransfer& t, std::uint64_t unit);
  /// A device copy of `unit` ended: a read's unit is done, a write's goes on to the owner.
  void unit_copied(std::uint64_t transfer, std::uint64_t unit, const std::optional<Error>& error);
  void unit_done(CmaTransfer& t, std::uint64_t unit);

  Context ctx_;
  CmaOptions options_;
  Capabilities caps_;
  bool closed_ = false;
  kit::Lifetime life_;
  std::unique_ptr<same_host::Listener> listener_;
  kit::RegistrationCache registrations_{nullptr};
  std::unique_ptr<cuda::Stager> stager_;
  kit::LinkPool<same_host::Link> links_;
  std::uint64_t next_link_ = 1;
  kit::TransferTable<CmaTransfer> transfers_;
};

}  // namespace ferry::transport::cma
