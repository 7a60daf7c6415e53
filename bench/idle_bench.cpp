// Whether a connector idle with N pending passive operations costs CPU, or wakes up.
//
// One process, three windows of --seconds each, the main thread asleep in each:
//   reference (before)  no connector yet
//   connector           a connector with --ops passive operations (half readable, half
//                       writable, 64 bytes each), created and then left 0.5 s to settle
//                       (--settle_ms);
//                       optionally each served at a NATS subject (--subject) and with a
//                       deadline (--timeout_ms)
//   reference (after)   the operations cancelled (all must end within 10 s + 1 ms per
//                       operation, else exit 1)
//                       and the connector destroyed
// For each window: the process's CPU time (getrusage RUSAGE_SELF: user, sys), its fraction of
// the wall time, the process's voluntary context switches, and per thread (/proc/self/task):
// CPU time (schedstat) and voluntary context switches, i.e. how often each thread went to
// sleep and so was woken. `wakeups` is the connector's loop thread's count (found as the thread
// that runs a completion callback). The reference values are both reference windows together.
//
//   build/bench/ferry_idle_bench --ops 1000 --seconds 5
//   build/bench/ferry_idle_bench --ops 10000 --subject --timeout_ms 3600000 --json idle.json
//   build/bench/ferry_idle_bench --ops 1000 --subject --metrics 127.0.0.1:9464
//
// With a side channel the connector also answers the stats subject (docs/operations.md), and
// with --metrics it serves Prometheus metrics: neither may add wakeups to its loop while
// nobody asks (prometheus-cpp's HTTP server thread polls its socket every 2 s: that thread's
// wakeups show among the process's others).
//
// --subject without --nats_url or $FERRY_NATS_URL starts a private /usr/sbin/nats-server on a
// free 127.0.0.1 port, and stops it. Without --subject the connector has no side channel
// (the environment is not read). Exit status: 0; 1 when an operation does not end after
// cancel() or one ended on its own while idle; 2 when the connector window's CPU fraction
// exceeds --max_cpu_fraction (default 0.5 of a core); 3 for bad arguments or a failed setup.
#include <dirent.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>

#include "bench/support/private_nats.hpp"

namespace {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------------------------
// Options

struct Options {
  std::size_t ops = 1000;
  double seconds = 5;
  bool subject = false;
  std::string nats_url;
  long timeout_ms = 0;
  std::string json;
  double max_cpu_fraction = 0.5;
  long settle_ms = 500;
  std::string metrics;  ///< --metrics HOST:PORT: the connector serves Prometheus metrics there
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "ferry_idle_bench: %s\n"
               "usage: ferry_idle_bench [--ops N] [--seconds S] [--subject] [--nats_url URL]\n"
               "                        [--timeout_ms T] [--json FILE] [--settle_ms MS]\n"
               "                        [--max_cpu_fraction F] [--metrics HOST:PORT]\n",
               why.c_str());
  std::exit(3);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    bool has_value = false;
    if (auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    auto next = [&]() -> std::string {
      if (has_value) return value;
      if (i + 1 >= argc) usage(arg + " needs a value");
      return argv[++i];
    };
    try {
      if (arg == "--ops") {
        long n = std::stol(next());
        if (n < 2 || n > 1000000) usage("--ops must be in [2, 1000000]");
        o.ops = static_cast<std::size_t>(n);
      } else if (arg == "--seconds") {
        o.seconds = std::stod(next());
        if (!(o.seconds > 0 && o.seconds <= 3600)) usage("--seconds must be in (0, 3600]");
      } else if (arg == "--subject") {
        o.subject = true;
      } else if (arg == "--nats_url") {
        o.nats_url = next();
      } else if (arg == "--timeout_ms") {
        o.timeout_ms = std::stol(next());
        if (o.timeout_ms < 0) usage("--timeout_ms must not be negative");
      } else if (arg == "--json") {
        o.json = next();
      } else if (arg == "--settle_ms") {
        o.settle_ms = std::stol(next());
        if (o.settle_ms < 0 || o.settle_ms > 600000) usage("--settle_ms must be in [0, 600000]");
      } else if (arg == "--metrics") {
        o.metrics = next();
      } else if (arg == "--max_cpu_fraction") {
        o.max_cpu_fraction = std::stod(next());
      } else if (arg == "--help" || arg == "-h") {
        usage("help");
      } else {
        usage("unknown argument " + arg);
      }
    } catch (const std::logic_error&) {
      usage("bad value for " + arg);
    }
  }
  if (o.nats_url.empty()) {
    if (const char* env = std::getenv("FERRY_NATS_URL"); env != nullptr) o.nats_url = env;
  }
  return o;
}

