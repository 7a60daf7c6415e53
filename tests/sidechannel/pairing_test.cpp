// Pairing by NATS subject against a real nats-server on a free loopback port.
#include <gtest/gtest.h>
#include <algorithm>

#include <signal.h>

#include <chrono>
#include <cstring>
#include <optional>
#include <thread>
#include <tuple>

#include <ferry/ferry.hpp>

#include "sidechannel/nats_channel.hpp"
#include "tests/support/child_process.hpp"
#include "tests/support/nats_server.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using test::at;
using test::ended_with;
using test::nats_options;
using test::Side;

TEST(Subject, ValidationNamesTheProblem) {
  using sidechannel::subject_problem;
  EXPECT_EQ(subject_problem("kv.decode-0.req-17"), std::nullopt);
  EXPECT_EQ(subject_problem("a"), std::nullopt);
  EXPECT_EQ(subject_problem(""), "is empty");
  EXPECT_EQ(subject_problem("a..b"), "has an empty token");
  EXPECT_EQ(subject_problem(".a"), "has an empty token");
  EXPECT_EQ(subject_problem("a."), "has an empty token");
  EXPECT_EQ(subject_problem("a.*"), "contains a wildcard");
  EXPECT_EQ(subject_problem("a.>"), "contains a wildcard");
  EXPECT_EQ(subject_problem("a.b*c"), "contains a wildcard");
  EXPECT_EQ(subject_problem("a b"), "contains whitespace or a control character");
  EXPECT_EQ(subject_problem("a\tb"), "contains whitespace or a control character");
  EXPECT_EQ(subject_problem(std::string(1025, 'x')), "is longer than 1024 characters");
}

TEST(Subject, WithoutASideChannelSubjectsAreRefused) {
  Connector plain(test::named("plain"));
  EXPECT_FALSE(plain.has_side_channel());
  auto buf = test::buffer(64);
  try {
    (void)plain.create_readable({Descriptor(buf.data(), buf.size())}, at("x.y"));
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidState);
    EXPECT_NE(std::string(e.what()).find("FERRY_NATS_URL"), std::string::npos);
  }
  EXPECT_THROW((void)plain.begin_read(Subject("x.y"), {Descriptor(buf.data(), buf.size())}), Error);
}

class PairingTest : public ::testing::Test {
 protected:
  test::NatsServer server_;
  Connector owner_{nats_options("owner", {server_.url()})};
  Connector peer_{nats_options("peer", {server_.url()})};
};

TEST_F(PairingTest, BadSubjectsAreRefusedAtTheCall) {
  auto buf = test::buffer(64);
  for (const char* bad : {"a..b", "a.*", "a.>", " a"}) {
    try {
      (void)owner_.create_writable({Descriptor(buf.data(), buf.size())}, at(bad));
      ADD_FAILURE() << "accepted " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
    }
    EXPECT_THROW((void)peer_.begin_write({Descriptor(buf.data(), buf.size())}, Subject(bad)),
                 Error);
  }
}

TEST_F(PairingTest, TheListenerFacesTheNatsInterface) {
  EXPECT_TRUE(owner_.has_side_channel());
  // The server is on loopback, so the NATS socket's local address is loopback too.
  const auto endpoints = owner_.endpoints();
  auto tcp = std::find_if(endpoints.begin(), endpoints.end(),
                          [](const Endpoint& e) { return e.method == "tcp"; });
  ASSERT_NE(tcp, endpoints.end());
  EXPECT_EQ(tcp->address.rfind("127.0.0.1:", 0), 0u);
}

// All four operation kinds in one process: each connector serves (readable, writable) and
// acts (read, write) by subject.
class InProcessPairing : public ::testing::TestWithParam<std::tuple<OperationKind, bool>> {
 protected:
  test::NatsServer server_;
  Connector a_{nats_options("a", {server_.url()})};
  Connector b_{nats_options("b", {server_.url()})};
};

