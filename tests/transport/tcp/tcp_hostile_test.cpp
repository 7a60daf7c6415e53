// Hostile TCP clients against a real Connector's listener (docs/protocol.md, "Checks on every
// request"). Each test speaks the frame protocol over a raw blocking socket on loopback,
// misbehaves, and checks the server's answer, that the exposed memory is untouched, and that
// the same connector still serves a well-behaved peer afterwards.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ferry/ferry.hpp>

#include "tests/support/patterns.hpp"
#include "tests/support/raw_peer.hpp"
#include "tests/support/util.hpp"
#include "transport/kit/exposure_table.hpp"
#include "transport/wire/frame.hpp"

namespace ferry {
namespace {

using namespace test;
using transport::Token;
using transport::wire::FrameHeader;
using transport::wire::FrameType;

constexpr auto kWait = std::chrono::seconds(30);
constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
constexpr std::uint64_t kDefaultMaxRequest = 16u << 20;

/// Connects and exchanges HELLO as `name`.
::testing::AssertionResult greeted(RawClient& client, const std::string& name = "raw-client") {
  if (!client.connected() || !client.greet(name))
    return ::testing::AssertionFailure() << client.error();
  return ::testing::AssertionSuccess();
}

std::string describe(const Operation& op) {
  auto e = op.error();
  return std::string(to_string(op.status())) + (e ? std::string(": ") + e->what() : "");
}

/// A second connector completes a real read and a real write against fresh passive
/// operations of `owner`: the server is still serving whatever the hostile client did.
void expect_serves_well_behaved_peer(Connector& owner) {
  constexpr std::size_t kSize = (256u << 10) + 3;
  Connector peer(test::named("well-behaved"));

  auto src = patterned(kSize, 101);
  auto got = buffer(kSize);
  auto readable = owner.create_readable({Descriptor(src.data(), kSize)});
  auto read = peer.begin_read(readable.metadata(), {Descriptor(got.data(), kSize)});
  ASSERT_TRUE(read.wait_for_completion(kWait)) << describe(read);
  ASSERT_TRUE(readable.wait_for_completion(kWait)) << describe(readable);
  EXPECT_EQ(first_mismatch(got.data(), kSize, 101), -1);

  auto data = patterned(kSize, 102);
  auto dst = buffer(kSize);
  auto writable = owner.create_writable({Descriptor(dst.data(), kSize)});
  auto write = peer.begin_write({Descriptor(data.data(), kSize)}, writable.metadata());
  ASSERT_TRUE(write.wait_for_completion(kWait)) << describe(write);
  ASSERT_TRUE(writable.wait_for_completion(kWait)) << describe(writable);
  EXPECT_EQ(first_mismatch(dst.data(), kSize, 102), -1);
}

/// A second connector reads all of `readable` (which must still be unclaimed) into fresh
/// memory and finds pattern `seed`.
void expect_peer_reads(const ReadableOperation& readable, std::size_t size, std::uint64_t seed) {
  Connector peer(test::named("late-reader"));
  auto got = buffer(size);
  auto read = peer.begin_read(readable.metadata(), {Descriptor(got.data(), size)});
  ASSERT_TRUE(read.wait_for_completion(kWait)) << describe(read);
  ASSERT_TRUE(readable.wait_for_completion(kWait)) << describe(readable);
  EXPECT_EQ(first_mismatch(got.data(), size, seed), -1);
}

/// Waits for `op` to fail and returns its error; a failure of the test if it completes or
/// does not end in time.
std::optional<Error> wait_for_failure(const Operation& op) {
  try {
    if (op.wait_for_completion(kWait))
      ADD_FAILURE() << "the operation completed";
    else
      ADD_FAILURE() << "the operation did not end within the wait";
  } catch (const Error& e) {
    return e;
  }
  return std::nullopt;
}

ConnectorOptions owner_options(std::size_t max_request) {
  ConnectorOptions o = test::named("owner");
  o.tcp.max_request = max_request;
  return o;
}

class TcpHostileTest : public ::testing::Test {
 protected:
  static constexpr std::size_t kSize = 64u << 10;
  static constexpr std::uint64_t kSeed = 7;

  // Every test ends by checking that the owner still serves a well-behaved peer.
  void TearDown() override {
    if (!HasFatalFailure()) expect_serves_well_behaved_peer(owner_);
  }

  bool memory_unchanged() const { return first_mismatch(memory_.data(), kSize, kSeed) == -1; }

