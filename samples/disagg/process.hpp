#pragma once

// Child processes for the "all" role: started with fork/exec, told to die with their parent
// (so a killed supervisor leaves nothing behind), stopped with SIGTERM, then SIGKILL.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace disagg {

class Child {
 public:
  /// `watch_ready`: the child's stdout is a pipe, read by wait_ready().
  explicit Child(const std::vector<std::string>& argv, bool watch_ready = false) {
    int fds[2] = {-1, -1};
    if (watch_ready && pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    const pid_t parent = ::getpid();
    pid_ = fork();
    if (pid_ < 0) throw std::runtime_error("fork");
    if (pid_ == 0) {
      // Die with the supervisor, even if it is killed outright; and keep out of its process
      // group, so that a Ctrl-C reaches the supervisor alone, which stops everyone in order.
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) _exit(1);
      setpgid(0, 0);
      if (watch_ready) dup2(fds[1], STDOUT_FILENO);
      execv(args[0], args.data());
      _exit(127);
    }
    if (watch_ready) {
      ::close(fds[1]);
      out_ = fds[0];
    }
  }
  ~Child() { stop(); }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  /// Waits for a line starting with "ready" on the child's stdout.
  bool wait_ready(std::chrono::milliseconds limit) {
    auto until = std::chrono::steady_clock::now() + limit;
    std::string seen;
    while (seen.find("ready") == std::string::npos) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          until - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{out_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char buf[256];
      ssize_t n = ::read(out_, buf, sizeof buf);
      if (n <= 0) return false;
      seen.append(buf, static_cast<std::size_t>(n));
    }
    return true;
  }

  /// Asks it to stop (SIGTERM) without waiting; stop() waits.
  void terminate() {
    if (pid_ > 0) ::kill(pid_, SIGTERM);
  }

  /// SIGTERM, up to 5 s for it to exit, then SIGKILL; always reaps.
  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    int status = 0;
    while (waitpid(pid_, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > until) {
        ::kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    pid_ = -1;
    if (out_ >= 0) ::close(out_);
    out_ = -1;
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
};

inline std::uint16_t free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

inline bool wait_for_port(std::uint16_t port, std::chrono::milliseconds limit) {
  auto until = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < until) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    if (ok) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

}  // namespace disagg
