// Transfers between this process and a child (ferry_test_peer), and peers killed mid-transfer.
#include <gtest/gtest.h>

#include <signal.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <tuple>

#include <ferry/ferry.hpp>

#include "tests/support/child_process.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using test::ChildProcess;
using test::eventually;
using test::peer_command;
using test::Side;
using test::side_name;

std::string expect_prefix(const std::string& line, const std::string& prefix) {
  EXPECT_EQ(line.rfind(prefix, 0), 0u) << line;
  return line.size() > prefix.size() ? line.substr(prefix.size()) : std::string();
}

class CrossProcessTest : public ::testing::TestWithParam<std::tuple<Side, std::size_t>> {
 protected:
  Connector connector_{test::named("parent")};
};

TEST_P(CrossProcessTest, TransfersAndVerifies) {
  const auto [side, size] = GetParam();
  ChildProcess child(peer_command({"child"}));
  switch (side) {
    case Side::OurReadable: {
      auto src = test::patterned(size, 11);
      auto readable = connector_.create_readable({Descriptor(src.data(), size)});
      child.send_line("read 11 " + readable.metadata().to_json());
      EXPECT_EQ(child.read_line(120s), "DONE complete");
      ASSERT_TRUE(readable.wait_for_completion(60s));
      break;
    }
    case Side::OurWritable: {
      auto dst = test::buffer(size);
      auto writable = connector_.create_writable({Descriptor(dst.data(), size)});
      child.send_line("write 12 " + writable.metadata().to_json());
      EXPECT_EQ(child.read_line(120s), "DONE complete");
      ASSERT_TRUE(writable.wait_for_completion(60s));
      EXPECT_EQ(test::first_mismatch(dst.data(), size, 12), -1);
      break;
    }
    case Side::WeRead: {
      child.send_line("readable " + std::to_string(size) + " 13");
      auto meta = RdmaMetadata::from_json(expect_prefix(child.read_line(), "META "));
      auto dst = test::buffer(size);
      auto read = connector_.begin_read(meta, {Descriptor(dst.data(), size)});
      ASSERT_TRUE(read.wait_for_completion(60s));
      EXPECT_EQ(test::first_mismatch(dst.data(), size, 13), -1);
      child.send_line("wait");
      EXPECT_EQ(child.read_line(60s), "DONE complete");
      break;
    }
    case Side::WeWrite: {
      child.send_line("writable " + std::to_string(size));
      auto meta = RdmaMetadata::from_json(expect_prefix(child.read_line(), "META "));
      auto src = test::patterned(size, 14);
      auto write = connector_.begin_write({Descriptor(src.data(), size)}, meta);
      ASSERT_TRUE(write.wait_for_completion(60s));
      child.send_line("wait");
      EXPECT_EQ(child.read_line(60s), "DONE complete");
      child.send_line("check 14");
      EXPECT_EQ(child.read_line(60s), "CHECK ok");
      break;
    }
  }
  child.send_line("quit");
  int status = child.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
}

INSTANTIATE_TEST_SUITE_P(AllPairings, CrossProcessTest,
                         ::testing::Combine(::testing::Values(Side::OurReadable, Side::OurWritable,
                                                              Side::WeRead, Side::WeWrite),
                                            ::testing::Values(std::size_t{1}, std::size_t{4096},
                                                              std::size_t{1} << 20,
                                                              std::size_t{64} << 20)),
                         [](const ::testing::TestParamInfo<std::tuple<Side, std::size_t>>& p) {
                           return side_name(std::get<0>(p.param)) + "_bytes_" +
                                  std::to_string(std::get<1>(p.param));
                         });