  Connector owner_{test::named("owner")};
  std::vector<std::byte> memory_ = patterned(kSize, kSeed);
};

// ---------------------------------------------------------------------------------------
// Connection slots

// Connections that greet and then claim nothing cannot lock real peers out: past
// max_unclaimed the oldest make room, and each is closed after unclaimed_timeout.
TEST(TcpSlots, SilentConnectionsCannotLockOutRealPeers) {
  ConnectorOptions o = test::named("owner");
  o.listener.max_connections = 64;
  o.listener.max_unclaimed = 8;
  o.listener.unclaimed_timeout = std::chrono::milliseconds(30000);
  Connector owner(o);
  auto memory = patterned(4096, 3);
  auto readable = owner.create_readable({Descriptor(memory.data(), memory.size())});
  const Target t = target_of(readable.metadata());
  std::vector<std::unique_ptr<RawClient>> squatters;
  for (int i = 0; i < 100; ++i) {
    squatters.push_back(std::make_unique<RawClient>(t.address));
    ASSERT_TRUE(greeted(*squatters.back(), "squatter")) << i;
  }
  // The real peer still gets in and completes.
  expect_serves_well_behaved_peer(owner);
  Connector peer(test::named("real-peer"));
  auto got = buffer(4096);
  auto read = peer.begin_read(readable.metadata(), {Descriptor(got.data(), got.size())});
  ASSERT_TRUE(read.wait_for_completion(kWait)) << describe(read);
  EXPECT_EQ(first_mismatch(got.data(), got.size(), 3), -1);
  // The oldest squatters were told why and closed.
  auto f = squatters.front()->read_frame();
  EXPECT_TRUE(is_status(f, 0, ErrorCode::AccessDenied, "claim no operation"));
}

TEST(TcpSlots, AConnectionThatClaimsNothingIsClosedAfterTheTimeout) {
  ConnectorOptions o = test::named("owner");
  o.listener.unclaimed_timeout = std::chrono::milliseconds(300);
  Connector owner(o);
  auto memory = patterned(64, 3);
  auto readable = owner.create_readable({Descriptor(memory.data(), memory.size())});
  RawClient idle(target_of(readable.metadata()).address);
  ASSERT_TRUE(greeted(idle, "idle"));
  auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(is_status(idle.read_frame(), 0, ErrorCode::AccessDenied, "no operation claimed"));
  EXPECT_TRUE(idle.closed_by_peer());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

// A claimant that goes silent with nothing in flight (every answer read, its socket open,
// its kernel still acknowledging) is noticed by the owner's watchdog alone: the kernel's user
// timeout has no unacknowledged data to time out. The readable errors within peer_timeout.
TEST(TcpSlots, AClaimantSilentBetweenRequestsErrorsTheOperationWithinPeerTimeout) {
  ConnectorOptions o = test::named("owner");
  o.peer_timeout = std::chrono::milliseconds(500);
  Connector owner(o);
  auto memory = patterned(4096, 3);
  auto readable = owner.create_readable({Descriptor(memory.data(), memory.size())});
  const Target t = target_of(readable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client, "silent-claimant"));
  ASSERT_TRUE(client.send_frame(request(FrameType::read, t, 1, t.base, 64))) << client.error();
  EXPECT_TRUE(is_data(client.read_frame(), 1, 64, 3, 0)) << client.error();
  ASSERT_TRUE(eventually([&] { return readable.status() == OperationStatus::in_progress; }));
  // Silent from here on, the socket left open.
  auto start = std::chrono::steady_clock::now();
  auto e = wait_for_failure(readable);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), ErrorCode::PeerLost) << e->what();
  EXPECT_NE(std::string(e->what()).find("silent-claimant"), std::string::npos) << e->what();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

// ---------------------------------------------------------------------------------------
// Tokens

TEST_F(TcpHostileTest, WrongTokenAndUnknownIdGetTheSameAccessDenied) {
  auto readable = owner_.create_readable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(readable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client));
  EXPECT_EQ(client.server_name(), "owner");

  FrameHeader wrong_token = request(FrameType::read, t, 1, t.base, 64);
  wrong_token.token = flipped(t.token);
  ASSERT_TRUE(client.send_frame(wrong_token)) << client.error();
  auto a = client.read_frame();
  EXPECT_TRUE(
      is_status(a, 1, ErrorCode::AccessDenied, "no live operation matches this id and token"))
      << client.error();

  FrameHeader unknown_id = request(FrameType::read, t, 2, t.base, 64);
  unknown_id.op_id = t.op_id ^ (1ULL << 62);  // no operation has this id
  ASSERT_TRUE(client.send_frame(unknown_id)) << client.error();
  auto b = client.read_frame();
  EXPECT_TRUE(
      is_status(b, 2, ErrorCode::AccessDenied, "no live operation matches this id and token"))
      << client.error();
  // Probing must learn nothing: the two answers are the same text.
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->message, b->message);

  EXPECT_TRUE(memory_unchanged());
  // A wrong token claims nothing: the rightful peer still gets the whole operation.
  EXPECT_EQ(readable.status(), OperationStatus::initialized);
  expect_peer_reads(readable, kSize, kSeed);
}

