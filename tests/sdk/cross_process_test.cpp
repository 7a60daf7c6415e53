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
  auto src = std::make_unique<std::byte[]>(kBig);
  std::memset(src.get(), 0x5a, kBig);
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
  auto src = std::make_unique<std::byte[]>(kBig);
  std::memset(src.get(), 0x5a, kBig);
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
  auto dst = std::make_unique<std::byte[]>(kBig);
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