TEST_P(InProcessPairing, BySubject) {
  const auto [kind, a_serves] = GetParam();
  Connector& owner = a_serves ? a_ : b_;
  Connector& peer = a_serves ? b_ : a_;
  constexpr std::size_t kSize = 3u << 20;
  auto src = test::patterned(kSize, 41);
  auto dst = test::buffer(kSize);
  const std::string subject =
      std::string("kv.") + (a_serves ? "a." : "b.") + std::string(to_string(kind));
  if (kind == OperationKind::read) {
    auto readable = owner.create_readable({Descriptor(src.data(), kSize)}, at(subject));
    auto read = peer.begin_read(Subject(subject), {Descriptor(dst.data(), kSize)});
    ASSERT_TRUE(read.wait_for_completion(30s));
    ASSERT_TRUE(readable.wait_for_completion(30s));
    // Two connectors of one process: the same-host method.
    EXPECT_EQ(read.method(), "cma");
    EXPECT_EQ(readable.method(), "cma");
  } else {
    auto writable = owner.create_writable({Descriptor(dst.data(), kSize)}, at(subject));
    auto write = peer.begin_write({Descriptor(src.data(), kSize)}, Subject(subject));
    ASSERT_TRUE(write.wait_for_completion(30s));
    ASSERT_TRUE(writable.wait_for_completion(30s));
    EXPECT_EQ(write.method(), "cma");
  }
  EXPECT_EQ(test::first_mismatch(dst.data(), kSize, 41), -1);
}

std::string in_process_name(const ::testing::TestParamInfo<std::tuple<OperationKind, bool>>& p) {
  const bool a_serves = std::get<1>(p.param);
  return std::get<0>(p.param) == OperationKind::read
             ? (a_serves ? "BReadsReadableOfA" : "AReadsReadableOfB")
             : (a_serves ? "BWritesWritableOfA" : "AWritesWritableOfB");
}

INSTANTIATE_TEST_SUITE_P(AllPairings, InProcessPairing,
                         ::testing::Combine(::testing::Values(OperationKind::read,
                                                              OperationKind::write),
                                            ::testing::Bool()),
                         in_process_name);

// README's "let NATS pair them" snippet, as written there (it once did not compile).
TEST_F(PairingTest, TheReadmeSnippetCompilesAndPairs) {
  ferry::Connector& decode = owner_;
  ferry::Connector& prefill = peer_;
  std::vector<std::byte> kv = test::patterned(64 << 10, 17), blocks(64 << 10);
  ferry::OperationOptions at;
  at.subject = "kv.decode-0.req-17";
  auto writable = decode.create_writable(blocks, at);  // serves its metadata there
  auto write = prefill.begin_write(kv, ferry::Subject("kv.decode-0.req-17"));
  write.wait_for_completion();  // writable completes as well
  ASSERT_TRUE(writable.wait_for_completion(std::chrono::seconds(10)));
  EXPECT_EQ(blocks, kv);
}

TEST_F(PairingTest, ActiveSideFirstRetriesUntilThePassiveSideAppears) {
  auto src = test::patterned(65536, 43);
  auto dst = test::buffer(65536);
  auto read =
      peer_.begin_read(Subject("kv.late"), {Descriptor(dst.data(), dst.size())}, at("", 20s));
  std::this_thread::sleep_for(300ms);  // nobody serves kv.late yet: the read keeps asking
  EXPECT_EQ(read.status(), OperationStatus::in_progress);
  auto readable = owner_.create_readable({Descriptor(src.data(), src.size())}, at("kv.late"));
  ASSERT_TRUE(read.wait_for_completion(20s));
  EXPECT_EQ(test::first_mismatch(dst.data(), dst.size(), 43), -1);
  ASSERT_TRUE(readable.wait_for_completion(20s));
}

TEST_F(PairingTest, PassiveSideThatNeverAppearsGivesTimeoutByTheDeadline) {
  auto dst = test::buffer(64);
  auto start = std::chrono::steady_clock::now();
  auto read =
      peer_.begin_read(Subject("kv.nobody"), {Descriptor(dst.data(), dst.size())}, at("", 400ms));
  EXPECT_EQ(ended_with(read), ErrorCode::Timeout);
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, 400ms);
  EXPECT_LT(took, 3s);
  // The error says where it asked, and that nobody answered.
  EXPECT_NE(read.error()->message().find("'kv.nobody'"), std::string::npos)
      << read.error()->message();
  EXPECT_NE(read.error()->message().find("nobody served it"), std::string::npos)
      << read.error()->message();
}

