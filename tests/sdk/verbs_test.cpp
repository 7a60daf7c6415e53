// The RDMA method (verbs) through the SDK, between two processes, on the simulated fabric
// (tests/support/simverbs/: there is no RDMA NIC on the machines that run these tests):
// chosen above cma and tcp; all four pairings from 1 byte to 256 MiB, in scatter/gather
// lists whose pieces outnumber the device's max_sge, in regions above its max_mr_size and
// transfers above its max_msg_sz; an owner killed mid-read; what probe_methods says without
// the simulation.
#include <gtest/gtest.h>

#include <signal.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include <ferry/ferry.hpp>

#include "sdk/src/transport_registry.hpp"
#include "tests/support/child_process.hpp"
#include "tests/support/exchange.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/scattered.hpp"
#include "tests/support/sim_verbs.hpp"
#include "tests/support/simverbs/simverbs.hpp"
#include "tests/support/util.hpp"

namespace ferry {

namespace test {
inline void PrintTo(Side side, std::ostream* os) { *os << side_name(side); }
}  // namespace test

namespace {

using namespace std::chrono_literals;
using test::ChildProcess;
using test::eventually;
using test::expect_prefix;
using test::Scattered;
using test::Side;

constexpr std::size_t kMiB = std::size_t{1} << 20;

ConnectorOptions options(std::string name) {
  ConnectorOptions o = test::named(std::move(name));
  o.transports = {"tcp", "verbs"};
  o.nats.use_environment = false;
  return o;
}

/// Every test here runs on the fabric with the default limits (max_sge 4, max_msg_sz 1 MiB,
/// max_mr_size 64 MiB), its children too.
class Verbs : public ::testing::Test {
 protected:
  void SetUp() override { test::use_simulated_verbs(); }
  void TearDown() override { detail::remove_method("verbs"); }
  /// A peer on the same fabric; `rate_mbps`: its NIC sends no faster.
  static ChildProcess child(const std::string& name, std::uint64_t rate_mbps = 0) {
    auto config = test::simverbs::current_config();
    config.rate_mbps = rate_mbps;
    return ChildProcess(
        test::peer_command({name}),
        {std::string(test::kSimVerbsEnv) + "=1",
         "FERRY_SIMVERBS=" + test::simverbs::to_string(config), "FERRY_TRANSPORTS=tcp,verbs"});
  }
};

class VerbsBetweenProcesses : public Verbs, public ::testing::WithParamInterface<Side> {};

TEST_P(VerbsBetweenProcesses, MovesScatterGatherListsOfEverySize) {
  Connector us(options("parent"));
  ChildProcess peer = child("child");
  // 64 MiB and 256 MiB pieces lie above max_mr_size (registered in pieces) and every transfer
  // above 1 MiB above max_msg_sz (split into work requests).
  const std::vector<std::size_t> sizes = {1, 4096 + 1, kMiB + 17, 64 * kMiB, 256 * kMiB};
  for (std::size_t i = 0; i < sizes.size() && !HasFatalFailure(); ++i)
    test::exchange(us, peer, GetParam(), sizes[i], i, "verbs");
  test::quit(peer);
}

std::string side_param(const ::testing::TestParamInfo<Side>& p) { return test::side_name(p.param); }

INSTANTIATE_TEST_SUITE_P(Sides, VerbsBetweenProcesses,
                         ::testing::Values(Side::WeRead, Side::WeWrite, Side::OurReadable,
                                           Side::OurWritable),
                         side_param);

// One piece on the owner's side, 64 on ours: a work request gathers at most max_sge (4) of
// them, so one remote run takes many work requests.
TEST_F(Verbs, ListsLongerThanMaxSgeArriveBothWays) {
  Connector us(options("parent"));
  ChildProcess peer = child("child");
  const std::vector<std::size_t> many(64, 16 * 1024 + 3);
  std::size_t total = 0;
  for (std::size_t n : many) total += n;

  peer.send_line("readable_sg 41 " + std::to_string(total));
  auto meta = RdmaMetadata::from_json(expect_prefix(peer.read_line(), "META "));
  Scattered dst(many, 0);
  auto read = us.begin_read(meta, dst.descriptors());
  ASSERT_TRUE(read.wait_for_completion(test::kExchangeWait));
  EXPECT_EQ(read.method(), "verbs");
  EXPECT_EQ(dst.mismatch(41), -1);
  EXPECT_TRUE(dst.guards_intact());
  peer.send_line("wait");
  EXPECT_EQ(peer.read_line(test::kExchangeWait), "DONE complete");

  peer.send_line("writable_sg " + std::to_string(total));
  meta = RdmaMetadata::from_json(expect_prefix(peer.read_line(), "META "));
  Scattered src(many, 42);
  auto write = us.begin_write(src.descriptors(), meta);
  ASSERT_TRUE(write.wait_for_completion(test::kExchangeWait));
  EXPECT_EQ(write.method(), "verbs");
  peer.send_line("wait");
  EXPECT_EQ(peer.read_line(test::kExchangeWait), "DONE complete");
  peer.send_line("check 42");
  EXPECT_EQ(peer.read_line(test::kExchangeWait), "CHECK ok");
  test::quit(peer);
}

// The owner's process dies mid-read: its simulated NIC's connection ends with it, and the
// read fails with PeerLost naming the owner, in bounded time.
TEST_F(Verbs, OwnerKilledMidReadErrorsTheReadWithPeerLost) {
  Connector us(options("parent"));
  // The owner's NIC sends at 400 Mbit/s: 256 MiB take about 5 s.
  ChildProcess peer = child("doomed-owner", 400);
  test::expect_owner_killed_mid_read(us, peer, "doomed-owner", 256 * kMiB, "verbs");
}

TEST_F(Verbs, ChosenAboveCmaAndTcpAndNamedByBothSides) {
  // Among the methods that move host memory (cuda_ipc moves CUDA memory only).
  auto host_movers = [](std::vector<MethodInfo> list) {
    std::erase_if(list, [](const MethodInfo& m) { return !m.moves_host; });
    return list;
  };
  const auto probed = host_movers(probe_methods(options("probe")));
  ASSERT_FALSE(probed.empty());
  EXPECT_EQ(probed[0].method, "verbs");
  EXPECT_EQ(probed[0].rank, 300);
  EXPECT_TRUE(probed[0].available) << probed[0].detail;
  Connector us(options("parent"));
  const auto mine = host_movers(us.methods());
  ASSERT_FALSE(mine.empty());
  EXPECT_EQ(mine[0].method, "verbs");
}

// Without the simulation: the built-in verbs says why this host cannot offer it (no device,
// or no RDMA support in the kernel), and a connector still works by the other methods.
TEST(VerbsHere, WithoutADeviceVerbsIsAbsentWithItsReason) {
  const auto probed = probe_methods(options("probe"));
  const MethodInfo* verbs = nullptr;
  for (const MethodInfo& m : probed)
    if (m.method == "verbs") verbs = &m;
  ASSERT_NE(verbs, nullptr) << "verbs is not built into this ferry";
  if (verbs->available) GTEST_SKIP() << "this host has an RDMA device: " << verbs->detail;
  EXPECT_FALSE(verbs->detail.empty());
  EXPECT_TRUE(verbs->detail.find("RDMA") != std::string::npos ||
              verbs->detail.find("ibv_") != std::string::npos ||
              verbs->detail.find("lib") != std::string::npos)
      << verbs->detail;
  Connector us(options("plain"));
  for (const MethodInfo& m : us.methods()) {
    if (m.method == "verbs") {
      EXPECT_FALSE(m.available) << m.detail;
    }
  }
}

}  // namespace
}  // namespace ferry
