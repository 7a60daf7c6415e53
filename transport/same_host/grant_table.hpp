#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include <ferry/error.hpp>

namespace ferry::transport::same_host {

/// The owner's permission for one peer to copy from or into one passive operation's memory,
/// kept in shared memory (a memfd the peer maps) so that taking it costs no message:
///
///   a slot, one word: bits 63..32 the grant's generation (0: free), bit 31 ended,
///                     bits 30..0 copies under way
///
/// A peer takes the grant (compare-and-swap: +1 copy, only while the generation is its own
/// and the grant has not ended) before every copy job, and gives it back after. The owner ends
/// a grant by setting the ended bit, then waits (futex) until no copy is under way: once
/// close() returns, no copy of that peer starts or runs, which is what cancel() promises.
///
/// The memfd is sealed against shrinking and growing before any peer sees it, and a peer maps
/// it only after checking those seals and its real size (GrantView): a table whose owner could
/// shrink it, or whose size the metadata overstates, would fault the peer's copies (SIGBUS).
inline constexpr std::size_t kSlotBytes = 8;
/// The largest table a peer maps (a million slots): a bound on what an owner's metadata may
/// make a peer map.
inline constexpr std::size_t kMaxTableBytes = std::size_t{1} << 23;

struct Grant {
  std::uint32_t slot = 0;
  std::uint32_t generation = 0;
};

/// The owner's side. Loop thread only.
class GrantTable {
 public:
  /// Throws Error(Internal) when the memfd cannot be made.
  explicit GrantTable(std::uint32_t slots = 16384);
  ~GrantTable();
  GrantTable(const GrantTable&) = delete;
  GrantTable& operator=(const GrantTable&) = delete;

  int fd() const noexcept { return fd_; }
  std::size_t bytes() const noexcept { return std::size_t{slots_} * kSlotBytes; }

  /// A fresh grant, or nullopt when every slot is taken.
  std::optional<Grant> open();
  /// Ends `grant`: no copy starts under it any more; then waits until none is under way,
  /// at most until `deadline`, and no longer once `peer_idle()` says the peer copies nothing
  /// (its process exited, or every thread of it is stopped). Returns false when copies were
  /// still under way at the deadline: the slot is then quarantined, not reused until its
  /// copies are given back or `peer_idle()` says the peer copies nothing (checked whenever a
  /// grant is opened). A slot whose generation a peer overwrote is reclaimed at once: only a
  /// peer that broke the protocol writes there, and the slot is not left to leak.
  bool close(Grant grant, std::chrono::steady_clock::time_point deadline,
             const std::function<bool()>& peer_idle);
  /// Copies under way under `grant` (for tests).
  std::uint32_t in_flight(Grant grant) const noexcept;
  /// Grants whose copies outlived close()'s deadline, since the table was made.
  std::uint32_t quarantined() const noexcept { return quarantined_; }
  /// Slots in quarantine now.
  std::size_t held() const noexcept { return quarantine_.size(); }

 private:
  std::atomic_ref<std::uint64_t> word(std::uint32_t slot) const noexcept;

  int fd_ = -1;
  std::uint32_t slots_;
  std::byte* base_ = nullptr;
  std::uint32_t next_generation_ = 1;
  std::uint32_t fresh_ = 0;  // slots below this were used once
  std::vector<std::uint32_t> free_;
  struct Held {
    Grant grant;
    std::function<bool()> peer_idle;
  };
  std::vector<Held> quarantine_;
  std::uint32_t quarantined_ = 0;

  /// Gives quarantined slots whose copies are over back to the free list.
  void reclaim();
};

/// A peer's view of an owner's table: the owner's memfd, mapped. Any thread.
class GrantView {
 public:
  /// Takes `fd` (closed by the constructor) and maps it, after checking that it is a memfd
  /// sealed against shrinking and growing, of exactly `bytes` (what the owner's metadata
  /// says: never trusted), a whole number of slots and at most kMaxTableBytes. Throws
  /// Error(ProtocolError) naming what is wrong, Error(Unsupported) when it cannot be mapped.
  GrantView(int fd, std::size_t bytes);
  ~GrantView();
  GrantView(const GrantView&) = delete;
  GrantView& operator=(const GrantView&) = delete;

  /// Whether `grant` names a slot inside the table.
  bool holds(Grant grant) const noexcept;
  /// Takes the grant for one copy: false once the owner has ended it.
  bool acquire(Grant grant) const noexcept;
  /// Gives it back after the copy (only to the same generation); wakes an owner waiting in
  /// close().
  void release(Grant grant) const noexcept;

 private:
  std::atomic_ref<std::uint64_t> word(std::uint32_t slot) const noexcept;
  std::byte* base_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace ferry::transport::same_host