// Without a deadline of its own, an operation paired by subject waits subject_timeout to be
// paired, then ends with Timeout naming its subject: a typo cannot wait forever. After
// pairing no such limit holds; an operation with its own deadline waits that long.
TEST(PairingDeadline, AnOperationNobodyPairsEndsAfterSubjectTimeoutNamingItsSubject) {
  test::NatsServer server;
  ConnectorOptions o = nats_options("owner", {server.url()});
  o.subject_timeout = 300ms;
  Connector owner(o);
  o.name = "peer";
  Connector peer(o);
  auto buf = test::buffer(64);
  const auto start = std::chrono::steady_clock::now();
  auto read = peer.begin_read(Subject("kv.typo"), {Descriptor(buf.data(), buf.size())});
  auto served = owner.create_readable({Descriptor(buf.data(), buf.size())}, at("kv.nobody.asks"));
  EXPECT_EQ(ended_with(read), ErrorCode::Timeout);
  EXPECT_EQ(ended_with(served), ErrorCode::Timeout);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 300ms);
  EXPECT_NE(read.error()->message().find("'kv.typo'"), std::string::npos)
      << read.error()->message();
  EXPECT_NE(read.error()->message().find("nobody served it"), std::string::npos)
      << read.error()->message();
  EXPECT_NE(served.error()->message().find("'kv.nobody.asks'"), std::string::npos)
      << served.error()->message();
  EXPECT_NE(served.error()->message().find("nobody asked for it"), std::string::npos)
      << served.error()->message();
  // A deadline of its own replaces the pairing deadline.
  auto patient =
      peer.begin_read(Subject("kv.later"), {Descriptor(buf.data(), buf.size())}, at("", 5s));
  EXPECT_EQ(patient.wait(600ms), OperationStatus::in_progress);
  auto late = owner.create_readable({Descriptor(buf.data(), buf.size())}, at("kv.later"));
  EXPECT_EQ(patient.wait(10s), OperationStatus::complete);
  // A paired operation is not cut by the pairing deadline: the served one completes too.
  EXPECT_EQ(late.wait(10s), OperationStatus::complete);
}

// The reader asks as soon as the previous operation at the subject has ended, before the
// next one exists: its request may reach the server while the ended operation's UNSUB is
// still on its way, and go to that subscription alone. It must be answered "ended" (the
// reader asks again at once), not swallowed (the reader would wait for request_timeout).
TEST_F(PairingTest, AReaderAskingWhileTheLastOperationUnsubscribesIsNotStalled) {
  constexpr int kRounds = 100;
  auto src = test::patterned(4096, 9);
  auto dst = test::buffer(4096);
  int slow_rounds = 0;
  for (int i = 0; i < kRounds; ++i) {
    auto start = std::chrono::steady_clock::now();
    auto read = peer_.begin_read(Subject("kv.asked-early"), {Descriptor(dst.data(), dst.size())},
                                 at("", 10s));
    auto readable =
        owner_.create_readable({Descriptor(src.data(), src.size())}, at("kv.asked-early"));
    ASSERT_TRUE(read.wait_for_completion(10s));
    ASSERT_TRUE(readable.wait_for_completion(10s));
    // request_timeout is 1 s: a swallowed request shows as a round near it.
    if (std::chrono::steady_clock::now() - start > 600ms) ++slow_rounds;
  }
  EXPECT_EQ(slow_rounds, 0) << slow_rounds << " of " << kRounds << " rounds stalled";
}

TEST_F(PairingTest, KindMismatchFailsBothSidesWithTheSameReason) {
  auto buf = test::buffer(4096);
  auto mine = test::buffer(4096);
  auto writable = owner_.create_writable({Descriptor(buf.data(), buf.size())}, at("kv.kind"));
  auto read = peer_.begin_read(Subject("kv.kind"), {Descriptor(mine.data(), mine.size())});
  EXPECT_EQ(ended_with(read), ErrorCode::KindMismatch);
  EXPECT_NE(read.error()->message().find("kv.kind"), std::string::npos);
  // The completion notice carries the reader's reason to the writable.
  EXPECT_EQ(ended_with(writable), ErrorCode::KindMismatch);
  EXPECT_NE(writable.error()->message().find("peer 'peer'"), std::string::npos)
      << writable.error()->message();
}

TEST_F(PairingTest, SizeMismatchFailsBothSides) {
  auto buf = test::buffer(4096);
  auto mine = test::buffer(4000);
  auto readable = owner_.create_readable({Descriptor(buf.data(), buf.size())}, at("kv.size"));
  auto read = peer_.begin_read(Subject("kv.size"), {Descriptor(mine.data(), mine.size())});
  EXPECT_EQ(ended_with(read), ErrorCode::SizeMismatch);
  EXPECT_EQ(ended_with(readable), ErrorCode::SizeMismatch);
}

