#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ferry/operation.hpp>

#include "loop/uv_handle.hpp"

namespace ferry::detail {

class Core;

/// What every operation has, passive or active: its lifecycle. Status, error and callbacks
/// are guarded by `mu_` for readers on any thread; everything else changes on the loop thread
/// only. Shared by its handle, the connector's table of live operations (weakly) and the
/// callbacks under way.
///
/// An operation ends once, in finish(): first its role releases the memory (release(): no
/// transport touches it after), then the final status is published, waiters wake and
/// callbacks are queued.
class OperationState : public std::enable_shared_from_this<OperationState> {
 public:
  OperationState(std::shared_ptr<Core> core, std::uint64_t id, OperationKind kind, bool passive,
                 std::vector<Descriptor> local);
  virtual ~OperationState();
  OperationState(const OperationState&) = delete;
  OperationState& operator=(const OperationState&) = delete;

  /// Loop thread: enters the connector's live table and starts the deadline timer, if any.
  void arm(std::chrono::milliseconds timeout);
  /// Loop thread: an operation paired by subject with no deadline of its own ends with
  /// Timeout if it is not paired within `timeout` (ConnectorOptions::subject_timeout).
  void arm_pairing(std::chrono::milliseconds timeout);
  /// Loop thread: the operation is paired (the metadata arrived, a peer claimed it).
  void paired() noexcept { pairing_.reset(); }
  /// Loop thread: ends the operation, once; later calls do nothing.
  void finish(OperationStatus status, std::optional<Error> error);
  /// Any thread: cancel() as the public API defines it.
  void cancel();
  /// Any thread, for an operation no transport ever saw, whose start the closing loop
  /// dropped: ends it with `error` (cancelled) at once; callbacks run on the calling thread.
  void abandon(Error error);
  /// Any thread, before the handle is published: the operation completed on the calling thread
  /// by `method` (a region's direct copy) without reaching the loop. Counted in stats.
  void completed_here(const std::string& method);

  OperationStatus status() const noexcept { return status_.load(std::memory_order_acquire); }
  void set_status(OperationStatus s) noexcept { status_.store(s, std::memory_order_release); }
  std::optional<Error> error() const;
  void wait() const;
  bool wait_for(std::chrono::nanoseconds timeout) const;
  /// Waits until the status is final or `timeout` passes; returns the status then. Never
  /// throws the operation's error (WrongThread on the loop thread).
  OperationStatus wait_status(std::chrono::nanoseconds timeout) const;
  void on_complete(CompletionCallback callback);

  /// Any thread: the method chosen, or empty.
  std::string method() const;
  /// The peer, once known (any thread); set on the loop thread.
  std::optional<PeerIdentity> peer() const;
  void set_peer(PeerIdentity peer);
  void set_method(const std::string& method);

  const std::shared_ptr<Core> core;
  const std::uint64_t id;
  const std::string id_hex;
  const OperationKind kind;
  const bool passive;
  const std::vector<Descriptor> local;
  /// Passive only: what a peer needs; set before the handle is published, then constant.
  RdmaMetadata metadata;

 protected:
  /// Loop thread: when a peer claimed this passive operation (stats' wait and transfer).
  std::optional<std::chrono::steady_clock::time_point> claimed_at_;
  /// Loop thread, from finish() before the status is final: makes the memory unreachable
  /// (revoke / cancel, synchronously) and tells the peer `reason` if it has one.
  virtual void release(OperationStatus final_status, const Error& reason) = 0;
  /// The text of the Timeout error when the deadline passes.
  virtual std::string deadline_text(std::chrono::milliseconds timeout) const;
  /// The text of the Timeout error when the pairing deadline passes.
  virtual std::string pairing_text(std::chrono::milliseconds timeout) const;

 private:
  static void on_deadline(uv_timer_t* timer);
  static void on_pairing_deadline(uv_timer_t* timer);
  void throw_if_failed() const;

  std::atomic<OperationStatus> status_{OperationStatus::initialized};
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::optional<Error> error_;               // guarded by mu_
  std::vector<CompletionCallback> waiting_;  // guarded by mu_
  std::string method_;                       // guarded by mu_
  std::optional<PeerIdentity> peer_;         // guarded by mu_
  loop::Timer deadline_;                     // loop thread only
  std::chrono::milliseconds timeout_{0};
  loop::Timer pairing_;  // loop thread only
  std::chrono::milliseconds pairing_timeout_{0};
  /// When the handle's call began: the start of the latency stats() reports.
  const std::chrono::steady_clock::time_point created_ = std::chrono::steady_clock::now();
  bool counted_ = false;  ///< loop thread: reported to the connector's stats by arm()
};

}  // namespace ferry::detail