TEST_F(TcpHostileTest, StaleTokenOfAFinishedReadableIsDenied) {
  auto readable = owner_.create_readable({Descriptor(memory_.data(), kSize)});
  {
    Connector peer(test::named("first-reader"));
    auto got = buffer(kSize);
    auto read = peer.begin_read(readable.metadata(), {Descriptor(got.data(), kSize)});
    ASSERT_TRUE(read.wait_for_completion(kWait)) << describe(read);
    ASSERT_TRUE(readable.wait_for_completion(kWait)) << describe(readable);
    ASSERT_EQ(first_mismatch(got.data(), kSize, kSeed), -1);
  }
  const Target t = target_of(readable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client));
  ASSERT_TRUE(client.send_frame(request(FrameType::read, t, 1, t.base, 64))) << client.error();
  EXPECT_TRUE(is_status(client.read_frame(), 1, ErrorCode::AccessDenied,
                        "no live operation matches this id and token"))
      << client.error();
  EXPECT_TRUE(memory_unchanged());
  EXPECT_EQ(readable.status(), OperationStatus::complete);
}

TEST_F(TcpHostileTest, StaleTokenOfAFinishedWritableWritesNothing) {
  auto dst = buffer(kSize);
  auto writable = owner_.create_writable({Descriptor(dst.data(), kSize)});
  {
    Connector peer(test::named("first-writer"));
    auto write = peer.begin_write({Descriptor(memory_.data(), kSize)}, writable.metadata());
    ASSERT_TRUE(write.wait_for_completion(kWait)) << describe(write);
    ASSERT_TRUE(writable.wait_for_completion(kWait)) << describe(writable);
    ASSERT_EQ(first_mismatch(dst.data(), kSize, kSeed), -1);
  }
  const Target t = target_of(writable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client));
  const std::vector<std::byte> junk(4096, std::byte{0x5a});
  ASSERT_TRUE(client.send_frame(request(FrameType::write, t, 1, t.base, junk.size()), {}, junk))
      << client.error();
  EXPECT_TRUE(is_status(client.read_frame(), 1, ErrorCode::AccessDenied,
                        "no live operation matches this id and token"))
      << client.error();
  // The STATUS comes only after the payload was consumed, so the memory is final here.
  EXPECT_EQ(first_mismatch(dst.data(), kSize, kSeed), -1);
  EXPECT_EQ(writable.status(), OperationStatus::complete);
}

TEST_F(TcpHostileTest, ClaimedOperationIsDeniedToASecondConnection) {
  auto readable = owner_.create_readable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(readable.metadata());
  RawClient first(t.address);
  ASSERT_TRUE(greeted(first, "raw-claimant"));
  ASSERT_TRUE(first.send_frame(request(FrameType::read, t, 1, t.base, 256))) << first.error();
  ASSERT_TRUE(is_data(first.read_frame(), 1, 256, kSeed, 0)) << first.error();

  RawClient second(t.address);
  ASSERT_TRUE(greeted(second, "raw-thief"));
  ASSERT_TRUE(second.send_frame(request(FrameType::read, t, 1, t.base, 256))) << second.error();
  EXPECT_TRUE(is_status(second.read_frame(), 1, ErrorCode::AccessDenied,
                        "claimed by another peer (raw-claimant)"))
      << second.error();
  // Nor may the second connection end the operation on the claimant's behalf.
  ASSERT_TRUE(second.send_frame(
      done_frame(t, 2, transport::Access::read, wire_status(ErrorCode::Cancelled)), "go away"))
      << second.error();
  EXPECT_TRUE(is_status(second.read_frame(), 2, ErrorCode::AccessDenied,
                        "claimed by another peer (raw-claimant)"))
      << second.error();

  // The claimant keeps the operation: it reads more and ends it.
  ASSERT_TRUE(first.send_frame(request(FrameType::read, t, 2, t.base + 4096, 512)))
      << first.error();
  EXPECT_TRUE(is_data(first.read_frame(), 2, 512, kSeed, 4096)) << first.error();
  ASSERT_TRUE(first.send_frame(done_frame(t, 3, transport::Access::read, 0))) << first.error();
  EXPECT_TRUE(is_ok(first.read_frame(), 3)) << first.error();
  EXPECT_TRUE(readable.wait_for_completion(kWait)) << describe(readable);
  EXPECT_TRUE(memory_unchanged());
}

TEST_F(TcpHostileTest, DoneWithAWrongTokenDoesNotEndTheOperation) {
  auto readable = owner_.create_readable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(readable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client));
  FrameHeader done = done_frame(t, 1, transport::Access::read, wire_status(ErrorCode::Cancelled));
  done.token = flipped(t.token);
  ASSERT_TRUE(client.send_frame(done, "forged")) << client.error();
  EXPECT_TRUE(is_status(client.read_frame(), 1, ErrorCode::AccessDenied,
                        "no live operation matches this id and token"))
      << client.error();
  // A DONE that names no access kind is refused, and the connection stays usable.
  ASSERT_TRUE(client.send_frame(done_frame(t, 2, transport::Access{}, 0))) << client.error();
  EXPECT_TRUE(
      is_status(client.read_frame(), 2, ErrorCode::ProtocolError, "DONE names no access kind"))
      << client.error();
  EXPECT_EQ(readable.status(), OperationStatus::initialized);
  expect_peer_reads(readable, kSize, kSeed);
}

