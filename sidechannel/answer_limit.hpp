#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>

namespace ferry::sidechannel {

/// How many requests a channel answers for each operation or region it serves at a subject
/// (NatsOptions::answer_burst, answers_per_second): a token bucket per served subscription
/// (`key`: the subject and the subscription's id), holding `burst` answers and refilled at
/// `per_second`. NATS does not say which connection published a request, so an owner cannot
/// tell an honest asker's reply inbox from one a flooder names; this bounds what a flood can
/// make the owner publish to any inbox (docs/sidechannel.md, "Who gets the metadata"). Not one
/// bucket per subject: an application that serves one operation after another at the same
/// subject, each asked once, would drain it. Thread-safe: cnats' delivery threads ask.
class AnswerLimit {
 public:
  using Clock = std::chrono::steady_clock;

  /// `per_second` 0: no limit.
  AnswerLimit(int burst, int per_second);

  /// Whether one more answer may go to a request served under `key` at `now`; takes its token
  /// if so.
  bool admit(std::string_view key, Clock::time_point now = Clock::now());

  /// The number of refused answers since the last note, when a note is due (the first
  /// refusal, then at most one every 10 s): for a warning in the connector's log.
  std::optional<std::uint64_t> note_due(Clock::time_point now = Clock::now());

  /// Keys with a bucket now (full buckets are forgotten once there are many). Tests.
  std::size_t subjects() const;

  /// Buckets kept before full ones are forgotten.
  static constexpr std::size_t kPruneAbove = 1024;

 private:
  struct Bucket {
    double tokens = 0;
    Clock::time_point last;
  };
  void prune(Clock::time_point now);

  const double burst_;
  const double per_second_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Bucket> buckets_;
  std::uint64_t refused_ = 0;
  std::optional<Clock::time_point> noted_;
};

}  // namespace ferry::sidechannel
