#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ferry/region.hpp>

#include "loop/uv_handle.hpp"
#include "sdk/src/operation_state.hpp"
#include "transport/region.hpp"

namespace ferry::detail {

class Core;

/// The transport's name for a region access.
inline transport::Access access_of(RegionAccess a) { return static_cast<transport::Access>(a); }
/// Whether access `offered` covers all of `wanted`.
inline bool region_allows(RegionAccess offered, RegionAccess wanted) {
  return (static_cast<unsigned>(wanted) & ~static_cast<unsigned>(offered)) == 0;
}

/// A region's owner side (docs/regions.md): memory registered and served once on every
/// transport that serves regions, for every peer that attaches. Loop thread, except where
/// said; events and the open/closed state are guarded by `mu_` for readers on any thread.
class RegionState final : public std::enable_shared_from_this<RegionState>,
                          public transport::RegionObserver {
 public:
  RegionState(std::shared_ptr<Core> core, std::uint64_t id, std::vector<Descriptor> local,
              RegionOptions options);
  ~RegionState() override;

  /// Registers and serves the memory, builds the metadata, serves it at the subject if asked,
  /// and arms the deadline. Throws what a transport throws (nothing is left served then).
  void open();
  /// Ends it: every transport stops serving it (when that returns, no peer touches the
  /// memory), the subject is dropped, and the `ended` event is the last. Idempotent.
  void end(const Error& reason);
  /// See Region::revoke.
  std::size_t revoke(const std::string& who);
  std::vector<RegionPeer> peers() const;

  // Any thread.
  bool is_open() const noexcept { return open_.load(std::memory_order_acquire); }
  std::optional<Error> error() const;
  std::optional<RegionEvent> next_event(std::chrono::nanoseconds timeout);
  std::uint64_t dropped() const;

  const std::shared_ptr<Core> core;
  const std::uint64_t id;
  const std::string id_hex;
  const std::vector<Descriptor> local;
  const RegionOptions options;
  /// Set before the handle is published, then constant.
  RegionMetadata metadata;
  /// Pairing by subject: the subscription (0: none) and, off the loop thread, when the server
  /// has it.
  std::uint64_t serving = 0;
  std::shared_future<void> served;

  // transport::RegionObserver
  void on_attached(const transport::Attachment& attachment) override;
  void on_region_transfer(const transport::RegionNotice& notice) override;
  void on_detached(std::uint64_t attachment, const std::optional<Error>& error) override;

 private:
  static void on_deadline(uv_timer_t* timer);
  void emit(RegionEvent event);
  /// The event's peer fields for attachment `id`.
  RegionEvent about(std::uint64_t id) const;
  std::vector<RegionRange> offsets(const transport::Ranges& ranges) const;

  struct Peer {
    transport::Transport* transport = nullptr;
    RegionPeer info;
  };
  std::unordered_map<std::uint64_t, Peer> peers_;
  std::vector<transport::Transport*> served_on_;
  std::vector<std::shared_ptr<const transport::Registration>> registrations_;
  /// (address, region offset) of each descriptor, by address: owner addresses to offsets.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> starts_;
  loop::Timer deadline_;
  std::atomic<bool> open_{false};

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<RegionEvent> queue_;  // guarded by mu_
  std::uint64_t dropped_ = 0;      // guarded by mu_
  std::optional<Error> error_;     // guarded by mu_
  bool ended_ = false;             // guarded by mu_: the ended event is queued
  bool ending_ = false;            // guarded by mu_: end() has begun
};

class RegionTransfer;

/// A peer's attachment to a region (docs/regions.md): the method chosen once, the attachment
/// made once, then transfers on it. Loop thread, except where said.
class AttachmentState final : public std::enable_shared_from_this<AttachmentState>,
                              public transport::AttachObserver {
 public:
  AttachmentState(std::shared_ptr<Core> core, std::uint64_t id, std::optional<RegionAccess> access);
  ~AttachmentState() override;

  /// Attaches by the best method both sides share that serves regions, falling back to the
  /// next when one fails at set-up. Ends the attachment with the error when none works.
  void start(const RegionMetadata& metadata);
  /// Asks for the metadata at `subject`, then start()s.
  void ask(const std::string& subject);
  /// Arms the attach deadline (loop thread).
  void arm(std::chrono::milliseconds timeout);
  /// Ends it: transfers under way are cancelled, the owner is told. Idempotent.
  void detach(const Error& reason);

  /// A transfer to start on this attachment: now, once attached, or never (its error).
  void begin(const std::shared_ptr<RegionTransfer>& transfer);
  void forget(RegionTransfer* transfer);

  // Any thread.
  Attachment::State state() const noexcept { return state_.load(std::memory_order_acquire); }
  std::optional<Error> error() const;
  std::optional<RegionMetadata> metadata() const;
  std::string method() const;
  void wait_attached() const;
  /// The calling thread's path for small transfers, while attached by a method that has one.
  std::shared_ptr<const transport::DirectCopy> direct() const;
  /// Loop thread: the owner hears of a transfer made through direct().
  void notify_direct(const transport::TransferSpec& spec);

  const std::shared_ptr<Core> core;
  const std::uint64_t id;
  const std::optional<RegionAccess> wanted;

  // transport::AttachObserver
  void on_attached() override;
  void on_attach_failed(const Error& error, bool setup) override;
  void on_detached(const Error& error) override;

 private:
  friend class RegionTransfer;
  bool try_next();
  void fail(const Error& error);
  void ended(const Error& error);
  static void on_deadline(uv_timer_t* timer);
  static void on_retry(uv_timer_t* timer);
  void request();

  std::vector<std::pair<transport::Transport*, Endpoint>> candidates_;
  std::size_t next_ = 0;
  std::string tried_;
  transport::Transport* transport_ = nullptr;
  std::unique_ptr<transport::RemoteRegion> remote_;
  std::vector<std::shared_ptr<RegionTransfer>> waiting_;  ///< begun before it attached
  std::unordered_map<RegionTransfer*, std::weak_ptr<RegionTransfer>> running_;
  loop::Timer deadline_;
  std::chrono::milliseconds attach_timeout_{0};
  // Asking at a subject.
  std::string subject_;
  std::vector<std::uint64_t> requests_;
  loop::Timer retry_;
  std::chrono::milliseconds backoff_{0};

  std::atomic<Attachment::State> state_{Attachment::State::attaching};
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::optional<RegionMetadata> metadata_;               // guarded by mu_
  std::optional<Error> error_;                           // guarded by mu_
  std::string method_;                                   // guarded by mu_
  std::shared_ptr<const transport::DirectCopy> direct_;  // guarded by mu_
};

/// One transfer on an attachment: an operation with the usual contract.
class RegionTransfer final : public OperationState, public transport::TransferObserver {
 public:
  RegionTransfer(std::shared_ptr<Core> core, std::uint64_t id, OperationKind kind,
                 std::vector<Descriptor> local, std::shared_ptr<AttachmentState> attachment,
                 std::vector<RegionRange> remote, std::vector<std::uint64_t> blocks,
                 std::string tag);

