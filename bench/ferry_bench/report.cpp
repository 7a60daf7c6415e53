#include "bench/ferry_bench/report.hpp"

#include <sys/utsname.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

#include "bench/ferry_bench/processes.hpp"

namespace ferry_bench {

namespace {

const std::vector<std::string> kColumns = {
    "method",     "op_type",        "pairing",         "kv",          "block_size",
    "batch_size", "bytes_per_op",   "inflight",        "threads",     "iterations",
    "seconds",    "bandwidth_gbps", "bandwidth_gibps", "ops_per_s",   "lat_p50_us",
    "lat_p99_us", "lat_min_us",     "prep_p50_us",     "post_p50_us", "transfer_p50_us",
    "skipped",    "errors"};

std::string csv_field(const json& v) {
  if (v.is_string()) {
    const std::string s = v.get<std::string>();
    if (s.find_first_of(",\"\n") == std::string::npos) return s;
    std::string out = "\"";
    for (char c : s) {
      if (c == '"') out += '"';
      out += c;
    }
    return out + "\"";
  }
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  return v.dump();
}

std::string find_in_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    if (dir.empty()) continue;
    const std::string candidate = dir + "/" + program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return {};
}

std::string gnuplot_quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') out += '\'';
    out += c;
  }
  return out + "'";
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

}  // namespace

json host_facts() {
  json h;
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  h["hostname"] = name;
  h["cores"] = ::sysconf(_SC_NPROCESSORS_ONLN);
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      if (auto colon = line.find(':'); colon != std::string::npos) {
        h["cpu_model"] = line.substr(line.find_first_not_of(" \t", colon + 1));
        break;
      }
    }
  }
  utsname u{};
  if (::uname(&u) == 0) {
    h["kernel"] = u.release;
    h["os"] = u.sysname;
    h["machine"] = u.machine;
  }
  h["memory_bytes"] = static_cast<std::uint64_t>(::sysconf(_SC_PHYS_PAGES)) *
                      static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  return h;
}

std::string describe(const PointResult& r) {
  std::string s = r.method + " " + r.op_type;
  if (r.kv) {
    s += " kv " + std::to_string(r.batch_size) + " x " + format_size(r.block_size) + " pages";
  } else {
    s += " " + format_size(r.block_size);
    if (r.batch_size > 1) s += " x" + std::to_string(r.batch_size);
  }
  s += " inflight " + std::to_string(r.inflight);
  if (r.threads > 1) s += " threads " + std::to_string(r.threads);
  if (r.pairing != "metadata") s += " by " + r.pairing;
  return s;
}

void print_table(std::FILE* out, const std::vector<PointResult>& results) {
  std::fprintf(
      out,
      "%-10s %-5s %-8s %-3s %6s %5s %5s %3s %7s %6s %8s %8s %9s %9s %9s %9s %8s %8s %9s %4s %s\n",
      "method", "op", "pairing", "kv", "block", "batch", "infl", "thr", "iters", "secs", "GB/s",
      "GiB/s", "ops/s", "p50_us", "p99_us", "min_us", "prep_us", "post_us", "xfer_us", "err",
      "skipped");
  for (const auto& r : results) {
    std::fprintf(out,
                 "%-10s %-5s %-8s %-3s %6s %5zu %5u %3u %7llu %6.2f %8.3f %8.3f %9.0f %9.1f %9.1f "
                 "%9.1f %8.1f %8.1f %9.1f %4llu %s\n",
                 r.method.c_str(), r.op_type.c_str(), r.pairing.c_str(), r.kv ? "yes" : "no",
                 format_size(r.block_size).c_str(), r.batch_size, r.inflight, r.threads,
                 static_cast<unsigned long long>(r.iterations), r.seconds, r.bandwidth_gbps,
                 r.bandwidth_gibps, r.ops_per_s, r.lat_p50_us, r.lat_p99_us, r.lat_min_us,
                 r.prep_p50_us, r.post_p50_us, r.transfer_p50_us,
                 static_cast<unsigned long long>(r.errors), r.skipped.c_str());
  }
  std::fflush(out);
}

void write_json(const std::string& path, const std::string& command,
                const std::vector<PointResult>& results, const json& stats) {
  json points = json::array();
  for (const auto& r : results) points.push_back(r.to_json());
  const json doc{{"command", command},
                 {"host", host_facts()},
                 {"points", std::move(points)},
                 {"stats", stats}};
  std::ofstream f(path);
  f << doc.dump(2) << "\n";
  if (!f) throw std::runtime_error("cannot write " + path);
}

