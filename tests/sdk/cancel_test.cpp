// Cancel mid-transfer on each of the four operation kinds, deadlines, and what a late peer
// meets afterwards.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>

#include <ferry/ferry.hpp>

#include <uv.h>

#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using test::ended_with;
using test::eventually;

constexpr std::size_t kBig = std::size_t{256} << 20;
constexpr std::byte kSentinel{0xab};

// A connector whose transfers move one small chunk per round trip, so that a 256 MiB
// transfer takes seconds and a cancel surely lands in the middle of it.
ConnectorOptions slow(std::string name) {
  ConnectorOptions o = test::named(std::move(name));
  o.tcp.chunk_size = 4096;
  o.tcp.window = 4096;
  // cma between processes of this host: one small copy job at a time, never on the loop.
  o.cma.chunk_size = 4096;
  o.cma.parallel = 1;
  o.cma.inline_max = 0;
  return o;
}

std::unique_ptr<std::byte[]> big_buffer(std::byte fill) { return test::filled(kBig, fill); }

TEST(Cancel, ActiveReadMidTransfer) {
  Connector owner(test::named("owner"));
  Connector reader(slow("reader"));
  auto src = big_buffer(std::byte{0x11});
  auto dst = big_buffer(std::byte{0});
  auto readable = owner.create_readable({Descriptor(src.get(), kBig)});
  auto read = reader.begin_read(readable.metadata(), {Descriptor(dst.get(), kBig)});
  ASSERT_TRUE(eventually([&] { return readable.status() == OperationStatus::in_progress; }));
  read.cancel();
  EXPECT_EQ(read.status(), OperationStatus::cancelled);
  EXPECT_EQ(read.error()->code(), ErrorCode::Cancelled);
  // From here on the destination is ours again: nothing may land in it.
  std::memset(dst.get(), static_cast<int>(kSentinel), kBig);
  // The owner hears of the cancel from the reader and fails its side with that reason.
  EXPECT_EQ(ended_with(readable), ErrorCode::Cancelled);
  EXPECT_NE(readable.error()->message().find("reader"), std::string::npos)
      << readable.error()->message();
  EXPECT_EQ(test::first_not(dst.get(), kBig, kSentinel), -1);
  // A late attempt with the same metadata finds a dead token.
  auto again = reader.begin_read(readable.metadata(), {Descriptor(dst.get(), kBig)});
  EXPECT_EQ(ended_with(again), ErrorCode::AccessDenied);
}

TEST(Cancel, PassiveReadableMidTransfer) {
  Connector owner(test::named("owner"));
  Connector reader(slow("reader"));
  auto src = big_buffer(std::byte{0x11});
  auto dst = big_buffer(std::byte{0});
  auto readable = owner.create_readable({Descriptor(src.get(), kBig)});
  auto read = reader.begin_read(readable.metadata(), {Descriptor(dst.get(), kBig)});
  ASSERT_TRUE(eventually([&] { return readable.status() == OperationStatus::in_progress; }));
  readable.cancel();
  EXPECT_EQ(readable.status(), OperationStatus::cancelled);
  // The source may be reused at once: no byte sent after this may come from it.
  std::memset(src.get(), static_cast<int>(kSentinel), kBig);
  // The owner tells its claimant why: Cancelled, naming the owner (not an access refusal).
  EXPECT_EQ(ended_with(read), ErrorCode::Cancelled);
  EXPECT_NE(read.error()->message().find("'owner'"), std::string::npos) << read.error()->message();
  EXPECT_NE(read.error()->message().find("cancelled"), std::string::npos)
      << read.error()->message();
  EXPECT_EQ(test::first_not_either(dst.get(), kBig, std::byte{0x11}, std::byte{0}), -1)
      << "a byte came from reused memory";
}

TEST(Cancel, ActiveWriteMidTransfer) {
  Connector owner(test::named("owner"));
  Connector writer(slow("writer"));
  auto src = big_buffer(std::byte{0x22});
  auto dst = big_buffer(std::byte{0});
  auto writable = owner.create_writable({Descriptor(dst.get(), kBig)});
  auto write = writer.begin_write({Descriptor(src.get(), kBig)}, writable.metadata());
  ASSERT_TRUE(eventually([&] { return writable.status() == OperationStatus::in_progress; }));
  write.cancel();
  EXPECT_EQ(write.status(), OperationStatus::cancelled);
  std::memset(src.get(), static_cast<int>(kSentinel), kBig);
  EXPECT_EQ(ended_with(writable), ErrorCode::Cancelled);
  EXPECT_EQ(test::first_not_either(dst.get(), kBig, std::byte{0x22}, std::byte{0}), -1)
      << "a byte came from reused memory";
}

