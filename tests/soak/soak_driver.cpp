// ferry_soak: the soak's driver (docs/testing.md, "The soak"). One long-lived connector (this
// process) against several ferry_soak_worker processes, one lane (thread) per worker, over a
// private nats-server on 127.0.0.1. Each lane runs one operation at a time, drawn at random
// from the seed: one-shot operations paired by NATS subject in both pairings and both
// directions (this side passive or active), and block or range transfers on the worker's
// region (attached by subject); sizes log-uniform from 1 B to --max-size; at random a short
// deadline, a cancel on either side, or the worker killed (SIGKILL) mid-operation and
// restarted; and the nats-server killed and restarted every --nats-restart-every seconds.
//
// Every operation must end (complete, cancelled, or errored with one of the codes a fault
// explains) within its deadline plus --slack-ms (else it is "lost"), every completed
// transfer's bytes are checked, and this process's RSS and open descriptors after warm-up
// and at the end must stay within --rss-growth-mb and --fd-growth. The run writes
// OUT/series.csv (a sample every --sample-ms) and OUT/summary.json, and exits 0 (pass),
// 1 (failures, listed), 2 (bad arguments) or 77 (skipped, with the reason).
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>

#include "tests/support/child_process.hpp"
#include "tests/support/nats_server.hpp"
#include "tests/support/patterns.hpp"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define FERRY_SOAK_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define FERRY_SOAK_SANITIZED 1
#endif
#endif
#ifndef FERRY_SOAK_SANITIZED
#define FERRY_SOAK_SANITIZED 0
#endif

namespace {

using namespace ferry;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr const char* kNatsServer = "/usr/sbin/nats-server";
constexpr long long kLongDeadlineMs = 20000;  // an active side's deadline, when it has one
constexpr long long kFaultDeadlineMs = 1500;  // every side's, when a fault is planned

struct Config {
  std::uint64_t seed = 0;
  double seconds = 120;            // stop starting operations after this long
  std::uint64_t ops = 0;           // ... or after this many (0: no limit)
  unsigned lanes = 3;              // workers, one operation in flight each
  double warmup = 25;              // seconds before the growth baseline
  unsigned sample_ms = 2000;       // time-series period
  double nats_restart_every = 45;  // seconds; 0: never
  std::size_t max_size = 64u << 20;
  std::size_t region_size = 32u << 20;
  std::size_t block_size = 64u << 10;
  double p_region = 0.3;           // a region transfer instead of a one-shot operation
  double p_kill = 0.004;           // the worker killed mid-operation
  double p_cancel = 0.04;          // this side cancels
  double p_worker_cancel = 0.03;   // the worker cancels
  double p_short_deadline = 0.06;  // a deadline of 1-500 ms (on either side)
  double p_long_deadline = 0.5;    // an active side's deadline of 20 s; else none
  long long slack_ms = 10000;      // beyond the deadline, before an operation counts lost
  long long no_deadline_bound_ms = 90000;
  long long subject_timeout_ms = 3000;
  long long peer_timeout_ms = 2000;
  double rss_growth_mb = 24;
  long long fd_growth = 16;
  // Under a sanitizer, ASan's quarantine and TSan's shadow grow, and everything is 5-20x
  // slower: RSS growth and errors no fault explains are reported, not failed on.
  bool check_rss = !FERRY_SOAK_SANITIZED;
  bool fail_unexplained = !FERRY_SOAK_SANITIZED;
  std::string transports;  // the workers' choice; empty: tcp, or tcp and cma
  std::string out = "soak-out";
  std::string form = "custom";
};

// ---------------------------------------------------------------------------------------
// What happened, counted.

double now_s(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

long long rss_kb(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::atoll(line.c_str() + 6);
  return 0;
}

long long open_fds() {
  long long n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') ++n;
    ::closedir(d);
  }
  return n - 1;  // the directory's own descriptor
}

std::uint64_t percentile(std::vector<std::uint32_t> v, double p) {
  if (v.empty()) return 0;
  std::size_t i = static_cast<std::size_t>(p * static_cast<double>(v.size() - 1));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(i), v.end());
  return v[i];
}

/// One side's view of how an operation ended.
struct Ending {
  std::string status;  // complete, cancelled, errored, lost, refused, killed
  std::string code = "-";
  std::string method = "-";
  std::string check = "-";  // ok, corrupt@N, -
  std::string message;
  std::uint64_t latency_us = 0;
  std::uint64_t verified = 0;  // bytes checked byte for byte
};

Ending ending(std::string status, std::string code = "-", std::string message = {}) {
  Ending e;
  e.status = std::move(status);
  e.code = std::move(code);
  e.message = std::move(message);
  return e;
}

/// What the lane planned for one operation: the faults that may explain an error.
struct Faults {
  bool cancel = false;         // this side cancels
  bool worker_cancel = false;  // the worker cancels
  bool short_deadline = false;
  bool kill = false;
  bool nats = false;  // it overlapped a nats-server outage (filled in at the end)
  bool any() const { return cancel || worker_cancel || short_deadline || kill || nats; }
};

struct Sample {
  double t = 0;
  long long rss = 0, fds = 0;
};

class Tally {
 public:
  explicit Tally(Clock::time_point t0) : t0_(t0) {}

  void started() { started_.fetch_add(1); }
  std::uint64_t started_count() const { return started_.load(); }

  /// Counts one side's ending, and notes a failure when it is lost, corrupt, a code no fault
  /// explains in a soak of cooperating peers, or an error with no fault to explain it.
  void ended(const std::string& side, const std::string& kind, const Ending& e, const Faults& f,
             const std::string& context) {
    std::lock_guard lock(mu_);
    ++ended_;
    std::string key = side + " " + e.status + (e.code != "-" ? " " + e.code : "");
    ++outcomes_[key];
    ++by_kind_[side + " " + kind + " " + e.status];
    if (e.method != "-") ++by_method_[side + " " + e.method + " " + e.status];
    verified_ += e.verified;
    if (e.status == "complete") {
      ++complete_;
      if (side == "driver") {
        window_.push_back(static_cast<std::uint32_t>(std::min<std::uint64_t>(e.latency_us, ~0u)));
        all_.push_back(window_.back());
      }
    } else if (e.status == "cancelled") {
      ++cancelled_;
    } else if (e.status == "errored" || e.status == "refused") {
      ++errored_;
    }
    std::string finding;
    if (e.status == "lost") {
      ++lost_;
      finding = "LOST";
    } else if (e.check.rfind("corrupt", 0) == 0) {
      ++corrupt_;
      finding = "CORRUPT " + e.check;
    } else if (e.status == "errored" || e.status == "refused" || e.status == "cancelled") {
      static const char* expected[] = {"Timeout", "Cancelled", "PeerLost", "AccessDenied",
                                       "SideChannel"};
      bool known = std::find_if(std::begin(expected), std::end(expected),
                                [&](const char* c) { return e.code == c; }) != std::end(expected);
      if (!known) {
        ++unexpected_;
        finding = "UNEXPECTED CODE " + e.code;
      } else if (!f.any()) {
        ++unexplained_;
        finding = "UNEXPLAINED " + e.status + " " + e.code;
      }
    }
    if (finding.empty() && e.latency_us > 5000000) {
      ++slow_;
      if (slow_list_.size() < 50)
        slow_list_.push_back(std::to_string(now_s(t0_)) + " s: " + side + " " + kind + " " +
                             e.status + " " + e.code + " after " +
                             std::to_string(e.latency_us / 1000) + " ms " + context +
                             " method=" + e.method + " message=" + e.message);
    }
    if (!finding.empty() && findings_.size() < 200)
      findings_.push_back(finding + " at " + std::to_string(now_s(t0_)) + " s: " + side + " " +
                          kind + " " + context + " method=" + e.method +
                          " latency_us=" + std::to_string(e.latency_us) + " message=" + e.message);
  }

