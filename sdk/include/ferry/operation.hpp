#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ferry/descriptor.hpp>
#include <ferry/error.hpp>
#include <ferry/operation_status.hpp>
#include <ferry/rdma_metadata.hpp>

namespace ferry {

namespace detail {
class OperationState;
}

/// Called once when an operation reaches a final status, on the connector's loop thread.
/// `error` is null for `complete` and points at the reason for `cancelled` and `errored`;
/// it is valid during the call only. The callback must not block: it runs on the loop that
/// moves every transfer of its connector. It may start, cancel or destroy operations of the
/// same connector (those calls run inline); a call into another connector waits for that
/// connector's loop, so two connectors doing so to each other from callbacks deadlock.
using CompletionCallback = std::function<void(OperationStatus status, const Error* error)>;

/// Per-operation settings.
struct OperationOptions {
  /// Deadline, counted from the call that creates the operation. Zero takes the connector's
  /// `default_timeout` (and zero there means no deadline). When it passes, the operation is
  /// `errored` with ErrorCode::Timeout and, if passive, its token dies with it.
  std::chrono::milliseconds timeout{0};
  /// Passive operations: a NATS subject at which to serve the metadata (request/reply) until
  /// the operation ends, so that a peer can pair by subject. Empty: none. Needs the
  /// connector's side channel.
  std::string subject;
};

/// What every operation handle offers. Handles are move-only; the operation itself lives on
/// the connector's loop.
///
/// Destructor: cancels the operation if it has not ended, and returns only when no transport
/// will touch its memory again (see cancel()).
class Operation {
 public:
  /// An empty handle: status() is `uninitialized`; every other call throws InvalidState.
  Operation() noexcept;
  Operation(Operation&&) noexcept;
  /// Cancels the operation this handle held (as the destructor does), then takes `other`'s.
  Operation& operator=(Operation&& other) noexcept;
  Operation(const Operation&) = delete;
  Operation& operator=(const Operation&) = delete;
  ~Operation();

  /// False for an empty handle. Any thread.
  explicit operator bool() const noexcept { return state_ != nullptr; }

  /// `read` for ReadableOperation and ReadOperation, `write` for the other two. Any thread.
  OperationKind kind() const;
  /// Current status; never blocks. Any thread.
  OperationStatus status() const noexcept;
  /// The operation's id at this connector (16 hex digits); a passive operation's metadata
  /// carries it as its notification key. Any thread.
  const std::string& id() const;
  /// The method that moves (or moved) the bytes, e.g. "tcp"; empty until one is chosen (an
  /// active operation paired by subject chooses once the metadata arrives; a passive one
  /// once its peer claims it). Any thread.
  std::string method() const;
  /// The peer this operation is (or was) with, once known: for an active operation the owner
  /// its metadata names (name, id, host, pid), from when the metadata is in hand; for a
  /// passive one the peer that claimed it (its connector's name and id; host and pid are not
  /// told). Empty before, and for a passive operation nobody claimed. Any thread.
  std::optional<PeerIdentity> peer() const;
  /// The local descriptors, as given. Any thread.
  const std::vector<Descriptor>& descriptors() const;
  /// Why the operation was cancelled or errored; empty otherwise. Any thread.
  std::optional<Error> error() const;

  /// Blocks until the operation ends. Returns if it completed; throws its error if it was
  /// cancelled or errored. Any thread but the connector's loop thread, where it throws
  /// Error(WrongThread) instead of deadlocking.
  void wait_for_completion() const;
  /// As above, but gives up after `timeout` and returns false; the operation goes on (its
  /// own deadline is OperationOptions::timeout). Returns true once complete. Note: it throws
  /// when the operation failed, and returns false only on timeout: it is not a poll (use
  /// wait() or status() for that).
  [[nodiscard]] bool wait_for_completion(std::chrono::nanoseconds timeout) const;
  /// Waits until the operation ends or `timeout` passes, and returns its status then: a final
  /// one (complete, cancelled, errored: error() says why) or, on timeout, the current one.
  /// Never throws the operation's error; throws Error(WrongThread) on the connector's loop
  /// thread, and Error(InvalidState) on an empty handle. Any other thread.
  OperationStatus wait(std::chrono::nanoseconds timeout = std::chrono::nanoseconds::max()) const;

  /// Registers a callback run once, on the loop thread, when the operation ends; if it has
  /// ended already, the callback is queued to the loop at once (or, when the connector is
  /// closed, run on the calling thread). Any thread.
  void on_complete(CompletionCallback callback);

  /// Stops the operation. When cancel() returns, no transport touches the operation's memory
  /// again; a passive operation's token is dead, so a late peer gets AccessDenied, and the
  /// peer of a started transfer is told. No effect on an operation that has ended.
  /// Any thread; from a foreign thread it waits for the loop to carry it out.
  void cancel();

 protected:
  explicit Operation(std::shared_ptr<detail::OperationState> state) noexcept;
  const detail::OperationState& state() const;
  std::shared_ptr<detail::OperationState> state_;

  friend class Connector;
  friend class Attachment;
};

/// Exposes local memory for one peer to read (the peer calls begin_read with its metadata).
/// Complete once the peer has read all of it.
class ReadableOperation : public Operation {
 public:
  ReadableOperation() noexcept = default;
  /// What the peer needs; pass it by any channel (to_json). Any thread.
  const RdmaMetadata& metadata() const;

 private:
  using Operation::Operation;
  friend class Connector;
};

/// Exposes local memory for one peer to write (the peer calls begin_write with its metadata).
/// Complete once all of the peer's bytes are in the memory.
class WritableOperation : public Operation {
 public:
  WritableOperation() noexcept = default;
  /// What the peer needs; pass it by any channel (to_json). Any thread.
  const RdmaMetadata& metadata() const;

 private:
  using Operation::Operation;
  friend class Connector;
};

/// Reads a peer's readable operation into local memory. Complete once the bytes are in the
/// local descriptors.
class ReadOperation : public Operation {
 public:
  ReadOperation() noexcept = default;

 private:
  using Operation::Operation;
  friend class Connector;
  friend class Attachment;
};

/// Writes local memory into a peer's writable operation. Complete once the peer has
/// acknowledged that the bytes are in its memory.
class WriteOperation : public Operation {
 public:
  WriteOperation() noexcept = default;

 private:
  using Operation::Operation;
  friend class Connector;
  friend class Attachment;
};

}  // namespace ferry
