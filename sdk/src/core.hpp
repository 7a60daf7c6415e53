#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <ferry/connector.hpp>

#include "loop/event_loop.hpp"
#include "sdk/src/endpoint_filter.hpp"
#include "sdk/src/stats.hpp"
#include "sidechannel/nats_channel.hpp"
#include "transport/method_selector.hpp"
#include "transport/transport.hpp"

namespace ferry::detail {

class OperationState;
class PassiveOperation;
class ActiveOperation;
class RegionState;
class AttachmentState;
struct SubscriptionState;
struct PendingRequest;

/// An operation's start, run on the loop: handed to it from another thread, or at once on the
/// loop thread. Either way a refusal it meets ends the operation with that error. When the
/// loop closes before running a posted start, the operation ends cancelled (no transport ever
/// saw it).
struct LoopStart {
  std::shared_ptr<OperationState> op;
  std::function<void(OperationState&)> start;
  std::chrono::milliseconds timeout{0};
  bool ran = false;

  LoopStart(std::shared_ptr<OperationState> o, std::function<void(OperationState&)> s,
            std::chrono::milliseconds t);
  LoopStart(const LoopStart&) = delete;
  LoopStart& operator=(const LoopStart&) = delete;
  ~LoopStart();
  /// Loop thread: arms the deadline and runs the start.
  void run();
};

/// A connector's state. Operations hold it too, so it lives until the last handle is gone;
/// shutdown() ends its loop and transports when the Connector itself is destroyed.
class Core : public std::enable_shared_from_this<Core> {
 public:
  /// Checks the options (InvalidArgument) and fixes the identity.
  explicit Core(ConnectorOptions options);
  /// Starts the loop, the side channel and the transports of the registry. Called once,
  /// right after construction.
  void start();
  /// Cancels every live operation, closes the transports and the loop. Any thread.
  void shutdown() noexcept;

  /// Loop thread: creates and exposes a passive operation, served at `subject` if not empty.
  std::shared_ptr<PassiveOperation> create_passive(OperationKind kind,
                                                   std::vector<Descriptor> local,
                                                   std::chrono::milliseconds timeout,
                                                   const std::string& subject);
  /// Any thread: starts an active operation on `remote` (checked by the caller). Throws what
  /// precheck() finds. On the loop thread the transfer starts inline and its set-up errors
  /// are thrown; elsewhere the operation is handed to the loop without waiting, and what the
  /// loop finds later (a method refused at set-up) becomes the operation's error.
  std::shared_ptr<ActiveOperation> begin_active(const RdmaMetadata& remote,
                                                std::vector<Descriptor> local,
                                                std::chrono::milliseconds timeout);
  /// Any thread: starts an active operation that first asks for the metadata at `subject`;
  /// as begin_active.
  std::shared_ptr<ActiveOperation> begin_by_subject(OperationKind kind, const std::string& subject,
                                                    std::vector<Descriptor> local,
                                                    std::chrono::milliseconds timeout);

  /// Loop thread: the transports an active operation toward `remote` may use, best first,
  /// with the peer's endpoint of each. Throws NoCommonMethod, or AccessDenied when the peer's
  /// endpoints lie outside endpoint_allow.
  std::vector<std::pair<transport::Transport*, Endpoint>> choose(const RdmaMetadata& remote,
                                                                 std::uint8_t local_kinds);
  /// Any thread: throws what choose() would from what is fixed (the methods both sides offer,
  /// locality, endpoint_allow), leaving out what changes (failures remembered per peer, a
  /// transport's own view of reachability).
  void precheck(const RdmaMetadata& remote, std::uint8_t local_kinds) const;

  /// Any thread: sets the operations in progress and runs their starts on the loop, with one
  /// hand-over (inline on the loop thread). Throws InvalidState when the connector is closed.
  void launch(std::vector<std::shared_ptr<LoopStart>> starts);

  std::chrono::milliseconds effective_timeout(const OperationOptions& options) const;
  /// Any thread.
  std::uint64_t next_id() noexcept { return next_id_.fetch_add(1, std::memory_order_relaxed); }

  const ConnectorOptions options;
  PeerIdentity identity;
  std::vector<Endpoint> endpoints;
  std::unique_ptr<loop::EventLoop> loop;
  /// Null without a side channel; set in start(), closed in shutdown().
  std::unique_ptr<sidechannel::NatsChannel> nats;
  bool has_nats = false;    ///< fixed after start(); readable from any thread
  std::string nats_prefix;  ///< fixed after start()
  /// Where the side channel stands (null without one); any thread.
  std::shared_ptr<sidechannel::StatusBoard> nats_status;
  /// Any thread: throws Error(SideChannel) when the side channel has given up (closed), naming
  /// the servers and the last error, for `what` ("pairing by subject").
  void require_open_side_channel(const char* what) const;
  /// Any thread: "" while the side channel is connected, else "; NATS is not connected
  /// (connecting: ...)", for a timeout's message.
  std::string nats_note() const;

