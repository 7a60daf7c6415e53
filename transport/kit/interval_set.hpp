#pragma once

#include <cstdint>
#include <map>

namespace ferry::transport::kit {

/// Disjoint ranges of bytes, merged as they are added: which bytes of a writable have been
/// written, so that overlapping writes cannot add up to "complete". Kept with inclusive ends,
/// so that a range ending at the top of the address space does not wrap.
class IntervalSet {
 public:
  /// Adds [begin, begin + len); len 0 adds nothing. `begin + len - 1` must not wrap.
  void add(std::uint64_t begin, std::uint64_t len) {
    if (len == 0) return;
    std::uint64_t last = begin + (len - 1);
    auto it = ranges_.upper_bound(begin);
    if (it != ranges_.begin() && joins(std::prev(it)->second, begin)) --it;
    while (it != ranges_.end() && joins(last, it->first)) {
      if (it->first < begin) begin = it->first;
      if (it->second > last) last = it->second;
      covered_ -= it->second - it->first + 1;
      it = ranges_.erase(it);
    }
    ranges_.emplace(begin, last);
    covered_ += last - begin + 1;
  }
  /// Bytes covered at least once.
  std::uint64_t covered() const noexcept { return covered_; }
  /// Whether [begin, begin + len) is covered entirely.
  bool covers(std::uint64_t begin, std::uint64_t len) const {
    if (len == 0) return true;
    auto it = ranges_.upper_bound(begin);
    if (it == ranges_.begin()) return false;
    --it;
    return it->first <= begin && begin <= it->second && len - 1 <= it->second - begin;
  }
  std::size_t pieces() const noexcept { return ranges_.size(); }

 private:
  /// Whether a range ending at `last` (inclusive) overlaps or touches one starting at `start`.
  static bool joins(std::uint64_t last, std::uint64_t start) noexcept {
    return start <= last || start - last == 1;
  }

  std::map<std::uint64_t, std::uint64_t> ranges_;  // begin -> last (inclusive)
  std::uint64_t covered_ = 0;
};

}  // namespace ferry::transport::kit
