// What the reference programs of bench/compare share: option parsing with K/M/G sizes, their
// main(), timed iterations and their percentiles, a forked child that dies with its parent,
// and a JSON object printed on stdout.
#pragma once

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ferry::ref {

using Clock = std::chrono::steady_clock;

inline double to_us(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

// "4096", "4K", "16M", "1G" (powers of 1024).
inline std::uint64_t parse_size(const std::string& text) {
  std::size_t used = 0;
  const unsigned long long n = std::stoull(text, &used);
  std::uint64_t unit = 1;
  const std::string rest = text.substr(used);
  if (rest == "K" || rest == "k" || rest == "KiB") {
    unit = 1ull << 10;
  } else if (rest == "M" || rest == "m" || rest == "MiB") {
    unit = 1ull << 20;
  } else if (rest == "G" || rest == "g" || rest == "GiB") {
    unit = 1ull << 30;
  } else if (!rest.empty()) {
    throw std::invalid_argument("bad size: " + text);
  }
  return n * unit;
}

// --name value pairs; every option takes a value. Unknown options are an error.
class Options {
 public:
  Options(int argc, char** argv, std::map<std::string, std::string> defaults)
      : values_(std::move(defaults)) {
    for (int i = 1; i < argc; ++i) {
      std::string_view arg = argv[i];
      if (arg == "-h" || arg == "--help") throw std::invalid_argument("help");
      if (arg.substr(0, 2) != "--" || i + 1 >= argc)
        throw std::invalid_argument("expected --option value, got " + std::string(arg));
      std::string name(arg.substr(2));
      if (!values_.contains(name)) throw std::invalid_argument("unknown option --" + name);
      values_[name] = argv[++i];
    }
  }
  const std::string& str(const std::string& name) const { return values_.at(name); }
  std::uint64_t size(const std::string& name) const { return parse_size(values_.at(name)); }

 private:
  std::map<std::string, std::string> values_;
};

// A program's main(): parses the options (`defaults` names every one) and calls `run`; on a
// bad option or any exception prints "TOOL: WHAT" and "usage: TOOL USAGE" on stderr and
// returns 2.
template <typename Run>
int main_of(int argc, char** argv, const char* tool, const char* usage,
            std::map<std::string, std::string> defaults, Run run) {
  try {
    const Options opts(argc, argv, std::move(defaults));
    return run(opts);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\nusage: %s %s\n", tool, e.what(), tool, usage);
    return 2;
  }
}

// Per-iteration times of `iters` calls of `once`, and the seconds they took together.
struct Timed {
  std::vector<double> us;
  double seconds = 0;
};

template <typename Once>
Timed time_iterations(std::uint64_t iters, Once once) {
  Timed t;
  t.us.reserve(iters);
  const auto start = Clock::now();
  for (std::uint64_t i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    once();
    t.us.push_back(to_us(Clock::now() - t0));
  }
  t.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return t;
}

struct Percentiles {
  double min_us = 0, p50_us = 0, p99_us = 0, max_us = 0, mean_us = 0;
};

inline Percentiles percentiles(std::vector<double> us) {
  Percentiles p;
  if (us.empty()) return p;
  std::sort(us.begin(), us.end());
  auto at = [&](double q) {
    return us[static_cast<std::size_t>(q * static_cast<double>(us.size() - 1) + 0.5)];
  };
  double total = 0;
  for (double v : us) total += v;
  p.min_us = us.front();
  p.p50_us = at(0.5);
  p.p99_us = at(0.99);
  p.max_us = us.back();
  p.mean_us = total / static_cast<double>(us.size());
  return p;
}

// A JSON object built field by field (numbers and plain strings only: nothing here needs
// escaping beyond quotes and backslashes).
class JsonObject {
 public:
  JsonObject& add(const std::string& key, const std::string& value) {
    std::string quoted = "\"";
    for (char c : value) {
      if (c == '"' || c == '\\') quoted += '\\';
      quoted += c;
    }
    return raw(key, quoted + "\"");
  }
  JsonObject& add(const std::string& key, const char* value) {
    return add(key, std::string(value));
  }
  JsonObject& add(const std::string& key, double value) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.6g", value);
    return raw(key, buf);
  }
  JsonObject& add(const std::string& key, std::uint64_t value) {
    return raw(key, std::to_string(value));
  }
  JsonObject& add(const std::string& key, const std::vector<double>& values) {
    std::string list = "[";
    char buf[64];
    for (std::size_t i = 0; i < values.size(); ++i) {
      std::snprintf(buf, sizeof buf, "%s%.3f", i ? ", " : "", values[i]);
      list += buf;
    }
    return raw(key, list + "]");
  }
  JsonObject& add(const std::string& key, const Percentiles& p) {
    add(key + "min_us", p.min_us);
    add(key + "p50_us", p.p50_us);
    add(key + "p99_us", p.p99_us);
    add(key + "max_us", p.max_us);
    return add(key + "mean_us", p.mean_us);
  }
  /// A value that is JSON already (an array, a nested object).
  JsonObject& raw(const std::string& key, const std::string& value) {
    if (!body_.empty()) body_ += ", ";
    body_ += "\"" + key + "\": " + value;
    return *this;
  }
  /// The members, without the braces.
  const std::string& text() const { return body_; }
  void print() const { std::printf("{%s}\n", body_.c_str()); }

 private:
  std::string body_;
};

// "iters", "warmup" and "seconds" of a timed run.
inline JsonObject& add_run(JsonObject& out, std::uint64_t iters, std::uint64_t warmup,
                           double seconds) {
  return out.add("iters", iters).add("warmup", warmup).add("seconds", seconds);
}

// add_run, then "round_trips_per_s" and the percentiles of timed round trips.
inline JsonObject& add_round_trips(JsonObject& out, std::uint64_t iters, std::uint64_t warmup,
                                   Timed timed) {
  return add_run(out, iters, warmup, timed.seconds)
      .add("round_trips_per_s", static_cast<double>(iters) / timed.seconds)
      .add("", percentiles(std::move(timed.us)));
}

// Forks a child that runs `body` and exits with its return value. The child is SIGKILLed when
// the parent dies; the destructor kills and reaps it if wait() was not called.
class Child {
 public:
  template <typename Body>
  explicit Child(Body body) {
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
      int rc = 1;
      try {
        rc = body();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child: %s\n", e.what());
      }
      std::fflush(stderr);
      ::_exit(rc);
    }
  }
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }

  // Waits at most `seconds` for the child to exit by itself; its exit status, or -1 when it
  // had to be killed.
  int wait(int seconds) {
    const auto until = Clock::now() + std::chrono::seconds(seconds);
    while (Clock::now() < until) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      ::usleep(1000);
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
    return -1;
  }

 private:
  pid_t pid_ = -1;
};

// Reads or writes exactly `len` bytes on a blocking descriptor; false on EOF or error.
inline bool read_all(int fd, void* buf, std::size_t len) {
  auto* p = static_cast<char*>(buf);
  while (len > 0) {
    const ssize_t n = ::read(fd, p, len);
    if (n <= 0) return false;
    p += n;
    len -= static_cast<std::size_t>(n);
  }
  return true;
}
inline bool write_all(int fd, const void* buf, std::size_t len) {
  const auto* p = static_cast<const char*>(buf);
  while (len > 0) {
    const ssize_t n = ::write(fd, p, len);
    if (n <= 0) return false;
    p += n;
    len -= static_cast<std::size_t>(n);
  }
  return true;
}

}  // namespace ferry::ref
