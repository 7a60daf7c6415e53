#pragma once

// An in-process transport for tests: the Transport contract (transport/transport.hpp) without
// sockets, so that Core can be tested alone and every transport can be held to the same
// conformance suites (tests/transport/conformance_test.cpp, region_conformance_test.cpp).
//
// Every FakeTransport joins a process-wide fabric under an address of its own, "fake:<n>".
// An active transfer asks the owner of the exposure for one chunk at a time by posting to the
// owner's loop; the owner checks the chunk through its Exposures, copies it there (out of its
// readable, or into its writable) and posts the answer back. So an exposure's memory is read
// and written on its owner's loop only, under the same check as tcp's, and revoke() on that
// loop stops every later copy; a transfer's local memory is touched on its own loop only, so
// cancel() there stops every later copy into or out of it. Each chunk costs a round trip
// through both loops: a transfer is observably in progress, and can be cancelled mid-way.
//
// Where tcp has a connection, the fake has a link between two transports: an exposure is
// claimed by the link its first request came by (so every transfer of one transport shares
// the claim, as tcp's pooled connection does), and a transport that closes, or a link dropped
// by the fault policy, loses every claim and transfer over it (PeerLost). Refusals carry the
// texts of ExposureTable, as tcp's do. Where tcp and the contract differ, the fake follows the
// contract: a peer it cannot find is a set-up failure (on_transfer_setup_failed), and a revoke
// answers the claimant's transfers with the revoke's reason.
//
// Regions (docs/regions.md) are served with the kit every transport shares (kit::Regions): an
// ATTACH through the owner's mailbox makes an attachment bound to the link it came by, with a
// secret of its own; its transfers are transfers as above under that id and secret, each
// ending with an ENDED instead of a DONE (a successful write's answered, the others notices).
// Revoking an attachment or ending the region tells the peer, whose transfers on it end with
// the reason; the memory is safe before that, since every chunk is checked on the owner's loop.
// The fault policy applies to attach() as to start() (set-up faults) and to the transfers on
// an attachment as to any other.

#include <uv.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/kit/exposures.hpp"
#include "transport/kit/regions.hpp"
#include "transport/kit/registration_cache.hpp"
#include "transport/region.hpp"
#include "transport/transport.hpp"

namespace ferry::test {

/// Faults a FakeTransport injects as the active side of its transfers and attachments.
struct FaultPolicy {
  enum class Setup : std::uint8_t {
    none,
    /// start() and attach() throw Error(setup_code): refused at once
    throw_error,
    /// start() and attach() return; the observer hears on_transfer_setup_failed(setup_code),
    /// or on_attach_failed(setup_code, setup = true)
    report_failure,
  };
  Setup setup = Setup::none;
  ErrorCode setup_code = ErrorCode::Unsupported;
  /// After this many chunks of a transfer, the link to its peer drops as a broken connection
  /// would: both sides see PeerLost. 0: never.
  std::uint64_t drop_after_chunks = 0;
  /// After this many chunks of a transfer, it asks for no more: it stays in progress until it
  /// is cancelled or its peer is lost. 0: never.
  std::uint64_t stall_after_chunks = 0;
};

/// Shared by a test and the fake transports made for it: the fault policy, and counters the
/// test reads. Any thread.
class FakeControl {
 public:
  void set_policy(const FaultPolicy& policy);
  FaultPolicy policy() const;
  /// start() calls, refused or not.
  std::uint64_t setup_attempts() const noexcept { return setup_attempts_.load(); }
  /// Chunks the owners copied (read or written).
  std::uint64_t chunks_served() const noexcept { return chunks_served_.load(); }
  /// Transports made by a FakeTransportFactory.
  std::uint64_t transports_made() const noexcept { return made_.load(); }

 private:
  friend class FakeTransport;
  friend class FakeTransportFactory;
  mutable std::mutex mu_;
  FaultPolicy policy_;  // guarded by mu_
  std::atomic<std::uint64_t> setup_attempts_{0};
  std::atomic<std::uint64_t> chunks_served_{0};
  std::atomic<std::uint64_t> made_{0};
};

struct FakeMailbox;
class FakeTransfer;
class FakeRemoteRegion;

/// See the file comment. Every method runs on the loop thread of the loop it was made on,
/// constructor and destructor included.
class FakeTransport final : public transport::Transport {
 public:
  struct Options {
    std::string method = "fake";
    int rank = 50;  ///< below tcp's 100
    std::uint8_t memory_kinds = transport::bit(transport::MemoryKind::host);
    bool same_host_only = false;
    /// Bytes per chunk: one round trip through both loops each.
    std::uint64_t chunk_size = 64u << 10;
    /// Largest chunk the owner serves; larger ones are refused (AccessDenied), as tcp does.
    std::uint64_t max_request = 16u << 20;
    std::string local_name = "fake";       ///< shown in peers' messages
    std::uint64_t local_id = 0;            ///< the connector's id, given to claims as peer_id
    std::shared_ptr<FakeControl> control;  ///< null: no faults, nothing counted
  };
  using Defer = transport::Defer;

  /// Joins the fabric under a fresh address. Throws Error(InvalidArgument) for a zero chunk size.
  FakeTransport(uv_loop_t* loop, Defer defer, Options options);
  /// close().
  ~FakeTransport() override;
  FakeTransport(const FakeTransport&) = delete;
  FakeTransport& operator=(const FakeTransport&) = delete;

