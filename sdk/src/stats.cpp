// Connector::stats(): the histogram, the recorder the operations report to, and the text and
// JSON forms.
#include "sdk/src/stats.hpp"
#include "sdk/src/stats_names.hpp"

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

double LatencyHistogram::sum_seconds() const noexcept { return static_cast<double>(sum_ns_) / 1e9; }

std::uint64_t LatencyHistogram::count_at_most(std::chrono::nanoseconds limit) const noexcept {
  if (count_ == 0 || limit.count() < 0) return 0;
  const auto most = static_cast<std::uint64_t>(limit.count());
  if (most >= max_ns_) return count_;
  if (most < min_ns_) return 0;
  std::uint64_t n = 0;
  for (int b = 0; b < kBuckets; ++b) {
    const std::uint64_t low = bucket_low(b);
    if (low > most) break;
    const std::uint64_t high = b + 1 < kBuckets ? bucket_low(b + 1) : max_ns_ + 1;
    // A bucket wholly below the limit counts; one that holds it, by its middle.
    if (high - 1 <= most || (low + (high - 1)) / 2 <= most)
      n += buckets_[static_cast<std::size_t>(b)];
  }
  return n;
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

nlohmann::json errors_json(const std::vector<ErrorCount>& errors) {
  nlohmann::json j = nlohmann::json::object();
  for (const ErrorCount& e : errors) j[std::string(to_string(e.code))] = e.operations;
  return j;
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
  out += "bytes: " + human_bytes(bytes_in) + " in, " + human_bytes(bytes_out) + " out\n";
  if (!errors.empty()) {
    out += "errors:";
    for (const ErrorCount& e : errors)
      out += " " + std::string(to_string(e.code)) + " " + std::to_string(e.operations);
    out += "\n";
  }
  if (!connections.empty()) {
    out += "connections:";
    for (const auto& [method, n] : connections) out += " " + method + " " + std::to_string(n);
    out += "\n";
  }
  if (regions + attachments > 0)
    out += "regions: " + std::to_string(regions) + " served, " + std::to_string(attachments) +
           " attached\n";
  return out;
}

std::string ConnectorStats::to_json() const {
  nlohmann::json j;
  j["methods"] = nlohmann::json::array();
  for (const MethodStats& m : methods) {
    nlohmann::json counts = nlohmann::json::array();
    for (const OperationCount& c : m.counts)
      counts.push_back({{"kind", detail::kind_name(c.kind)},
                        {"role", c.passive ? "passive" : "active"},
                        {"outcome", detail::outcome_name(c.outcome)},
                        {"operations", c.operations},
                        {"bytes", c.bytes}});
    j["methods"].push_back({{"method", m.method},
                            {"complete", outcome_json(m.complete)},
                            {"cancelled", outcome_json(m.cancelled)},
                            {"errored", outcome_json(m.errored)},
                            {"latency", histogram_json(m.latency)},
                            {"wait", histogram_json(m.wait)},
                            {"transfer", histogram_json(m.transfer)},
                            {"counts", std::move(counts)},
                            {"errors", errors_json(m.errors)},
                            {"bytes_in", m.bytes_in},
                            {"bytes_out", m.bytes_out},
                            {"fallbacks", m.fallbacks}});
  }
  j["latency"] = histogram_json(latency);
  j["wait"] = histogram_json(wait);
  j["transfer"] = histogram_json(transfer);
  j["active"] = active;
  j["passive"] = passive;
  j["live"] = live;
  j["errors"] = errors_json(errors);
  j["bytes_in"] = bytes_in;
  j["bytes_out"] = bytes_out;
  j["peers"] = nlohmann::json::array();
  for (const PeerStats& p : peers)
    j["peers"].push_back({{"name", p.name},
                          {"id", p.id},
                          {"host", p.host},
                          {"operations", p.operations},
                          {"errored", p.errored},
                          {"bytes_in", p.bytes_in},
                          {"bytes_out", p.bytes_out}});
  j["connections"] = nlohmann::json::object();
  for (const auto& [method, n] : connections) j["connections"][method] = n;
  j["regions"] = regions;
  j["attachments"] = attachments;
  j["nats_reconnects"] = nats_reconnects;
  return j.dump();
}

namespace detail {

const char* kind_name(OperationKind kind) {
  return kind == OperationKind::read ? "read" : kind == OperationKind::write ? "write" : "unknown";
}

const char* outcome_name(OperationStatus status) {
  return status == OperationStatus::complete    ? "complete"
         : status == OperationStatus::cancelled ? "cancelled"
                                                : "errored";
}

namespace {

void count_error(std::vector<ErrorCount>& errors, ErrorCode code) {
  auto it = std::lower_bound(errors.begin(), errors.end(), code,
                             [](const ErrorCount& e, ErrorCode c) { return e.code < c; });
  if (it == errors.end() || it->code != code) it = errors.insert(it, ErrorCount{code, 0});
  ++it->operations;
}

// Whether an ended operation's bytes came into this process's memory: a read it made, or a
// peer's write into its writable.
bool inbound(OperationKind kind, bool passive) { return (kind == OperationKind::read) != passive; }

}  // namespace

void StatsRecorder::started(bool passive) noexcept {
  std::lock_guard lock(mu_);
  ++(passive ? snapshot_.passive : snapshot_.active);
  ++snapshot_.live;
}

MethodStats& StatsRecorder::method_entry(const std::string& name) {
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
  return *it;
}

void StatsRecorder::ended(const OperationEnd& end) {
  const std::string name = end.method.empty() ? std::string("none") : end.method;
  const bool complete = end.status == OperationStatus::complete;
  std::lock_guard lock(mu_);
  if (snapshot_.live > 0) --snapshot_.live;
  MethodStats& m = method_entry(name);
  OutcomeCounts& counts = complete                                   ? m.complete
                          : end.status == OperationStatus::cancelled ? m.cancelled
                                                                     : m.errored;
  ++counts.operations;
  counts.bytes += end.bytes;
  const OperationStatus outcome =
      complete || end.status == OperationStatus::cancelled ? end.status : OperationStatus::errored;
  auto split = std::find_if(m.counts.begin(), m.counts.end(), [&](const OperationCount& c) {
    return c.kind == end.kind && c.passive == end.passive && c.outcome == outcome;
  });
  if (split == m.counts.end()) {
    m.counts.push_back(OperationCount{end.kind, end.passive, outcome, 0, 0});
    split = std::prev(m.counts.end());
  }
  ++split->operations;
  split->bytes += end.bytes;
  const bool in = inbound(end.kind, end.passive);
  if (complete) {
    (in ? m.bytes_in : m.bytes_out) += end.bytes;
    (in ? snapshot_.bytes_in : snapshot_.bytes_out) += end.bytes;
    m.latency.record(end.latency);
    snapshot_.latency.record(end.latency);
    const auto transfer = end.wait.count() >= 0 ? end.latency - end.wait : end.latency;
    m.transfer.record(transfer);
    snapshot_.transfer.record(transfer);
    if (end.wait.count() >= 0) {
      m.wait.record(end.wait);
      snapshot_.wait.record(end.wait);
    }
  } else {
    const ErrorCode code = end.code.value_or(
        end.status == OperationStatus::cancelled ? ErrorCode::Cancelled : ErrorCode::Internal);
    count_error(m.errors, code);
    count_error(snapshot_.errors, code);
  }
  if (end.peer == nullptr || end.peer->id.empty()) return;
  auto peer = peers_.find(end.peer->id);
  if (peer == peers_.end()) {
    if (peers_.size() >= ConnectorStats::kPeersKept) {
      // Forget the peer with the fewest bytes to make room.
      auto least = std::min_element(peers_.begin(), peers_.end(), [](const auto& a, const auto& b) {
        return a.second.bytes_in + a.second.bytes_out < b.second.bytes_in + b.second.bytes_out;
      });
      peers_.erase(least);
    }
    PeerStats fresh;
    fresh.id = end.peer->id;
    peer = peers_.emplace(end.peer->id, std::move(fresh)).first;
  }
  PeerStats& p = peer->second;
  if (!end.peer->name.empty()) p.name = end.peer->name;
  if (!end.peer->host.empty()) p.host = end.peer->host;
  ++p.operations;
  if (end.status == OperationStatus::errored) ++p.errored;
  if (complete) (in ? p.bytes_in : p.bytes_out) += end.bytes;
}

void StatsRecorder::fell_back(const std::string& method) {
  std::lock_guard lock(mu_);
  ++method_entry(method).fallbacks;
}

void StatsRecorder::set_gauges(std::vector<std::pair<std::string, std::uint64_t>> connections,
                               std::uint64_t regions, std::uint64_t attachments) {
  std::lock_guard lock(mu_);
  snapshot_.connections = std::move(connections);
  snapshot_.regions = regions;
  snapshot_.attachments = attachments;
}

ConnectorStats StatsRecorder::snapshot() const {
  std::lock_guard lock(mu_);
  ConnectorStats s = snapshot_;
  s.peers.reserve(std::min(peers_.size(), ConnectorStats::kMaxPeers));
  for (const auto& [id, p] : peers_) s.peers.push_back(p);
  auto busier = [](const PeerStats& a, const PeerStats& b) {
    const auto ab = a.bytes_in + a.bytes_out;
    const auto bb = b.bytes_in + b.bytes_out;
    return ab != bb                       ? ab > bb
           : a.operations != b.operations ? a.operations > b.operations
                                          : a.id < b.id;
  };
  if (s.peers.size() > ConnectorStats::kMaxPeers) {
    std::partial_sort(s.peers.begin(),
                      s.peers.begin() + static_cast<std::ptrdiff_t>(ConnectorStats::kMaxPeers),
                      s.peers.end(), busier);
    s.peers.resize(ConnectorStats::kMaxPeers);
  } else {
    std::sort(s.peers.begin(), s.peers.end(), busier);
  }
  return s;
}

}  // namespace detail

}  // namespace ferry
