#pragma once

// The processes `--role both` starts: a private nats-server and the target (this program
// again, `--role target`). Both die with this process however it ends: SIGKILL from the
// kernel when it dies (PR_SET_PDEATHSIG), SIGKILL from the handler of SIGINT, SIGTERM and
// SIGHUP, or stopped in order at the end.

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bench/support/private_nats.hpp"

namespace ferry_bench {

namespace bench_support = ferry::bench_support;

/// Installs the handler that kills every child started here on SIGINT, SIGTERM and SIGHUP
/// and then dies of the same signal. Ignores SIGPIPE.
void install_signal_handlers();

/// The path of this program (/proc/self/exe).
std::string self_path();

/// Runs `argv` (its output shared with this process's), waits up to `limit`, killing it past
/// that. Returns its exit status, or -1 when it did not exit normally.
int run_command(const std::vector<std::string>& argv, std::chrono::seconds limit);

/// A private nats-server on a free 127.0.0.1 port (bench/support/private_nats.hpp), killed
/// by the signal handler too; SIGKILLed and reaped by the destructor.
class NatsServerProcess : public bench_support::PrivateNatsServer {
 public:
  /// Throws std::runtime_error when it does not accept connections within 10 s.
  NatsServerProcess();
};

/// A child process watched by a thread: when it exits before stop() asked it to,
/// `on_unexpected_exit` is called (on the watching thread) with a description.
class ChildProcess {
 public:
  ChildProcess(const std::vector<std::string>& argv,
               std::function<void(const std::string&)> on_unexpected_exit);
  /// Kills it (SIGKILL) if it still runs, and reaps it.
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  /// Whether it has exited, and how ("exited with status 1", "killed by signal 9 (Killed)").
  bool exited(std::string* how = nullptr) const;
  /// Lets it exit by itself within `grace`, then SIGKILLs it; returns how it ended.
  std::string stop(std::chrono::milliseconds grace);

 private:
  pid_t pid_ = -1;
  std::function<void(const std::string&)> on_unexpected_exit_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool exited_ = false;
  std::string how_;
  std::thread watcher_;
};

}  // namespace ferry_bench
