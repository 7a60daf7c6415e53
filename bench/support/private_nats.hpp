#pragma once

// What the benchmark programs share to run a private nats-server: a free 127.0.0.1 port, a
// child process that dies with this one, and the server itself, started on that port, waited
// for until it accepts connections, and stopped.

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry::bench_support {

/// Whether something accepts TCP connections on 127.0.0.1:`port`.
bool accepts(std::uint16_t port);

/// A port on 127.0.0.1 that was free a moment ago (bound to port 0, then closed). Throws
/// std::runtime_error when no socket can be bound.
std::uint16_t free_port();

/// Forks and execs `args` (args[0] a path). The child gets SIGKILL when the thread that
/// started it ends (PR_SET_PDEATHSIG), SIGPIPE at its default, and /dev/null for stdin; with
/// `quiet` for stdout and stderr too, else it shares this process's. Throws std::runtime_error
/// when fork fails; an exec that fails makes the child exit with status 127.
pid_t spawn(const std::vector<std::string>& args, bool quiet);

/// How a child ended, from its wait status: "exited with status 1", "killed by signal 9
/// (Killed)".
std::string describe(int status);

/// /usr/sbin/nats-server on a free 127.0.0.1 port, its output to /dev/null. Started by the
/// constructor, which returns once it accepts connections; stopped and reaped by stop() or
/// the destructor.
class PrivateNatsServer {
 public:
  struct Options {
    /// How long stop() lets it end after SIGTERM before SIGKILL; zero: SIGKILL at once.
    std::chrono::milliseconds stop_grace{0};
    /// Called with its pid once it is started, and before it is killed or reaped (ferry-bench
    /// keeps the children its signal handler kills).
    void (*on_start)(pid_t) = nullptr;
    void (*on_stop)(pid_t) = nullptr;
  };

  /// Throws std::runtime_error when it exits at start or does not accept connections within
  /// 10 s (then it is stopped).
  PrivateNatsServer();
  explicit PrivateNatsServer(Options options);
  ~PrivateNatsServer();
  PrivateNatsServer(const PrivateNatsServer&) = delete;
  PrivateNatsServer& operator=(const PrivateNatsServer&) = delete;

  std::string url() const;
  std::uint16_t port() const { return port_; }

  /// Stops it if it still runs, and reaps it.
  void stop();

 private:
  Options options_;
  std::uint16_t port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace ferry::bench_support