TEST_F(PairingTest, AccessRefusedByTheOwnerErrorsThePassiveSideWithThatReason) {
  // The owner serves at most 4 KiB per request; the reader asks for 1 MiB chunks and is
  // refused before it claims anything. It gives up and says why.
  ConnectorOptions strict = nats_options("strict-owner", {server_.url()});
  strict.tcp.max_request = 4096;
  strict.transports = {"tcp"};  // the limit is tcp's
  Connector owner(strict);
  auto src = test::patterned(1u << 20, 44);
  auto dst = test::buffer(1u << 20);
  auto readable = owner.create_readable({Descriptor(src.data(), src.size())}, at("kv.denied"));
  auto read = peer_.begin_read(Subject("kv.denied"), {Descriptor(dst.data(), dst.size())});
  EXPECT_EQ(ended_with(read), ErrorCode::AccessDenied);
  EXPECT_EQ(ended_with(readable), ErrorCode::AccessDenied);
  EXPECT_NE(readable.error()->message().find("requests take 1 to 4096 bytes"), std::string::npos)
      << readable.error()->message();
}

TEST_F(PairingTest, CancellingThePassiveSideStopsServingItsSubject) {
  auto buf = test::buffer(4096);
  auto writable = owner_.create_writable({Descriptor(buf.data(), buf.size())}, at("kv.gone"));
  writable.cancel();
  auto src = test::patterned(4096, 45);
  auto write =
      peer_.begin_write({Descriptor(src.data(), src.size())}, Subject("kv.gone"), at("", 500ms));
  EXPECT_EQ(ended_with(write), ErrorCode::Timeout);
  EXPECT_TRUE(std::all_of(buf.begin(), buf.end(), [](std::byte b) { return b == std::byte{0}; }));
}

TEST_F(PairingTest, ManyConcurrentPairingsOnDistinctSubjects) {
  constexpr int kOps = 64;
  constexpr std::size_t kSize = 32768;
  std::vector<std::vector<std::byte>> srcs, dsts;
  std::vector<ReadableOperation> readables;
  std::vector<ReadOperation> reads;
  for (int i = 0; i < kOps; ++i) {
    srcs.push_back(test::patterned(kSize, static_cast<std::uint64_t>(500 + i)));
    dsts.push_back(test::buffer(kSize));
    std::string subject = "kv.many." + std::to_string(i);
    // Half the reads start before their readable exists.
    if (i % 2 == 0)
      reads.push_back(peer_.begin_read(Subject(subject), {Descriptor(dsts.back().data(), kSize)}));
    readables.push_back(
        owner_.create_readable({Descriptor(srcs.back().data(), kSize)}, at(subject)));
    if (i % 2 == 1)
      reads.push_back(peer_.begin_read(Subject(subject), {Descriptor(dsts.back().data(), kSize)}));
  }
  for (auto& r : reads) ASSERT_TRUE(r.wait_for_completion(30s));
  for (auto& r : readables) ASSERT_TRUE(r.wait_for_completion(30s));
  for (int i = 0; i < kOps; ++i)
    EXPECT_EQ(test::first_mismatch(dsts[static_cast<std::size_t>(i)].data(), kSize,
                                   static_cast<std::uint64_t>(500 + i)),
              -1);
}

// ---------------------------------------------------------------------------------------
// Metadata larger than the server's max_payload.

class SmallPayloadTest : public ::testing::Test {
 protected:
  test::NatsServer server_{test::NatsServer::Options{0, {}, "max_payload: 2048\n"}};
  Connector owner_{nats_options("owner", {server_.url()})};
  Connector peer_{nats_options("peer", {server_.url()})};
};

TEST_F(SmallPayloadTest, AdjacentDescriptorsAreCoalescedToFit) {
  // 100 slices of one buffer: far beyond 2 KiB as listed, one descriptor when merged.
  auto src = test::patterned(100 * 1000, 46);
  std::vector<Descriptor> slices;
  for (int i = 0; i < 100; ++i) slices.emplace_back(src.data() + i * 1000, 1000);
  auto readable = owner_.create_readable(slices, at("kv.coalesced"));
  ASSERT_GT(readable.metadata().to_json().size(), 2048u);
  auto dst = test::buffer(src.size());
  auto read = peer_.begin_read(Subject("kv.coalesced"), {Descriptor(dst.data(), dst.size())});
  ASSERT_TRUE(read.wait_for_completion(30s));
  EXPECT_EQ(test::first_mismatch(dst.data(), dst.size(), 46), -1);
}

TEST_F(SmallPayloadTest, MetadataThatCannotFitIsRefusedNamingBothSizes) {
  // 100 slices with gaps between them: nothing to merge.
  auto src = test::buffer(100 * 2000);
  std::vector<Descriptor> slices;
  for (int i = 0; i < 100; ++i) slices.emplace_back(src.data() + i * 2000, 1000);
  try {
    (void)owner_.create_readable(slices, at("kv.toolarge"));
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    std::string what = e.what();
    EXPECT_NE(what.find("exceeds the NATS server's max_payload of 2048 bytes"), std::string::npos)
        << what;
    EXPECT_NE(what.find("100 descriptors"), std::string::npos) << what;
  }
  // Without a subject the same operation is fine (its metadata goes by other means). Only
  // its creation is checked: the handle is dropped, which cancels it at once.
  EXPECT_NO_THROW((void)owner_.create_readable(slices));
}

