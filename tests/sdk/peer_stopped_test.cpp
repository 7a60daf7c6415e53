// Owners that stop (SIGSTOP) while a peer reads from or writes into them, by every method this
// host offers: a stopped process keeps its sockets open and its kernel keeps acknowledging
// (TCP zero-window probes, a Unix socket's buffer taking keepalives), so only silence tells.
// The active side must end PeerLost, naming the owner, within peer_timeout and some slack, or
// complete where the method needs nothing of the owner's process (cma copies from a stopped
// process). Never hang.
#include <gtest/gtest.h>

#include <signal.h>

#include <chrono>
#include <string>
#include <tuple>
#include <vector>

#include <ferry/ferry.hpp>

#include "build_config.hpp"
#include "tests/support/child_process.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"
#if FERRY_HAS_VERBS
#include "tests/support/sim_verbs.hpp"
#include "tests/support/simverbs/simverbs.hpp"
#endif

namespace ferry {
namespace {

using namespace std::chrono_literals;
using test::ChildProcess;
using test::peer_command;

constexpr auto kPeerTimeout = 1s;
// Room for the watchdog's own granularity and a loaded machine.
constexpr auto kSlack = 3s;
// Large enough that no method finishes before the owner is stopped.
const std::size_t kSize = std::size_t{256} << 20;

enum class Way { read, write };

using Param = std::tuple<std::string, Way>;

std::string param_name(const ::testing::TestParamInfo<Param>& p) {
  return std::get<0>(p.param) + (std::get<1>(p.param) == Way::read ? "_Read" : "_Write");
}

class PeerStopped : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    const std::string& method = std::get<0>(GetParam());
    std::vector<std::string> env{"FERRY_TRANSPORTS=" + method};
#if FERRY_HAS_VERBS
    if (method == "verbs") {
      test::use_simulated_verbs();
      env.push_back(std::string(test::kSimVerbsEnv) + "=1");
    }
#else
    if (method == "verbs") GTEST_SKIP() << "this ferry was built without verbs";
#endif
    ConnectorOptions o = test::named("stopper");
    o.transports = {method};
    o.peer_timeout = kPeerTimeout;
    for (const MethodInfo& m : probe_methods(o))
      if (m.method == method && !m.available) GTEST_SKIP() << method << ": " << m.detail;
    us_ = std::make_unique<Connector>(o);
    child_ = std::make_unique<ChildProcess>(peer_command({"frozen-owner"}), env);
  }
  void TearDown() override {
    if (child_) child_->kill(SIGKILL);
  }

  std::unique_ptr<Connector> us_;
  std::unique_ptr<ChildProcess> child_;
};

TEST_P(PeerStopped, TheActiveSideEndsWithinPeerTimeout) {
  const auto& [method, way] = GetParam();
  // Mid-transfer: once the owner has seen the claim, and while our side still runs. A transfer
  // that finished first (seen under ThreadSanitizer, whose owner answered "status" after the
  // whole 256 MiB had moved) says nothing about a stopped owner: another one, three at most.
  Operation op;
  std::vector<std::byte> mem;
  bool running = false;
  for (int attempt = 0; attempt < 3 && !running; ++attempt) {
    child_->send_line(way == Way::read ? "readable " + std::to_string(kSize) + " 5"
                                       : "writable " + std::to_string(kSize));
    const std::string line = child_->read_line(60s);
    ASSERT_EQ(line.rfind("META ", 0), 0u) << line;
    const RdmaMetadata meta = RdmaMetadata::from_json(line.substr(5));
    mem = test::buffer(kSize);
    if (way == Way::read)
      op = us_->begin_read(meta, {Descriptor(mem.data(), kSize)});
    else
      op = us_->begin_write({Descriptor(mem.data(), kSize)}, meta);
    ASSERT_TRUE(test::eventually(
        [&] {
          child_->send_line("status");
          return child_->read_line() == "STATUS in_progress" ||
                 op.status() != OperationStatus::in_progress;
        },
        30s));
    running = op.status() == OperationStatus::in_progress;
    if (!running) {
      try {
        (void)op.wait_for_completion(kSlack);  // let it end before the next one
      } catch (const Error&) {
      }
    }
  }
  ASSERT_TRUE(running) << "three transfers of " << kSize
                       << " bytes ended before the owner could be stopped";
  child_->kill(SIGSTOP);
  const auto stopped = std::chrono::steady_clock::now();
  bool completed = false;
  try {
    completed = op.wait_for_completion(kPeerTimeout + kSlack);
    EXPECT_TRUE(completed)
        << "still " << to_string(op.status()) << " "
        << std::chrono::duration_cast<std::chrono::milliseconds>(kPeerTimeout + kSlack).count()
        << " ms after the owner stopped";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::PeerLost) << e.what();
    EXPECT_NE(std::string(e.what()).find("frozen-owner"), std::string::npos) << e.what();
  }
  const auto took = std::chrono::steady_clock::now() - stopped;
  if (completed && way == Way::write)
    ADD_FAILURE() << method << ": a write completed although its owner was stopped";
  if (completed) {
    EXPECT_EQ(method, "cma") << "only cma reads without the owner's process";
  }
  EXPECT_LT(took, kPeerTimeout + kSlack);
}

INSTANTIATE_TEST_SUITE_P(EveryMethod, PeerStopped,
                         ::testing::Combine(::testing::Values("tcp", "cma", "verbs"),
                                            ::testing::Values(Way::read, Way::write)),
                         param_name);

}  // namespace
}  // namespace ferry