  void event(const std::string& what) {
    std::lock_guard lock(mu_);
    ++events_[what];
  }
  void failure(const std::string& what) {
    std::lock_guard lock(mu_);
    ++fatal_;
    if (findings_.size() < 200) findings_.push_back("FAILURE " + what);
  }

  /// A time-series row; clears the latency window.
  std::string row(double t, long long rss, long long fds, std::uint64_t live, long long wrss,
                  bool nats_up) {
    std::lock_guard lock(mu_);
    std::ostringstream o;
    o << t << ',' << started_.load() << ',' << ended_ << ',' << complete_ << ',' << cancelled_
      << ',' << errored_ << ',' << lost_ << ',' << corrupt_ << ',' << verified_ << ',' << rss << ','
      << fds << ',' << live << ',' << wrss << ',' << percentile(window_, 0.5) << ','
      << percentile(window_, 0.99) << ',' << window_.size() << ',' << (nats_up ? 1 : 0) << ','
      << events_["worker killed"] << ',' << events_["nats restarted"];
    window_.clear();
    return o.str();
  }
  static const char* header() {
    return "t_s,started,ended,complete,cancelled,errored,lost,corrupt,bytes_verified,rss_kb,fds,"
           "live_ops,workers_rss_kb,p50_us,p99_us,window_ops,nats_up,kills,nats_restarts";
  }

  std::uint64_t lost() const {
    std::lock_guard lock(mu_);
    return lost_;
  }
  std::uint64_t failures(bool count_unexplained) const {
    std::lock_guard lock(mu_);
    return lost_ + corrupt_ + unexpected_ + (count_unexplained ? unexplained_ : 0) + fatal_;
  }

  std::string json(const Config& c, const Sample& base, const Sample& end, double wall,
                   std::uint64_t live_after, const std::vector<std::string>& growth,
                   const std::vector<std::string>& warnings) const {
    std::lock_guard lock(mu_);
    auto str = [](const std::string& s) {
      std::string o = "\"";
      for (char ch : s) {
        if (ch == '"' || ch == '\\') o += '\\';
        if (static_cast<unsigned char>(ch) < 0x20) ch = ' ';
        o += ch;
      }
      return o + "\"";
    };
    auto map = [&](const std::map<std::string, std::uint64_t>& m) {
      std::string o = "{";
      for (const auto& [k, v] : m)
        o += (o.size() > 1 ? "," : "") + str(k) + ":" + std::to_string(v);
      return o + "}";
    };
    auto list = [&](const std::vector<std::string>& v) {
      std::string o = "[";
      for (const auto& s : v) o += (o.size() > 1 ? ",\n    " : "\n    ") + str(s);
      return o + "]";
    };
    std::ostringstream o;
    o << "{\n  \"form\": " << str(c.form) << ",\n  \"seed\": " << c.seed
      << ",\n  \"wall_s\": " << wall << ",\n  \"lanes\": " << c.lanes
      << ",\n  \"started\": " << started_.load() << ",\n  \"ended\": " << ended_
      << ",\n  \"complete\": " << complete_ << ",\n  \"cancelled\": " << cancelled_
      << ",\n  \"errored\": " << errored_ << ",\n  \"lost\": " << lost_
      << ",\n  \"corrupt\": " << corrupt_ << ",\n  \"unexpected_code\": " << unexpected_
      << ",\n  \"unexplained\": " << unexplained_ << ",\n  \"bytes_verified\": " << verified_
      << ",\n  \"latency_us\": {\"p50\": " << percentile(all_, 0.5)
      << ", \"p99\": " << percentile(all_, 0.99) << ", \"completed\": " << all_.size() << "}"
      << ",\n  \"rss_kb\": {\"after_warmup\": " << base.rss << ", \"end\": " << end.rss << "}"
      << ",\n  \"fds\": {\"after_warmup\": " << base.fds << ", \"end\": " << end.fds << "}"
      << ",\n  \"live_ops_after\": " << live_after << ",\n  \"outcomes\": " << map(outcomes_)
      << ",\n  \"by_kind\": " << map(by_kind_) << ",\n  \"by_method\": " << map(by_method_)
      << ",\n  \"events\": " << map(events_) << ",\n  \"growth\": " << list(growth)
      << ",\n  \"slow_over_5s\": " << slow_ << ",\n  \"slow\": " << list(slow_list_)
      << ",\n  \"findings\": " << list(findings_) << ",\n  \"warnings\": " << list(warnings)
      << "\n}\n";
    return o.str();
  }

 private:
  Clock::time_point t0_;
  mutable std::mutex mu_;
  std::atomic<std::uint64_t> started_{0};
  std::uint64_t ended_ = 0, complete_ = 0, cancelled_ = 0, errored_ = 0, lost_ = 0, corrupt_ = 0,
                unexpected_ = 0, unexplained_ = 0, fatal_ = 0, verified_ = 0;
  std::map<std::string, std::uint64_t> outcomes_, by_kind_, by_method_, events_;
  std::vector<std::uint32_t> window_, all_;
  std::vector<std::string> findings_;
  std::uint64_t slow_ = 0;
  std::vector<std::string> slow_list_;
};