  const transport::Capabilities& capabilities() const override { return caps_; }
  std::vector<Endpoint> endpoints() const override;
  std::shared_ptr<const transport::Registration> register_memory(
      const transport::Region& region) override;
  std::string expose(const transport::Exposure& exposure,
                     transport::ExposureObserver& observer) override;
  void revoke(std::uint64_t id, const Error& reason) override;
  std::unique_ptr<transport::Transfer> start(transport::TransferSpec spec,
                                             transport::TransferObserver& observer) override;
  void close() override;

  bool serves_regions() const override { return true; }
  std::string serve_region(const transport::RegionExposure& region,
                           transport::RegionObserver& observer) override;
  void revoke_attachment(std::uint64_t attachment, const Error& reason) override;
  std::vector<std::uint64_t> attachments_of_peer(std::uint64_t id,
                                                 const std::string& peer_id) const override;
  void end_region(std::uint64_t id, const Error& reason) override;
  std::unique_ptr<transport::RemoteRegion> attach(transport::AttachSpec spec,
                                                  transport::AttachObserver& observer) override;

  /// "fake:<n>".
  const std::string& address() const noexcept { return address_; }
  /// Exposures served now, a live attachment counting as one.
  std::size_t exposures() const noexcept { return exposures_.size(); }
  /// Drops the link to the transport at `address` as a broken connection would: transfers
  /// between the two fail, exposures either side claimed over it are lost (PeerLost).
  void drop_link(const std::string& address, const std::string& why);

 private:
  friend struct FakeMailbox;
  friend class FakeTransfer;
  friend class FakeRemoteRegion;

  struct Request;
  struct Reply;
  struct Peer {
    std::string name;
    std::string id;
  };
  enum class Waiting : std::uint8_t { none, chunk, done };

  // The owner's side: requests from active transfers, answered on this loop.
  void serve(Request r);
  void serve_done(Request& r);
  void serve_ended(Request& r);
  void serve_attach(std::uint64_t from, const Peer& who, std::uint64_t key, std::uint64_t region,
                    const transport::Token& token, transport::Access access);
  void serve_detach(std::uint64_t from, std::uint64_t attachment, const transport::Token& secret);
  /// Tells the peer at `peer` that exposure or attachment `id` ended with `reason`.
  void tell_revoked(std::uint64_t peer, std::uint64_t id, const Error& reason);
  void refuse(const Request& r, ErrorCode code, const std::string& message);
  void answer(std::uint64_t to, Reply reply);
  std::optional<transport::Token> claim(transport::kit::Exposures::Entry& entry,
                                        std::uint64_t peer);
  std::string describe_peer(std::uint64_t peer) const;

  // The active side.
  void pump(FakeTransfer& t);
  void on_reply(std::uint64_t from, Reply r);
  void on_revoked(std::uint64_t from, std::uint64_t op, const Error& reason);
  void send_done_notice(FakeTransfer& t, const Error& error);
  void finish(FakeTransfer& t, std::optional<Error> error, bool setup = false);
  void cancel_transfer(FakeTransfer& t, const Error& reason);
  void forget(FakeTransfer& t);
  void on_attach_answer(std::uint64_t from, std::uint64_t key, std::uint64_t attachment,
                        const transport::Token& secret, const std::optional<Error>& refusal);
  void forget_region(FakeRemoteRegion& region);
  /// The request fields every message of this side carries: who sends it.
  Request request_from_me() const;

  // Both: the link to a peer is gone.
  void lose_peer(std::uint64_t peer, const std::string& why);
  bool send(std::uint64_t to, std::function<void(FakeTransport&)> task);
  FaultPolicy policy() const;

  uv_loop_t* loop_;
  Defer defer_;
  Options options_;
  transport::Capabilities caps_;
  std::uint64_t id_ = 0;
  std::string address_;
  bool closed_ = false;
  std::shared_ptr<FakeMailbox> box_;

  transport::kit::Exposures exposures_;
  transport::kit::Regions regions_;  ///< its attachments are exposures in exposures_
  transport::kit::RegistrationCache registrations_{nullptr};
  std::unordered_map<std::uint64_t, Peer> peers_;  ///< who sent requests, from their requests
  std::unordered_map<std::uint64_t, FakeTransfer*> transfers_;
  std::unordered_map<std::uint64_t, FakeRemoteRegion*> remote_regions_;  ///< by key
  std::uint64_t next_transfer_ = 1;
  std::uint64_t next_region_ = 1;
  std::uint64_t next_req_ = 1;
  /// Deferred observer calls hold it weakly: they do nothing once the transport is closed.
  std::shared_ptr<int> life_ = std::make_shared<int>(0);
};

/// Registers FakeTransport under its method ("fake" by default) with
/// ferry::detail::add_method for connectors created while it lives, and removes it
/// on destruction. The transports it makes share its control() and take the connector's
/// name and id. Any thread.
class FakeTransportFactory {
 public:
  explicit FakeTransportFactory(FakeTransport::Options base = {});
  ~FakeTransportFactory();
  FakeTransportFactory(const FakeTransportFactory&) = delete;
  FakeTransportFactory& operator=(const FakeTransportFactory&) = delete;

  FakeControl& control() noexcept { return *control_; }
  /// false: the factory answers that the method is not available on this host.
  void set_available(bool available) noexcept { available_->store(available); }

 private:
  std::string method_;
  std::shared_ptr<FakeControl> control_ = std::make_shared<FakeControl>();
  std::shared_ptr<std::atomic<bool>> available_ = std::make_shared<std::atomic<bool>>(true);
};

}  // namespace ferry::test
