#include "bench/ferry_bench/processes.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>

namespace ferry_bench {

namespace {

// The children to kill from a signal handler: lock-free atomics only.
std::array<std::atomic<pid_t>, 4> g_children{};

void remember(pid_t pid) {
  for (auto& slot : g_children) {
    pid_t empty = 0;
    if (slot.compare_exchange_strong(empty, pid)) return;
  }
}

void forget(pid_t pid) {
  for (auto& slot : g_children) {
    pid_t expected = pid;
    slot.compare_exchange_strong(expected, 0);
  }
}

extern "C" void on_fatal_signal(int sig) {
  for (auto& slot : g_children) {
    const pid_t pid = slot.load();
    if (pid > 0) ::kill(pid, SIGKILL);
  }
  // Reaped here, so that none is left even as a zombie when this process is gone.
  for (auto& slot : g_children) {
    const pid_t pid = slot.exchange(0);
    if (pid > 0) ::waitpid(pid, nullptr, 0);
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// bench_support::spawn, the child remembered for the signal handler.
pid_t spawn(const std::vector<std::string>& args, bool quiet) {
  const pid_t pid = bench_support::spawn(args, quiet);
  remember(pid);
  return pid;
}

using bench_support::describe;

// Keeps the server among the children the signal handler kills.
bench_support::PrivateNatsServer::Options killed_on_signal() {
  bench_support::PrivateNatsServer::Options options;
  options.on_start = remember;
  options.on_stop = forget;
  return options;
}

}  // namespace

void install_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_fatal_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
}

std::string self_path() {
  std::string path(4096, '\0');
  const ssize_t n = ::readlink("/proc/self/exe", path.data(), path.size() - 1);
  if (n <= 0) throw std::runtime_error("cannot read /proc/self/exe");
  path.resize(static_cast<std::size_t>(n));
  return path;
}

int run_command(const std::vector<std::string>& argv, std::chrono::seconds limit) {
  const pid_t pid = spawn(argv, false);
  const auto until = std::chrono::steady_clock::now() + limit;
  // Waits without reaping, so that the pid leaves the signal handler's list while it still
  // names this child.
  for (;;) {
    siginfo_t info{};
    const int rc = ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT);
    if (rc == 0 && info.si_pid == pid) break;
    if (rc < 0 && errno != EINTR) break;
    if (std::chrono::steady_clock::now() > until) {
      ::kill(pid, SIGKILL);
      while (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT) < 0 &&
             errno == EINTR) {
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  forget(pid);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

NatsServerProcess::NatsServerProcess() : PrivateNatsServer(killed_on_signal()) {}

ChildProcess::ChildProcess(const std::vector<std::string>& argv,
                           std::function<void(const std::string&)> on_unexpected_exit)
    : on_unexpected_exit_(std::move(on_unexpected_exit)) {
  pid_ = spawn(argv, false);
  watcher_ = std::thread([this] {
    // Wait without reaping first, so that the pid leaves the signal handler's list while it
    // still names this child (a reaped pid may be reused).
    siginfo_t info{};
    while (::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOWAIT) < 0 &&
           errno == EINTR) {
    }
    // Reaped under the lock: stop() kills only while exited_ is false, when the pid is
    // still this child's (a zombie at worst).
    bool unexpected = false;
    std::string how;
    {
      std::lock_guard lock(mu_);
      forget(pid_);
      int status = 0;
      while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
      how = describe(status);
      exited_ = true;
      how_ = how;
      unexpected = !stopping_;
    }
    cv_.notify_all();
    if (unexpected && on_unexpected_exit_) on_unexpected_exit_(how);
  });
}

ChildProcess::~ChildProcess() {
  if (watcher_.joinable()) {
    stop(std::chrono::milliseconds(0));
    watcher_.join();
  }
}

bool ChildProcess::exited(std::string* how) const {
  std::lock_guard lock(mu_);
  if (exited_ && how != nullptr) *how = how_;
  return exited_;
}

std::string ChildProcess::stop(std::chrono::milliseconds grace) {
  std::unique_lock lock(mu_);
  stopping_ = true;
  if (!cv_.wait_for(lock, grace, [&] { return exited_; })) {
    ::kill(pid_, SIGKILL);
    cv_.wait(lock, [&] { return exited_; });
  }
  return how_;
}

}  // namespace ferry_bench