/// The nats-server's outages, so that an error during one counts as explained.
class Outages {
 public:
  void down(Clock::time_point t) {
    std::lock_guard lock(mu_);
    spans_.push_back({t, Clock::time_point::max()});
    up_ = false;
  }
  void up(Clock::time_point t) {
    std::lock_guard lock(mu_);
    if (!spans_.empty()) spans_.back().second = t;
    up_ = true;
  }
  bool is_up() const {
    std::lock_guard lock(mu_);
    return up_;
  }
  /// Whether [from, to] meets an outage, or the few seconds after one in which the
  /// connections come back and the subscriptions are made again.
  bool overlaps(Clock::time_point from, Clock::time_point to, Clock::duration grace) const {
    std::lock_guard lock(mu_);
    for (const auto& [d, u] : spans_)
      if (from <= (u == Clock::time_point::max() ? u : u + grace) && to >= d) return true;
    return false;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::pair<Clock::time_point, Clock::time_point>> spans_;
  bool up_ = true;
};

bool ended_status(OperationStatus s) {
  return s == OperationStatus::complete || s == OperationStatus::cancelled ||
         s == OperationStatus::errored;
}

std::vector<std::string> split(const std::string& line, std::size_t fields) {
  std::vector<std::string> out;
  std::istringstream in(line);
  std::string w;
  while (out.size() + 1 < fields && in >> w) out.push_back(w);
  std::getline(in >> std::ws, w);
  out.push_back(w);
  return out;
}

// ---------------------------------------------------------------------------------------
// A lane: one worker process and the operations with it, one at a time.

struct Shared {
  Shared(const Config& c, Connector& conn, Tally& t, Outages& o, std::string u, std::string p)
      : cfg(c), connector(conn), tally(t), outages(o), url(std::move(u)), prefix(std::move(p)) {}
  const Config& cfg;
  Connector& connector;
  Tally& tally;
  Outages& outages;
  std::string url;
  std::string prefix;  // of every subject of this run
  Clock::time_point t0{};
  Clock::time_point stop_at{};
  std::atomic<bool> stop{false};
  std::vector<std::string> worker_transports;  // the choices for a worker
};

class Lane {
 public:
  Lane(Shared& s, unsigned index) : s_(s), index_(index), rng_(s.cfg.seed * 1000003u + index) {
    std::size_t size = std::max(s.cfg.max_size, s.cfg.region_size);
    // Touched once here, so that the resident size does not climb as larger sizes come up.
    buffer_ = ferry::test::filled(size, std::byte{0});
  }

  pid_t pid() const { return pid_.load(); }

  void run() {
    try {
      create_own_region();
      start_worker();
      while (!should_stop()) one();
    } catch (const std::exception& e) {
      s_.tally.failure("lane " + std::to_string(index_) + ": " + e.what());
      s_.stop = true;
    }
    attachment_ = Attachment();
    if (worker_) {
      worker_->send_line("quit");
      worker_->wait(10s);
      worker_.reset();
    }
    own_region_.close();
  }

 private:
  enum class Kind {
    worker_reads,
    worker_writes,
    we_read,
    we_write,
    region_read_blocks,
    region_write_blocks,
    region_read_range,
    own_region_worker_reads,
    own_region_worker_writes
  };
  static const char* name(Kind k) {
    switch (k) {
      case Kind::worker_reads:
        return "oneshot-worker-reads-our-readable";
      case Kind::worker_writes:
        return "oneshot-worker-writes-our-writable";
      case Kind::we_read:
        return "oneshot-we-read-worker-readable";
      case Kind::we_write:
        return "oneshot-we-write-worker-writable";
      case Kind::region_read_blocks:
        return "region-read-blocks";
      case Kind::region_write_blocks:
        return "region-write-blocks";
      case Kind::region_read_range:
        return "region-read-range";
      case Kind::own_region_worker_reads:
        return "our-region-worker-reads-blocks";
      case Kind::own_region_worker_writes:
        return "our-region-worker-writes-blocks";
    }
    return "?";
  }

  struct Plan {
    Kind kind = Kind::we_read;
    std::size_t size = 0;
    std::uint64_t seed = 0;
    long long timeout_ms = 0;         // this side's deadline (0: none)
    long long worker_timeout_ms = 0;  // the worker's
    long long cancel_ms = -1;         // this side cancels after
    long long worker_cancel_ms = -1;
    long long kill_ms = -1;  // the worker is killed after
    Faults faults;
    std::string subject;
  };

  bool should_stop() const {
    if (s_.stop || Clock::now() >= s_.stop_at) return true;
    return s_.cfg.ops != 0 && s_.tally.started_count() >= s_.cfg.ops;
  }

  double uniform() { return std::uniform_real_distribution<double>(0, 1)(rng_); }
  /// Log-uniform in [lo, hi].
  std::uint64_t log_uniform(double lo, double hi) {
    double v =
        std::exp(std::uniform_real_distribution<double>(std::log(lo), std::log(hi + 1))(rng_));
    return std::clamp<std::uint64_t>(static_cast<std::uint64_t>(v), static_cast<std::uint64_t>(lo),
                                     static_cast<std::uint64_t>(hi));
  }
  Plan plan() {
    Plan p;
    p.seed = rng_() | 1;
    if (uniform() < s_.cfg.p_region) {
      double r = uniform();
      p.kind = r < 0.25  ? Kind::region_read_blocks
               : r < 0.5 ? Kind::region_write_blocks
               : r < 0.6 ? Kind::region_read_range
               : r < 0.8 ? Kind::own_region_worker_reads
                         : Kind::own_region_worker_writes;
    } else {
      p.kind = static_cast<Kind>(rng_() % 4);
      p.size = log_uniform(1, static_cast<double>(s_.cfg.max_size));
    }
    // Faults first: they decide the deadlines of the sides they leave waiting.
    const bool short_mine = uniform() < s_.cfg.p_short_deadline;
    const bool short_theirs = uniform() < s_.cfg.p_short_deadline;
    p.faults.short_deadline = short_mine || short_theirs;
    if (uniform() < s_.cfg.p_cancel) {
      p.faults.cancel = true;
      p.cancel_ms = static_cast<long long>(log_uniform(1, 200)) - 1;
    }
    if (uniform() < s_.cfg.p_worker_cancel) {
      p.faults.worker_cancel = true;
      p.worker_cancel_ms = static_cast<long long>(log_uniform(1, 200)) - 1;
    }
    if (uniform() < s_.cfg.p_kill) {
      p.faults.kill = true;
      p.kill_ms = static_cast<long long>(log_uniform(1, 300)) - 1;
    }
    // A side whose peer gives up before pairing waits, as documented, until its own deadline
    // (or subject_timeout, without one): with a fault planned, every side gets at most
    // kFaultDeadlineMs, so that such a wait costs the lane seconds, not a minute. A passive
    // side otherwise has no deadline (subject_timeout bounds its wait for a peer); an active
    // side has a long one or none.
    const bool fault =
        p.faults.cancel || p.faults.worker_cancel || p.faults.kill || p.faults.short_deadline;
    const bool we_are_passive = p.kind == Kind::worker_reads || p.kind == Kind::worker_writes ||
                                p.kind == Kind::own_region_worker_reads ||
                                p.kind == Kind::own_region_worker_writes;
    auto deadline = [&](bool is_short, bool passive) -> long long {
      if (is_short) return static_cast<long long>(log_uniform(1, 500));
      if (fault) return kFaultDeadlineMs;
      if (passive) return 0;
      return uniform() < s_.cfg.p_long_deadline ? kLongDeadlineMs : 0;
    };
    p.timeout_ms = deadline(short_mine, we_are_passive);
    p.worker_timeout_ms = deadline(short_theirs, !we_are_passive);
    p.subject = s_.prefix + ".op.l" + std::to_string(index_) + "." + std::to_string(++serial_);
    return p;
  }

