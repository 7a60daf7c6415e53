#pragma once

// ferry-top's view of a cluster (docs/operations.md): rounds of answers to the stats subject
// in, one line per worker, totals and the busiest peer pairs out, as a table or JSON. Kept
// apart from the NATS and terminal plumbing so that a test can feed it answers.

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace ferry::tools {

class View {
 public:
  /// One round: each connector's answer (the JSON of the stats subject). Rates come from the
  /// difference to the same connector's answer of the round before (by its uptime).
  void update(const std::vector<nlohmann::json>& answers);

  struct Row {
    std::string name, id, host, methods, nats;
    std::int64_t pid = 0;
    std::optional<double> ops_per_s;  ///< operations ended per second; none in the first round
    std::optional<double> in_bytes_per_s, out_bytes_per_s;
    std::map<std::string, std::uint64_t> errors;  ///< since the connector started, by code
    double p50_us = 0, p99_us = 0;                ///< completed operations, since it started
    std::uint64_t live = 0;
    std::uint64_t ended = 0;  ///< operations ended since it started
  };
  struct Pair {
    std::string a, b;                   ///< the two connectors' names, in order
    std::optional<double> bytes_per_s;  ///< both ways, as the busier side reported it
    std::uint64_t bytes = 0;            ///< both ways, since the first of them started
  };
  const std::vector<Row>& rows() const noexcept { return rows_; }
  /// The busiest pairs, by rate (by total bytes in the first round), at most `most`.
  std::vector<Pair> pairs(std::size_t most = 5) const;

  nlohmann::json to_json() const;
  /// The table a terminal shows, `width` columns at most; `title` above it.
  std::string table(const std::string& title, int width) const;

 private:
  struct Seen {
    nlohmann::json answer;
  };
  void add(const nlohmann::json& answer, std::map<std::string, Seen>& seen);

  std::map<std::string, Seen> last_;  ///< by connector id: the previous round's answer
  std::vector<Row> rows_;
  std::map<std::pair<std::string, std::string>, Pair> pairs_;
};

/// "5.60 GB"-style: bytes in decimal units.
std::string bytes_text(double bytes);
/// "1.50 GB/s"-style: bytes per second in decimal units; "-" for none.
std::string rate_text(std::optional<double> bytes_per_s);
/// "45us", "2.1ms", "1.30s".
std::string duration_text(double us);

}  // namespace ferry::tools