  // Loop thread only.
  std::vector<std::unique_ptr<transport::Transport>> transports;
  /// Methods the registry knows that are not running here, with the reason.
  std::vector<std::pair<std::string, std::string>> absent;
  /// Every method of the registry, best first: served here or not, and why (fixed after
  /// start(); readable from any thread).
  std::vector<MethodInfo> methods;
  transport::MethodSelector selector;
  /// The capabilities of `transports`, in their order (fixed after start(); any thread).
  std::vector<transport::Capabilities> capabilities;
  EndpointFilter allow;
  std::unordered_map<std::uint64_t, std::weak_ptr<OperationState>> live;
  /// Regions served and attachments made here, until they end (shutdown() ends them).
  std::unordered_map<std::uint64_t, std::weak_ptr<RegionState>> regions;
  std::unordered_map<std::uint64_t, std::weak_ptr<AttachmentState>> attachments;
  /// The application's subscriptions and open requests (sdk/src/messaging.cpp), until they end
  /// (shutdown() ends them).
  std::unordered_map<std::uint64_t, std::weak_ptr<SubscriptionState>> subscriptions;
  std::unordered_map<std::uint64_t, std::shared_ptr<PendingRequest>> requests;
  bool closed = false;
  /// Any thread: what the operations came to (Connector::stats()).
  StatsRecorder stats;
  /// Loop thread: counts what the connector holds now (connections by method, regions,
  /// attachments) into `stats`. Cheap: a few sizes.
  void refresh_gauges();
  /// Any thread: stats(), with the side channel's reconnects; on the loop thread after
  /// refresh_gauges().
  ConnectorStats stats_now();
  /// Any thread: stats_now() after the loop has counted the gauges (waiting for it at most
  /// `wait`; past that, the gauges it counted last).
  ConnectorStats stats_fresh(std::chrono::milliseconds wait);
  /// Any thread: the answer to a request at the stats subject (docs/operations.md).
  std::string stats_answer();
  /// The Prometheus endpoint's registration (sdk/src/metrics.hpp); null when off.
  std::shared_ptr<void> metrics_endpoint;
  /// When the connector started (uptime in the stats answer).
  const std::chrono::steady_clock::time_point born = std::chrono::steady_clock::now();

 private:
  /// The endpoints of `remote` that endpoint_allow lets us reach; throws AccessDenied when
  /// none. Any thread.
  std::vector<Endpoint> reachable(const RdmaMetadata& remote) const;
  /// What an operation toward `remote` needs of a method, from what is fixed. Any thread.
  transport::MethodSelector::Needs needs_of(const RdmaMetadata& remote,
                                            std::uint8_t local_kinds) const;
  /// begin_active / begin_by_subject: sets `op` in progress and runs `start` on the loop
  /// (inline there, throwing; else posted, its errors ending the operation).
  std::shared_ptr<ActiveOperation> launch(std::shared_ptr<ActiveOperation> op,
                                          std::function<void(ActiveOperation&)> start,
                                          std::chrono::milliseconds timeout);

  std::atomic<std::uint64_t> next_id_;
};

/// Throws what begin_read / begin_write throw for metadata that does not fit: InvalidMetadata,
/// KindMismatch, SizeMismatch, InvalidArgument (bad local list), Unsupported.
void check_remote(const RdmaMetadata& remote, OperationKind wanted,
                  const std::vector<Descriptor>& local);
/// Throws InvalidArgument, naming `call`, when a descriptor of `local` is read-only (memory
/// ferry would write into).
void check_writable(const std::vector<Descriptor>& local, const char* call);
/// Throws InvalidArgument for an empty or too long list or an overflowing total, Unsupported
/// for memory this build cannot move.
void check_local(const std::vector<Descriptor>& local);
/// The memory a descriptor names, as the transports take it (kind and device).
transport::Region region_of(const Descriptor& d);
/// The memory kinds of `local`, as a set of transport::bit(MemoryKind).
std::uint8_t memory_kinds_of(const std::vector<Descriptor>& local);

/// `m` with consecutive descriptors that are contiguous in memory merged (the byte stream is
/// unchanged); for metadata that must fit into one NATS message.
RdmaMetadata coalesced(const RdmaMetadata& m);

}  // namespace ferry::detail