// Regions (docs/regions.md) between two processes, by the best method both offer (cma here).
TEST(CrossProcessRegion, WeAttachToTheChildsRegionReadAndWriteAndItHearsOfEach) {
  Connector us(test::named("parent"));
  ChildProcess child(peer_command({"child"}));
  constexpr std::size_t kSize = 1u << 20;
  child.send_line("region " + std::to_string(kSize) + " 31");
  auto meta = RegionMetadata::from_json(expect_prefix(child.read_line(), "META "));
  auto att = us.attach(meta);
  auto dst = test::buffer(kSize);
  auto read = att.read({{0, kSize}}, {Descriptor(dst.data(), kSize)});
  ASSERT_TRUE(read.wait_for_completion(60s));
  EXPECT_EQ(test::first_mismatch(dst.data(), kSize, 31), -1);
  auto src = test::patterned(8192, 32);
  TransferOptions t;
  t.tag = "request-7";
  auto write = att.write_blocks({Descriptor(src.data(), src.size())}, {3, 4}, t);
  ASSERT_TRUE(write.wait_for_completion(60s));
  for (const auto& m : us.methods())
    if (m.method == "cma" && m.available) {
      EXPECT_EQ(att.method(), "cma");
    }
  child.send_line("region_event");
  EXPECT_EQ(child.read_line(60s).rfind("EVENT attached", 0), 0u);
  child.send_line("region_event");
  EXPECT_EQ(child.read_line(60s), "EVENT transfer read - 0 1048576 complete");
  child.send_line("region_event");
  EXPECT_EQ(child.read_line(60s), "EVENT transfer write request-7 12288 8192 complete");
  child.send_line("region_check 32 12288 8192");
  EXPECT_EQ(child.read_line(60s), "CHECK ok");
  child.send_line("quit");
  int status = child.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
}

TEST(CrossProcessRegion, TheChildAttachesToOursAndWeHearTheTagOnceTheBytesAreIn) {
  Connector us(test::named("parent"));
  constexpr std::size_t kSize = 1u << 20;
  auto pool = test::patterned(kSize, 41);
  RegionOptions ro;
  ro.access = RegionAccess::read_write;
  auto region = us.create_region({Descriptor(pool.data(), kSize)}, ro);
  ChildProcess child(peer_command({"child"}));
  const std::string json = region.metadata().to_json();
  child.send_line("region_read 41 4096 65536 " + json);
  EXPECT_EQ(child.read_line(60s), "DONE complete");
  child.send_line("region_write 42 100000 5000 r-99 " + json);
  EXPECT_EQ(child.read_line(60s), "DONE complete");
  std::vector<RegionEvent> events;
  while (events.size() < 3) {
    auto e = region.next_event(10s);
    ASSERT_TRUE(e);
    events.push_back(*e);
  }
  EXPECT_EQ(events[0].type, RegionEvent::Type::attached);
  EXPECT_NE(events[0].peer.find("child"), std::string::npos) << events[0].peer;
  EXPECT_EQ(events[1].kind, OperationKind::read);
  EXPECT_EQ(events[2].kind, OperationKind::write);
  EXPECT_EQ(events[2].tag, "r-99");
  ASSERT_EQ(events[2].ranges.size(), 1u);
  EXPECT_EQ(events[2].ranges[0], (RegionRange{100000, 5000}));
  // The event came after the bytes: they are in.
  EXPECT_EQ(test::first_mismatch(pool.data() + 100000, 5000, 42), -1);
  child.send_line("quit");
  int status = child.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  // The child's attachment ended with it.
  auto gone = region.next_event(10s);
  ASSERT_TRUE(gone);
  EXPECT_EQ(gone->type, RegionEvent::Type::detached);
}

// Large enough that the transfer cannot finish between noticing it started and stopping the
// child; the child is frozen (SIGSTOP) first, so it is surely mid-transfer when killed.
constexpr std::size_t kBig = std::size_t{512} << 20;

void expect_peer_lost_in_time(const Operation& op, const std::string& peer_name) {
  auto start = std::chrono::steady_clock::now();
  bool ended = false;
  try {
    ended = op.wait_for_completion(5s);
    ADD_FAILURE() << "completed although the peer was killed";
  } catch (const Error& e) {
    ended = true;
    EXPECT_EQ(e.code(), ErrorCode::PeerLost) << e.what();
    EXPECT_NE(std::string(e.what()).find(peer_name), std::string::npos) << e.what();
  }
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(ended) << "still not ended 5 s after the kill";
  EXPECT_EQ(op.status(), OperationStatus::errored);
  EXPECT_LT(took, 2s) << "took "
                      << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                      << " ms";
}