  long long bound_ms(long long timeout_ms) const {
    return (timeout_ms > 0 ? timeout_ms : s_.cfg.no_deadline_bound_ms) + s_.cfg.slack_ms;
  }

  std::string context(const Plan& p) const {
    std::ostringstream o;
    o << "lane=" << index_ << " gen=" << generation_ << " op=" << serial_ << " size=" << p.size
      << " timeout=" << p.timeout_ms << " worker_timeout=" << p.worker_timeout_ms
      << " cancel=" << p.cancel_ms << " worker_cancel=" << p.worker_cancel_ms
      << " kill=" << p.kill_ms;
    return o.str();
  }

  // -- the worker -------------------------------------------------------------------------

  void start_worker() {
    ++generation_;
    region_subject_ =
        s_.prefix + ".region.l" + std::to_string(index_) + ".g" + std::to_string(generation_);
    region_seed_ = rng_() | 1;
    // Taken in turn, so that every method is in use from the start in some lane.
    const std::string& transports =
        s_.worker_transports[(index_ + generation_) % s_.worker_transports.size()];
    for (int attempt = 0;; ++attempt) {
      worker_ = std::make_unique<test::ChildProcess>(std::vector<std::string>{
          FERRY_SOAK_WORKER_PATH, "soak-worker-" + std::to_string(index_), s_.url, region_subject_,
          std::to_string(s_.cfg.region_size), std::to_string(s_.cfg.block_size),
          std::to_string(region_seed_), transports, std::to_string(s_.cfg.subject_timeout_ms),
          std::to_string(s_.cfg.peer_timeout_ms)});
      try {
        std::string hello = worker_->read_line(60s);
        if (hello.rfind("HELLO ", 0) != 0) throw std::runtime_error("worker said: " + hello);
        pid_ = worker_->pid();
        break;
      } catch (const std::exception& e) {
        // A worker that cannot start (its region's subject while the nats-server is down)
        // is retried; one that never starts ends the soak.
        s_.tally.event("worker start retried");
        worker_.reset();
        if (attempt == 2)
          throw std::runtime_error("worker " + std::to_string(index_) +
                                   " did not start: " + e.what());
      }
    }
    shadow_.assign(s_.cfg.region_size / s_.cfg.block_size, region_seed_);
    attachment_ = Attachment();
    s_.tally.event("worker started");
  }

  void kill_worker() {
    worker_->kill(SIGKILL);
    worker_->wait(10s);
    worker_.reset();
    pid_ = 0;
    s_.tally.event("worker killed");
  }

  /// The worker's END line for its side of an operation.
  Ending worker_end(const Plan& p, long long bound) {
    std::string line;
    try {
      line = worker_->read_line(milliseconds(bound + 30000));
    } catch (const std::exception& e) {
      // No answer: the worker died by itself (a crash) or hangs. Either is a finding.
      s_.tally.failure("worker " + std::to_string(index_) + " did not answer (" + e.what() + ") " +
                       context(p));
      kill_worker();
      start_worker();
      return ending("killed");
    }
    auto f = split(line, 7);
    if (f.size() < 7 || f[0] != "END") {
      s_.tally.failure("worker " + std::to_string(index_) + " said: " + line);
      return ending("killed");
    }
    Ending e;
    e.status = f[1];
    e.code = f[2];
    e.method = f[3];
    e.check = f[4];
    e.latency_us = std::strtoull(f[5].c_str(), nullptr, 10);
    e.message = f[6];
    if (e.check == "ok") e.verified = p.size;
    return e;
  }

  // -- one operation ----------------------------------------------------------------------

  void one() {
    Plan p = plan();
    s_.tally.started();
    switch (p.kind) {
      case Kind::worker_reads:
      case Kind::worker_writes:
        worker_active(p);
        break;
      case Kind::we_read:
      case Kind::we_write:
        we_active(p);
        break;
      case Kind::own_region_worker_reads:
      case Kind::own_region_worker_writes:
        own_region(p);
        break;
      default:
        region(p);
        break;
    }
  }

  /// Waits for `op` to end, cancelling it or killing the worker on the way as planned.
  /// Returns false when it did not end within its bound (lost).
  bool drive(Operation& op, const Plan& p, Clock::time_point began, bool& killed) {
    struct Step {
      long long at;
      bool kill;
    };
    std::vector<Step> steps;
    if (p.cancel_ms >= 0) steps.push_back({p.cancel_ms, false});
    if (p.kill_ms >= 0) steps.push_back({p.kill_ms, true});
    std::sort(steps.begin(), steps.end(), [](auto& a, auto& b) { return a.at < b.at; });
    for (const Step& step : steps) {
      auto at = began + milliseconds(step.at);
      if (ended_status(op.wait(std::max(Clock::duration::zero(), at - Clock::now())))) break;
      if (step.kill) {
        kill_worker();
        killed = true;
      } else {
        auto t = Clock::now();
        op.cancel();
        auto took = Clock::now() - t;
        if (took > 5s)
          s_.tally.failure("cancel() took " +
                           std::to_string(std::chrono::duration<double>(took).count()) + " s " +
                           context(p));
      }
    }
    auto until = began + milliseconds(bound_ms(p.timeout_ms));
    return ended_status(op.wait(std::max(Clock::duration::zero(), until - Clock::now())));
  }

