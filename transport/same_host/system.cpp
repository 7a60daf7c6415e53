#include "transport/same_host/system.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>

namespace ferry::transport::same_host {

namespace {

std::string read_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return {};
  return line;
}

}  // namespace

std::string errno_text(int err) {
  const char* name = strerrorname_np(err);
  return std::string(name != nullptr ? name : "errno " + std::to_string(err)) + " (" +
         std::strerror(err) + ")";
}

ProcessScope this_process() {
  static const ProcessScope fixed = [] {
    ProcessScope s;
    s.boot_id = read_line("/proc/sys/kernel/random/boot_id");
    struct stat st {};
    if (::stat("/proc/self/ns/pid", &st) == 0) s.pid_ns = st.st_ino;
    if (::stat("/proc/self/ns/net", &st) == 0) s.net_ns = st.st_ino;
    return s;
  }();
  ProcessScope s = fixed;
  s.pid = ::getpid();
  return s;
}

int yama_ptrace_scope() {
  const std::string v = read_line("/proc/sys/kernel/yama/ptrace_scope");
  if (v.size() != 1 || v[0] < '0' || v[0] > '3') return -1;
  return v[0] - '0';
}

std::optional<Error> unavailable_reason(bool ptracer_any) {
  const ProcessScope self = this_process();
  if (self.boot_id.empty() || self.pid_ns == 0)
    return Error(ErrorCode::Unsupported,
                 "cannot tell which host and PID namespace this is "
                 "(/proc/sys/kernel/random/boot_id or /proc/self/ns/pid unreadable)");
  // The system call on ourselves: refused only by seccomp, or missing from the kernel.
  static const char probe[8] = "ferry";
  char out[8] = {};
  iovec local{out, sizeof out};
  iovec remote{const_cast<char*>(probe), sizeof probe};
  if (::process_vm_readv(::getpid(), &local, 1, &remote, 1, 0) != sizeof probe) {
    const int err = errno;
    if (err == ENOSYS) return Error(ErrorCode::Unsupported, "this kernel has no process_vm_readv");
    return Error(ErrorCode::Unsupported,
                 "process_vm_readv is refused even on this process (" + errno_text(err) +
                     "): a seccomp filter, as a container without CAP_SYS_PTRACE has");
  }
  return yama_reason(yama_ptrace_scope(), ptracer_any);
}

std::optional<Error> yama_reason(int scope, bool ptracer_any) {
  switch (scope) {
    case 1:
      if (ptracer_any) return std::nullopt;
      return Error(ErrorCode::Unsupported,
                   "kernel.yama.ptrace_scope is 1: only this process's ancestors may read its "
                   "memory, so peers cannot; set the sysctl to 0, or CmaOptions::ptracer_any "
                   "(FERRY_CMA_PTRACER_ANY=1) to let processes of the same user in");
    case 2:
      return Error(ErrorCode::Unsupported,
                   "kernel.yama.ptrace_scope is 2: only processes with CAP_SYS_PTRACE may read "
                   "another's memory");
    case 3:
      return Error(ErrorCode::Unsupported,
                   "kernel.yama.ptrace_scope is 3: no process may read another's memory");
    default:
      return std::nullopt;
  }
}

bool ptracer_any(const ConnectorOptions& o) {
  if (o.cma.ptracer_any) return true;
  if (!o.use_environment) return false;
  const char* v = std::getenv("FERRY_CMA_PTRACER_ANY");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

void allow_any_ptracer() {
  if (::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0)
    throw Error(ErrorCode::Unsupported, "prctl(PR_SET_PTRACER_ANY): " + errno_text(errno));
}

int open_pidfd(std::int64_t pid) {
#ifdef SYS_pidfd_open
  const int fd = static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
  if (fd >= 0) return fd;
  const int err = errno;
  if (err == ENOSYS) return -1;
  Error error(err == ESRCH ? ErrorCode::PeerLost : ErrorCode::Unsupported,
              "pidfd_open of process " + std::to_string(pid) + ": " + errno_text(err));
  if (err == ESRCH) error.set_retryable(false);  // the process is gone
  throw error;
#else
  (void)pid;
  return -1;
#endif
}

int fetch_fd(int pidfd, std::int64_t pid, int fd) {
#ifdef SYS_pidfd_getfd
  if (pidfd >= 0) {
    const int got = static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd, fd, 0));
    if (got >= 0) return got;
    const int err = errno;
    if (err != ENOSYS)
      throw Error(ErrorCode::Unsupported, "pidfd_getfd of fd " + std::to_string(fd) +
                                              " of process " + std::to_string(pid) + ": " +
                                              errno_text(err));
  }
#endif
  // Older kernels: the same permission check (ptrace read access) through /proc.
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int got = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (got < 0) throw Error(ErrorCode::Unsupported, "opening " + path + ": " + errno_text(errno));
  return got;
}

void close_fetched(int fd) noexcept {
  if (fd >= 0) ::syscall(SYS_close, fd);
}

bool process_exited(int pidfd) noexcept {
  if (pidfd < 0) return false;
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP)) != 0;
}

bool process_stopped(std::int64_t pid) noexcept {
  try {
    const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
    DIR* dir = ::opendir(tasks.c_str());
    if (dir == nullptr) return false;
    bool all = true;
    int seen = 0;
    while (dirent* e = ::readdir(dir)) {
      if (e->d_name[0] == '.') continue;
      const std::string line = read_line((tasks + "/" + e->d_name + "/stat").c_str());
      // "tid (comm) S ...": the state follows the last ')', since comm may hold any byte.
      const auto close = line.rfind(')');
      const char state =
          close != std::string::npos && close + 2 < line.size() ? line[close + 2] : '?';
      ++seen;
      if (state != 'T' && state != 't') {
        all = false;
        break;
      }
    }
    ::closedir(dir);
    return all && seen > 0;
  } catch (...) {
    return false;
  }
}

int copy(std::int64_t pid, Access access, iovec* local, iovec* remote, std::size_t count,
         std::uint64_t& moved) noexcept {
  std::size_t first = 0;
  while (first < count) {
    // At most IOV_MAX pieces a call (EINVAL beyond).
    const auto n = static_cast<unsigned long>(std::min<std::size_t>(count - first, IOV_MAX));
    const ssize_t got =
        access == Access::read
            ? ::process_vm_readv(static_cast<pid_t>(pid), local + first, n, remote + first, n, 0)
            : ::process_vm_writev(static_cast<pid_t>(pid), local + first, n, remote + first, n, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (got == 0) return EFAULT;
    moved += static_cast<std::uint64_t>(got);
    // A partial copy stops at the first piece that failed; go on from there (it fails again,
    // with its own errno, if it is really bad).
    auto left = static_cast<std::size_t>(got);
    while (left > 0 && first < count) {
      const std::size_t take = std::min(left, local[first].iov_len);
      local[first].iov_base = static_cast<char*>(local[first].iov_base) + take;
      local[first].iov_len -= take;
      remote[first].iov_base = static_cast<char*>(remote[first].iov_base) + take;
      remote[first].iov_len -= take;
      left -= take;
      if (local[first].iov_len == 0) ++first;
    }
  }
  return 0;
}

}  // namespace ferry::transport::same_host
