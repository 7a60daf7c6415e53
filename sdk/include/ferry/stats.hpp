#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ferry/error.hpp>
#include <ferry/operation_status.hpp>

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
  /// The sum of every sample, in seconds (Prometheus' `_sum`).
  double sum_seconds() const noexcept;
  /// The samples of at most `limit`, counting each bucket by its middle (within the same 9%):
  /// a Prometheus histogram's cumulative bucket `le`.
  std::uint64_t count_at_most(std::chrono::nanoseconds limit) const noexcept;

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

/// Operations of one method that did one thing and ended one way.
struct OperationCount {
  OperationKind kind = OperationKind::unspecified;      ///< read or write
  bool passive = false;                                 ///< a readable or writable
  OperationStatus outcome = OperationStatus::complete;  ///< complete, cancelled or errored
  std::uint64_t operations = 0;
  std::uint64_t bytes = 0;  ///< as OutcomeCounts::bytes
};

/// Operations that ended with one error code (errored ones; a cancelled operation counts as
/// Cancelled here too, a deadline as Timeout).
struct ErrorCount {
  ErrorCode code = ErrorCode::Internal;
  std::uint64_t operations = 0;
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
  /// The same operations by kind, role and outcome (only the combinations that occurred).
  std::vector<OperationCount> counts;
  /// The operations that did not complete, by error code, ordered by code.
  std::vector<ErrorCount> errors;
  /// The bytes of completed operations that came into this process's memory (its reads, and
  /// peers' writes into its writables) and that went out of it (its writes, and peers' reads
  /// of its readables).
  std::uint64_t bytes_in = 0;
  std::uint64_t bytes_out = 0;
  /// Set-ups of this method that failed before a byte moved (refused, unreachable), after
  /// which the operation fell back to its next method, or ended when none was left.
  std::uint64_t fallbacks = 0;
};

/// What this connector's operations with one peer came to.
struct PeerStats {
  std::string name;  ///< the peer connector's name
  std::string id;    ///< its id
  std::string host;  ///< its host, when its metadata said (the peer of an active operation)
  std::uint64_t operations = 0;  ///< operations with it that ended, however
  std::uint64_t errored = 0;     ///< of those, the ones that errored
  std::uint64_t bytes_in = 0;    ///< completed, as MethodStats::bytes_in
  std::uint64_t bytes_out = 0;
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
  /// Every method's errors, summed (as MethodStats::errors), and bytes in and out.
  std::vector<ErrorCount> errors;
  std::uint64_t bytes_in = 0;
  std::uint64_t bytes_out = 0;
  /// The peers with the most bytes moved, most first: at most kMaxPeers. The connector
  /// remembers up to kPeersKept peers (when more come, the one with the fewest bytes is
  /// forgotten).
  static constexpr std::size_t kMaxPeers = 32;
  static constexpr std::size_t kPeersKept = 1024;
  std::vector<PeerStats> peers;
  /// What the connector holds now, as its loop last counted it (an operation's end, a region
  /// or attachment made or ended, a stats request, a metrics scrape, or stats() on the loop
  /// thread): connections open by method
  /// (both ways; every method served, 0 included), regions served and attachments made that
  /// have not ended.
  std::vector<std::pair<std::string, std::uint64_t>> connections;
  std::uint64_t regions = 0;
  std::uint64_t attachments = 0;
  /// How many times the side channel reconnected after losing its server.
  std::uint64_t nats_reconnects = 0;

  /// A small table: one line per method with the counts, bytes and latency percentiles (the
  /// whole latency, and the transfer's and the wait's p50).
  std::string to_text() const;
  /// One JSON object with the same content.
  std::string to_json() const;
};

}  // namespace ferry