// ---------------------------------------------------------------------------------------
// Kinds

TEST_F(TcpHostileTest, WriteToAReadableIsDeniedAndItsPayloadDiscarded) {
  auto readable = owner_.create_readable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(readable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client));
  const std::vector<std::byte> junk(8192, std::byte{0});
  ASSERT_TRUE(client.send_frame(request(FrameType::write, t, 1, t.base, junk.size()), {}, junk))
      << client.error();
  EXPECT_TRUE(is_status(client.read_frame(), 1, ErrorCode::AccessDenied,
                        "the operation is readable; it cannot be written"))
      << client.error();
  EXPECT_TRUE(memory_unchanged());
  // The payload was skipped exactly: the next frame is read as a frame.
  ASSERT_TRUE(client.send_frame(request(FrameType::read, t, 2, t.base + 8, 8))) << client.error();
  EXPECT_TRUE(is_data(client.read_frame(), 2, 8, kSeed, 8)) << client.error();
}

TEST_F(TcpHostileTest, ReadFromAWritableIsDenied) {
  auto writable = owner_.create_writable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(writable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client));
  ASSERT_TRUE(client.send_frame(request(FrameType::read, t, 1, t.base, kSize))) << client.error();
  EXPECT_TRUE(is_status(client.read_frame(), 1, ErrorCode::AccessDenied,
                        "the operation is writable; it cannot be read"))
      << client.error();
  EXPECT_TRUE(memory_unchanged());
  EXPECT_EQ(writable.status(), OperationStatus::initialized);
}

TEST_F(TcpHostileTest, RefusedWritePayloadIsDiscarded) {
  auto writable = owner_.create_writable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(writable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client));
  FrameHeader h = request(FrameType::write, t, 1, t.base, kSize);
  h.token = flipped(t.token);
  const std::vector<std::byte> junk(kSize, std::byte{0xee});
  ASSERT_TRUE(client.send_frame(h, {}, junk)) << client.error();
  EXPECT_TRUE(is_status(client.read_frame(), 1, ErrorCode::AccessDenied,
                        "no live operation matches this id and token"))
      << client.error();
  EXPECT_TRUE(memory_unchanged());
  // The stream is still in frame: a WRITE of zero bytes is answered as such.
  ASSERT_TRUE(client.send_frame(request(FrameType::write, t, 2, t.base, 0))) << client.error();
  EXPECT_TRUE(is_status(client.read_frame(), 2, ErrorCode::AccessDenied, "empty write"))
      << client.error();
  EXPECT_TRUE(memory_unchanged());
  EXPECT_EQ(writable.status(), OperationStatus::initialized);
}

// ---------------------------------------------------------------------------------------
// Ranges and lengths

TEST_F(TcpHostileTest, ReadOutsideTheDescriptorIsDenied) {
  auto readable = owner_.create_readable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(readable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client));
  struct Case {
    std::uint64_t addr;
    std::uint64_t len;
  };
  const Case cases[] = {
      {t.base + t.size - 16, 32},  // runs past the end
      {t.base + t.size, 1},        // one past the end
      {t.base - 1, 1},             // one before the start
      {t.base, t.size + 1},        // one longer than the descriptor
      {t.base + t.size - 1, 2},
  };
  std::uint64_t req = 0;
  for (const Case& c : cases) {
    ++req;
    ASSERT_TRUE(client.send_frame(request(FrameType::read, t, req, c.addr, c.len)))
        << client.error();
    EXPECT_TRUE(is_status(client.read_frame(), req, ErrorCode::AccessDenied,
                          "is outside the operation's memory"))
        << client.error();
  }
  // The exact last byte is inside.
  ASSERT_TRUE(client.send_frame(request(FrameType::read, t, 100, t.base + t.size - 1, 1)))
      << client.error();
  EXPECT_TRUE(is_data(client.read_frame(), 100, 1, kSeed, kSize - 1)) << client.error();
  EXPECT_TRUE(memory_unchanged());
}

TEST_F(TcpHostileTest, ReadWhoseEndWrapsIsDenied) {
  auto readable = owner_.create_readable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(readable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client));
  struct Case {
    std::uint64_t addr;
    std::uint64_t len;
  };
  const Case cases[] = {
      {kMax - 7, 16},     // addr + len wraps to 8
      {kMax, 1},          // the very last address
      {kMax - 15, 4096},  // wraps well past 0
  };
  std::uint64_t req = 0;
  for (const Case& c : cases) {
    ++req;
    ASSERT_TRUE(client.send_frame(request(FrameType::read, t, req, c.addr, c.len)))
        << client.error();
    EXPECT_TRUE(is_status(client.read_frame(), req, ErrorCode::AccessDenied,
                          "is outside the operation's memory"))
        << client.error();
  }
  EXPECT_TRUE(memory_unchanged());
}