  Ending ending_of(Operation& op, bool ended, Clock::time_point began) {
    Ending e;
    e.latency_us = static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - began).count());
    if (!ended) {
      e.status = "lost";
      graveyard_.push_back(std::move(op));
      // Its memory may still be written: this lane gets a new buffer and keeps the old one.
      graveyard_memory_.push_back(std::move(buffer_));
      buffer_ = ferry::test::filled(std::max(s_.cfg.max_size, s_.cfg.region_size), std::byte{0});
      return e;
    }
    e.status = std::string(to_string(op.status()));
    if (auto err = op.error()) {
      e.code = std::string(to_string(err->code()));
      e.message = err->message();
    }
    std::string m = op.method();
    if (!m.empty()) e.method = m;
    return e;
  }

  void finish(const Plan& p, Ending driver, std::optional<Ending> worker, Clock::time_point began,
              bool killed) {
    Faults f = p.faults;
    f.nats = s_.outages.overlaps(began, Clock::now(), 5s);
    std::string ctx = context(p);
    s_.tally.ended("driver", name(p.kind), driver, f, ctx);
    if (killed) {
      s_.tally.ended("worker", name(p.kind), ending("killed"), f, ctx);
      start_worker();
    } else if (worker) {
      s_.tally.ended("worker", name(p.kind), *worker, f, ctx);
    }
  }

  Ending refused(const Error& e, Clock::time_point began) {
    Ending r = ending("refused", std::string(to_string(e.code())), e.message());
    r.latency_us = static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - began).count());
    return r;
  }

  /// This side passive (served at the plan's subject), the worker active.
  void worker_active(const Plan& p) {
    const bool reads = p.kind == Kind::worker_reads;
    std::byte* data = buffer_.get();
    if (reads)
      ferry::test::fill_pattern(data, p.size, p.seed);
    else
      std::fill_n(data, p.size, std::byte{0});
    OperationOptions o;
    o.subject = p.subject;
    o.timeout = milliseconds(p.timeout_ms);
    const auto began = Clock::now();
    Operation op;
    try {
      if (reads)
        op = s_.connector.create_readable({Descriptor(data, p.size)}, o);
      else
        op = s_.connector.create_writable({Descriptor(data, p.size)}, o);
    } catch (const Error& e) {
      finish(p, refused(e, began), std::nullopt, began, false);
      return;
    }
    const long long worker_bound = bound_ms(p.worker_timeout_ms);
    worker_->send_line(std::string("active ") + (reads ? "read " : "write ") + p.subject + " " +
                       std::to_string(p.size) + " " + std::to_string(p.seed) + " " +
                       std::to_string(p.worker_timeout_ms) + " " +
                       std::to_string(p.worker_cancel_ms) + " " + std::to_string(worker_bound));
    conclude(op, p, began, data, !reads, worker_bound);
  }

  /// The worker passive (served at the plan's subject), this side active by subject.
  void we_active(const Plan& p) {
    const bool reads = p.kind == Kind::we_read;
    const long long worker_bound = bound_ms(p.worker_timeout_ms);
    worker_->send_line(std::string("passive ") + (reads ? "read " : "write ") + p.subject + " " +
                       std::to_string(p.size) + " " + std::to_string(p.seed) + " " +
                       std::to_string(p.worker_timeout_ms));
    std::string ready = worker_->read_line(60s);
    const auto began = Clock::now();
    if (ready != "READY") {
      // The worker could not create it: its refusal is the operation's end.
      auto f = split(ready, 7);
      Ending w = ending("refused", f.size() > 2 ? f[2] : "?", ready);
      s_.tally.ended("worker", name(p.kind), w, p.faults, context(p));
      return;
    }
    worker_->send_line("end " + std::to_string(p.seed) + " " + std::to_string(p.worker_cancel_ms) +
                       " " + std::to_string(worker_bound));
    std::byte* data = buffer_.get();
    if (reads)
      std::fill_n(data, p.size, std::byte{0});
    else
      ferry::test::fill_pattern(data, p.size, p.seed);
    OperationOptions o;
    o.timeout = milliseconds(p.timeout_ms);
    Operation op;
    try {
      if (reads)
        op = s_.connector.begin_read(Subject(p.subject), {Descriptor(data, p.size)}, o);
      else
        op = s_.connector.begin_write({Descriptor(data, p.size)}, Subject(p.subject), o);
    } catch (const Error& e) {
      finish(p, refused(e, began), worker_end(p, worker_bound), began, false);
      return;
    }
    conclude(op, p, began, data, reads, worker_bound);
  }

  /// The end of a one-shot operation of ours: driven to its end (or the worker's killing), our
  /// destination checked when we received the bytes and completed, the worker's end heard.
  void conclude(Operation& op, const Plan& p, Clock::time_point began, const std::byte* data,
                bool received, long long worker_bound) {
    bool killed = false;
    bool ended = drive(op, p, began, killed);
    Ending mine = ending_of(op, ended, began);
    if (mine.status == "complete" && received) {
      long long bad = ferry::test::first_mismatch(data, p.size, p.seed);
      mine.check = bad < 0 ? "ok" : "corrupt@" + std::to_string(bad);
      if (bad < 0) mine.verified = p.size;
    }
    std::optional<Ending> theirs;
    if (!killed) theirs = worker_end(p, worker_bound);
    finish(p, mine, theirs, began, killed);
  }

  /// Log-uniform many of `blocks` blocks: a run, or as many scattered, in ascending order.
  std::vector<std::uint64_t> choose_blocks(std::uint64_t blocks) {
    std::vector<std::uint64_t> ids;
    std::uint64_t n = log_uniform(1, static_cast<double>(blocks));
    if (uniform() < 0.5) {
      std::uint64_t first = rng_() % (blocks - n + 1);
      for (std::uint64_t i = 0; i < n; ++i) ids.push_back(first + i);
    } else {
      std::vector<std::uint64_t> all(blocks);
      for (std::uint64_t i = 0; i < blocks; ++i) all[i] = i;
      std::shuffle(all.begin(), all.end(), rng_);
      ids.assign(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(n));
      std::sort(ids.begin(), ids.end());
    }
    return ids;
  }

  /// This lane's own region (read_write, served at a subject), which its workers attach to,
  /// one after another as they are killed and restarted: the long-lived owner's side.
  void create_own_region() {
    const std::size_t size = s_.cfg.region_size;
    own_memory_ = ferry::test::filled(size, std::byte{0});
    const std::uint64_t seed = rng_() | 1;
    ferry::test::fill_pattern(own_memory_.get(), size, seed);
    own_shadow_.assign(size / s_.cfg.block_size, seed);
    own_subject_ = s_.prefix + ".own.l" + std::to_string(index_);
    RegionOptions ro;
    ro.access = RegionAccess::read_write;
    ro.block_size = s_.cfg.block_size;
    ro.subject = own_subject_;
    // The owner learns of each write into its memory from the region's events (own_region()
    // checks a worker's write only once its event came).
    ro.queue_events = true;
    own_region_ = s_.connector.create_region({Descriptor(own_memory_.get(), size)}, ro);
  }

  /// The worker reads or writes blocks of this lane's region (attached by subject). It checks
  /// what it reads against the patterns this side knows; what it wrote is checked here, in
  /// the region's memory, once its write completed (its bytes are then in place).
  void own_region(Plan p) {
    const std::uint64_t bs = s_.cfg.block_size;
    const bool writes = p.kind == Kind::own_region_worker_writes;
    std::vector<std::uint64_t> ids = choose_blocks(own_shadow_.size());
    p.size = ids.size() * bs;
    std::string list;
    std::uint64_t known = 0;
    for (auto id : ids) {
      list += (list.empty() ? "" : ",") + std::to_string(id) + ":" +
              std::to_string(writes ? p.seed : own_shadow_[id]);
      if (own_shadow_[id] != 0) known += bs;
      // A write that does not complete may have landed in part.
      if (writes) own_shadow_[id] = 0;
    }
    const long long bound = bound_ms(p.worker_timeout_ms);
    // What orders this lane's reads of the region's memory (its checks) before the writes the
    // worker is about to make is this process's pipe to the worker, which no tool here sees
    // into: a round trip to the loop thread (which writes what arrives) says it in-process, so
    // that ThreadSanitizer, which watches these checks, sees it too.
    (void)own_region_.peers();
    const auto began = Clock::now();
    worker_->send_line(std::string("blocks ") + (writes ? "write " : "read ") + own_subject_ + " " +
                       std::to_string(p.worker_timeout_ms) + " " +
                       std::to_string(p.worker_cancel_ms) + " " + std::to_string(bound) + " " +
                       std::to_string(p.seed) + " " + list);
    Faults f = p.faults;
    if (p.kill_ms >= 0) {
      std::this_thread::sleep_for(milliseconds(p.kill_ms));
      kill_worker();
      f.nats = s_.outages.overlaps(began, Clock::now(), 5s);
      s_.tally.ended("worker", name(p.kind), ending("killed"), f, context(p));
      start_worker();
      return;
    }
    Ending w = worker_end(p, bound);
    w.verified = 0;
    // A complete write: the region tells its owner once the bytes are in its memory (the
    // worker heard of it from this process, but through its pipe, which orders nothing here).
    if (w.status == "complete" && writes && !owner_told_of_write(ids, bound)) {
      s_.tally.failure("the region's owner was not told of a complete write into it: " +
                       context(p));
    } else if (w.status == "complete" && writes) {
      long long bad = -1;
      for (std::size_t j = 0; j < ids.size() && bad < 0; ++j) {
        long long m =
            ferry::test::first_mismatch(own_memory_.get() + ids[j] * bs, bs, p.seed, ids[j] * bs);
        if (m >= 0) bad = static_cast<long long>(ids[j] * bs) + m;
      }
      w.check = bad < 0 ? "ok" : "corrupt@" + std::to_string(bad);
      if (bad < 0) {
        w.verified = p.size;
        for (auto id : ids) own_shadow_[id] = p.seed;
      }
    } else if (w.check == "ok") {
      w.verified = known;
    }
    f.nats = s_.outages.overlaps(began, Clock::now(), 5s);
    s_.tally.ended("worker", name(p.kind), w, f, context(p));
  }

  /// Waits up to `bound_ms` for this lane's region to report a complete write of exactly
  /// `ids`; the events before it (reads, writes that ended otherwise, earlier workers') go.
  bool owner_told_of_write(std::vector<std::uint64_t> ids, long long bound_ms) {
    std::sort(ids.begin(), ids.end());
    const auto until = Clock::now() + milliseconds(bound_ms);
    for (;;) {
      const auto left = until - Clock::now();
      if (left <= Clock::duration::zero()) return false;
      std::optional<RegionEvent> e = own_region_.next_event(left);
      if (!e) return false;
      if (e->type != RegionEvent::Type::transfer || e->kind != OperationKind::write ||
          e->status != OperationStatus::complete)
        continue;
      std::vector<std::uint64_t> got = e->blocks;
      std::sort(got.begin(), got.end());
      if (got == ids) return true;
    }
  }

  /// A transfer on the worker's region, attached by subject (once per worker and whenever
  /// the attachment has ended). Blocks written are remembered by seed, so that every read
  /// checks each byte whose content is known; a write that did not complete leaves its
  /// blocks unknown until the next complete write.
  void region(Plan p) {
    const std::uint64_t bs = s_.cfg.block_size;
    const std::uint64_t blocks = shadow_.size();
    if (!attachment_ || attachment_.state() == Attachment::State::detached) {
      if (attachment_)
        s_.tally.event(
            "attachment ended: " +
            std::string(attachment_.error() ? to_string(attachment_.error()->code()) : "-"));
      AttachOptions ao;
      ao.timeout = 10s;
      try {
        attachment_ = s_.connector.attach(Subject(region_subject_), ao);
        s_.tally.event("attached");
      } catch (const Error& e) {
        finish(p, refused(e, Clock::now()), std::nullopt, Clock::now(), false);
        return;
      }
    }
    std::vector<std::uint64_t> ids;
    std::vector<RegionRange> ranges;
    if (p.kind == Kind::region_read_range) {
      std::uint64_t total = blocks * bs;
      std::uint64_t offset = rng_() % total;
      std::uint64_t length = log_uniform(1, static_cast<double>(total - offset));
      ranges.push_back({offset, length});
      p.size = length;
    } else {
      ids = choose_blocks(blocks);
      p.size = ids.size() * bs;
    }
    std::byte* data = buffer_.get();
    const bool writes = p.kind == Kind::region_write_blocks;
    if (writes) {
      for (std::size_t j = 0; j < ids.size(); ++j)
        ferry::test::fill_pattern(data + j * bs, bs, p.seed, ids[j] * bs);
    } else {
      std::fill_n(data, p.size, std::byte{0});
    }
    TransferOptions t;
    t.timeout = milliseconds(p.timeout_ms);
    t.tag = "soak-" + std::to_string(serial_);
    const auto began = Clock::now();
    Operation op;
    try {
      if (writes)
        op = attachment_.write_blocks({Descriptor(data, p.size)}, ids, t);
      else if (p.kind == Kind::region_read_blocks)
        op = attachment_.read_blocks(ids, {Descriptor(data, p.size)}, t);
      else
        op = attachment_.read(ranges, {Descriptor(data, p.size)}, t);
    } catch (const Error& e) {
      if (writes)
        for (auto id : ids) shadow_[id] = 0;
      attachment_ = Attachment();
      finish(p, refused(e, began), std::nullopt, began, false);
      return;
    }
    bool killed = false;
    bool ended = drive(op, p, began, killed);
    Ending mine = ending_of(op, ended, began);
    if (writes) {
      for (auto id : ids) shadow_[id] = mine.status == "complete" ? p.seed : 0;
    } else if (mine.status == "complete") {
      // Check every byte whose block's content is known.
      if (ranges.empty())
        for (std::uint64_t j = 0; j < ids.size(); ++j) ranges.push_back({ids[j] * bs, bs});
      std::uint64_t local = 0;
      long long bad = -1;
      for (const RegionRange& r : ranges) {
        for (std::uint64_t off = r.offset; off < r.offset + r.length && bad < 0;) {
          std::uint64_t b = off / bs;
          std::uint64_t n = std::min(r.offset + r.length, (b + 1) * bs) - off;
          std::uint64_t at = local + (off - r.offset);
          if (shadow_[b] != 0) {
            long long m = ferry::test::first_mismatch(data + at, n, shadow_[b], off);
            if (m >= 0)
              bad = static_cast<long long>(at) + m;
            else
              mine.verified += n;
          }
          off += n;
        }
        local += r.length;
      }
      mine.check = bad < 0 ? "ok" : "corrupt@" + std::to_string(bad);
    }
    if (killed) attachment_ = Attachment();
    finish(p, mine, std::nullopt, began, killed);
  }

  Shared& s_;
  unsigned index_;
  std::mt19937_64 rng_;
  std::unique_ptr<std::byte[]> buffer_;
  std::unique_ptr<test::ChildProcess> worker_;
  std::atomic<pid_t> pid_{0};
  unsigned generation_ = 0;
  std::uint64_t serial_ = 0;
  std::string region_subject_;
  std::uint64_t region_seed_ = 0;
  std::vector<std::uint64_t> shadow_;  // per block: the seed of its pattern, 0: unknown
  Attachment attachment_;
  std::unique_ptr<std::byte[]> own_memory_;  // this lane's region
  std::vector<std::uint64_t> own_shadow_;
  std::string own_subject_;
  Region own_region_;
  std::vector<Operation> graveyard_;  // lost operations, never destroyed (that would cancel)
  std::vector<std::unique_ptr<std::byte[]>> graveyard_memory_;
};