void write_csv(const std::string& path, const std::vector<PointResult>& results) {
  std::ofstream f(path);
  for (std::size_t i = 0; i < kColumns.size(); ++i) f << (i ? "," : "") << kColumns[i];
  f << "\n";
  for (const auto& r : results) {
    const json j = r.to_json();
    for (std::size_t i = 0; i < kColumns.size(); ++i)
      f << (i ? "," : "") << csv_field(j.at(kColumns[i]));
    f << "\n";
  }
  if (!f) throw std::runtime_error("cannot write " + path);
}

std::string write_png(const std::string& path, const std::vector<PointResult>& results) {
  const std::string gnuplot = find_in_path("gnuplot");
  if (gnuplot.empty()) return "gnuplot is not installed (Debian: gnuplot-nox); no PNG written";
  std::string terminal = "pngcairo size 1200,760 font ',10'";
  if (run_command({gnuplot, "-e", "set terminal pngcairo"}, std::chrono::seconds(10)) != 0)
    terminal = "png size 1200,760";

  // What varies gets into the series' names.
  std::set<std::size_t> batches;
  std::set<unsigned> threads;
  std::set<std::string> pairings;
  for (const auto& r : results) {
    batches.insert(r.batch_size);
    threads.insert(r.threads);
    pairings.insert(r.pairing + (r.kv ? " kv" : ""));
  }
  std::map<std::string, std::map<std::size_t, double>> series;
  std::set<std::size_t> sizes;
  for (const auto& r : results) {
    if (!r.skipped.empty() || r.iterations == 0) continue;
    std::string name = r.method + " " + r.op_type + " inflight " + std::to_string(r.inflight);
    if (batches.size() > 1) name += " batch " + std::to_string(r.batch_size);
    if (threads.size() > 1) name += " threads " + std::to_string(r.threads);
    if (pairings.size() > 1) name += " " + r.pairing;
    series[name][r.block_size] = r.bandwidth_gbps;
    sizes.insert(r.block_size);
  }
  if (series.empty()) return "no measured point to plot; no PNG written";

  std::string script = "set terminal " + terminal + "\n";
  script += "set output " + gnuplot_quoted(path) + "\n";
  script += "set title 'ferry-bench: bandwidth against block size' noenhanced\n";
  script += "set logscale x 2\nset grid\nset key left top noenhanced\n";
  script += "set xlabel 'block size (bytes per descriptor)'\nset ylabel 'GB/s (10^9 bytes/s)'\n";
  script += "set yrange [0:*]\n";
  std::string tics;
  for (std::size_t s : sizes)
    tics += (tics.empty() ? "" : ", ") + ("'" + format_size(s) + "' " + std::to_string(s));
  script += "set xtics (" + tics + ")\n";
  // Room at both ends, so that the end points and their tic labels show.
  script += "set xrange [" + fixed(static_cast<double>(*sizes.begin()) / 1.5, 0) + ":" +
            fixed(static_cast<double>(*sizes.rbegin()) * 1.5, 0) + "]\n";
  std::string plot = "plot ";
  int k = 0;
  for (const auto& [name, points] : series) {
    const std::string block = "$d" + std::to_string(k);
    script += block + " << EOD\n";
    for (const auto& [size, gbps] : points)
      script += std::to_string(size) + " " + fixed(gbps, 6) + "\n";
    script += "EOD\n";
    plot += (k ? ", " : "") + block + " using 1:2 with linespoints lw 2 pt 7 title " +
            gnuplot_quoted(name);
    ++k;
  }
  script += plot + "\n";

  char tmpl[] = "/tmp/ferry-bench-plot-XXXXXX";
  const int fd = ::mkstemp(tmpl);
  if (fd < 0) return "cannot create a temporary file for gnuplot; no PNG written";
  const bool written =
      ::write(fd, script.data(), script.size()) == static_cast<ssize_t>(script.size());
  ::close(fd);
  int status = -1;
  if (written) status = run_command({gnuplot, tmpl}, std::chrono::seconds(60));
  ::unlink(tmpl);
  if (status != 0) return "gnuplot failed (status " + std::to_string(status) + "); no PNG written";
  return {};
}

}  // namespace ferry_bench
