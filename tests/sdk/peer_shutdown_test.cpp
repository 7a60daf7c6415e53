// A peer's connector destroyed in the middle of a transfer: the operation on this side ends
// Cancelled, naming the peer, every time (docs/api.md). The peer cancelled its operation and
// said so before it closed; what the closing socket does next (a reset, a broken pipe) must
// not win the race against what the peer said.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include <ferry/ferry.hpp>

#include "build_config.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"
#if FERRY_HAS_VERBS
#include "tests/support/sim_verbs.hpp"
#endif

namespace ferry {
namespace {

using namespace std::chrono_literals;

constexpr std::size_t kSize = std::size_t{256} << 20;
constexpr int kRounds = 12;

class PeerShutdown : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
#if FERRY_HAS_VERBS
    if (GetParam() == "verbs") test::use_simulated_verbs();
#else
    if (GetParam() == "verbs") GTEST_SKIP() << "this ferry was built without verbs";
#endif
    for (const MethodInfo& m : probe_methods(options("probe")))
      if (m.method == GetParam() && !m.available) GTEST_SKIP() << GetParam() << ": " << m.detail;
  }
  ConnectorOptions options(const std::string& name) const {
    ConnectorOptions o = test::named(name);
    o.transports = {GetParam()};
    o.use_environment = false;
    o.nats.use_environment = false;
    return o;
  }
};

TEST_P(PeerShutdown, AReaderClosedMidTransferLeavesOurReadableCancelled) {
  Connector owner(options("owner"));
  auto src = test::buffer(kSize);
  auto dst = test::buffer(kSize);
  int finished = 0;
  for (int round = 0; round < kRounds; ++round) {
    auto readable = owner.create_readable(src);
    auto reader = std::make_unique<Connector>(options("reader"));
    auto read = reader->begin_read(readable.metadata(), dst);
    ASSERT_TRUE(
        test::eventually([&] { return readable.status() != OperationStatus::initialized; }, 10s));
    reader.reset();  // cancels the read, tells us, closes
    try {
      (void)readable.wait_for_completion(10s);
      // The read may have ended before the close: nothing to race then.
      ++finished;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Cancelled) << "round " << round << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find("reader"), std::string::npos) << e.what();
    }
  }
  EXPECT_LT(finished, kRounds) << "every read finished before its connector closed";
}

INSTANTIATE_TEST_SUITE_P(EveryMethod, PeerShutdown, ::testing::Values("tcp", "cma", "verbs"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace ferry
