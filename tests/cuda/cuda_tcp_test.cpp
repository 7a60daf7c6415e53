// tcp moves CUDA memory (of the simulated driver, whose device memory the CPU cannot touch:
// a path that forgets to stage crashes) by staging it through pinned host chunks: every
// pairing of host and device memory both ways, scatter lists mixing them, cancel and revoke
// mid-transfer, deadlines, and the staging pool idle after all of it.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <uv.h>

#include <ferry/ferry.hpp>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "tests/cuda/device_memory.hpp"
#include "tests/cuda/simulated_driver.hpp"
#include "tests/support/child_process.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"
#include "transport/cuda/copy_engine.hpp"
#include "transport/cuda/cuda_api.hpp"
#include "transport/cuda/cuda_memory.hpp"

namespace ferry {
namespace {

namespace cuda = transport::cuda;
using test::api;
using test::Memory;
using test::Pieces;
using namespace std::chrono_literals;
using test::ended_with;
using test::eventually;

constexpr auto kWait = std::chrono::seconds(120);

// Before main (ctest sets both too).
const bool kFakeDriver = test::use_simulated_driver("200");

using test::where;

class CudaTcp : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kFakeDriver);
    const std::optional<Error> why = cuda::unavailable();
    ASSERT_FALSE(why) << why->what();
  }
  void TearDown() override {
    // Every staging chunk is back once the operations are over.
    EXPECT_TRUE(eventually([] { return cuda::StagingPool::held_in_process() == 0; }))
        << cuda::StagingPool::held_in_process() << " staging chunks still held";
  }
};

// (source memory, destination memory, size, read or write)
using Pairing = std::tuple<int, int, std::size_t, bool>;

class CudaTcpPairs : public ::testing::WithParamInterface<Pairing>, public CudaTcp {
 protected:
  Connector owner_{test::tcp_only("owner")};
  Connector peer_{test::tcp_only("peer")};
};

TEST_P(CudaTcpPairs, BytesArriveWhole) {
  const auto [from, to, size, reading] = GetParam();
  Memory src(from, size);
  Memory dst(to, size);
  src.fill(size + 7);
  if (reading) {
    auto readable = owner_.create_readable({src.descriptor()});
    auto read = peer_.begin_read(readable.metadata(), {dst.descriptor()});
    ASSERT_TRUE(read.wait_for_completion(kWait));
    ASSERT_TRUE(readable.wait_for_completion(kWait));
    EXPECT_EQ(read.method(), "tcp");
  } else {
    auto writable = owner_.create_writable({dst.descriptor()});
    auto write = peer_.begin_write({src.descriptor()}, writable.metadata());
    ASSERT_TRUE(write.wait_for_completion(kWait));
    ASSERT_TRUE(writable.wait_for_completion(kWait));
    EXPECT_EQ(write.method(), "tcp");
  }
  EXPECT_EQ(dst.mismatch(size + 7), -1);
}

INSTANTIATE_TEST_SUITE_P(All, CudaTcpPairs,
                         ::testing::Combine(::testing::Values(-1, 0), ::testing::Values(-1, 0, 1),
                                            ::testing::Values(std::size_t{1}, std::size_t{4097},
                                                              (std::size_t{2} << 20) + 1,
                                                              std::size_t{64} << 20),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<Pairing>& p) {
                           return where(std::get<0>(p.param)) + "_to_" +
                                  where(std::get<1>(p.param)) + "_" +
                                  std::to_string(std::get<2>(p.param)) +
                                  (std::get<3>(p.param) ? "_read" : "_write");
                         });