// ---------------------------------------------------------------------------------------
// Across processes: the child finds the server through FERRY_NATS_URL.

class CrossProcessPairing : public ::testing::TestWithParam<Side> {
 protected:
  test::NatsServer server_;
  Connector us_{nats_options("parent", {server_.url()})};
  test::ChildProcess child_{test::peer_command({"child"}), {"FERRY_NATS_URL=" + server_.url()}};
};

TEST_P(CrossProcessPairing, BySubject) {
  constexpr std::size_t kSize = 5u << 20;
  switch (GetParam()) {
    case Side::OurReadable: {
      auto src = test::patterned(kSize, 51);
      auto readable = us_.create_readable({Descriptor(src.data(), kSize)}, at("x.r"));
      child_.send_line("read_at 51 " + std::to_string(kSize) + " x.r");
      EXPECT_EQ(child_.read_line(60s), "DONE complete");
      ASSERT_TRUE(readable.wait_for_completion(30s));
      break;
    }
    case Side::OurWritable: {
      auto dst = test::buffer(kSize);
      auto writable = us_.create_writable({Descriptor(dst.data(), kSize)}, at("x.w"));
      child_.send_line("write_at 52 " + std::to_string(kSize) + " x.w");
      EXPECT_EQ(child_.read_line(60s), "DONE complete");
      ASSERT_TRUE(writable.wait_for_completion(30s));
      EXPECT_EQ(test::first_mismatch(dst.data(), kSize, 52), -1);
      break;
    }
    case Side::WeRead: {
      child_.send_line("readable_at y.r " + std::to_string(kSize) + " 53");
      EXPECT_EQ(child_.read_line(), "READY");
      auto dst = test::buffer(kSize);
      auto read = us_.begin_read(Subject("y.r"), {Descriptor(dst.data(), kSize)});
      ASSERT_TRUE(read.wait_for_completion(30s));
      EXPECT_EQ(test::first_mismatch(dst.data(), kSize, 53), -1);
      child_.send_line("wait");
      EXPECT_EQ(child_.read_line(30s), "DONE complete");
      break;
    }
    case Side::WeWrite: {
      child_.send_line("writable_at y.w " + std::to_string(kSize) + " 0");
      EXPECT_EQ(child_.read_line(), "READY");
      auto src = test::patterned(kSize, 54);
      auto write = us_.begin_write({Descriptor(src.data(), kSize)}, Subject("y.w"));
      ASSERT_TRUE(write.wait_for_completion(30s));
      child_.send_line("wait");
      EXPECT_EQ(child_.read_line(30s), "DONE complete");
      child_.send_line("check 54");
      EXPECT_EQ(child_.read_line(30s), "CHECK ok");
      break;
    }
  }
  child_.send_line("quit");
  int status = child_.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

std::string side_param_name(const ::testing::TestParamInfo<test::Side>& param) {
  return test::side_name(param.param);
}

INSTANTIATE_TEST_SUITE_P(AllPairings, CrossProcessPairing,
                         ::testing::Values(Side::OurReadable, Side::OurWritable, Side::WeRead,
                                           Side::WeWrite),
                         side_param_name);

TEST(PairingAcrossProcesses, ActiveReaderKilledErrorsThePassiveSideNamingIt) {
  test::NatsServer server;
  Connector us(nats_options("parent", {server.url()}));
  constexpr std::size_t kBig = std::size_t{512} << 20;
  auto src = test::filled(kBig, std::byte{0x5a});
  auto readable = us.create_readable({Descriptor(src.get(), kBig)}, at("x.doomed"));
  test::ChildProcess child(test::peer_command({"doomed-reader"}),
                           {"FERRY_NATS_URL=" + server.url()});
  child.send_line("start_read_at " + std::to_string(kBig) + " x.doomed");
  EXPECT_EQ(child.read_line(), "STARTED");
  auto until = std::chrono::steady_clock::now() + 10s;
  while (readable.status() == OperationStatus::initialized &&
         std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(1ms);
  child.kill(SIGSTOP);
  ASSERT_EQ(readable.status(), OperationStatus::in_progress);
  child.kill(SIGKILL);
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(ended_with(readable, 5s), ErrorCode::PeerLost);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  EXPECT_NE(readable.error()->message().find("doomed-reader"), std::string::npos);
}

}  // namespace
}  // namespace ferry