TEST(PeerKilled, ActiveReaderKilledErrorsOurReadable) {
  Connector connector(test::named("parent"));
  auto src = test::filled(kBig, std::byte{0x5a});
  auto readable = connector.create_readable({Descriptor(src.get(), kBig)});
  ChildProcess child(peer_command({"doomed-reader"}));
  child.send_line("start_read " + readable.metadata().to_json());
  EXPECT_EQ(child.read_line(), "STARTED");
  ASSERT_TRUE(eventually([&] { return readable.status() != OperationStatus::initialized; }, 10s));
  child.kill(SIGSTOP);
  ASSERT_EQ(readable.status(), OperationStatus::in_progress) << "finished before the kill";
  child.kill(SIGKILL);
  expect_peer_lost_in_time(readable, "doomed-reader");
}

// A stopped peer keeps its socket open: only silence tells. Both sides notice it within
// peer_timeout (2 s by default), the passive side too.
TEST(PeerStopped, ActiveReaderStoppedErrorsOurReadableWithinPeerTimeout) {
  Connector connector(test::named("parent"));
  auto src = test::filled(kBig, std::byte{0x5a});
  auto readable = connector.create_readable({Descriptor(src.get(), kBig)});
  ChildProcess child(peer_command({"frozen-reader"}));
  child.send_line("start_read " + readable.metadata().to_json());
  EXPECT_EQ(child.read_line(), "STARTED");
  ASSERT_TRUE(eventually([&] { return readable.status() != OperationStatus::initialized; }, 10s));
  child.kill(SIGSTOP);
  ASSERT_EQ(readable.status(), OperationStatus::in_progress) << "finished before the stop";
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(test::ended_with(readable, 8s), ErrorCode::PeerLost);
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_LT(took, 4s) << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                      << " ms";
  EXPECT_NE(readable.error()->message().find("frozen-reader"), std::string::npos)
      << readable.error()->message();
  child.kill(SIGKILL);
}

TEST(PeerKilled, PassiveOwnerKilledErrorsOurRead) {
  // tcp's pace: a stopped owner stops a tcp read (its loop serves the bytes), not a cma one.
  Connector connector(test::tcp_only("parent"));
  ChildProcess child(peer_command({"doomed-owner"}));
  child.send_line("readable " + std::to_string(kBig) + " 0");
  std::string meta_line = child.read_line();
  ASSERT_EQ(meta_line.rfind("META ", 0), 0u) << meta_line;
  auto meta = RdmaMetadata::from_json(meta_line.substr(5));
  auto dst = test::filled(kBig, std::byte{0});
  auto read = connector.begin_read(meta, {Descriptor(dst.get(), kBig)});
  ASSERT_TRUE(eventually(
      [&] {
        child.send_line("status");
        return child.read_line() == "STATUS in_progress";
      },
      10s));
  child.kill(SIGSTOP);
  ASSERT_EQ(read.status(), OperationStatus::in_progress) << "finished before the kill";
  child.kill(SIGKILL);
  expect_peer_lost_in_time(read, "doomed-owner");
}

TEST(PeerKilled, LaterOperationsToOtherPeersStillWork) {
  // A peer dying must not poison the connector: a fresh child is served normally after.
  Connector connector(test::named("parent"));
  {
    ChildProcess doomed(peer_command({"doomed"}));
    doomed.send_line("writable 4096");
    auto meta = RdmaMetadata::from_json(doomed.read_line().substr(5));
    doomed.kill(SIGKILL);
    doomed.wait();
    auto src = test::patterned(4096, 3);
    auto write = connector.begin_write({Descriptor(src.data(), 4096)}, meta);
    EXPECT_THROW((void)write.wait_for_completion(5s), Error);
    EXPECT_EQ(write.error()->code(), ErrorCode::PeerLost);
  }
  ChildProcess child(peer_command({"healthy"}));
  child.send_line("readable 65536 21");
  auto meta = RdmaMetadata::from_json(child.read_line().substr(5));
  auto dst = test::buffer(65536);
  auto read = connector.begin_read(meta, {Descriptor(dst.data(), 65536)});
  ASSERT_TRUE(read.wait_for_completion(30s));
  EXPECT_EQ(test::first_mismatch(dst.data(), 65536, 21), -1);
}

}  // namespace
}  // namespace ferry
