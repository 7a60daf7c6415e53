// transport/same_host/system.hpp: what the same-host methods need of the kernel.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
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

TEST(Yama, EachScopeSaysWhatItMeansForPeers) {
  EXPECT_EQ(yama_reason(-1, false), "");
  EXPECT_EQ(yama_reason(0, false), "");
  EXPECT_NE(yama_reason(1, false).find("ptracer_any"), std::string::npos);
  EXPECT_EQ(yama_reason(1, true), "");
  EXPECT_NE(yama_reason(2, false).find("CAP_SYS_PTRACE"), std::string::npos);
  EXPECT_NE(yama_reason(2, true).find("CAP_SYS_PTRACE"), std::string::npos);
  EXPECT_NE(yama_reason(3, true).find("no process"), std::string::npos);
}

TEST(System, ThisProcessHasAScopeAndMayOfferCmaHere) {
  const ProcessScope self = this_process();
  EXPECT_EQ(self.boot_id.size(), 36u) << self.boot_id;
  EXPECT_NE(self.pid_ns, 0u);
  EXPECT_EQ(self.pid, ::getpid());
  // This machine has no Yama (or scope 0) and no seccomp filter: the same-host method must be
  // on offer. Elsewhere the reason is printed.
  if (yama_ptrace_scope() > 0) GTEST_SKIP() << unavailable_reason(false);
  EXPECT_EQ(unavailable_reason(false), "");
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