  /// Loop thread: hands itself to the attachment.
  void launch();
  /// Loop thread: starts the transfer on the attached region.
  void go(transport::Transport& transport, transport::RemoteRegion& remote,
          const RegionMetadata& metadata);

  // transport::TransferObserver
  void on_transfer_complete() override;
  void on_transfer_failed(const Error& error) override;

 private:
  void release(OperationStatus final_status, const Error& reason) override;

  const std::shared_ptr<AttachmentState> attachment_;
  const std::vector<RegionRange> remote_;
  const std::vector<std::uint64_t> blocks_;  ///< by block index when not empty
  const std::string tag_;
  std::unique_ptr<transport::Transfer> transfer_;
  std::vector<std::shared_ptr<const transport::Registration>> registrations_;
};

/// The segments of a transfer of `local` to or from `remote` ranges of the region `m`
/// (offsets into its byte stream). Throws InvalidArgument for a range outside the region, an
/// empty one, or totals that differ.
std::vector<transport::Segment> region_segments(const RegionMetadata& m,
                                                const std::vector<RegionRange>& remote,
                                                const std::vector<Descriptor>& local);
/// The ranges of `blocks` of `m` (InvalidArgument without a block layout or for an index past
/// the end); adjacent blocks merged.
std::vector<RegionRange> block_ranges(const RegionMetadata& m,
                                      const std::vector<std::uint64_t>& blocks);

}  // namespace ferry::detail
