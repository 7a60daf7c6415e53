// Connector::stats(): the histogram, the recorder the operations report to, and the text and
// JSON forms.
#include "sdk/src/stats.hpp"

#include <algorithm>
#include <bit>
#include <cstdio>

#include <nlohmann/json.hpp>

namespace ferry {

int LatencyHistogram::bucket_of(std::uint64_t ns) noexcept {
  if (ns < kSubBuckets) return static_cast<int>(ns);  // 0..7 ns: one bucket each
  // The power of two, then the next three bits below the leading one.
  const int power = static_cast<int>(std::bit_width(ns)) - 1;  // >= 3
  const auto sub = static_cast<int>((ns >> (power - 3)) & (kSubBuckets - 1));
  return std::min((power - 2) * kSubBuckets + sub, kBuckets - 1);
}

std::uint64_t LatencyHistogram::bucket_low(int bucket) noexcept {
  if (bucket < kSubBuckets) return static_cast<std::uint64_t>(bucket);
  const int power = bucket / kSubBuckets + 2;
  const auto sub = static_cast<std::uint64_t>(bucket % kSubBuckets);
  return (std::uint64_t{kSubBuckets} + sub) << (power - 3);
}

void LatencyHistogram::record(std::chrono::nanoseconds duration) noexcept {
  const auto ns = static_cast<std::uint64_t>(std::max<std::int64_t>(duration.count(), 0));
  ++buckets_[static_cast<std::size_t>(bucket_of(ns))];
  min_ns_ = count_ == 0 ? ns : std::min(min_ns_, ns);
  max_ns_ = std::max(max_ns_, ns);
  sum_ns_ += ns;
  ++count_;
}

void LatencyHistogram::merge(const LatencyHistogram& other) noexcept {
  if (other.count_ == 0) return;
  for (std::size_t i = 0; i < buckets_.size(); ++i) buckets_[i] += other.buckets_[i];
  min_ns_ = count_ == 0 ? other.min_ns_ : std::min(min_ns_, other.min_ns_);
  max_ns_ = std::max(max_ns_, other.max_ns_);
  sum_ns_ += other.sum_ns_;
  count_ += other.count_;
}

double LatencyHistogram::percentile_us(double q) const noexcept {
  if (count_ == 0) return 0;
  q = std::clamp(q, 0.0, 1.0);
  // The rank of the sample wanted, 1-based: at least the first, at most the last.
  const auto rank = std::clamp<std::uint64_t>(
      static_cast<std::uint64_t>(q * static_cast<double>(count_) + 0.5), 1, count_);
  // The first and the last sample are known exactly.
  if (rank == count_) return max_us();
  if (rank == 1) return min_us();
  std::uint64_t seen = 0;
  for (int b = 0; b < kBuckets; ++b) {
    seen += buckets_[static_cast<std::size_t>(b)];
    if (seen < rank) continue;
    const std::uint64_t low = bucket_low(b);
    const std::uint64_t high = b + 1 < kBuckets ? bucket_low(b + 1) : max_ns_ + 1;
    const double mid = (static_cast<double>(low) + static_cast<double>(high - 1)) / 2;
    return std::clamp(mid, static_cast<double>(min_ns_), static_cast<double>(max_ns_)) / 1e3;
  }
  return static_cast<double>(max_ns_) / 1e3;
}

double LatencyHistogram::min_us() const noexcept { return static_cast<double>(min_ns_) / 1e3; }
double LatencyHistogram::max_us() const noexcept { return static_cast<double>(max_ns_) / 1e3; }
double LatencyHistogram::mean_us() const noexcept {
  return count_ == 0 ? 0 : static_cast<double>(sum_ns_) / static_cast<double>(count_) / 1e3;
}

namespace {

std::string human_bytes(std::uint64_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  auto value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, unit == 0 ? "%.0f %s" : "%.1f %s", value, units[unit]);
  return buf;
}

nlohmann::json histogram_json(const LatencyHistogram& h) {
  return {{"count", h.count()},
          {"min_us", h.min_us()},
          {"p50_us", h.percentile_us(0.5)},
          {"p90_us", h.percentile_us(0.9)},
          {"p99_us", h.percentile_us(0.99)},
          {"max_us", h.max_us()},
          {"mean_us", h.mean_us()}};
}

nlohmann::json outcome_json(const OutcomeCounts& c) {
  return {{"operations", c.operations}, {"bytes", c.bytes}};
}

}  // namespace