// ---------------------------------------------------------------------------------------------
// A private nats-server (for --subject without a URL): bench/support/private_nats.hpp, asked
// to stop with SIGTERM and given 2 s before SIGKILL.

using ferry::bench_support::PrivateNatsServer;

// ---------------------------------------------------------------------------------------------
// Measuring

int gettid_now() { return static_cast<int>(::syscall(SYS_gettid)); }

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct ThreadSample {
  std::string name;
  long voluntary = -1;    // voluntary_ctxt_switches
  long involuntary = -1;  // nonvoluntary_ctxt_switches
  double cpu_ms = -1;     // schedstat's on-CPU time, else stat's utime + stime
};

std::vector<int> task_ids() {
  std::vector<int> out;
  if (DIR* d = ::opendir("/proc/self/task")) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') out.push_back(std::atoi(e->d_name));
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

ThreadSample sample_thread(int tid) {
  ThreadSample t;
  const std::string dir = "/proc/self/task/" + std::to_string(tid) + "/";
  std::istringstream status(read_file(dir + "status"));
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("Name:", 0) == 0) {
      t.name = line.substr(5);
      t.name.erase(0, t.name.find_first_not_of(" \t"));
    } else if (line.rfind("voluntary_ctxt_switches:", 0) == 0) {
      t.voluntary = std::stol(line.substr(24));
    } else if (line.rfind("nonvoluntary_ctxt_switches:", 0) == 0) {
      t.involuntary = std::stol(line.substr(27));
    }
  }
  std::istringstream schedstat(read_file(dir + "schedstat"));
  if (unsigned long long ns = 0; schedstat >> ns) {
    t.cpu_ms = static_cast<double>(ns) / 1e6;
  } else {
    // stat: fields 14 and 15 (utime, stime) in clock ticks, after the parenthesized name.
    const std::string stat = read_file(dir + "stat");
    if (auto close = stat.rfind(')'); close != std::string::npos) {
      std::istringstream rest(stat.substr(close + 2));
      std::string field;
      unsigned long long utime = 0, stime = 0;
      for (int i = 3; i <= 15 && rest >> field; ++i) {
        if (i == 14) utime = std::stoull(field);
        if (i == 15) stime = std::stoull(field);
      }
      t.cpu_ms =
          static_cast<double>(utime + stime) * 1000.0 / static_cast<double>(::sysconf(_SC_CLK_TCK));
    }
  }
  return t;
}

struct Snapshot {
  Clock::time_point at;
  rusage usage{};
  std::map<int, ThreadSample> threads;
};

// Reading /proc costs the main thread CPU: it is done before the window opens and after it
// closes, outside what getrusage counts.
Snapshot open_window() {
  Snapshot s;
  for (int tid : task_ids()) s.threads[tid] = sample_thread(tid);
  ::getrusage(RUSAGE_SELF, &s.usage);
  s.at = Clock::now();
  return s;
}

Snapshot close_window() {
  Snapshot s;
  s.at = Clock::now();
  ::getrusage(RUSAGE_SELF, &s.usage);
  for (int tid : task_ids()) s.threads[tid] = sample_thread(tid);
  return s;
}

double ms(const timeval& tv) {
  return static_cast<double>(tv.tv_sec) * 1e3 + static_cast<double>(tv.tv_usec) / 1e3;
}

struct ThreadDelta {
  int tid = 0;
  std::string name;
  long voluntary = 0;
  long involuntary = 0;
  double cpu_ms = 0;
};

