#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <ferry/descriptor.hpp>
#include <ferry/messaging.hpp>
#include <ferry/operation.hpp>
#include <ferry/options.hpp>
#include <ferry/rdma_metadata.hpp>
#include <ferry/region.hpp>
#include <ferry/stats.hpp>

namespace ferry {

namespace detail {
class Core;
}

/// A NATS subject at which a passive operation serves its metadata; begin_read/begin_write
/// take one in place of metadata. Explicit, so that a subject is never mistaken for JSON.
struct Subject {
  explicit Subject(std::string subject_name) : name(std::move(subject_name)) {}
  std::string name;
};

/// A transfer method of this build, and whether a connector here offers it.
struct MethodInfo {
  std::string method;  ///< "tcp", "cma"
  /// Preference: between two peers, the highest-ranked method both offer (and that fits) is
  /// used (cma 200 > tcp 100).
  int rank = 0;
  bool available = false;
  /// Why it is not offered (no permission, left out by the transports option, ...), or what
  /// it needs of a peer when it is.
  std::string detail;
  /// Whether it moves CUDA memory (descriptors on cuda:N) on both sides in this build, where
  /// the CUDA driver is usable (cma stages the active side's CUDA memory, but exposes none).
  bool moves_cuda = false;
  /// Whether it moves host memory on both sides: every method but cuda_ipc does (cuda_ipc
  /// copies the owner's CUDA memory to or from the active side's host memory, but exposes none).
  bool moves_host = true;
};

/// The methods this build knows, best first, and whether a connector made with `options`
/// would offer each here, and why not. Starts nothing; reads /proc and probes system calls.
/// Throws Error(InvalidArgument) for an unknown name in options.transports. Any thread.
std::vector<MethodInfo> probe_methods(const ConnectorOptions& options = {});

/// One per worker: owns the event loop (or joins the caller's), the transports and the pool
/// of peer connections, and creates every operation.
///
/// Every method is safe from any thread; from a foreign thread the work is posted to the loop
/// and the call waits for it, except begin_read / begin_write, which hand the operation to the
/// loop and return at once (one thread hop less per operation).
///
/// Destructor: cancels every operation that has not ended (their handles then report
/// `cancelled`), ends every subscription (no handler runs afterwards) and every pending
/// request (its handler gets Cancelled), closes all connections and stops the loop thread.
/// Handles may outlive it.
class Connector {
 public:
  /// Starts the loop (or attaches to options.loop) and the TCP listener.
  /// Throws Error(InvalidArgument) for bad options, Error(Internal) when the listener fails.
  explicit Connector(ConnectorOptions options = {});
  ~Connector();
  Connector(const Connector&) = delete;
  Connector& operator=(const Connector&) = delete;
  /// Movable (a member of a class, a std::vector<Connector>): the connector, its loop and its
  /// operations go with it. A moved-from connector holds nothing: its calls throw
  /// Error(InvalidState), has_side_channel() is false and identity() empty. Assigning to a
  /// connector first shuts down the one it held, as its destructor would.
  Connector(Connector&& other) noexcept;
  Connector& operator=(Connector&& other) noexcept;

  /// Exposes `local` for one peer to read. Throws InvalidArgument for an empty list,
  /// Unsupported for device memory this build cannot serve.
  [[nodiscard("dropping the handle cancels the operation")]] ReadableOperation create_readable(
      std::vector<Descriptor> local, OperationOptions options = {});
  /// Exposes `local` for one peer to write. Throws as create_readable does, and
  /// InvalidArgument for a read-only descriptor.
  [[nodiscard("dropping the handle cancels the operation")]] WritableOperation create_writable(
      std::vector<Descriptor> local, OperationOptions options = {});
  /// The same for one contiguous range of bytes (a std::vector<std::byte>, a std::span, ...).
  /// Const memory cannot be made writable: that overload takes only mutable bytes.
  template <class Bytes>
  requires std::is_convertible_v<Bytes&&, std::span<const std::byte>>
  [[nodiscard("dropping the handle cancels the operation")]] ReadableOperation create_readable(
      Bytes&& memory, OperationOptions options = {}) {
    return create_readable({bytes_descriptor(std::span<const std::byte>(memory))},
                           std::move(options));
  }
  template <class Bytes>
  requires std::is_convertible_v<Bytes&&, std::span<std::byte>>
  [[nodiscard("dropping the handle cancels the operation")]] WritableOperation create_writable(
      Bytes&& memory, OperationOptions options = {}) {
    return create_writable({bytes_descriptor(std::span<std::byte>(memory))}, std::move(options));
  }