std::string ConnectorStats::to_text() const {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "%-8s %10s %12s %10s %10s %10s %10s %10s %12s %10s\n", "method",
                "complete", "bytes", "cancelled", "errored", "p50 us", "p99 us", "max us",
                "transfer p50", "wait p50");
  out += line;
  for (const MethodStats& m : methods) {
    std::snprintf(line, sizeof line,
                  "%-8s %10llu %12s %10llu %10llu %10.1f %10.1f %10.1f %12.1f %10.1f\n",
                  m.method.c_str(), static_cast<unsigned long long>(m.complete.operations),
                  human_bytes(m.complete.bytes).c_str(),
                  static_cast<unsigned long long>(m.cancelled.operations),
                  static_cast<unsigned long long>(m.errored.operations),
                  m.latency.percentile_us(0.5), m.latency.percentile_us(0.99), m.latency.max_us(),
                  m.transfer.percentile_us(0.5), m.wait.percentile_us(0.5));
    out += line;
  }
  std::snprintf(line, sizeof line, "operations: %llu active, %llu passive, %llu live\n",
                static_cast<unsigned long long>(active), static_cast<unsigned long long>(passive),
                static_cast<unsigned long long>(live));
  out += line;
  return out;
}

std::string ConnectorStats::to_json() const {
  nlohmann::json j;
  j["methods"] = nlohmann::json::array();
  for (const MethodStats& m : methods)
    j["methods"].push_back({{"method", m.method},
                            {"complete", outcome_json(m.complete)},
                            {"cancelled", outcome_json(m.cancelled)},
                            {"errored", outcome_json(m.errored)},
                            {"latency", histogram_json(m.latency)},
                            {"wait", histogram_json(m.wait)},
                            {"transfer", histogram_json(m.transfer)}});
  j["latency"] = histogram_json(latency);
  j["wait"] = histogram_json(wait);
  j["transfer"] = histogram_json(transfer);
  j["active"] = active;
  j["passive"] = passive;
  j["live"] = live;
  return j.dump();
}

namespace detail {

void StatsRecorder::started(bool passive) noexcept {
  std::lock_guard lock(mu_);
  ++(passive ? snapshot_.passive : snapshot_.active);
  ++snapshot_.live;
}

void StatsRecorder::ended(const std::string& method, OperationStatus status, std::uint64_t bytes,
                          std::chrono::nanoseconds latency, std::chrono::nanoseconds wait) {
  const std::string& name = method.empty() ? std::string("none") : method;
  std::lock_guard lock(mu_);
  if (snapshot_.live > 0) --snapshot_.live;
  auto it = std::find_if(snapshot_.methods.begin(), snapshot_.methods.end(),
                         [&](const MethodStats& m) { return m.method == name; });
  if (it == snapshot_.methods.end()) {
    MethodStats fresh;
    fresh.method = name;
    it = snapshot_.methods.insert(
        std::upper_bound(snapshot_.methods.begin(), snapshot_.methods.end(), name,
                         [](const std::string& n, const MethodStats& m) { return n < m.method; }),
        std::move(fresh));
  }
  OutcomeCounts& counts = status == OperationStatus::complete    ? it->complete
                          : status == OperationStatus::cancelled ? it->cancelled
                                                                 : it->errored;
  ++counts.operations;
  counts.bytes += bytes;
  if (status == OperationStatus::complete) {
    it->latency.record(latency);
    snapshot_.latency.record(latency);
    const auto transfer = wait.count() >= 0 ? latency - wait : latency;
    it->transfer.record(transfer);
    snapshot_.transfer.record(transfer);
    if (wait.count() >= 0) {
      it->wait.record(wait);
      snapshot_.wait.record(wait);
    }
  }
}

ConnectorStats StatsRecorder::snapshot() const {
  std::lock_guard lock(mu_);
  return snapshot_;
}

}  // namespace detail

}  // namespace ferry