TEST(TcpHostileNoLimit, ReadWhoseEndWrapsIsDeniedByTheRangeCheckAlone) {
  // With no request limit, only check 4 (the range, without overflow) stands between a
  // wrapping request and the owner's memory.
  Connector owner(owner_options(std::numeric_limits<std::size_t>::max()));
  constexpr std::size_t kSize = 64u << 10;
  auto memory = patterned(kSize, 9);
  auto readable = owner.create_readable({Descriptor(memory.data(), kSize)});
  const Target t = target_of(readable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client));
  struct Case {
    std::uint64_t addr;
    std::uint64_t len;
  };
  const Case cases[] = {
      {t.base + 16, kMax - 15},  // addr + len wraps to exactly base
      {t.base + 1, kMax},        // addr + len wraps to base
      {t.base, kMax},
      {t.base + 8, kMax - t.base - 7},  // addr + len wraps to exactly 0
  };
  std::uint64_t req = 0;
  for (const Case& c : cases) {
    ++req;
    ASSERT_TRUE(client.send_frame(request(FrameType::read, t, req, c.addr, c.len)))
        << client.error();
    EXPECT_TRUE(is_status(client.read_frame(), req, ErrorCode::AccessDenied,
                          "is outside the operation's memory"))
        << client.error();
  }
  EXPECT_EQ(first_mismatch(memory.data(), kSize, 9), -1);
  EXPECT_EQ(readable.status(), OperationStatus::initialized);
  expect_serves_well_behaved_peer(owner);
}

TEST_F(TcpHostileTest, ReadLongerThanMaxRequestIsDenied) {
  auto readable = owner_.create_readable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(readable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client));
  const std::uint64_t lens[] = {kDefaultMaxRequest + 1, kMax};
  std::uint64_t req = 0;
  for (std::uint64_t len : lens) {
    ++req;
    ASSERT_TRUE(client.send_frame(request(FrameType::read, t, req, t.base, len))) << client.error();
    EXPECT_TRUE(is_status(client.read_frame(), req, ErrorCode::AccessDenied,
                          "read of " + std::to_string(len) + " bytes: requests take 1 to " +
                              std::to_string(kDefaultMaxRequest) + " bytes"))
        << client.error();
  }
  // Zero bytes is no request either.
  ASSERT_TRUE(client.send_frame(request(FrameType::read, t, 10, t.base, 0))) << client.error();
  EXPECT_TRUE(is_status(client.read_frame(), 10, ErrorCode::AccessDenied, "read of 0 bytes"))
      << client.error();
  EXPECT_TRUE(memory_unchanged());
  EXPECT_EQ(readable.status(), OperationStatus::initialized);
}

TEST(TcpHostileSmallLimit, ReadInsideTheDescriptorButOverTheLimitIsDenied) {
  // The limit holds on its own, not only through the range check.
  Connector owner(owner_options(4096));
  constexpr std::size_t kSize = 64u << 10;
  auto memory = patterned(kSize, 11);
  auto readable = owner.create_readable({Descriptor(memory.data(), kSize)});
  const Target t = target_of(readable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client));
  ASSERT_TRUE(client.send_frame(request(FrameType::read, t, 1, t.base, 4097))) << client.error();
  EXPECT_TRUE(
      is_status(client.read_frame(), 1, ErrorCode::AccessDenied, "requests take 1 to 4096 bytes"))
      << client.error();
  ASSERT_TRUE(client.send_frame(request(FrameType::read, t, 2, t.base, 4096))) << client.error();
  EXPECT_TRUE(is_data(client.read_frame(), 2, 4096, 11, 0)) << client.error();
  EXPECT_EQ(first_mismatch(memory.data(), kSize, 11), -1);
}

TEST_F(TcpHostileTest, HugeWriteGetsAProtocolErrorNoticeAndIsClosed) {
  auto writable = owner_.create_writable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(writable.metadata());
  for (std::uint64_t len : {kDefaultMaxRequest + 1, kMax}) {
    RawClient client(t.address);
    ASSERT_TRUE(greeted(client));
    // Only the header: a server that waited for the payload would time out here.
    ASSERT_TRUE(client.send_frame(request(FrameType::write, t, 1, t.base, len))) << client.error();
    EXPECT_TRUE(is_status(client.read_frame(), 0, ErrorCode::ProtocolError,
                          "write of " + std::to_string(len) + " bytes exceeds the limit of " +
                              std::to_string(kDefaultMaxRequest)))
        << client.error();
    EXPECT_TRUE(client.closed_by_peer()) << client.error();
  }
  EXPECT_TRUE(memory_unchanged());
  // A valid token in a refused frame claims nothing.
  EXPECT_EQ(writable.status(), OperationStatus::initialized);
}

