#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ferry/operation_status.hpp>
#include <ferry/rdma_metadata.hpp>
#include <ferry/stats.hpp>

namespace ferry::detail {

/// How an operation ended, as the recorder counts it.
struct OperationEnd {
  std::string method;  ///< empty: none was chosen
  OperationKind kind = OperationKind::unspecified;
  bool passive = false;
  OperationStatus status = OperationStatus::complete;
  std::optional<ErrorCode> code;  ///< the error's, for an operation that did not complete
  std::uint64_t bytes = 0;
  /// Counts only for `complete`; `wait` is the part of it a passive operation spent waiting
  /// for its peer's claim (negative: not passive, or never claimed).
  std::chrono::nanoseconds latency{0};
  std::chrono::nanoseconds wait{-1};
  const PeerIdentity* peer = nullptr;  ///< null: none known
};

/// A connector's running totals. Operations report to it when they start and when they end
/// (on the loop thread); stats() copies it from any thread. One short lock per report: no
/// thread hop.
class StatsRecorder {
 public:
  void started(bool passive) noexcept;
  void ended(const OperationEnd& end);
  /// A set-up of `method` failed before a byte moved (the operation falls back to its next).
  void fell_back(const std::string& method);
  /// Loop thread: what the connector holds now (ConnectorStats::connections, regions,
  /// attachments).
  void set_gauges(std::vector<std::pair<std::string, std::uint64_t>> connections,
                  std::uint64_t regions, std::uint64_t attachments);
  ConnectorStats snapshot() const;

 private:
  MethodStats& method_entry(const std::string& name);

  mutable std::mutex mu_;
  ConnectorStats snapshot_;
  std::unordered_map<std::string, PeerStats> peers_;  ///< by id, at most kPeersKept
};

}  // namespace ferry::detail