  /// Reads the peer's readable operation described by `remote` into `local`. The two lists
  /// are matched as one byte stream (their lengths may differ, their totals may not).
  /// Throws InvalidMetadata, KindMismatch (remote is not a readable's), SizeMismatch,
  /// InvalidArgument (empty list), NoCommonMethod (the two sides share no usable method),
  /// AccessDenied (endpoints outside endpoint_allow), from every thread. What only the
  /// transfer finds out is the operation's error, from every thread alike: transfer failures,
  /// and a method that refuses at set-up (remembered per peer for a while; NoCommonMethod
  /// when no other method is left). Off the loop thread the call does not wait for the loop:
  /// it returns the operation `in_progress` at once. On the loop thread (in a completion
  /// callback, or on an embedded loop) the set-up runs within the call, so the operation may
  /// come back already `errored`; its completion callbacks still run after the call returns.
  [[nodiscard("dropping the handle cancels the operation")]] ReadOperation begin_read(
      const RdmaMetadata& remote, std::vector<Descriptor> local, OperationOptions options = {});
  /// Writes `local` into the peer's writable operation described by `remote`.
  /// Throws as begin_read does (KindMismatch when remote is not a writable's).
  [[nodiscard("dropping the handle cancels the operation")]] WriteOperation begin_write(
      std::vector<Descriptor> local, const RdmaMetadata& remote, OperationOptions options = {});

  /// Reads the readable operation that serves its metadata at `subject`: asks for it there
  /// (retrying while nobody answers, until the deadline), checks it as above, transfers, and
  /// tells the passive side how it ended. Throws InvalidArgument for a bad subject,
  /// InvalidState without a side channel; everything later is the operation's error.
  [[nodiscard("dropping the handle cancels the operation")]] ReadOperation begin_read(
      const Subject& subject, std::vector<Descriptor> local, OperationOptions options = {});
  /// Writes into the writable operation that serves its metadata at `subject`.
  [[nodiscard("dropping the handle cancels the operation")]] WriteOperation begin_write(
      std::vector<Descriptor> local, const Subject& subject, OperationOptions options = {});

  /// The four above for one contiguous range of bytes (reads need mutable memory).
  template <class Bytes>
  requires std::is_convertible_v<Bytes&&, std::span<std::byte>>
  [[nodiscard("dropping the handle cancels the operation")]] ReadOperation begin_read(
      const RdmaMetadata& remote, Bytes&& local, OperationOptions options = {}) {
    return begin_read(remote, {bytes_descriptor(std::span<std::byte>(local))}, std::move(options));
  }
  template <class Bytes>
  requires std::is_convertible_v<Bytes&&, std::span<const std::byte>>
  [[nodiscard("dropping the handle cancels the operation")]] WriteOperation begin_write(
      Bytes&& local, const RdmaMetadata& remote, OperationOptions options = {}) {
    return begin_write({bytes_descriptor(std::span<const std::byte>(local))}, remote,
                       std::move(options));
  }
  template <class Bytes>
  requires std::is_convertible_v<Bytes&&, std::span<std::byte>>
  [[nodiscard("dropping the handle cancels the operation")]] ReadOperation begin_read(
      const Subject& subject, Bytes&& local, OperationOptions options = {}) {
    return begin_read(subject, {bytes_descriptor(std::span<std::byte>(local))}, std::move(options));
  }
  template <class Bytes>
  requires std::is_convertible_v<Bytes&&, std::span<const std::byte>>
  [[nodiscard("dropping the handle cancels the operation")]] WriteOperation begin_write(
      Bytes&& local, const Subject& subject, OperationOptions options = {}) {
    return begin_write({bytes_descriptor(std::span<const std::byte>(local))}, subject,
                       std::move(options));
  }

  /// Exposes `local` as a region (docs/regions.md): registered and served once, for any number
  /// of peers that attach and transfer until close(). Throws InvalidArgument for an empty list,
  /// a read-only descriptor in a writable region, a size that is not a whole number of blocks
  /// or a bad subject; Unsupported when no method here serves regions of this memory;
  /// InvalidState for a subject without a side channel. Any thread (waits for the loop, and
  /// off it, for the subject's subscription).
  [[nodiscard("dropping the handle closes the region")]] Region create_region(
      std::vector<Descriptor> local, RegionOptions options = {});
  /// Attaches to the region `remote` describes. Returns at once (attaching); transfers may
  /// start right away and wait for it. Throws InvalidMetadata, KindMismatch (options.access
  /// beyond the region's), NoCommonMethod (no method both sides share serves regions),
  /// AccessDenied (endpoints outside endpoint_allow); what only attaching finds out is the
  /// attachment's error(). Any thread.
  [[nodiscard("dropping the handle detaches")]] Attachment attach(const RegionMetadata& remote,
                                                                  AttachOptions options = {});
  /// Attaches to the region served at `subject`: one request/reply, once.
  [[nodiscard("dropping the handle detaches")]] Attachment attach(const Subject& subject,
                                                                  AttachOptions options = {});

  /// Whether this connector was configured with NATS servers (NatsOptions::servers or
  /// FERRY_NATS_URL), and so has a side channel: it may still be connecting, or have given up
  /// (side_channel_state() says which). Any thread.
  bool has_side_channel() const noexcept;
  /// Where the side channel stands: none (no server configured), connecting (not connected
  /// yet; operations by subject wait for it within their deadlines), connected, reconnecting,
  /// or closed (given up: calls by subject throw Error(SideChannel) with this detail; or the
  /// connector is closed). Any thread; no wait for the loop.
  SideChannelStatus side_channel_state() const;

