#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

namespace ferry::test {

/// A child process (fork + exec) owned by this object: its stdin and stdout are pipes to us,
/// its stderr is ours. The destructor kills it (SIGKILL) if it still runs and reaps it, so a
/// failing test never leaves a process behind; and it dies with this process (PDEATHSIG),
/// should the test itself be killed.
class ChildProcess {
 public:
  /// `env`: "NAME=value" entries added to (or replacing those of) this process's environment.
  explicit ChildProcess(const std::vector<std::string>& argv,
                        const std::vector<std::string>& env = {});
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const noexcept { return pid_; }
  /// Writes `line` and a newline to the child's stdin.
  void send_line(const std::string& line);
  /// The next line of the child's stdout, without its newline. Throws std::runtime_error on
  /// end of file or when none arrives within `timeout`.
  std::string read_line(std::chrono::milliseconds timeout = std::chrono::seconds(30));
  /// Sends `signal` to the child.
  void kill(int signal);
  /// Waits for the child to exit (at most `timeout`, then SIGKILL) and returns its wait status.
  int wait(std::chrono::milliseconds timeout = std::chrono::seconds(10));

 private:
  pid_t pid_ = -1;
  int in_fd_ = -1;   // our end of the child's stdin
  int out_fd_ = -1;  // our end of the child's stdout
  std::string buffered_;
  bool reaped_ = false;
};

/// A command line of the test peer program, with ferry_test_peer's path first.
std::vector<std::string> peer_command(const std::vector<std::string>& args = {});

}  // namespace ferry::test