// ---------------------------------------------------------------------------------------
// Malformed streams

TEST_F(TcpHostileTest, GarbageBytesGetAProtocolErrorNoticeAndAreClosed) {
  auto writable = owner_.create_writable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(writable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client));
  std::vector<std::byte> garbage(transport::wire::kHeaderSize, std::byte{0xab});
  ASSERT_TRUE(client.send_bytes(garbage.data(), garbage.size())) << client.error();
  EXPECT_TRUE(is_status(client.read_frame(), 0, ErrorCode::ProtocolError, "bad magic"))
      << client.error();
  EXPECT_TRUE(client.closed_by_peer()) << client.error();
  EXPECT_TRUE(memory_unchanged());
  EXPECT_EQ(writable.status(), OperationStatus::initialized);
}

TEST_F(TcpHostileTest, UnknownVersionTypeOrOverlongTextCloseTheConnection) {
  auto readable = owner_.create_readable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(readable.metadata());
  struct Case {
    FrameHeader header;
    std::string point;
  };
  std::vector<Case> cases;
  FrameHeader bad_version = request(FrameType::read, t, 1, t.base, 16);
  bad_version.version = 2;
  cases.push_back({bad_version, "unsupported protocol version 2"});
  FrameHeader bad_type = request(FrameType::read, t, 1, t.base, 16);
  bad_type.type = static_cast<FrameType>(14);
  cases.push_back({bad_type, "unknown frame type 14"});
  for (const Case& c : cases) {
    RawClient client(t.address);
    ASSERT_TRUE(greeted(client));
    ASSERT_TRUE(client.send_frame(c.header)) << client.error();
    EXPECT_TRUE(is_status(client.read_frame(), 0, ErrorCode::ProtocolError, c.point))
        << client.error();
    EXPECT_TRUE(client.closed_by_peer()) << client.error();
  }
  {
    // msg_len is announced but the text never sent: the header alone must close it.
    RawClient client(t.address);
    ASSERT_TRUE(greeted(client));
    FrameHeader h = done_frame(t, 1, transport::Access::read, wire_status(ErrorCode::Cancelled));
    h.msg_len = transport::wire::kMaxMessage + 1;
    const auto bytes = transport::wire::encode(h);
    ASSERT_TRUE(client.send_bytes(bytes.data(), bytes.size())) << client.error();
    EXPECT_TRUE(is_status(client.read_frame(), 0, ErrorCode::ProtocolError, "message of 4097"))
        << client.error();
    EXPECT_TRUE(client.closed_by_peer()) << client.error();
  }
  EXPECT_TRUE(memory_unchanged());
  EXPECT_EQ(readable.status(), OperationStatus::initialized);
  expect_peer_reads(readable, kSize, kSeed);
}

TEST_F(TcpHostileTest, ServerOnlyFramesFromAClientCloseTheConnection) {
  auto readable = owner_.create_readable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(readable.metadata());
  for (FrameType type : {FrameType::data, FrameType::status, FrameType::hello}) {
    RawClient client(t.address);
    ASSERT_TRUE(greeted(client));
    ASSERT_TRUE(client.send_frame(request(type, t, 1, t.base, 0))) << client.error();
    EXPECT_TRUE(is_status(
        client.read_frame(), 0, ErrorCode::ProtocolError,
        "unexpected frame type " + std::to_string(static_cast<int>(type)) + " from a client"))
        << client.error();
    EXPECT_TRUE(client.closed_by_peer()) << client.error();
  }
  EXPECT_TRUE(memory_unchanged());
  EXPECT_EQ(readable.status(), OperationStatus::initialized);
}