TEST_F(CudaTcp, ScatterListsMixHostAndDeviceMemory) {
  Connector owner(test::tcp_only("owner"));
  Connector peer(test::tcp_only("peer"));
  const std::vector<std::pair<int, std::size_t>> a = {
      {-1, 1000}, {0, (3u << 20) + 5}, {-1, 7}, {1, 100000}, {0, 1}};
  const std::vector<std::pair<int, std::size_t>> b = {{1, 2u << 20},
                                                      {-1, (1u << 20) + 3},
                                                      {0, 4096},
                                                      {-1, 1},
                                                      {1, 100000 + 1000 + 7 + 1 - 4096 + 1}};
  std::size_t ta = 0;
  std::size_t tb = 0;
  for (auto [o, s] : a) ta += s;
  for (auto [o, s] : b) tb += s;
  ASSERT_EQ(ta, tb);
  {
    Pieces src(a, 31);
    Pieces dst(b, 0);
    auto readable = owner.create_readable(src.descriptors);
    auto read = peer.begin_read(readable.metadata(), dst.descriptors);
    ASSERT_TRUE(read.wait_for_completion(kWait));
    ASSERT_TRUE(readable.wait_for_completion(kWait));
    dst.expect_stream(31);
  }
  {
    Pieces src(b, 32);
    Pieces dst(a, 0);
    auto writable = owner.create_writable(dst.descriptors);
    auto write = peer.begin_write(src.descriptors, writable.metadata());
    ASSERT_TRUE(write.wait_for_completion(kWait));
    ASSERT_TRUE(writable.wait_for_completion(kWait));
    dst.expect_stream(32);
  }
}

// Small chunks and a small window: 32 MiB take well over a second of simulated copies, so a
// cancel lands in the middle.
ConnectorOptions slow(std::string name) {
  ConnectorOptions o = test::tcp_only(std::move(name));
  o.tcp.chunk_size = 16384;
  o.tcp.window = 65536;
  return o;
}
constexpr std::size_t kBig = std::size_t{32} << 20;
constexpr std::byte kSentinel{0xab};

TEST_F(CudaTcp, CancelOfAnActiveReadMidTransfer) {
  Connector owner(slow("owner"));
  Connector reader(slow("reader"));
  Memory src(0, kBig);
  Memory dst(1, kBig);
  src.fill(3);
  auto readable = owner.create_readable({src.descriptor()});
  auto read = reader.begin_read(readable.metadata(), {dst.descriptor()});
  ASSERT_TRUE(eventually([&] { return readable.status() == OperationStatus::in_progress; }));
  std::this_thread::sleep_for(50ms);
  read.cancel();
  EXPECT_EQ(read.status(), OperationStatus::cancelled);
  // The destination is ours again: nothing may land in it.
  dst.set(kSentinel);
  EXPECT_EQ(ended_with(readable), ErrorCode::Cancelled);
  std::this_thread::sleep_for(50ms);
  EXPECT_TRUE(dst.all(kSentinel)) << "a byte landed after cancel()";
}

TEST_F(CudaTcp, CancelOfAnActiveWriteMidTransfer) {
  Connector owner(slow("owner"));
  Connector writer(slow("writer"));
  Memory src(0, kBig);
  Memory dst(0, kBig);
  src.fill(4);
  auto writable = owner.create_writable({dst.descriptor()});
  auto write = writer.begin_write({src.descriptor()}, writable.metadata());
  ASSERT_TRUE(eventually([&] { return writable.status() == OperationStatus::in_progress; }));
  std::this_thread::sleep_for(50ms);
  write.cancel();
  EXPECT_EQ(write.status(), OperationStatus::cancelled);
  EXPECT_EQ(ended_with(writable), ErrorCode::Cancelled);
  // The writable's memory is its owner's again: nothing may land in it.
  dst.set(kSentinel);
  std::this_thread::sleep_for(50ms);
  EXPECT_TRUE(dst.all(kSentinel)) << "a byte landed after the writable ended";
}

TEST_F(CudaTcp, CancelOfAPassiveReadableMidTransfer) {
  Connector owner(slow("owner"));
  Connector reader(slow("reader"));
  Memory src(1, kBig);
  Memory dst(-1, kBig);
  src.fill(5);
  auto readable = owner.create_readable({src.descriptor()});
  auto read = reader.begin_read(readable.metadata(), {dst.descriptor()});
  ASSERT_TRUE(eventually([&] { return readable.status() == OperationStatus::in_progress; }));
  std::this_thread::sleep_for(50ms);
  readable.cancel();
  EXPECT_EQ(readable.status(), OperationStatus::cancelled);
  EXPECT_EQ(ended_with(read), ErrorCode::Cancelled);
}

