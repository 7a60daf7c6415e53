#include "bench/ferry_bench/processes.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
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

// Forks and execs `argv`; the child gets SIGKILL when this process dies. With `quiet`, its
// stdin, stdout and stderr are /dev/null; else it shares this process's stdout and stderr.
pid_t spawn(const std::vector<std::string>& args, bool quiet) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::signal(SIGPIPE, SIG_DFL);
    int null = ::open("/dev/null", O_RDWR);
    if (null >= 0) {
      ::dup2(null, 0);
      if (quiet) {
        ::dup2(null, 1);
        ::dup2(null, 2);
      }
      if (null > 2) ::close(null);
    }
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  remember(pid);
  return pid;
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "killed by signal " + std::to_string(sig) + " (" + ::strsignal(sig) + ")";
  }
  return "ended (status " + std::to_string(status) + ")";
}

bool accepts(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

std::uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error("socket failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    throw std::runtime_error("cannot bind a free port");
  }
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
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

NatsServerProcess::NatsServerProcess() : port_(free_port()) {
  const std::string port = std::to_string(port_);
  pid_ = spawn({"/usr/sbin/nats-server", "-a", "127.0.0.1", "-p", port}, true);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!accepts(port_)) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      forget(pid_);
      pid_ = -1;
      throw std::runtime_error("nats-server " + describe(status) + " at start (port " + port +
                               "; is /usr/sbin/nats-server installed?)");
    }
    if (std::chrono::steady_clock::now() > until) {
      throw std::runtime_error("nats-server did not come up on 127.0.0.1:" + port + " in 10 s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

NatsServerProcess::~NatsServerProcess() {
  if (pid_ <= 0) return;
  forget(pid_);
  ::kill(pid_, SIGKILL);
  while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
  }
}

std::string NatsServerProcess::url() const { return "nats://127.0.0.1:" + std::to_string(port_); }

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
