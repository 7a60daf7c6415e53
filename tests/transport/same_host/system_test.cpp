// transport/same_host/system.hpp: what the same-host methods need of the kernel.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "transport/same_host/system.hpp"

namespace ferry::transport::same_host {
namespace {

using namespace std::chrono_literals;

TEST(System, AStoppedProcessIsSeenStoppedAndARunningOneNot) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    for (;;) ::pause();
  }
  EXPECT_FALSE(process_stopped(child));
  ::kill(child, SIGSTOP);
  bool stopped = false;
  for (int i = 0; i < 200 && !stopped; ++i) {
    std::this_thread::sleep_for(5ms);
    stopped = process_stopped(child);
  }
  EXPECT_TRUE(stopped);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  EXPECT_FALSE(process_stopped(::getpid()));
}

// The reason Yama's scope gives, or "" when it lets peers in.
std::string yama_text(int scope, bool ptracer_any) {
  const std::optional<Error> why = yama_reason(scope, ptracer_any);
  if (!why) return {};
  EXPECT_EQ(why->code(), ErrorCode::Unsupported) << why->what();
  return why->message();
}

TEST(Yama, EachScopeSaysWhatItMeansForPeers) {
  EXPECT_EQ(yama_text(-1, false), "");
  EXPECT_EQ(yama_text(0, false), "");
  EXPECT_NE(yama_text(1, false).find("ptracer_any"), std::string::npos);
  EXPECT_EQ(yama_text(1, true), "");
  EXPECT_NE(yama_text(2, false).find("CAP_SYS_PTRACE"), std::string::npos);
  EXPECT_NE(yama_text(2, true).find("CAP_SYS_PTRACE"), std::string::npos);
  EXPECT_NE(yama_text(3, true).find("no process"), std::string::npos);
}

TEST(System, ThisProcessHasAScopeAndMayOfferCmaHere) {
  const ProcessScope self = this_process();
  EXPECT_EQ(self.boot_id.size(), 36u) << self.boot_id;
  EXPECT_NE(self.pid_ns, 0u);
  EXPECT_EQ(self.pid, ::getpid());
  // This machine has no Yama (or scope 0) and no seccomp filter: the same-host method must be
  // on offer. Elsewhere the reason is printed.
  const std::optional<Error> why = unavailable_reason(false);
  if (yama_ptrace_scope() > 0) GTEST_SKIP() << (why ? why->message() : "Yama's scope is above 0");
  EXPECT_FALSE(why) << why->what();
}

TEST(System, AProcessThatIsGoneCannotBePinnedAndItsFdsCannotBeTaken) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  // Reaped: no process has that pid (until it is reused, which takes a while).
  try {
    const int fd = open_pidfd(child);
    if (fd < 0) GTEST_SKIP() << "this kernel has no pidfd_open";
    ::close(fd);
    ADD_FAILURE() << "pinned a process that is gone";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::PeerLost) << e.what();
    EXPECT_NE(e.message().find("ESRCH"), std::string::npos) << e.what();
  }
  try {
    const int fd = fetch_fd(-1, child, 0);
    ::close(fd);
    ADD_FAILURE() << "took an fd of a process that is gone";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
    EXPECT_NE(e.message().find("/proc/" + std::to_string(child) + "/fd/0"), std::string::npos)
        << e.what();
  }
}

TEST(System, CopyGoesOnAfterAPartialCopyAndNamesTheFault) {
  std::vector<char> src(8192, 'x');
  std::vector<char> dst(8192, 0);
  iovec local[2] = {{dst.data(), 4096}, {dst.data() + 4096, 4096}};
  iovec remote[2] = {{src.data(), 4096}, {nullptr, 4096}};  // the second piece is unmapped
  std::uint64_t moved = 0;
  EXPECT_EQ(copy(::getpid(), Access::read, local, remote, 2, moved), EFAULT);
  EXPECT_EQ(moved, 4096u);
  EXPECT_EQ(dst[0], 'x');
  EXPECT_EQ(dst[4096], 0);
}

}  // namespace
}  // namespace ferry::transport::same_host
