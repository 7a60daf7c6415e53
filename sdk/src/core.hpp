#pragma once

#include <uv.h>

#include <atomic>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ferry/connector.hpp>

#include "loop/event_loop.hpp"
#include "sidechannel/nats_channel.hpp"
#include "transport/transport.hpp"

namespace ferry::detail {

class OperationState;

/// A connector's state. Operation states hold it too, so it lives until the last handle is
/// gone; shutdown() ends its loop and transports when the Connector itself is destroyed.
class Core : public std::enable_shared_from_this<Core> {
 public:
  explicit Core(ConnectorOptions options);
  /// Starts the loop and the transports. Called once, right after construction.
  void start();
  /// Cancels every live operation, closes the transports and the loop. Any thread.
  void shutdown() noexcept;

  /// Loop thread: creates and arms a passive operation, serving its metadata at `subject`
  /// when that is not empty.
  std::shared_ptr<OperationState> create_passive(OperationKind kind, std::vector<Descriptor> local,
                                                 std::chrono::milliseconds timeout,
                                                 const std::string& subject);
  /// Loop thread: starts an active operation on `remote` (already checked).
  std::shared_ptr<OperationState> begin_active(const RdmaMetadata& remote,
                                               std::vector<Descriptor> local,
                                               std::chrono::milliseconds timeout);
  /// Loop thread: starts an active operation that first asks for the metadata at `subject`.
  std::shared_ptr<OperationState> begin_by_subject(OperationKind kind, const std::string& subject,
                                                   std::vector<Descriptor> local,
                                                   std::chrono::milliseconds timeout);
  /// Loop thread: starts `op`'s transfer toward `remote` (checked). Throws as begin_* do.
  void start_transfer(OperationState& op, const RdmaMetadata& remote);
  /// Loop thread: the transport and endpoint an active operation toward `remote` uses;
  /// throws NoCommonMethod.
  std::pair<transport::Transport*, Endpoint> choose_transport(const RdmaMetadata& remote) const;

  std::chrono::milliseconds effective_timeout(const OperationOptions& options) const;

  const ConnectorOptions options;
  PeerIdentity identity;
  std::vector<Endpoint> endpoints;
  std::unique_ptr<loop::EventLoop> loop;
  /// Null without a side channel; set in start(), closed in shutdown().
  std::unique_ptr<sidechannel::NatsChannel> nats;
  bool has_nats = false;    ///< fixed after start(); readable from any thread
  std::string nats_prefix;  ///< fixed after start()

  // Loop thread only.
  std::vector<std::unique_ptr<transport::Transport>> transports;
  std::unordered_map<std::uint64_t, std::weak_ptr<OperationState>> live;
  bool closed = false;

 private:
  void on_notice(const sidechannel::Message& message);
  std::uint64_t next_id_;
};

/// Throws what begin_read / begin_write throw for metadata that does not fit: InvalidMetadata,
/// KindMismatch, SizeMismatch, InvalidArgument (bad local list), Unsupported.
void check_remote(const RdmaMetadata& remote, OperationKind wanted,
                  const std::vector<Descriptor>& local);
void check_local(const std::vector<Descriptor>& local);

/// `m` with consecutive descriptors that are contiguous in memory merged (the byte stream is
/// unchanged); for metadata that must fit into one NATS message.
RdmaMetadata coalesced(const RdmaMetadata& m);

/// One operation, passive or active; shared by its handle, the connector's table of live
/// operations (weakly) and callbacks under way. Status, error and callbacks are guarded by
/// `mu` for readers on any thread; everything else changes on the loop thread only.
class OperationState final : public transport::ExposureObserver,
                             public transport::TransferObserver,
                             public std::enable_shared_from_this<OperationState> {
 public:
  OperationState(std::shared_ptr<Core> core, std::uint64_t id, OperationKind kind, bool passive,
                 std::vector<Descriptor> local);
  ~OperationState() override;

  /// Loop thread: starts the deadline timer, if any.
  void arm(std::chrono::milliseconds timeout);
  /// Loop thread: ends the operation once. Releases its transport resources first, so that
  /// nothing touches its memory once its status is final, then wakes waiters and queues
  /// callbacks.
  void finish(OperationStatus status, std::optional<Error> error);
  /// Any thread: cancel() as the public API defines it.
  void cancel();

  OperationStatus status() const noexcept { return status_.load(std::memory_order_acquire); }
  void set_status(OperationStatus s) noexcept { status_.store(s, std::memory_order_release); }
  std::optional<Error> error() const;
  void wait() const;
  bool wait_for(std::chrono::nanoseconds timeout) const;
  void on_complete(CompletionCallback callback);

  /// Any thread: the method chosen, or empty.
  std::string method() const;
  void set_method(const std::string& method);

  /// Loop thread: pairing by subject, on the active side: ask for the metadata (again).
  void request_metadata();
  void on_metadata_reply(std::uint64_t request, const sidechannel::Message& reply);

  // transport::ExposureObserver
  void on_claimed(const std::string& method, const std::string& peer,
                  const std::string& peer_id) override;
  void on_peer_finished(const std::string& peer, const std::optional<Error>& error) override;
  void on_peer_lost(const Error& error) override;
  // transport::TransferObserver
  void on_transfer_complete() override;
  void on_transfer_failed(const Error& error) override;

  const std::shared_ptr<Core> core;
  const std::uint64_t id;
  const std::string id_hex;
  const OperationKind kind;
  const bool passive;
  const std::vector<Descriptor> local;
  RdmaMetadata metadata;  ///< passive only; set before the handle is published

  // Loop thread only.
  std::unique_ptr<transport::Transfer> transfer;
  std::vector<transport::Transport*> exposed_on;
  /// Passive, paired by subject: the subscription that serves the metadata.
  std::uint64_t serving = 0;
  /// Active, paired by subject: where to ask, the request under way, the retry timer.
  std::string subject;
  std::vector<std::uint64_t> requests;  ///< every request still unanswered: any answer counts
  uv_timer_t* retry = nullptr;
  std::chrono::milliseconds backoff{0};
  /// Passive, paired by subject: set once the NATS server has the subscription.
  std::shared_future<void> served;
  /// Active, paired by subject: the peer's metadata once it arrived (the completion notice
  /// goes to its owner).
  std::optional<RdmaMetadata> remote;
  /// Passive: the connector id of the peer that claimed it (completion notices from anyone
  /// else are ignored once it is claimed).
  std::string claimant;

 private:
  static void on_deadline(uv_timer_t* timer);
  static void on_retry(uv_timer_t* timer);
  void stop_pairing();
  void notify_peer(const std::optional<Error>& error);
  void throw_if_failed() const;

  std::atomic<OperationStatus> status_{OperationStatus::initialized};
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::optional<Error> error_;               // guarded by mu_
  std::vector<CompletionCallback> waiting_;  // guarded by mu_
  std::string method_;                       // guarded by mu_
  uv_timer_t* deadline_ = nullptr;           // loop thread only
  std::chrono::milliseconds timeout_{0};
};

/// "00000000deadbeef"
std::string hex16(std::uint64_t value);

}  // namespace ferry::detail