  // Messaging on the side channel's own connection (docs/sidechannel.md, "Messaging"): the
  // worker's own orchestration ("decode-3 is ready", "which blocks for request 17") without a
  // second NATS connection. Every call below throws Error(InvalidState) without a side channel
  // or once the connector is closed, Error(SideChannel) once the side channel gave up
  // connecting (side_channel_state() closed), and Error(InvalidArgument) for a subject (or reply
  // subject) that is malformed or lies in ferry's own namespace (NatsOptions::prefix: ferry's
  // control messages live there, and carry credentials). Handlers run on the loop thread.

  /// Subscribes to `subject`, which may hold the wildcards `*` (one token) and `>` (the rest,
  /// last token only); `handler` runs on the loop thread for each message until the returned
  /// handle unsubscribes (or is destroyed) or the connector is closed. Off the loop thread and
  /// with the side channel connected, returns once the server has the subscription, so that a
  /// message anyone publishes after the call returns reaches the handler (not connected: at
  /// once, and the server gets it on connect); throws Error(SideChannel) when the server refuses
  /// it or does not confirm it within NatsOptions::request_timeout, Error(Cancelled) when the
  /// connector closes meanwhile. On the loop thread it cannot wait: it returns at once (what
  /// this connector publishes afterwards is still seen, since one connection's messages reach
  /// the server in order), and a later refusal ends the subscription (Subscription::error()).
  /// Also InvalidArgument for an empty handler or a bad queue name.
  [[nodiscard("dropping the handle unsubscribes")]] Subscription subscribe(
      std::string subject, MessageHandler handler, SubscribeOptions options = {});
  /// Publishes `data` to `subject` (no wildcards), with `reply` as its reply subject when not
  /// empty. Returns once the message is handed to the connection, in call order (a publish
  /// after subscribe() returns comes after the subscription). Throws Error(SideChannel) when
  /// `data` exceeds the server's max_payload (naming both sizes); a connection that is down
  /// keeps the message until it is back (cnats' reconnect buffer), as does one not connected
  /// yet. Any thread.
  void publish(std::string_view subject, std::string_view data, std::string_view reply = {});
  /// Answers `request` (a message a subscription handler got) with `data`, at its reply
  /// subject. Throws Error(InvalidArgument) when `request` has no reply subject, or one in
  /// ferry's namespace that is not a request inbox (another ferry connector's request() is
  /// answered there); as publish() otherwise. Any thread.
  void respond(const Message& request, std::string_view data);
  /// Publishes a request and calls `on_reply` once, on the loop thread, with the first answer,
  /// or with an error: Timeout ("no reply at 'x' within N ms") once `timeout` (positive)
  /// passes, PeerLost when the server says nobody subscribes to `subject` (no responders;
  /// retryable), Cancelled when the connector is closed first. Never calls it within this
  /// call. Throws as publish() does (and InvalidArgument for a timeout that is not positive or
  /// an empty handler); then `on_reply` is never called. Any thread.
  void request(std::string subject, std::string data, std::chrono::milliseconds timeout,
               ReplyHandler on_reply);
  /// The same, waiting for the answer: returns it, or throws the error on_reply would get.
  /// Any thread but the loop thread, where it throws Error(WrongThread) instead of
  /// deadlocking.
  Message request(std::string subject, std::string data, std::chrono::milliseconds timeout);

  /// This connector's name, id, host and process, as put into metadata. Any thread.
  const PeerIdentity& identity() const noexcept;
  /// The endpoints put into metadata, one per method served. Any thread.
  std::vector<Endpoint> endpoints() const;
  /// The methods of this build, best first: those this connector serves (available), and
  /// why each other one is not. Any thread.
  std::vector<MethodInfo> methods() const;

  /// What this connector's operations have come to since it started: operations and bytes
  /// by method, kind, role and outcome, errors by code, latency of completed ones, the
  /// busiest peers, how many are live; and what it holds (connections by method, regions) as
  /// its loop last counted it (ConnectorStats::connections). Any thread; a snapshot taken
  /// under a short lock, without waiting for the loop (on the loop thread it counts first).
  ConnectorStats stats() const;
  /// The same figures in the Prometheus text format, as the endpoint of
  /// ConnectorOptions::metrics serves them (docs/operations.md lists the metrics), counting
  /// the connections first (waiting at most 100 ms for the loop). Throws Error(Unsupported) in
  /// a build without prometheus-cpp. Any thread.
  std::string metrics() const;

 private:
  static Descriptor bytes_descriptor(std::span<std::byte> memory) {
    return Descriptor(memory.data(), memory.size());
  }
  static Descriptor bytes_descriptor(std::span<const std::byte> memory) {
    return Descriptor::read_only(memory.data(), memory.size());
  }

  /// The connector's core; throws Error(InvalidState) when moved from.
  detail::Core& core() const;

  std::shared_ptr<detail::Core> core_;
};

}  // namespace ferry