// ---------------------------------------------------------------------------------------

int usage() {
  std::cerr
      << "usage: ferry_soak [--form short|long] [--seed N] [--seconds S] [--ops N] [--lanes N]\n"
         "  [--warmup S] [--sample-ms MS] [--nats-restart-every S] [--max-size BYTES]\n"
         "  [--p-kill P] [--p-cancel P] [--p-worker-cancel P] [--p-short-deadline P]\n"
         "  [--p-region P] [--transports tcp|tcp,cma] [--rss-growth-mb MB] [--fd-growth N]\n"
         "  [--out DIR] [--skip-unless-env VAR]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  ::signal(SIGPIPE, SIG_IGN);  // a worker killed mid-command must not take us with it
  Config c;
  c.seed = std::random_device{}();
  std::string skip_unless;
  std::vector<std::string> args(argv + 1, argv + argc);
  // A form first, so that the options after it override its values.
  for (std::size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == "--form") c.form = args[i + 1];
  if (c.form == "long") {
    c.seconds = 4 * 3600;
    c.ops = 100000;
    c.warmup = 60;
    c.sample_ms = 10000;
    c.nats_restart_every = 120;
  } else if (c.form == "short") {
    c.seconds = 110;
    c.warmup = 25;
    c.sample_ms = 2000;
    c.nats_restart_every = 40;
  } else if (c.form != "custom") {
    return usage();
  }
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (i + 1 >= args.size()) return usage();
    const std::string& v = args[++i];
    if (a == "--form") continue;
    if (a == "--seed")
      c.seed = std::strtoull(v.c_str(), nullptr, 10);
    else if (a == "--seconds")
      c.seconds = std::atof(v.c_str());
    else if (a == "--ops")
      c.ops = std::strtoull(v.c_str(), nullptr, 10);
    else if (a == "--lanes")
      c.lanes = static_cast<unsigned>(std::atoi(v.c_str()));
    else if (a == "--warmup")
      c.warmup = std::atof(v.c_str());
    else if (a == "--sample-ms")
      c.sample_ms = static_cast<unsigned>(std::atoi(v.c_str()));
    else if (a == "--nats-restart-every")
      c.nats_restart_every = std::atof(v.c_str());
    else if (a == "--max-size")
      c.max_size = std::strtoull(v.c_str(), nullptr, 10);
    else if (a == "--p-kill")
      c.p_kill = std::atof(v.c_str());
    else if (a == "--p-cancel")
      c.p_cancel = std::atof(v.c_str());
    else if (a == "--p-worker-cancel")
      c.p_worker_cancel = std::atof(v.c_str());
    else if (a == "--p-short-deadline")
      c.p_short_deadline = std::atof(v.c_str());
    else if (a == "--p-region")
      c.p_region = std::atof(v.c_str());
    else if (a == "--transports")
      c.transports = v;
    else if (a == "--rss-growth-mb")
      c.rss_growth_mb = std::atof(v.c_str());
    else if (a == "--fd-growth")
      c.fd_growth = std::atoll(v.c_str());
    else if (a == "--out")
      c.out = v;
    else if (a == "--skip-unless-env")
      skip_unless = v;
    else
      return usage();
  }
  if (c.lanes == 0 || c.max_size == 0 || c.region_size % c.block_size != 0) return usage();

  // A skip says why, and exits 77: ctest reports it as skipped, never as passed.
  if (!skip_unless.empty() && std::getenv(skip_unless.c_str()) == nullptr) {
    std::cout << "SKIP: the " << c.form << " soak runs only with " << skip_unless
              << "=1 set (it takes 20 minutes or more)\n";
    return 77;
  }
  if (::access(kNatsServer, X_OK) != 0) {
    std::cout << "SKIP: no nats-server at " << kNatsServer << "\n";
    return 77;
  }

  ::mkdir(c.out.c_str(), 0755);
  std::cout << "soak: form " << c.form << ", seed " << c.seed << " (rerun with --seed " << c.seed
            << "), " << c.lanes << " lanes, up to " << c.seconds << " s"
            << (c.ops ? ", " + std::to_string(c.ops) + " operations" : std::string()) << ", out "
            << c.out << std::endl;

  auto nats = std::make_unique<test::NatsServer>();
  std::mutex warn_mu;
  std::map<std::string, std::uint64_t> warnings;
  ConnectorOptions co;
  co.name = "soak-driver";
  co.use_environment = false;
  co.nats.use_environment = false;
  co.nats.servers = {nats->url()};
  co.nats.reconnect_wait = 100ms;
  co.subject_timeout = milliseconds(c.subject_timeout_ms);
  co.peer_timeout = milliseconds(c.peer_timeout_ms);
  co.log.sink = [&](LogLevel level, const std::string& message) {
    // Counted by their first words (peers vanish all the time here), never printed one by one.
    std::string key = std::string(to_string(level)) + ": " + message.substr(0, 60);
    std::lock_guard lock(warn_mu);
    if (warnings.size() < 100 || warnings.count(key)) ++warnings[key];
  };
  Connector connector(co);

  std::vector<std::string> methods;
  for (const MethodInfo& m : connector.methods())
    if (m.available) methods.push_back(m.method);
  bool cma = std::find(methods.begin(), methods.end(), "cma") != methods.end();
  std::cout << "soak: methods here:";
  for (auto& m : methods) std::cout << ' ' << m;
  std::cout << (cma ? "" : " (no cma: tcp only)")
            << "; verbs only on an RDMA device (none is used by the soak)" << std::endl;

  const auto t0 = Clock::now();
  Tally tally(t0);
  Outages outages;
  Shared shared{c, connector, tally, outages, nats->url(), "soak." + std::to_string(::getpid())};
  shared.t0 = t0;
  shared.stop_at =
      t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(c.seconds));
  if (!c.transports.empty())
    shared.worker_transports = {c.transports};
  else if (cma)
    shared.worker_transports = {"tcp", "tcp,cma"};
  else
    shared.worker_transports = {"tcp"};

  std::vector<std::unique_ptr<Lane>> lanes;
  for (unsigned i = 0; i < c.lanes; ++i) lanes.push_back(std::make_unique<Lane>(shared, i));
  std::vector<std::thread> threads;
  for (auto& lane : lanes) threads.emplace_back([&lane] { lane->run(); });

  // The nats-server: killed and restarted every nats_restart_every seconds, down 0.3-1.5 s.
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  std::atomic<bool> running{true};
  std::thread chaos([&] {
    std::mt19937_64 rng(c.seed ^ 0x9e3779b97f4a7c15ULL);
    if (c.nats_restart_every <= 0) return;
    for (unsigned k = 1; running; ++k) {
      auto at = t0 + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(c.nats_restart_every * k));
      std::unique_lock lock(stop_mu);
      if (stop_cv.wait_until(lock, at, [&] { return !running.load(); })) return;
      lock.unlock();
      outages.down(Clock::now());
      nats->kill();
      std::this_thread::sleep_for(milliseconds(300 + rng() % 1200));
      bool up = false;
      for (int attempt = 0; attempt < 3 && !up; ++attempt) {
        try {
          nats->start();
          up = true;
        } catch (const std::exception& e) {
          tally.failure(std::string("nats-server did not restart: ") + e.what());
        }
      }
      outages.up(Clock::now());
      tally.event("nats restarted");
    }
  });

  // The time series.
  std::ofstream csv(c.out + "/series.csv");
  csv << Tally::header() << '\n';
  std::vector<Sample> samples;
  std::atomic<bool> lanes_done{false};
  std::thread sampler([&] {
    for (auto next = t0;;) {
      next += milliseconds(c.sample_ms);
      {
        std::unique_lock lock(stop_mu);
        if (stop_cv.wait_until(lock, next, [&] { return lanes_done.load(); })) return;
      }
      long long wrss = 0;
      for (auto& lane : lanes)
        if (pid_t pid = lane->pid()) wrss += rss_kb(pid);
      Sample s{now_s(t0), rss_kb(::getpid()), open_fds()};
      csv << tally.row(s.t, s.rss, s.fds, connector.stats().live, wrss, outages.is_up())
          << std::endl;
      samples.push_back(s);
      std::cout << "soak: " << static_cast<int>(s.t) << " s, " << tally.started_count()
                << " operations started, rss " << s.rss / 1024 << " MiB, fds " << s.fds
                << std::endl;
    }
  });

  for (auto& t : threads) t.join();
  const double wall = now_s(t0);
  {
    std::lock_guard lock(stop_mu);
    running = false;
    lanes_done = true;
  }
  stop_cv.notify_all();
  chaos.join();
  sampler.join();

  // Growth: the median of three samples just after warm-up against the last three.
  std::vector<std::string> growth;
  Sample base, end;
  auto median = [](std::vector<Sample> v) {
    auto mid = [&](auto key) {
      std::sort(v.begin(), v.end(), [&](auto& a, auto& b) { return key(a) < key(b); });
      return key(v[v.size() / 2]);
    };
    Sample m;
    m.rss = mid([](const Sample& s) { return s.rss; });
    m.fds = mid([](const Sample& s) { return s.fds; });
    m.t = v.back().t;
    return m;
  };
  std::vector<Sample> after;
  for (const Sample& s : samples)
    if (s.t >= c.warmup) after.push_back(s);
  if (after.size() >= 6) {
    base = median({after.begin(), after.begin() + 3});
    end = median({after.end() - 3, after.end()});
    double rss_mb = static_cast<double>(end.rss - base.rss) / 1024.0;
    std::ostringstream g;
    g << "rss " << base.rss / 1024 << " -> " << end.rss / 1024 << " MiB (+" << rss_mb
      << ", tolerance " << c.rss_growth_mb << (c.check_rss ? "" : ", not enforced: sanitizer")
      << "); fds " << base.fds << " -> " << end.fds << " (tolerance +" << c.fd_growth << ")";
    growth.push_back(g.str());
    if (c.check_rss && rss_mb > c.rss_growth_mb) tally.failure("RSS grew: " + g.str());
    if (end.fds - base.fds > c.fd_growth) tally.failure("descriptors grew: " + g.str());
  } else {
    growth.push_back("too few samples after warm-up to judge growth");
    tally.failure("too few samples after warm-up (" + std::to_string(after.size()) +
                  "): run longer than --warmup");
  }
  // Every operation this side started has ended (lost ones are counted already).
  std::uint64_t live = connector.stats().live;

  std::vector<std::string> warning_lines;
  {
    std::lock_guard lock(warn_mu);
    for (const auto& [k, n] : warnings) warning_lines.push_back(std::to_string(n) + "x " + k);
  }
  if (live > tally.lost())
    tally.failure(std::to_string(live) + " operations still live after the run, " +
                  std::to_string(tally.lost()) + " of them lost");
  std::string summary = tally.json(c, base, end, wall, live, growth, warning_lines);
  std::ofstream(c.out + "/summary.json") << summary;
  std::cout << summary << std::flush;
  if (tally.lost() != 0) {
    // Destroying a lost operation cancels it, which may hang as it did: leave without.
    std::cout << "soak: FAILED (lost operations; seed " << c.seed << ")" << std::endl;
    std::_Exit(1);
  }
  lanes.clear();
  nats.reset();

  std::uint64_t failures = tally.failures(c.fail_unexplained);
  if (failures != 0) {
    std::cout << "soak: FAILED (" << failures << " failures; seed " << c.seed << ")\n";
    return 1;
  }
  std::cout << "soak: passed (seed " << c.seed << ")\n";
  return 0;
}