struct Window {
  double wall_s = 0;
  double user_ms = 0;
  double sys_ms = 0;
  long voluntary = 0;                // the process's (getrusage)
  long involuntary = 0;              // the process's
  std::vector<ThreadDelta> threads;  // those alive at both ends
  double cpu_fraction() const { return (user_ms + sys_ms) / 1e3 / wall_s; }
  const ThreadDelta* thread(int tid) const {
    for (const auto& t : threads)
      if (t.tid == tid) return &t;
    return nullptr;
  }
  // Voluntary switches of every thread but `except` (the main thread, asleep once per window).
  long others_voluntary(int except) const {
    long n = 0;
    for (const auto& t : threads)
      if (t.tid != except) n += t.voluntary;
    return n;
  }
};

Window diff(const Snapshot& a, const Snapshot& b) {
  Window w;
  w.wall_s = std::chrono::duration<double>(b.at - a.at).count();
  w.user_ms = ms(b.usage.ru_utime) - ms(a.usage.ru_utime);
  w.sys_ms = ms(b.usage.ru_stime) - ms(a.usage.ru_stime);
  w.voluntary = b.usage.ru_nvcsw - a.usage.ru_nvcsw;
  w.involuntary = b.usage.ru_nivcsw - a.usage.ru_nivcsw;
  for (const auto& [tid, end] : b.threads) {
    auto it = a.threads.find(tid);
    if (it == a.threads.end()) continue;
    w.threads.push_back(ThreadDelta{tid, end.name, end.voluntary - it->second.voluntary,
                                    end.involuntary - it->second.involuntary,
                                    end.cpu_ms - it->second.cpu_ms});
  }
  return w;
}

Window idle_window(double seconds) {
  Snapshot a = open_window();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  Snapshot b = close_window();
  return diff(a, b);
}

void print_window(const char* title, const Window& w, int main_tid, int loop_tid) {
  std::printf("%-20s %zu threads:", title, w.threads.size());
  for (const auto& t : w.threads) std::printf(" %s", t.name.c_str());
  std::printf("\n");
  std::printf(
      "%-20s wall %.3f s  user %.3f ms  sys %.3f ms  cpu %.5f%% of a core  "
      "voluntary switches %ld (involuntary %ld)\n",
      title, w.wall_s, w.user_ms, w.sys_ms, 100.0 * w.cpu_fraction(), w.voluntary, w.involuntary);
  for (const auto& t : w.threads) {
    // The main thread sleeps once per window; its CPU here is the reading of /proc.
    if (t.tid == main_tid) continue;
    if (t.voluntary == 0 && t.involuntary == 0 && t.cpu_ms < 0.001) continue;
    std::printf("  thread %-7d %-16s %s wakeups %ld (%.2f/s)  involuntary %ld  cpu %.3f ms\n",
                t.tid, t.name.c_str(),
                t.tid == loop_tid ? "[loop]" : (t.tid == main_tid ? "[main]" : "      "),
                t.voluntary, static_cast<double>(t.voluntary) / w.wall_s, t.involuntary, t.cpu_ms);
  }
}

// ---------------------------------------------------------------------------------------------
// The run

struct Result {
  Window before, connector, after;
  int loop_tid = -1;
  std::size_t ended_while_idle = 0;
  std::size_t not_ended = 0;
  std::size_t not_cancelled = 0;
  double cancel_ms = 0;
};