TEST_F(CudaTcp, CancelOfAPassiveWritableMidTransfer) {
  Connector owner(slow("owner"));
  Connector writer(slow("writer"));
  Memory src(-1, kBig);
  Memory dst(1, kBig);
  src.fill(6);
  auto writable = owner.create_writable({dst.descriptor()});
  auto write = writer.begin_write({src.descriptor()}, writable.metadata());
  ASSERT_TRUE(eventually([&] { return writable.status() == OperationStatus::in_progress; }));
  std::this_thread::sleep_for(50ms);
  writable.cancel();
  EXPECT_EQ(writable.status(), OperationStatus::cancelled);
  // No host-to-device copy of this writable runs after cancel() returned.
  dst.set(kSentinel);
  EXPECT_EQ(ended_with(write), ErrorCode::Cancelled);
  std::this_thread::sleep_for(50ms);
  EXPECT_TRUE(dst.all(kSentinel)) << "a byte landed after cancel()";
}

TEST_F(CudaTcp, ADeadlineExpiresMidTransfer) {
  Connector owner(slow("owner"));
  Connector reader(slow("reader"));
  Memory src(0, kBig);
  Memory dst(0, kBig);
  src.fill(7);
  auto readable = owner.create_readable({src.descriptor()});
  OperationOptions o;
  o.timeout = 300ms;
  auto read = reader.begin_read(readable.metadata(), {dst.descriptor()}, o);
  EXPECT_EQ(ended_with(read), ErrorCode::Timeout);
  dst.set(kSentinel);
  EXPECT_EQ(ended_with(readable), ErrorCode::Timeout);
  std::this_thread::sleep_for(50ms);
  EXPECT_TRUE(dst.all(kSentinel)) << "a byte landed after the deadline";

  // And a write whose deadline passes: the owner's side ends too.
  Memory wdst(1, kBig);
  auto writable = owner.create_writable({wdst.descriptor()});
  auto write = reader.begin_write({src.descriptor()}, writable.metadata(), o);
  EXPECT_EQ(ended_with(write), ErrorCode::Timeout);
  EXPECT_EQ(ended_with(writable), ErrorCode::Timeout);
}

TEST_F(CudaTcp, AConnectorReadsAndWritesItsOwnDeviceMemory) {
  // Its client and its server stage at once, from pools of their own: neither waits on the
  // other, with more transfers than one pool has chunks.
  Connector self(test::tcp_only("self"));
  constexpr std::size_t kSize = (16u << 20) + 3;
  std::vector<std::unique_ptr<Memory>> mem;
  std::vector<ReadableOperation> readables;
  std::vector<ReadOperation> reads;
  for (int i = 0; i < 3; ++i) {
    mem.push_back(std::make_unique<Memory>(0, kSize));
    mem.back()->fill(200 + static_cast<std::uint64_t>(i));
    readables.push_back(self.create_readable({mem.back()->descriptor()}));
  }
  std::vector<std::unique_ptr<Memory>> dst;
  for (int i = 0; i < 3; ++i) {
    dst.push_back(std::make_unique<Memory>(1, kSize));
    reads.push_back(self.begin_read(readables[static_cast<std::size_t>(i)].metadata(),
                                    {dst.back()->descriptor()}));
  }
  for (auto& r : reads) ASSERT_TRUE(r.wait_for_completion(kWait));
  for (auto& r : readables) ASSERT_TRUE(r.wait_for_completion(kWait));
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(dst[static_cast<std::size_t>(i)]->mismatch(200 + static_cast<std::uint64_t>(i)), -1);
  Memory back(1, kSize);
  back.fill(300);
  auto writable = self.create_writable({mem[0]->descriptor()});
  auto write = self.begin_write({back.descriptor()}, writable.metadata());
  ASSERT_TRUE(write.wait_for_completion(kWait));
  ASSERT_TRUE(writable.wait_for_completion(kWait));
  EXPECT_EQ(mem[0]->mismatch(300), -1);
}

