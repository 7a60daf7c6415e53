// Transfers between two connectors in one process, over TCP on loopback.
#include <gtest/gtest.h>

#include <ferry/ferry.hpp>

#include <atomic>
#include <vector>

#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using test::buffer;
using test::first_mismatch;
using test::patterned;

constexpr auto kWait = std::chrono::seconds(60);

class TransferTest : public ::testing::TestWithParam<std::size_t> {
 protected:
  Connector owner_{test::named("owner")};
  Connector peer_{test::named("peer")};
};

TEST_P(TransferTest, ReadableToRead) {
  const std::size_t size = GetParam();
  auto src = patterned(size, 1);
  auto dst = buffer(size);
  auto readable = owner_.create_readable({Descriptor(src.data(), size)});
  EXPECT_EQ(readable.status(), OperationStatus::initialized);
  auto read = peer_.begin_read(readable.metadata(), {Descriptor(dst.data(), size)});
  ASSERT_TRUE(read.wait_for_completion(kWait));
  ASSERT_TRUE(readable.wait_for_completion(kWait));
  EXPECT_EQ(read.status(), OperationStatus::complete);
  EXPECT_EQ(readable.status(), OperationStatus::complete);
  EXPECT_EQ(first_mismatch(dst.data(), size, 1), -1);
}

// wait() returns the status the operation ended with, or the current one on timeout, and
// never throws the operation's error (wait_for_completion does).
TEST(Wait, ReturnsTheFinalStatusWithoutThrowing) {
  Connector owner(test::named("owner"));
  Connector peer(test::named("peer"));
  auto src = patterned(4096, 3);
  auto dst = buffer(4096);
  auto readable = owner.create_readable({Descriptor(src.data(), src.size())});
  EXPECT_EQ(readable.wait(std::chrono::milliseconds(20)), OperationStatus::initialized);
  auto read = peer.begin_read(readable.metadata(), {Descriptor(dst.data(), dst.size())});
  EXPECT_EQ(read.wait(kWait), OperationStatus::complete);
  EXPECT_EQ(readable.wait(), OperationStatus::complete);
  // A read of a readable that is over fails: wait() says so, wait_for_completion throws.
  auto late = peer.begin_read(readable.metadata(), {Descriptor(dst.data(), dst.size())});
  EXPECT_EQ(late.wait(kWait), OperationStatus::errored);
  ASSERT_TRUE(late.error().has_value());
  EXPECT_EQ(late.error()->code(), ErrorCode::AccessDenied);
  EXPECT_NE(late.error()->message().find("serves one peer, once"), std::string::npos)
      << late.error()->message();
  EXPECT_THROW((void)late.wait_for_completion(kWait), Error);
  auto cancelled = owner.create_writable({Descriptor(dst.data(), dst.size())});
  cancelled.cancel();
  EXPECT_EQ(cancelled.wait(), OperationStatus::cancelled);
  EXPECT_EQ(ReadOperation().status(), OperationStatus::uninitialized);
  EXPECT_THROW((void)ReadOperation().wait(), Error);
}

// A completed operation says whom it was with: the active side the owner its metadata named,
// the passive side the peer that claimed it.
TEST(Peer, BothSidesNameEachOther) {
  for (bool tcp : {false, true}) {
    SCOPED_TRACE(tcp ? "tcp" : "best method");
    Connector owner(tcp ? test::tcp_only("owner") : test::named("owner"));
    Connector peer(tcp ? test::tcp_only("peer") : test::named("peer"));
    auto src = patterned(4096, 4);
    auto dst = buffer(4096);
    auto readable = owner.create_readable({Descriptor(src.data(), src.size())});
    EXPECT_FALSE(readable.peer().has_value());
    auto read = peer.begin_read(readable.metadata(), {Descriptor(dst.data(), dst.size())});
    ASSERT_EQ(read.wait(kWait), OperationStatus::complete);
    ASSERT_EQ(readable.wait(kWait), OperationStatus::complete);
    ASSERT_TRUE(read.peer().has_value());
    EXPECT_EQ(*read.peer(), owner.identity());
    ASSERT_TRUE(readable.peer().has_value());
    EXPECT_EQ(readable.peer()->name, "peer");
    EXPECT_EQ(readable.peer()->id, peer.identity().id);
    EXPECT_EQ(read.method(), tcp ? "tcp" : readable.method());
  }
}