// Runs `work` on a thread of its own and waits for it at most `limit`. A call into the SDK
// that hangs must fail the run, not hang it: on timeout the thread is left behind and the
// caller exits.
bool bounded(std::chrono::milliseconds limit, std::function<void()> work) {
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread([done, work = std::move(work)] {
    work();
    done->store(true);
  }).detach();
  const auto until = Clock::now() + limit;
  while (!done->load()) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

int run(const Options& o) {
  std::unique_ptr<PrivateNatsServer> server;
  std::string url = o.nats_url;
  if (o.subject && url.empty()) {
    PrivateNatsServer::Options server_options;
    server_options.stop_grace = std::chrono::seconds(2);
    server = std::make_unique<PrivateNatsServer>(server_options);
    url = server->url();
  }
  const int main_tid = gettid_now();
  Result r;

  // The buffers exist in all three windows: only the connector differs between them.
  constexpr std::size_t kBuffer = 64;
  std::vector<std::byte> memory(o.ops * kBuffer);

  r.before = idle_window(o.seconds);

  ferry::ConnectorOptions co;
  co.name = "idle-bench";
  co.metrics.listen = o.metrics;
  if (o.subject) {
    co.nats.servers = {url};
  } else {
    co.nats.use_environment = false;
  }
  auto connector = std::make_unique<ferry::Connector>(co);

  // The loop thread is the one that runs completion callbacks.
  {
    std::vector<std::byte> probe_memory(kBuffer);
    auto probe = connector->create_readable(probe_memory);
    auto tid = std::make_shared<std::atomic<int>>(-1);
    probe.on_complete(
        [tid](ferry::OperationStatus, const ferry::Error*) { tid->store(gettid_now()); });
    probe.cancel();
    const auto until = Clock::now() + std::chrono::seconds(5);
    while (tid->load() < 0 && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    r.loop_tid = tid->load();
  }

  std::vector<ferry::Operation> ops;
  ops.reserve(o.ops);
  auto ended = std::make_shared<std::atomic<std::size_t>>(0);
  const auto created_at = Clock::now();
  for (std::size_t i = 0; i < o.ops; ++i) {
    ferry::OperationOptions oo;
    oo.timeout = std::chrono::milliseconds(o.timeout_ms);
    if (o.subject) oo.subject = "idlebench." + std::to_string(::getpid()) + "." + std::to_string(i);
    std::vector<ferry::Descriptor> d{ferry::Descriptor(memory.data() + i * kBuffer, kBuffer)};
    ferry::Operation op;
    if (i % 2 == 0)
      op = connector->create_readable(std::move(d), std::move(oo));
    else
      op = connector->create_writable(std::move(d), std::move(oo));
    op.on_complete([ended](ferry::OperationStatus, const ferry::Error*) { ended->fetch_add(1); });
    ops.push_back(std::move(op));
  }
  const double create_ms =
      std::chrono::duration<double, std::milli>(Clock::now() - created_at).count();
  std::this_thread::sleep_for(std::chrono::milliseconds(o.settle_ms));

  r.connector = idle_window(o.seconds);
  r.ended_while_idle = ended->load();

  // Cancel everything, each cancel() bounded as a whole; then every callback must have run.
  const auto cancel_at = Clock::now();
  const std::chrono::milliseconds cancel_limit(10000 + static_cast<long>(o.ops));
  bool cancelled = bounded(cancel_limit, [&ops] {
    for (auto& op : ops) op.cancel();
  });
  const auto until = Clock::now() + std::chrono::seconds(5);
  while (cancelled && ended->load() < o.ops && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  r.cancel_ms = std::chrono::duration<double, std::milli>(Clock::now() - cancel_at).count();
  if (!cancelled) {
    std::fprintf(stderr, "ferry_idle_bench: cancel() of %zu operations did not return in %ld ms\n",
                 o.ops, static_cast<long>(cancel_limit.count()));
    std::fflush(nullptr);
    std::_Exit(1);
  }
  r.not_ended = o.ops - ended->load();
  for (const auto& op : ops) {
    auto s = op.status();
    if (s != ferry::OperationStatus::cancelled && s != ferry::OperationStatus::errored)
      ++r.not_cancelled;
  }
  ops.clear();
  if (!bounded(std::chrono::seconds(10), [&connector] { connector.reset(); })) {
    std::fprintf(stderr, "ferry_idle_bench: the connector's destructor did not return in 10 s\n");
    std::fflush(nullptr);
    std::_Exit(1);
  }

  // What the connector leaves to finish after its destructor (cnats frees subscriptions on a
  // thread of its own) settles too before the second reference window.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  r.after = idle_window(o.seconds);
  server.reset();

  // The report.
  const Window& c = r.connector;
  const double ref_wall = r.before.wall_s + r.after.wall_s;
  const double ref_user = (r.before.user_ms + r.after.user_ms) / 2;
  const double ref_sys = (r.before.sys_ms + r.after.sys_ms) / 2;
  const double ref_fraction =
      (r.before.user_ms + r.before.sys_ms + r.after.user_ms + r.after.sys_ms) / 1e3 / ref_wall;
  const ThreadDelta* loop = c.thread(r.loop_tid);
  const long wakeups = loop != nullptr ? loop->voluntary : -1;
  // No loop thread in the reference windows: what stands for it there is every thread but the
  // main one (none before the connector; what a library may leave behind after it).
  const long ref_wakeups =
      (r.before.others_voluntary(main_tid) + r.after.others_voluntary(main_tid) + 1) / 2;

  std::printf(
      "ferry_idle_bench: %zu passive operations (%zu readable, %zu writable), %s, %s, "
      "created in %.1f ms; windows of %.1f s\n",
      o.ops, (o.ops + 1) / 2, o.ops / 2,
      o.subject ? ("served at NATS subjects via " + url).c_str() : "no side channel",
      o.timeout_ms > 0 ? ("deadline " + std::to_string(o.timeout_ms) + " ms").c_str()
                       : "no deadline",
      create_ms, o.seconds);
  print_window("reference (before)", r.before, main_tid, r.loop_tid);
  print_window("connector", c, main_tid, r.loop_tid);
  print_window("reference (after)", r.after, main_tid, r.loop_tid);
  std::printf("loop thread %d: %ld wakeups in %.1f s (%.2f/s), %.3f ms of CPU\n", r.loop_tid,
              wakeups, c.wall_s, static_cast<double>(wakeups) / c.wall_s,
              loop != nullptr ? loop->cpu_ms : -1.0);
  std::printf(
      "connector cpu fraction %.6f against reference %.6f; other threads' wakeups %ld "
      "against reference %ld\n",
      c.cpu_fraction(), ref_fraction, c.others_voluntary(main_tid) - std::max(wakeups, 0L),
      ref_wakeups);
  std::printf("cancel: %zu of %zu ended in %.1f ms; %zu ended while idle; %zu not cancelled\n",
              o.ops - r.not_ended, o.ops, r.cancel_ms, r.ended_while_idle, r.not_cancelled);

  if (!o.json.empty()) {
    FILE* f = std::fopen(o.json.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "ferry_idle_bench: cannot write %s\n", o.json.c_str());
      return 3;
    }
    std::fprintf(
        f,
        "{\"ops\": %zu, \"seconds\": %.3f, \"subject\": %s, \"timeout_ms\": %ld, \"settle_ms\": "
        "%ld,\n"
        " \"cpu_user_ms\": %.3f, \"cpu_sys_ms\": %.3f, \"cpu_fraction\": %.8f,\n"
        " \"wakeups\": %ld, \"loop_thread_cpu_ms\": %.3f, \"voluntary_switches\": %ld,\n"
        " \"reference_cpu_user_ms\": %.3f, \"reference_cpu_sys_ms\": %.3f,\n"
        " \"reference_cpu_fraction\": %.8f, \"reference_wakeups\": %ld,\n"
        " \"reference_voluntary_switches\": %ld,\n"
        " \"ended_while_idle\": %zu, \"not_ended_after_cancel\": %zu, \"cancel_ms\": %.3f}\n",
        o.ops, o.seconds, o.subject ? "true" : "false", o.timeout_ms, o.settle_ms, c.user_ms,
        c.sys_ms, c.cpu_fraction(), wakeups, loop != nullptr ? loop->cpu_ms : -1.0, c.voluntary,
        ref_user, ref_sys, ref_fraction, ref_wakeups,
        (r.before.voluntary + r.after.voluntary + 1) / 2, r.ended_while_idle, r.not_ended,
        r.cancel_ms);
    std::fclose(f);
  }

  if (r.not_ended != 0 || r.not_cancelled != 0) {
    std::fprintf(stderr, "ferry_idle_bench: FAIL: %zu operations did not end after cancel()\n",
                 std::max(r.not_ended, r.not_cancelled));
    return 1;
  }
  if (o.timeout_ms == 0 || o.timeout_ms > static_cast<long>(o.seconds * 1000 + 1000)) {
    if (r.ended_while_idle != 0) {
      std::fprintf(stderr, "ferry_idle_bench: FAIL: %zu operations ended while idle\n",
                   r.ended_while_idle);
      return 1;
    }
  }
  if (c.cpu_fraction() > o.max_cpu_fraction) {
    std::fprintf(stderr, "ferry_idle_bench: FAIL: cpu fraction %.6f while idle exceeds %.6f\n",
                 c.cpu_fraction(), o.max_cpu_fraction);
    return 2;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry_idle_bench: %s\n", e.what());
    return 3;
  }
}