TEST_F(TcpHostileTest, FirstFrameThatIsNotHelloClosesTheConnection) {
  auto readable = owner_.create_readable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(readable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(client.connected()) << client.error();
  // A valid READ, but before HELLO.
  ASSERT_TRUE(client.send_frame(request(FrameType::read, t, 1, t.base, 64))) << client.error();
  EXPECT_TRUE(is_status(client.read_frame(), 0, ErrorCode::ProtocolError,
                        "expected HELLO as the first frame"))
      << client.error();
  EXPECT_TRUE(client.closed_by_peer()) << client.error();
  EXPECT_TRUE(memory_unchanged());
  // The token it carried claimed nothing.
  EXPECT_EQ(readable.status(), OperationStatus::initialized);
  expect_peer_reads(readable, kSize, kSeed);
}

TEST_F(TcpHostileTest, WriteBeforeHelloTouchesNoMemory) {
  auto writable = owner_.create_writable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(writable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(client.connected()) << client.error();
  const std::vector<std::byte> junk(4096, std::byte{0x11});
  ASSERT_TRUE(client.send_frame(request(FrameType::write, t, 1, t.base, junk.size()), {}, junk))
      << client.error();
  EXPECT_TRUE(is_status(client.read_frame(), 0, ErrorCode::ProtocolError,
                        "expected HELLO as the first frame"))
      << client.error();
  EXPECT_TRUE(client.closed_by_peer()) << client.error();
  EXPECT_TRUE(memory_unchanged());
  EXPECT_EQ(writable.status(), OperationStatus::initialized);
}

TEST_F(TcpHostileTest, TruncatedHeaderThenCloseIsHarmless) {
  auto readable = owner_.create_readable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(readable.metadata());
  {
    RawClient client(t.address);
    ASSERT_TRUE(greeted(client));
    const auto bytes = transport::wire::encode(request(FrameType::read, t, 1, t.base, kSize));
    ASSERT_TRUE(client.send_bytes(bytes.data(), bytes.size() / 2)) << client.error();
  }  // closes the socket halfway through the header
  EXPECT_TRUE(memory_unchanged());
  EXPECT_EQ(readable.status(), OperationStatus::initialized);
  expect_peer_reads(readable, kSize, kSeed);
}

TEST_F(TcpHostileTest, TruncatedWritePayloadErrorsTheWritable) {
  auto writable = owner_.create_writable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(writable.metadata());
  constexpr std::size_t kSent = 100;
  {
    RawClient client(t.address);
    ASSERT_TRUE(greeted(client, "raw-quitter"));
    const std::vector<std::byte> part(kSent, std::byte{0});
    ASSERT_TRUE(client.send_frame(request(FrameType::write, t, 1, t.base, 4096), {}, part))
        << client.error();
  }  // the peer goes away with 3996 bytes of its WRITE still owed
  auto error = wait_for_failure(writable);
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->code(), ErrorCode::PeerLost) << error->what();
  EXPECT_TRUE(contains(error->message(), "raw-quitter")) << error->what();
  EXPECT_EQ(writable.status(), OperationStatus::errored);
  // The bytes that arrived may have landed (the payload goes straight to memory); nothing
  // past them was touched.
  EXPECT_EQ(first_mismatch(memory_.data() + kSent, kSize - kSent, kSeed, kSent), -1);
}

TEST_F(TcpHostileTest, ProtocolErrorOnOneConnectionLeavesOthersAlone) {
  auto readable = owner_.create_readable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(readable.metadata());
  RawClient good(t.address);
  ASSERT_TRUE(greeted(good, "raw-good"));
  ASSERT_TRUE(good.send_frame(request(FrameType::read, t, 1, t.base, 1024))) << good.error();
  ASSERT_TRUE(is_data(good.read_frame(), 1, 1024, kSeed, 0)) << good.error();

  RawClient bad(t.address);
  ASSERT_TRUE(greeted(bad));
  std::vector<std::byte> garbage(transport::wire::kHeaderSize, std::byte{0xcd});
  ASSERT_TRUE(bad.send_bytes(garbage.data(), garbage.size())) << bad.error();
  EXPECT_TRUE(is_status(bad.read_frame(), 0, ErrorCode::ProtocolError, "bad magic")) << bad.error();
  EXPECT_TRUE(bad.closed_by_peer()) << bad.error();

  ASSERT_TRUE(good.send_frame(request(FrameType::read, t, 2, t.base + 1024, kSize - 1024)))
      << good.error();
  EXPECT_TRUE(is_data(good.read_frame(), 2, kSize - 1024, kSeed, 1024)) << good.error();
  ASSERT_TRUE(good.send_frame(done_frame(t, 3, transport::Access::read, 0))) << good.error();
  EXPECT_TRUE(is_ok(good.read_frame(), 3)) << good.error();
  EXPECT_TRUE(readable.wait_for_completion(kWait)) << describe(readable);
  EXPECT_TRUE(memory_unchanged());
}

// ---------------------------------------------------------------------------------------
// Ending early, and clients that do not read

TEST(TcpHostileEnd, ReadsQueuedBeforeAFailingDoneNeverTouchTheMemoryAfter) {
  // A claimant queues 16 MiB of reads, then says it failed, and reads nothing yet. When the
  // owner sees its readable end, the memory is the owner's again: whatever the client reads
  // later must not come from it.
  Connector owner(test::named("owner"));
  constexpr std::size_t kBig = 16u << 20;
  std::vector<std::byte> memory(kBig, std::byte{0x11});
  auto readable = owner.create_readable({Descriptor(memory.data(), kBig)});
  const Target t = target_of(readable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client));
  for (std::uint64_t i = 0; i < 8; ++i)
    ASSERT_TRUE(
        client.send_frame(request(FrameType::read, t, i + 1, t.base + i * (2u << 20), 2u << 20)));
  ASSERT_TRUE(client.send_frame(
      done_frame(t, 9, transport::Access::read, wire_status(ErrorCode::Cancelled)), "gave up"));
  auto e = wait_for_failure(readable);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), ErrorCode::Cancelled);
  std::fill(memory.begin(), memory.end(), std::byte{0xee});
  std::size_t reused = 0;
  std::size_t answers = 0;
  while (answers < 9) {
    auto f = client.read_frame();
    ASSERT_TRUE(f) << client.error();
    ++answers;
    for (std::byte b : f->payload) reused += b == std::byte{0xee};
  }
  EXPECT_EQ(reused, 0u) << "bytes sent from memory the owner had got back";
}

