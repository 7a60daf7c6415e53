#include "sidechannel/answer_limit.hpp"

#include <algorithm>
#include <utility>

namespace ferry::sidechannel {

AnswerLimit::AnswerLimit(int burst, int per_second)
    : burst_(std::max(burst, 1)), per_second_(std::max(per_second, 0)) {}

bool AnswerLimit::admit(std::string_view key, Clock::time_point now) {
  if (per_second_ <= 0) return true;
  std::lock_guard lock(mu_);
  auto it = buckets_.find(std::string(key));
  if (it == buckets_.end()) {
    if (buckets_.size() >= kPruneAbove) prune(now);
    it = buckets_.emplace(std::string(key), Bucket{burst_, now}).first;
  }
  Bucket& b = it->second;
  if (now > b.last) {
    const double elapsed = std::chrono::duration<double>(now - b.last).count();
    b.tokens = std::min(burst_, b.tokens + elapsed * per_second_);
    b.last = now;
  }
  if (b.tokens < 1.0) {
    ++refused_;
    return false;
  }
  b.tokens -= 1.0;
  return true;
}

std::optional<std::uint64_t> AnswerLimit::note_due(Clock::time_point now) {
  std::lock_guard lock(mu_);
  if (refused_ == 0 || (noted_ && now - *noted_ < std::chrono::seconds(10))) return std::nullopt;
  noted_ = now;
  return std::exchange(refused_, 0);
}

std::size_t AnswerLimit::subjects() const {
  std::lock_guard lock(mu_);
  return buckets_.size();
}

void AnswerLimit::prune(Clock::time_point now) {
  // A bucket that has refilled says nothing a fresh one would not: forget it. Only what this
  // channel serves gets buckets, so those left were asked within burst/per_second.
  std::erase_if(buckets_, [&](const auto& entry) {
    const Bucket& b = entry.second;
    const double elapsed = std::chrono::duration<double>(now - b.last).count();
    return b.tokens + elapsed * per_second_ >= burst_;
  });
}

}  // namespace ferry::sidechannel
