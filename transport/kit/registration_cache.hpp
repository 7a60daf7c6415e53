#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>

#include "transport/memory.hpp"
#include "transport/registration.hpp"

namespace ferry::transport::kit {

/// A method's registrations keyed by address range. A range inside one already registered
/// reuses it; a range that overlaps registered ones without fitting inside one is registered
/// as the union of them all, which then replaces them in the index (holders of the old ones
/// keep them until they let go). Unused registrations stay cached, most recently used first,
/// up to `max_idle`; beyond that the least recently used are released: at each new
/// registration while the index holds at most max_idle + 256 entries, and once it holds more
/// (registrations in use by large operations), each time it has grown by half since the last
/// trim, so that a thousand-page operation costs O(n log n), not O(n^2).
///
/// Loop thread only (not thread-safe). Destructor: drops the index; registrations still held
/// live on until their holders let go.
class RegistrationCache {
 public:
  /// Registers `region` with the method; returns its handle (null when the method needs
  /// none). Throws Error to refuse.
  using RegisterFn = std::function<std::shared_ptr<void>(const Region& region)>;

  explicit RegistrationCache(RegisterFn register_fn, std::size_t max_idle = 64);

  /// A registration covering `region`; throws what the method throws.
  std::shared_ptr<const Registration> acquire(const Region& region);
  /// The cached registration covering [addr, addr + len), or null.
  std::shared_ptr<const Registration> find(std::uint64_t addr, std::uint64_t len) const;
  /// Forgets every registration overlapping `region` (its memory is being freed): later
  /// acquires register anew. Holders keep theirs.
  void invalidate(const Region& region);

  std::size_t size() const noexcept { return index_.size(); }
  /// How many times the method was asked to register (for tests and statistics).
  std::uint64_t registrations() const noexcept { return registered_; }

 private:
  struct Slot {
    std::shared_ptr<const Registration> reg;
    std::uint64_t last_use = 0;
  };
  void trim();
  /// Up to max_idle + kTrimAlways entries, every new registration trims the index.
  static constexpr std::size_t kTrimAlways = 256;

  RegisterFn register_fn_;
  std::size_t max_idle_;
  std::map<std::uint64_t, Slot> index_;  // by base; the ranges are disjoint
  std::uint64_t clock_ = 0;
  std::size_t next_trim_ = 0;  ///< a large index is trimmed again once it reaches this size
  std::uint64_t registered_ = 0;
};

}  // namespace ferry::transport::kit
