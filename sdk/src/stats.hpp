#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

#include <ferry/operation_status.hpp>
#include <ferry/stats.hpp>

namespace ferry::detail {

/// A connector's running totals. Operations report to it when they start and when they end
/// (on the loop thread); stats() copies it from any thread. One short lock per report: no
/// thread hop.
class StatsRecorder {
 public:
  void started(bool passive) noexcept;
  /// `method` empty: none was chosen. `latency` counts only for `complete`; `wait` is the part
  /// of it a passive operation spent waiting for its peer's claim (negative: not passive, or
  /// never claimed).
  void ended(const std::string& method, OperationStatus status, std::uint64_t bytes,
             std::chrono::nanoseconds latency,
             std::chrono::nanoseconds wait = std::chrono::nanoseconds(-1));
  ConnectorStats snapshot() const;

 private:
  mutable std::mutex mu_;
  ConnectorStats snapshot_;
};

}  // namespace ferry::detail