TEST(Cancel, PassiveWritableMidTransfer) {
  Connector owner(test::named("owner"));
  Connector writer(slow("writer"));
  auto src = big_buffer(std::byte{0x22});
  auto dst = big_buffer(std::byte{0});
  auto writable = owner.create_writable({Descriptor(dst.get(), kBig)});
  auto write = writer.begin_write({Descriptor(src.get(), kBig)}, writable.metadata());
  ASSERT_TRUE(eventually([&] { return writable.status() == OperationStatus::in_progress; }));
  writable.cancel();
  EXPECT_EQ(writable.status(), OperationStatus::cancelled);
  std::memset(dst.get(), static_cast<int>(kSentinel), kBig);
  ErrorCode code = ended_with(write);
  EXPECT_TRUE(code == ErrorCode::Cancelled || code == ErrorCode::AccessDenied) << to_string(code);
  EXPECT_EQ(test::first_not(dst.get(), kBig, kSentinel), -1) << "a byte landed after cancel()";
}

TEST(Cancel, DestroyingAnUnfinishedPassiveOperationKillsItsToken) {
  Connector owner(test::named("owner"));
  Connector peer(test::named("peer"));
  auto src = test::patterned(4096, 1);
  auto dst = test::buffer(4096);
  RdmaMetadata meta;
  {
    auto readable = owner.create_readable({Descriptor(src.data(), src.size())});
    meta = readable.metadata();
  }
  auto read = peer.begin_read(meta, {Descriptor(dst.data(), dst.size())});
  EXPECT_EQ(ended_with(read), ErrorCode::AccessDenied);
  EXPECT_EQ(test::first_not(dst.data(), dst.size(), std::byte{0}), -1);
}

TEST(Cancel, CancelAfterCompletionChangesNothing) {
  Connector owner(test::named("owner"));
  Connector peer(test::named("peer"));
  auto src = test::patterned(4096, 1);
  auto dst = test::buffer(4096);
  auto readable = owner.create_readable({Descriptor(src.data(), src.size())});
  auto read = peer.begin_read(readable.metadata(), {Descriptor(dst.data(), dst.size())});
  read.wait_for_completion();
  read.cancel();
  EXPECT_EQ(read.status(), OperationStatus::complete);
  EXPECT_FALSE(read.error().has_value());
}

TEST(Deadline, PassiveOperationWithoutPeerTimesOutAndItsTokenDies) {
  Connector owner(test::named("owner"));
  Connector peer(test::named("peer"));
  auto src = test::patterned(4096, 1);
  auto dst = test::buffer(4096);
  OperationOptions o;
  o.timeout = 100ms;
  auto start = std::chrono::steady_clock::now();
  auto readable = owner.create_readable({Descriptor(src.data(), src.size())}, o);
  EXPECT_EQ(ended_with(readable), ErrorCode::Timeout);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 100ms);
  EXPECT_NE(readable.error()->message().find("100 ms"), std::string::npos);
  auto late = peer.begin_read(readable.metadata(), {Descriptor(dst.data(), dst.size())});
  EXPECT_EQ(ended_with(late), ErrorCode::AccessDenied);
  EXPECT_NE(late.error()->message().find("no live operation"), std::string::npos)
      << late.error()->message();
}

TEST(Deadline, ActiveOperationTimesOutAndTellsThePeer) {
  Connector owner(test::named("owner"));
  Connector reader(slow("reader"));
  auto src = big_buffer(std::byte{0x11});
  auto dst = big_buffer(std::byte{0});
  auto readable = owner.create_readable({Descriptor(src.get(), kBig)});
  OperationOptions o;
  o.timeout = 200ms;
  auto read = reader.begin_read(readable.metadata(), {Descriptor(dst.get(), kBig)}, o);
  EXPECT_EQ(ended_with(read), ErrorCode::Timeout);
  EXPECT_EQ(ended_with(readable), ErrorCode::Timeout);
  EXPECT_NE(readable.error()->message().find("reader"), std::string::npos);
}

TEST(Deadline, ConnectorDefaultAppliesWhenTheOperationSetsNone) {
  ConnectorOptions options = test::named("owner");
  options.default_timeout = 50ms;
  Connector owner(options);
  auto src = test::patterned(64, 1);
  auto readable = owner.create_writable({Descriptor(src.data(), src.size())});
  EXPECT_EQ(ended_with(readable), ErrorCode::Timeout);
}

TEST(Deadline, NegativeTimeoutIsRefused) {
  Connector owner(test::named("owner"));
  auto src = test::patterned(64, 1);
  OperationOptions o;
  o.timeout = -5ms;
  EXPECT_THROW((void)owner.create_readable({Descriptor(src.data(), src.size())}, o), Error);
}

TEST(Deadline, PassiveDeadlineMidTransferTellsTheReaderTimeoutNamingTheOwner) {
  Connector owner(test::named("deadline-owner"));
  Connector reader(slow("reader"));
  auto src = big_buffer(std::byte{0x11});
  auto dst = big_buffer(std::byte{0});
  OperationOptions o;
  o.timeout = 300ms;
  auto readable = owner.create_readable({Descriptor(src.get(), kBig)}, o);
  auto read = reader.begin_read(readable.metadata(), {Descriptor(dst.get(), kBig)});
  EXPECT_EQ(ended_with(readable), ErrorCode::Timeout);
  EXPECT_EQ(ended_with(read), ErrorCode::Timeout) << read.error()->message();
  EXPECT_NE(read.error()->message().find("deadline-owner"), std::string::npos)
      << read.error()->message();
}

