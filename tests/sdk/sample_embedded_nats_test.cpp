// samples/embedded_nats (ferry-embedded-nats), run as a program against a private nats-server:
// the decode worker on its own libuv loop, orchestrated over the connector's NATS connection,
// and the peer that writes the blocks it is told to.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <stdexcept>
#include <string>

#include "tests/support/child_process.hpp"
#include "tests/support/nats_server.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;

// Exit status 0 only when every request was verified on both sides and the worker's loop
// closed with nothing left open.
void expect_run_passes(const std::string& transports) {
  test::NatsServer server;
  test::ChildProcess sample({FERRY_EMBEDDED_NATS_PATH},
                            {"FERRY_NATS_URL=" + server.url(), "FERRY_TRANSPORTS=" + transports});
  const int status = sample.wait(60s);
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(SampleEmbeddedNats, EveryRequestIsVerifiedOverTcp) { expect_run_passes("tcp"); }

TEST(SampleEmbeddedNats, EveryRequestIsVerifiedByTheBestMethod) { expect_run_passes(""); }

TEST(SampleEmbeddedNats, WithoutANatsServerItSaysWhatIsMissing) {
  // Its stderr into the pipe we read.
  test::ChildProcess sample({"/bin/sh", "-c", "exec \"$0\" 2>&1", FERRY_EMBEDDED_NATS_PATH},
                            {"FERRY_NATS_URL="});
  bool said = false;
  try {
    for (int i = 0; i < 10 && !said; ++i)
      said = sample.read_line(10s).find("no NATS server: set FERRY_NATS_URL") != std::string::npos;
  } catch (const std::runtime_error&) {
    // end of its output
  }
  EXPECT_TRUE(said);
  const int status = sample.wait(30s);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
}

}  // namespace
}  // namespace ferry
