#include "tools/ferry-top/view.hpp"

#include <algorithm>
#include <cstdio>

namespace ferry::tools {

namespace {

using json = nlohmann::json;

std::uint64_t number(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<std::uint64_t>() : 0;
}

// Operations that ended (complete, cancelled, errored), over every method.
std::uint64_t ended(const json& stats) {
  std::uint64_t n = 0;
  for (const json& m : stats.value("methods", json::array()))
    for (const char* outcome : {"complete", "cancelled", "errored"})
      n += number(m.value(outcome, json::object()), "operations");
  return n;
}

// A peer's bytes both ways, as `stats` lists it (0 when it does not).
std::uint64_t peer_bytes(const json& stats, const std::string& id) {
  for (const json& p : stats.value("peers", json::array()))
    if (p.value("id", "") == id) return number(p, "bytes_in") + number(p, "bytes_out");
  return 0;
}

std::string fit(const std::string& text, std::size_t width) {
  if (text.size() <= width) return text;
  return width == 0 ? std::string() : text.substr(0, width - 1) + "~";
}

}  // namespace

std::string bytes_text(double bytes) {
  static const char* units[] = {"B", "kB", "MB", "GB", "TB"};
  double v = bytes;
  int u = 0;
  while (v >= 1000 && u < 4) {
    v /= 1000;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

std::string rate_text(std::optional<double> bytes_per_s) {
  return bytes_per_s ? bytes_text(*bytes_per_s) + "/s" : "-";
}

std::string duration_text(double us) {
  char buf[32];
  if (us <= 0)
    return "-";
  else if (us < 1000)
    std::snprintf(buf, sizeof buf, "%.0fus", us);
  else if (us < 1e6)
    std::snprintf(buf, sizeof buf, "%.1fms", us / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.2fs", us / 1e6);
  return buf;
}

void View::update(const std::vector<json>& answers) {
  std::map<std::string, Seen> seen;
  rows_.clear();
  pairs_.clear();
  for (const json& a : answers) {
    // An answer of another shape (another version, another program at the subject) is
    // skipped whole.
    try {
      add(a, seen);
    } catch (const json::exception&) {
    }
  }
  std::sort(rows_.begin(), rows_.end(), [](const Row& x, const Row& y) {
    return std::tie(x.host, x.name, x.id) < std::tie(y.host, y.name, y.id);
  });
  last_ = std::move(seen);
}

void View::add(const json& a, std::map<std::string, Seen>& seen) {
  {
    if (!a.is_object() || !a.contains("id") || !a.contains("stats")) return;
    const std::string id = a.value("id", "");
    if (seen.count(id)) return;  // the same connector twice in a round: keep the first
    const json& stats = a["stats"];
    Row r;
    r.name = a.value("name", "");
    r.id = id;
    r.host = a.value("host", "");
    r.pid = a.value("pid", std::int64_t{0});
    for (const json& m : a.value("methods", json::array()))
      r.methods += (r.methods.empty() ? "" : ",") + m.get<std::string>();
    r.nats = a.value("nats", json::object()).value("state", "");
    r.ended = ended(stats);
    r.live = number(stats, "live");
    const json latency = stats.value("latency", json::object());
    r.p50_us = latency.value("p50_us", 0.0);
    r.p99_us = latency.value("p99_us", 0.0);
    const json errors = stats.value("errors", json::object());  // items() needs it alive
    for (const auto& [code, n] : errors.items()) r.errors[code] = n.get<std::uint64_t>();
    // Rates against the round before, over the connector's own clock.
    const Seen* before = nullptr;
    if (auto it = last_.find(id); it != last_.end()) before = &it->second;
    double dt = 0;
    if (before != nullptr) dt = a.value("uptime_s", 0.0) - before->answer.value("uptime_s", 0.0);
    const bool rates = before != nullptr && dt > 0;
    const json* prev = rates ? &before->answer["stats"] : nullptr;
    if (rates) {
      r.ops_per_s = static_cast<double>(r.ended - std::min(r.ended, ended(*prev))) / dt;
      r.in_bytes_per_s =
          static_cast<double>(number(stats, "bytes_in") -
                              std::min(number(stats, "bytes_in"), number(*prev, "bytes_in"))) /
          dt;
      r.out_bytes_per_s =
          static_cast<double>(number(stats, "bytes_out") -
                              std::min(number(stats, "bytes_out"), number(*prev, "bytes_out"))) /
          dt;
    }
    for (const json& p : stats.value("peers", json::array())) {
      const std::string peer_id = p.value("id", "");
      if (peer_id.empty()) continue;
      const std::uint64_t total = number(p, "bytes_in") + number(p, "bytes_out");
      auto key = std::minmax(id, peer_id);
      Pair& pair = pairs_[{key.first, key.second}];
      const std::string peer_name = p.value("name", "");
      if (pair.a.empty()) {  // by name, so that a pair reads the same in every round
        pair.a = std::min(r.name, peer_name);
        pair.b = std::max(r.name, peer_name);
      }
      pair.bytes = std::max(pair.bytes, total);
      if (rates) {
        const std::uint64_t was = peer_bytes(*prev, peer_id);
        const double rate = static_cast<double>(total - std::min(total, was)) / dt;
        pair.bytes_per_s = std::max(pair.bytes_per_s.value_or(0), rate);
      }
    }
    seen[id] = Seen{a};
    rows_.push_back(std::move(r));
  }
}

std::vector<View::Pair> View::pairs(std::size_t most) const {
  std::vector<Pair> out;
  for (const auto& [key, p] : pairs_) out.push_back(p);
  std::sort(out.begin(), out.end(), [](const Pair& x, const Pair& y) {
    const double xr = x.bytes_per_s.value_or(-1), yr = y.bytes_per_s.value_or(-1);
    return xr != yr ? xr > yr : x.bytes > y.bytes;
  });
  if (out.size() > most) out.resize(most);
  return out;
}

json View::to_json() const {
  json workers = json::array();
  double ops = 0, in = 0, out = 0;
  std::uint64_t live = 0, errors = 0;
  for (const Row& r : rows_) {
    json e = json::object();
    for (const auto& [code, n] : r.errors) {
      e[code] = n;
      errors += n;
    }
    auto opt = [](std::optional<double> v) { return v ? json(*v) : json(nullptr); };
    workers.push_back({{"name", r.name},
                       {"id", r.id},
                       {"host", r.host},
                       {"pid", r.pid},
                       {"methods", r.methods},
                       {"nats", r.nats},
                       {"ops_per_s", opt(r.ops_per_s)},
                       {"in_bytes_per_s", opt(r.in_bytes_per_s)},
                       {"out_bytes_per_s", opt(r.out_bytes_per_s)},
                       {"ended", r.ended},
                       {"errors", std::move(e)},
                       {"p50_us", r.p50_us},
                       {"p99_us", r.p99_us},
                       {"live", r.live}});
    ops += r.ops_per_s.value_or(0);
    in += r.in_bytes_per_s.value_or(0);
    out += r.out_bytes_per_s.value_or(0);
    live += r.live;
  }
  json pairs_json = json::array();
  for (const Pair& p : pairs())
    pairs_json.push_back({{"a", p.a},
                          {"b", p.b},
                          {"bytes_per_s", p.bytes_per_s ? json(*p.bytes_per_s) : json(nullptr)},
                          {"bytes", p.bytes}});
  return {{"workers", std::move(workers)},
          {"totals",
           {{"workers", rows_.size()},
            {"ops_per_s", ops},
            {"in_bytes_per_s", in},
            {"out_bytes_per_s", out},
            {"live", live},
            {"errors", errors}}},
          {"pairs", std::move(pairs_json)}};
}

std::string View::table(const std::string& title, int width) const {
  const auto w = static_cast<std::size_t>(std::max(width, 40));
  std::string out = fit(title, w) + "\n\n";
  char line[512];
  auto add = [&](const char* text) { out += fit(text, w) + "\n"; };
  std::snprintf(line, sizeof line, "%-14s %-16s %-12s %9s %12s %12s %8s %8s %5s  %s", "HOST",
                "NAME", "METHODS", "OPS/S", "IN", "OUT", "P50", "P99", "LIVE", "ERRORS");
  add(line);
  double ops = 0, in = 0, outb = 0;
  std::uint64_t live = 0, errors = 0;
  bool rates = false;
  for (const Row& r : rows_) {
    std::string e;
    for (const auto& [code, n] : r.errors) {
      e += (e.empty() ? "" : " ") + code + ":" + std::to_string(n);
      errors += n;
    }
    char ops_text[32] = "-";
    if (r.ops_per_s) std::snprintf(ops_text, sizeof ops_text, "%.1f", *r.ops_per_s);
    std::snprintf(line, sizeof line, "%-14s %-16s %-12s %9s %12s %12s %8s %8s %5llu  %s",
                  fit(r.host, 14).c_str(), fit(r.name, 16).c_str(), fit(r.methods, 12).c_str(),
                  ops_text, rate_text(r.in_bytes_per_s).c_str(),
                  rate_text(r.out_bytes_per_s).c_str(), duration_text(r.p50_us).c_str(),
                  duration_text(r.p99_us).c_str(), static_cast<unsigned long long>(r.live),
                  e.empty() ? "-" : e.c_str());
    add(line);
    rates = rates || r.ops_per_s.has_value();
    ops += r.ops_per_s.value_or(0);
    in += r.in_bytes_per_s.value_or(0);
    outb += r.out_bytes_per_s.value_or(0);
    live += r.live;
  }
  char ops_text[32] = "-";
  if (rates) std::snprintf(ops_text, sizeof ops_text, "%.1f", ops);
  const std::string count =
      std::to_string(rows_.size()) + " worker" + (rows_.size() == 1 ? "" : "s");
  std::snprintf(line, sizeof line, "%-14s %-16s %-12s %9s %12s %12s %8s %8s %5llu  %llu", "TOTAL",
                count.c_str(), "", ops_text,
                rate_text(rates ? std::optional(in) : std::nullopt).c_str(),
                rate_text(rates ? std::optional(outb) : std::nullopt).c_str(), "", "",
                static_cast<unsigned long long>(live), static_cast<unsigned long long>(errors));
  add(line);
  const std::vector<Pair> busiest = pairs();
  if (!busiest.empty()) {
    out += "\n";
    std::snprintf(line, sizeof line, "%-40s %11s %12s", "BUSIEST PAIRS", "RATE", "MOVED");
    add(line);
    for (const Pair& p : busiest) {
      const std::string who = fit(p.a, 18) + " <-> " + fit(p.b, 17);
      std::snprintf(line, sizeof line, "%-40s %11s %12s", who.c_str(),
                    rate_text(p.bytes_per_s).c_str(),
                    bytes_text(static_cast<double>(p.bytes)).c_str());
      add(line);
    }
  }
  return out;
}

}  // namespace ferry::tools