TEST_P(TransferTest, WritableToWrite) {
  const std::size_t size = GetParam();
  auto src = patterned(size, 2);
  auto dst = buffer(size);
  auto writable = owner_.create_writable({Descriptor(dst.data(), size)});
  auto write = peer_.begin_write({Descriptor(src.data(), size)}, writable.metadata());
  ASSERT_TRUE(write.wait_for_completion(kWait));
  ASSERT_TRUE(writable.wait_for_completion(kWait));
  EXPECT_EQ(first_mismatch(dst.data(), size, 2), -1);
}

INSTANTIATE_TEST_SUITE_P(Sizes, TransferTest, ::testing::Values(1, 4096, 1u << 20, 64u << 20),
                         test::size_name);

// Descriptor lists are one byte stream each: 3 remote descriptors may feed 5 local ones.
class ScatterGatherTest : public ::testing::Test {
 protected:
  // Pieces of one patterned stream, placed with gaps inside larger buffers.
  struct Pieces {
    std::vector<std::vector<std::byte>> storage;
    std::vector<Descriptor> descriptors;
  };
  static Pieces split(const std::vector<std::size_t>& sizes, std::uint64_t seed) {
    Pieces p;
    std::uint64_t offset = 0;
    for (std::size_t size : sizes) {
      auto& buf = p.storage.emplace_back(size + 64);
      if (seed != 0) test::fill_pattern(buf.data() + 32, size, seed, offset);
      p.descriptors.emplace_back(buf.data() + 32, size);
      offset += size;
    }
    return p;
  }
  static void expect_stream(const Pieces& p, std::uint64_t seed) {
    std::uint64_t offset = 0;
    for (std::size_t i = 0; i < p.descriptors.size(); ++i) {
      const Descriptor& d = p.descriptors[i];
      EXPECT_EQ(test::first_mismatch(d.bytes(), d.size(), seed, offset), -1) << "piece " << i;
      // The gaps around each piece stay untouched.
      for (std::size_t g = 0; g < 32; ++g) {
        EXPECT_EQ(p.storage[i][g], std::byte{0});
        EXPECT_EQ(p.storage[i][32 + d.size() + g], std::byte{0});
      }
      offset += d.size();
    }
  }
  Connector owner_{test::named("owner")};
  Connector peer_{test::named("peer")};
  // 3 and 5 pieces of the same 3 MiB + 7 bytes stream, cut at different places.
  const std::vector<std::size_t> three_{1000, (3u << 20) - 2000, 1007};
  const std::vector<std::size_t> five_{1, 4096, (2u << 20) + 3, (1u << 20) - 4100, 7};
};

TEST_F(ScatterGatherTest, ThreeRemoteFeedFiveLocalOnRead) {
  auto remote = split(three_, 31);
  auto local = split(five_, 0);
  auto readable = owner_.create_readable(remote.descriptors);
  auto read = peer_.begin_read(readable.metadata(), local.descriptors);
  ASSERT_TRUE(read.wait_for_completion(kWait));
  ASSERT_TRUE(readable.wait_for_completion(kWait));
  expect_stream(local, 31);
}

TEST_F(ScatterGatherTest, FiveLocalFeedThreeRemoteOnWrite) {
  auto remote = split(three_, 0);
  auto local = split(five_, 32);
  auto writable = owner_.create_writable(remote.descriptors);
  auto write = peer_.begin_write(local.descriptors, writable.metadata());
  ASSERT_TRUE(write.wait_for_completion(kWait));
  ASSERT_TRUE(writable.wait_for_completion(kWait));
  expect_stream(remote, 32);
}

