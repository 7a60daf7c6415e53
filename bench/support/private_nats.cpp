#include "bench/support/private_nats.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace ferry::bench_support {

namespace {

using Clock = std::chrono::steady_clock;

sockaddr_in loopback(std::uint16_t port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return addr;
}

}  // namespace

bool accepts(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr = loopback(port);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

std::uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error("socket failed");
  sockaddr_in addr = loopback(0);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    throw std::runtime_error("cannot bind a free port");
  }
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

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

PrivateNatsServer::PrivateNatsServer() : PrivateNatsServer(Options{}) {}

PrivateNatsServer::PrivateNatsServer(Options options) : options_(options), port_(free_port()) {
  const std::string port = std::to_string(port_);
  pid_ = spawn({"/usr/sbin/nats-server", "-a", "127.0.0.1", "-p", port}, true);
  if (options_.on_start != nullptr) options_.on_start(pid_);
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (!accepts(port_)) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      if (options_.on_stop != nullptr) options_.on_stop(pid_);
      pid_ = -1;
      throw std::runtime_error("nats-server " + describe(status) + " at start (port " + port +
                               "; is /usr/sbin/nats-server installed?)");
    }
    if (Clock::now() > until) {
      stop();
      throw std::runtime_error("nats-server did not come up on 127.0.0.1:" + port + " in 10 s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

PrivateNatsServer::~PrivateNatsServer() { stop(); }

std::string PrivateNatsServer::url() const { return "nats://127.0.0.1:" + std::to_string(port_); }

void PrivateNatsServer::stop() {
  if (pid_ <= 0) return;
  if (options_.on_stop != nullptr) options_.on_stop(pid_);
  if (options_.stop_grace.count() > 0) {
    ::kill(pid_, SIGTERM);
    const auto until = Clock::now() + options_.stop_grace;
    for (;;) {
      const pid_t reaped = ::waitpid(pid_, nullptr, WNOHANG);
      if (reaped == pid_ || (reaped < 0 && errno != EINTR)) {
        pid_ = -1;
        return;
      }
      if (Clock::now() > until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  ::kill(pid_, SIGKILL);
  while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
}

}  // namespace ferry::bench_support