TEST(Shutdown, ClosingTheOwnerMidTransferErrorsThePeerNamingIt) {
  auto owner = std::make_unique<Connector>(test::named("closing-owner"));
  Connector reader(slow("reader"));
  auto src = big_buffer(std::byte{0x11});
  auto dst = big_buffer(std::byte{0});
  auto readable = owner->create_readable({Descriptor(src.get(), kBig)});
  auto read = reader.begin_read(readable.metadata(), {Descriptor(dst.get(), kBig)});
  ASSERT_TRUE(eventually([&] { return readable.status() == OperationStatus::in_progress; }));
  owner.reset();
  // The owner's handle outlives its connector and reports why it ended.
  EXPECT_EQ(readable.status(), OperationStatus::cancelled);
  EXPECT_NE(readable.error()->message().find("connector was closed"), std::string::npos);
  EXPECT_NO_THROW(readable.cancel());
  auto start = std::chrono::steady_clock::now();
  // A connector closed mid-transfer tells its peers Cancelled, not a reset.
  EXPECT_EQ(ended_with(read), ErrorCode::Cancelled) << read.error()->message();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  EXPECT_NE(read.error()->message().find("closing-owner"), std::string::npos)
      << read.error()->message();
}

// A writable may end complete after its writer was cancelled (the last bytes may have landed
// first), but only with every byte in place: never complete with bytes missing.
void expect_complete_means_all_bytes(const WritableOperation& writable,
                                     const std::vector<std::byte>& dst, std::uint64_t seed) {
  try {
    if (!writable.wait_for_completion(30s)) {
      ADD_FAILURE() << "the writable did not end";
      return;
    }
    EXPECT_EQ(test::first_mismatch(dst.data(), dst.size(), seed), -1)
        << "complete with bytes missing";
  } catch (const Error& e) {
    EXPECT_TRUE(e.code() == ErrorCode::Cancelled || e.code() == ErrorCode::Timeout) << e.what();
  }
}

TEST(Cancel, AWriteCancelledRightAfterItBeganNeverCompletesTheWritableHalfWritten) {
  Connector owner(test::named("owner"));
  Connector writer(test::named("writer"));
  constexpr std::size_t kSize = 16u << 20;
  auto src = test::patterned(kSize, 71);
  for (int round = 0; round < 5; ++round) {
    auto dst = test::buffer(kSize);
    auto writable = owner.create_writable({Descriptor(dst.data(), kSize)});
    auto write = writer.begin_write({Descriptor(src.data(), kSize)}, writable.metadata());
    write.cancel();
    expect_complete_means_all_bytes(writable, dst, 71);
  }
}

TEST(Deadline, AWriteThatTimesOutNeverCompletesTheWritableHalfWritten) {
  Connector owner(test::named("owner"));
  ConnectorOptions wide = test::named("writer");
  wide.tcp.window = 128u << 20;  // everything queued at once, DONE right behind it
  Connector writer(wide);
  constexpr std::size_t kSize = 128u << 20;
  auto src = test::patterned(kSize, 72);
  auto dst = test::buffer(kSize);
  auto writable = owner.create_writable({Descriptor(dst.data(), kSize)});
  OperationOptions o;
  o.timeout = 20ms;
  auto write = writer.begin_write({Descriptor(src.data(), kSize)}, writable.metadata(), o);
  expect_complete_means_all_bytes(writable, dst, 72);
}

// Off the loop, begin_* hands the operation to the loop without waiting. When the loop closes
// before it runs the start (here: an embedded loop that never ran), the operation ends
// cancelled, its waiters and callbacks told; it never stays in_progress.
TEST(Shutdown, AStartTheClosingLoopNeverRanEndsCancelled) {
  Connector owner(test::named("owner"));
  auto src = test::patterned(4096, 5);
  auto dst = test::buffer(4096);
  auto readable = owner.create_readable({Descriptor(src.data(), src.size())});

  uv_loop_t loop;
  ASSERT_EQ(uv_loop_init(&loop), 0);
  auto options = test::named("peer");
  options.loop = &loop;
  auto peer = std::make_unique<Connector>(options);
  ReadOperation read;
  std::thread([&] {
    read = peer->begin_read(readable.metadata(), {Descriptor(dst.data(), dst.size())});
  }).join();
  EXPECT_EQ(read.status(), OperationStatus::in_progress);
  std::atomic<int> called{0};
  read.on_complete([&](OperationStatus s, const Error* e) {
    EXPECT_EQ(s, OperationStatus::cancelled);
    EXPECT_NE(e, nullptr);
    ++called;
  });
  peer.reset();  // on the loop's thread, the loop not running: the start is dropped
  EXPECT_EQ(read.status(), OperationStatus::cancelled);
  ASSERT_TRUE(read.error());
  EXPECT_EQ(read.error()->code(), ErrorCode::Cancelled);
  EXPECT_NE(read.error()->message().find("closed"), std::string::npos) << read.error()->message();
  EXPECT_EQ(called.load(), 1);
  uv_run(&loop, UV_RUN_DEFAULT);
  EXPECT_EQ(uv_loop_close(&loop), 0);
}

}  // namespace
}  // namespace ferry