TEST_F(ScatterGatherTest, ADescriptorNestedInAnotherHidesNothing) {
  // A buffer and a view into it, exposed together: the read must get both, in order.
  auto buf = patterned(4u << 20, 33);
  auto readable = owner_.create_readable(
      {Descriptor(buf.data(), buf.size()), Descriptor(buf.data() + (1u << 20), 16)});
  auto dst = buffer((4u << 20) + 16);
  auto read = peer_.begin_read(readable.metadata(), {Descriptor(dst.data(), dst.size())});
  ASSERT_TRUE(read.wait_for_completion(kWait));
  EXPECT_EQ(first_mismatch(dst.data(), 4u << 20, 33), -1);
  EXPECT_EQ(first_mismatch(dst.data() + (4u << 20), 16, 33, 1u << 20), -1);
}

TEST(ManyInFlight, TwoHundredFiftySixOperationsShareOneConnection) {
  Connector owner(test::named("owner"));
  Connector peer(test::named("peer"));
  constexpr int kOps = 256;
  constexpr std::size_t kSize = 256 * 1024 + 17;
  std::vector<std::vector<std::byte>> srcs, dsts;
  std::vector<ReadableOperation> readables;
  std::vector<WritableOperation> writables;
  std::vector<Operation> actives;
  for (int i = 0; i < kOps; ++i) {
    bool reading = i % 2 == 0;
    auto seed = static_cast<std::uint64_t>(100 + i);
    srcs.push_back(patterned(kSize, seed));
    dsts.push_back(buffer(kSize));
    if (reading) {
      readables.push_back(owner.create_readable({Descriptor(srcs.back().data(), kSize)}));
      actives.push_back(
          peer.begin_read(readables.back().metadata(), {Descriptor(dsts.back().data(), kSize)}));
    } else {
      writables.push_back(owner.create_writable({Descriptor(dsts.back().data(), kSize)}));
      actives.push_back(
          peer.begin_write({Descriptor(srcs.back().data(), kSize)}, writables.back().metadata()));
    }
  }
  // Every operation was started before any is awaited.
  for (auto& op : actives) ASSERT_TRUE(op.wait_for_completion(kWait));
  for (auto& op : readables) ASSERT_TRUE(op.wait_for_completion(kWait));
  for (auto& op : writables) ASSERT_TRUE(op.wait_for_completion(kWait));
  for (int i = 0; i < kOps; ++i)
    EXPECT_EQ(first_mismatch(dsts[static_cast<std::size_t>(i)].data(), kSize,
                             static_cast<std::uint64_t>(100 + i)),
              -1)
        << "operation " << i;
}

TEST(Reuse, AConnectorReadsItsOwnReadable) {
  Connector self(test::named("self"));
  auto src = patterned(10000, 8);
  auto dst = buffer(10000);
  auto readable = self.create_readable({Descriptor(src.data(), src.size())});
  auto read = self.begin_read(readable.metadata(), {Descriptor(dst.data(), dst.size())});
  ASSERT_TRUE(read.wait_for_completion(kWait));
  EXPECT_EQ(first_mismatch(dst.data(), dst.size(), 8), -1);
}

TEST(Reuse, OnlyOnePeerMayClaimAPassiveOperation) {
  Connector owner(test::named("owner"));
  Connector first(test::named("first"));
  Connector second(test::named("second"));
  auto dst = buffer(1 << 20);
  auto a = patterned(1 << 20, 1);
  auto b = patterned(1 << 20, 2);
  auto writable = owner.create_writable({Descriptor(dst.data(), dst.size())});
  auto w1 = first.begin_write({Descriptor(a.data(), a.size())}, writable.metadata());
  ASSERT_TRUE(w1.wait_for_completion(kWait));
  auto w2 = second.begin_write({Descriptor(b.data(), b.size())}, writable.metadata());
  EXPECT_THROW((void)w2.wait_for_completion(kWait), Error);
  EXPECT_EQ(w2.error()->code(), ErrorCode::AccessDenied);
  EXPECT_EQ(first_mismatch(dst.data(), dst.size(), 1), -1);
}

}  // namespace
}  // namespace ferry
