#pragma once

// What the same-host transport needs of the kernel: which process and namespace this is, whether
// Yama lets peers read this process, and the system calls themselves. Any thread.

#include <sys/uio.h>

#include <cstdint>
#include <optional>
#include <string>

#include <ferry/options.hpp>

#include "transport/transport.hpp"

namespace ferry::transport::same_host {

/// Where a process lives: two processes may copy between each other with process_vm_* only
/// when both values match (the same boot of the same kernel, and pids that mean the same).
struct ProcessScope {
  std::string boot_id;       ///< /proc/sys/kernel/random/boot_id
  std::uint64_t pid_ns = 0;  ///< the inode of /proc/self/ns/pid
  /// The inode of /proc/self/ns/net (0: unknown). An abstract Unix socket lives in its
  /// network namespace: another one's owner cannot be reached by a same-host method.
  std::uint64_t net_ns = 0;
  std::int64_t pid = 0;
};

/// This process's scope (read once; the pid is read each time, for forked children).
ProcessScope this_process();

/// /proc/sys/kernel/yama/ptrace_scope: 0 to 3, or -1 when Yama is not there.
int yama_ptrace_scope();

/// Why peers cannot copy from or into this process with process_vm_* (Unsupported): the
/// system call refused even on ourselves (seccomp, no kernel support), or Yama's ptrace scope;
/// none when they can. `ptracer_any`: scope 1 is acceptable because the caller will call
/// allow_any_ptracer().
std::optional<Error> unavailable_reason(bool ptracer_any);

/// Why Yama's ptrace scope `scope` (-1: no Yama) keeps peers from reading this process
/// (Unsupported); none when they may.
std::optional<Error> yama_reason(int scope, bool ptracer_any);

/// CmaOptions::ptracer_any, or FERRY_CMA_PTRACER_ANY=1 where the environment is read: whether
/// a same-host method lets any process of the same user in under Yama scope 1.
bool ptracer_any(const ConnectorOptions& options);

/// prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY): under Yama scope 1, any process of the same user
/// may then read this one. Throws Error(Unsupported) naming errno when the kernel refuses.
void allow_any_ptracer();

/// pidfd_open: a descriptor that pins process `pid` (its pid cannot mean another process while
/// the descriptor is open), for the caller to close. -1 when this kernel has no pidfd_open: the
/// caller goes on without one. Throws Error(PeerLost) when there is no such process,
/// Error(Unsupported) when the kernel refuses, naming errno.
int open_pidfd(std::int64_t pid);
/// A copy of process `pid`'s descriptor `fd` in this process, for the caller to close: by
/// pidfd_getfd through `pidfd`, or, without it (no pidfd, or an older kernel), by opening
/// /proc/<pid>/fd/<fd> (the same permission check: ptrace read access). Throws
/// Error(Unsupported) naming the call and errno when it is refused.
int fetch_fd(int pidfd, std::int64_t pid, int fd);
/// Closes a descriptor that open_pidfd or fetch_fd returned, by the raw system call as it was
/// made: a sanitizer that intercepts close() but never saw the descriptor made (pidfd_open and
/// pidfd_getfd are raw calls) would take an older descriptor of the same number, closed on
/// another thread, for this one. Nothing for a negative `fd`.
void close_fetched(int fd) noexcept;
/// Whether the process behind `pidfd` has exited (false when pidfd < 0: unknown).
bool process_exited(int pidfd) noexcept;

/// Whether every thread of process `pid` is stopped (SIGSTOP, a debugger): none of them is
/// then inside a system call such as a copy. False when unknown.
bool process_stopped(std::int64_t pid) noexcept;

/// Copies with process_vm_readv (read: remote -> local) or process_vm_writev (write), going on
/// after partial copies, at most IOV_MAX pieces a call. `local[i]` and `remote[i]` have equal
/// lengths. Returns 0, or the errno
/// of the call that failed; `moved` counts the bytes copied before that.
int copy(std::int64_t pid, Access access, iovec* local, iovec* remote, std::size_t count,
         std::uint64_t& moved) noexcept;

/// "EPERM (Operation not permitted)" and the like.
std::string errno_text(int err);

}  // namespace ferry::transport::same_host