TEST_F(CudaTcp, ManyTransfersAtOnceShareThePool) {
  Connector owner(test::tcp_only("owner"));
  Connector peer(test::tcp_only("peer"));
  constexpr std::size_t kSize = (8u << 20) + 11;
  std::vector<std::unique_ptr<Memory>> srcs;
  std::vector<std::unique_ptr<Memory>> dsts;
  std::vector<ReadableOperation> readables;
  std::vector<ReadOperation> reads;
  for (int i = 0; i < 6; ++i) {
    srcs.push_back(std::make_unique<Memory>(i % 2, kSize));
    dsts.push_back(std::make_unique<Memory>((i + 1) % 2, kSize));
    srcs.back()->fill(100 + static_cast<std::uint64_t>(i));
    readables.push_back(owner.create_readable({srcs.back()->descriptor()}));
  }
  for (int i = 0; i < 6; ++i)
    reads.push_back(peer.begin_read(readables[static_cast<std::size_t>(i)].metadata(),
                                    {dsts[static_cast<std::size_t>(i)]->descriptor()}));
  for (auto& r : reads) ASSERT_TRUE(r.wait_for_completion(kWait));
  for (auto& r : readables) ASSERT_TRUE(r.wait_for_completion(kWait));
  for (int i = 0; i < 6; ++i)
    EXPECT_EQ(dsts[static_cast<std::size_t>(i)]->mismatch(100 + static_cast<std::uint64_t>(i)), -1);
}

TEST_F(CudaTcp, ACopyThatFailsOnTheDeviceStreamReportsAnError) {
  // The copy's destination is freed while the copy ahead of it runs: the driver fails it on
  // the stream, and its completion must say so (tcp then fails the transfer) instead of
  // reporting bytes that never arrived. The simulated driver's failure is sticky: the copy
  // queued behind it is skipped, and must not report success either.
  uv_loop_t loop{};
  ASSERT_EQ(uv_loop_init(&loop), 0);
  {
    const std::size_t size = 1 << 20;
    // The copy ahead is large, so that it still runs when `gone` is freed: under
    // ThreadSanitizer a 1 MiB copy ahead was once done, and the next one had run into `gone`,
    // before the test thread freed it.
    const std::size_t ahead = std::size_t{64} << 20;
    std::vector<std::byte> source = test::patterned(ahead, 5);
    Memory first(0, ahead);
    auto gone = std::make_unique<Memory>(0, size);
    cuda::CopyEngine engine(&loop, api());
    std::vector<std::optional<Error>> results(3);
    std::size_t reported = 0;
    auto done = [&](std::size_t i) {
      return [&, i](const std::optional<Error>& e) {
        results[i] = e;
        ++reported;
      };
    };
    engine.copy(0, first.data(), source.data(), ahead, done(0));
    engine.copy(0, gone->data(), source.data(), size, done(1));
    gone.reset();
    engine.copy(0, first.data(), source.data(), size, done(2));
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (reported < 3 && std::chrono::steady_clock::now() < until) uv_run(&loop, UV_RUN_NOWAIT);
    ASSERT_EQ(reported, 3u);
    ASSERT_TRUE(results[1]) << "a failed copy reported success";
    EXPECT_EQ(results[1]->code(), ErrorCode::Internal);
    EXPECT_TRUE(results[2]) << "a copy the driver skipped reported success";
  }
  uv_run(&loop, UV_RUN_NOWAIT);  // the engine's handle closes
  EXPECT_EQ(uv_loop_close(&loop), 0);
}

TEST_F(CudaTcp, AnotherProcessReadsAndWritesOurDeviceMemory) {
  // The child (tests/support/peer_main.cpp) moves host memory; ours is on cuda:1, which only
  // tcp offers. The child loads the simulated driver too, through the inherited environment.
  using namespace std::chrono_literals;
  Connector parent(test::tcp_only("parent"));
  test::ChildProcess child(test::peer_command({"child"}));
  constexpr std::size_t kSize = (5u << 20) + 17;
  {
    Memory src(1, kSize);
    src.fill(11);
    auto readable = parent.create_readable({src.descriptor()});
    child.send_line("read 11 " + readable.metadata().to_json());
    EXPECT_EQ(child.read_line(120s), "DONE complete");
    ASSERT_TRUE(readable.wait_for_completion(kWait));
  }
  {
    Memory dst(1, kSize);
    auto writable = parent.create_writable({dst.descriptor()});
    child.send_line("write 12 " + writable.metadata().to_json());
    EXPECT_EQ(child.read_line(120s), "DONE complete");
    ASSERT_TRUE(writable.wait_for_completion(kWait));
    EXPECT_EQ(dst.mismatch(12), -1);
  }
  child.send_line("quit");
  int status = child.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
}

}  // namespace
}  // namespace ferry
