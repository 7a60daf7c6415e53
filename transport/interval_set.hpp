#pragma once

#include <cstdint>
#include <map>

namespace ferry::transport {

/// Disjoint half-open ranges [begin, end), merged as they are added: which bytes of a
/// writable have been written, so that overlapping writes cannot add up to "complete".
class IntervalSet {
 public:
  /// Adds [begin, begin + len); len 0 adds nothing.
  void add(std::uint64_t begin, std::uint64_t len) {
    if (len == 0) return;
    std::uint64_t end = begin + len;
    auto it = ranges_.upper_bound(begin);
    if (it != ranges_.begin() && std::prev(it)->second >= begin) --it;
    while (it != ranges_.end() && it->first <= end) {
      if (it->first < begin) begin = it->first;
      if (it->second > end) end = it->second;
      covered_ -= it->second - it->first;
      it = ranges_.erase(it);
    }
    ranges_.emplace(begin, end);
    covered_ += end - begin;
  }
  /// Bytes covered at least once.
  std::uint64_t covered() const noexcept { return covered_; }
  /// Whether [begin, begin + len) is covered entirely.
  bool covers(std::uint64_t begin, std::uint64_t len) const {
    if (len == 0) return true;
    auto it = ranges_.upper_bound(begin);
    if (it == ranges_.begin()) return false;
    --it;
    return it->first <= begin && it->second >= begin + len;
  }
  std::size_t pieces() const noexcept { return ranges_.size(); }

 private:
  std::map<std::uint64_t, std::uint64_t> ranges_;  // begin -> end
  std::uint64_t covered_ = 0;
};

}  // namespace ferry::transport