// Writes the first half of a writable `times` times, then says DONE: the writable must refuse
// it (only half its bytes were written) and fail.
void expect_half_written_refused(Connector& owner, std::vector<std::byte>& memory, int times) {
  const std::size_t size = memory.size();
  auto writable = owner.create_writable({Descriptor(memory.data(), size)});
  const Target t = target_of(writable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client));
  std::vector<std::byte> half(size / 2, std::byte{0x42});
  std::uint64_t req = 1;
  for (int i = 0; i < times; ++i, ++req) {
    ASSERT_TRUE(
        client.send_frame(request(FrameType::write, t, req, t.base, half.size()), {}, half));
    EXPECT_TRUE(is_ok(client.read_frame(), req));
  }
  ASSERT_TRUE(client.send_frame(done_frame(t, req, transport::Access::write, 0)));
  EXPECT_TRUE(is_status(client.read_frame(), req, ErrorCode::ProtocolError,
                        "said it was done after writing " + std::to_string(size / 2) + " of " +
                            std::to_string(size) + " bytes"));
  auto e = wait_for_failure(writable);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), ErrorCode::ProtocolError);
}

TEST_F(TcpHostileTest, DoneBeforeEveryByteWasWrittenDoesNotCompleteTheWritable) {
  expect_half_written_refused(owner_, memory_, 1);
}

// Writing the same half twice adds up to the total, but covers half the bytes: the writable
// is complete only when every exposed byte was written.
TEST_F(TcpHostileTest, OverlappingWritesCannotFakeCompletion) {
  expect_half_written_refused(owner_, memory_, 2);
}

// A peer's text that is not valid UTF-8 (its HELLO name, its reason) reaches errors and JSON
// as valid UTF-8, and the operation still ends.
TEST_F(TcpHostileTest, PeerTextThatIsNotUtf8IsSanitizedAndTheOperationEnds) {
  auto writable = owner_.create_writable({Descriptor(memory_.data(), kSize)});
  const Target t = target_of(writable.metadata());
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client, "bad\xff\xfename"));
  std::vector<std::byte> some(16, std::byte{1});
  ASSERT_TRUE(client.send_frame(request(FrameType::write, t, 1, t.base, some.size()), {}, some));
  EXPECT_TRUE(is_ok(client.read_frame(), 1));
  ASSERT_TRUE(client.send_frame(
      done_frame(t, 2, transport::Access::write, wire_status(ErrorCode::Cancelled)),
      "why\xc0\xaf"));
  auto e = wait_for_failure(writable);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), ErrorCode::Cancelled);
  const std::string text = e->what();
  EXPECT_EQ(text.find("\xff"), std::string::npos) << text;
  EXPECT_NE(text.find("\xef\xbf\xbd"), std::string::npos) << text;
  // The text goes into JSON without throwing.
  RdmaMetadata m = writable.metadata();
  m.owner.name = text;
  EXPECT_NO_THROW((void)RdmaMetadata::from_json(m.to_json()));
}

TEST_F(TcpHostileTest, AClientThatNeverReadsCannotGrowTheServerWithoutBound) {
  // Refused requests are answered; a client that never reads the answers gets no more of
  // its requests read once the server's queue is full.
  auto readable = owner_.create_readable({Descriptor(memory_.data(), kSize)});
  Target t = target_of(readable.metadata());
  t.token = flipped(t.token);
  RawClient client(t.address);
  ASSERT_TRUE(greeted(client));
  timeval tv{};
  tv.tv_usec = 500000;  // a stalled send gives up after half a second
  setsockopt(client.fd(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  constexpr std::uint64_t kFrames = 1u << 20;  // 64 MiB of requests
  std::uint64_t sent = 0;
  std::vector<std::byte> batch;
  for (int i = 0; i < 1024; ++i) {
    auto bytes = transport::wire::encode(request(FrameType::read, t, 1, t.base, 64));
    batch.insert(batch.end(), bytes.begin(), bytes.end());
  }
  while (sent < kFrames && client.send_bytes(batch.data(), batch.size())) sent += 1024;
  EXPECT_LT(sent, kFrames) << "the server read every request although nobody read its answers";
}

}  // namespace
}  // namespace ferry
