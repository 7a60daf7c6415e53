#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace ferry::test {

/// What one run of ferry-info printed, and how it exited.
struct ToolRun {
  int exit_code = -1;  ///< -1: killed by a signal, or by the time limit
  std::string out;
  std::string err;
};

/// Runs the program at `path` with `args`, in this process's environment less the variables
/// that steer ferry's tools (FERRY_NATS_*, FERRY_TRANSPORTS), plus `env` ("NAME=value"). Kills
/// it after `limit`.
inline ToolRun run_tool(const std::string& path, const std::vector<std::string>& args,
                        const std::vector<std::string>& env = {},
                        std::chrono::milliseconds limit = std::chrono::seconds(30)) {
  std::vector<std::string> argv{path};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> argp;
  for (auto& a : argv) argp.push_back(a.data());
  argp.push_back(nullptr);
  // Built before fork: between fork and exec only async-signal-safe calls.
  std::vector<std::string> entries;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry = *e;
    if (entry.rfind("FERRY_NATS_", 0) != 0 && entry.rfind("FERRY_TRANSPORTS=", 0) != 0)
      entries.push_back(entry);
  }
  entries.insert(entries.end(), env.begin(), env.end());
  std::vector<char*> envp;
  for (auto& e : entries) envp.push_back(e.data());
  envp.push_back(nullptr);

  int out_pipe[2];
  int err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0)
    throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    dup2(out_pipe[1], STDOUT_FILENO);
    dup2(err_pipe[1], STDERR_FILENO);
    execve(argp[0], argp.data(), envp.data());
    _exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);

  ToolRun run;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&run.out, &run.err};
  auto deadline = std::chrono::steady_clock::now() + limit;
  int open = 2;
  while (open > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      ::kill(pid, SIGKILL);
      break;
    }
    if (::poll(fds, 2, static_cast<int>(left.count())) < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buf[65536];
      ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n > 0) {
        sinks[i]->append(buf, static_cast<std::size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open;
      }
    }
  }
  for (const pollfd& p : fds)
    if (p.fd >= 0) ::close(p.fd);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) run.exit_code = WEXITSTATUS(status);
  return run;
}

#ifdef FERRY_INFO_PATH
/// run_tool() for ferry-info (FERRY_INFO_PATH).
inline ToolRun run_ferry_info(const std::vector<std::string>& args,
                              const std::vector<std::string>& env = {},
                              std::chrono::milliseconds limit = std::chrono::seconds(30)) {
  return run_tool(FERRY_INFO_PATH, args, env, limit);
}
#endif

}  // namespace ferry::test
