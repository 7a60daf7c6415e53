#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry {

/// Durations in log-scaled buckets: 8 per power of two, so a percentile read from it is within
/// about 9% of the true value; min, max and the mean are exact. From 1 ns to about 18 minutes
/// (longer durations count in the last bucket; the max stays exact).
class LatencyHistogram {
 public:
  static constexpr int kSubBuckets = 8;
  static constexpr int kBuckets = 40 * kSubBuckets;

  void record(std::chrono::nanoseconds duration) noexcept;
  /// Adds every sample of `other`.
  void merge(const LatencyHistogram& other) noexcept;

  std::uint64_t count() const noexcept { return count_; }
  /// The duration below which a fraction `q` (0..1) of the samples lie, in microseconds: the
  /// middle of the bucket holding that sample, clamped to [min, max]; the first and the last
  /// sample exactly (min and max). 0 when empty.
  double percentile_us(double q) const noexcept;
  double min_us() const noexcept;
  double max_us() const noexcept;
  double mean_us() const noexcept;

 private:
  static int bucket_of(std::uint64_t ns) noexcept;
  static std::uint64_t bucket_low(int bucket) noexcept;

  std::array<std::uint64_t, kBuckets> buckets_{};
  std::uint64_t count_ = 0;
  std::uint64_t sum_ns_ = 0;
  std::uint64_t min_ns_ = 0;
  std::uint64_t max_ns_ = 0;
};

/// Operations that ended one way, and the bytes they covered (the total of their local
/// descriptors, whether or not every byte moved before they failed).
struct OutcomeCounts {
  std::uint64_t operations = 0;
  std::uint64_t bytes = 0;
};

/// What the operations of one method came to.
struct MethodStats {
  /// "tcp", "cma", "verbs", ...; "none" for operations that ended before a method was chosen
  /// (a passive operation never claimed, an active one whose metadata never came).
  std::string method;
  OutcomeCounts complete;
  OutcomeCounts cancelled;
  OutcomeCounts errored;
  /// Completed operations, passive and active: from the call that created the operation to
  /// its completion on the loop.
  LatencyHistogram latency;
  /// The same split in two: `wait`, for passive operations only, from creation until a peer
  /// claimed it (the time its peer took to come); `transfer`, from that claim (passive) or
  /// from creation (active) to completion. For a passive operation latency = wait + transfer.
  LatencyHistogram wait;
  LatencyHistogram transfer;
};

/// A snapshot of what a connector's operations have come to since it started.
struct ConnectorStats {
  /// One per method that any ended operation used, best-known first (ordered by name).
  std::vector<MethodStats> methods;
  /// Every completed operation, whatever its method (and split as MethodStats splits it).
  LatencyHistogram latency;
  LatencyHistogram wait;
  LatencyHistogram transfer;
  std::uint64_t active = 0;   ///< active operations begun (reads and writes)
  std::uint64_t passive = 0;  ///< passive operations created (readables and writables)
  std::uint64_t live = 0;     ///< operations not ended yet

  /// A small table: one line per method with the counts, bytes and latency percentiles (the
  /// whole latency, and the transfer's and the wait's p50).
  std::string to_text() const;
  /// One JSON object with the same content.
  std::string to_json() const;
};

}  // namespace ferry
