// cma moves CUDA memory of its active side (of the simulated driver, whose device memory the
// CPU cannot touch: a path that forgets to stage crashes) by staging it through pinned host
// chunks: host memory of the owner to and from device memory, read and write, 1 B to 64 MiB;
// scatter lists mixing kinds; cancel and deadline mid-transfer; an owner in another process,
// and one killed mid-read; passive CUDA memory never offered by cma; the staging pool idle
// after all of it. Two connectors of one process reach each other by cma, so most tests run
// in this process.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <ferry/ferry.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "tests/cuda/device_memory.hpp"
#include "tests/cuda/simulated_driver.hpp"
#include "tests/support/child_process.hpp"
#include "tests/support/exchange.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"
#include "transport/cuda/copy_engine.hpp"
#include "transport/cuda/cuda_api.hpp"
#include "transport/cuda/cuda_memory.hpp"

namespace ferry {
namespace {

namespace cuda = transport::cuda;
using test::ended_with;
using test::eventually;
using test::Memory;
using test::Pieces;
using namespace std::chrono_literals;

constexpr auto kWait = std::chrono::seconds(120);

// Before main (ctest sets both too).
const bool kFakeDriver = test::use_simulated_driver("200");

/// Options that do not read the environment; cma, and tcp for what cma does not serve.
ConnectorOptions options(std::string name, std::vector<std::string> transports = {"tcp", "cma"}) {
  ConnectorOptions o = test::named(std::move(name));
  o.transports = std::move(transports);
  o.use_environment = false;
  o.nats.use_environment = false;
  return o;
}

/// cma made slow: small chunks, two at a time, so that 32 MiB are under way when a test acts.
ConnectorOptions slow(std::string name) {
  ConnectorOptions o = options(std::move(name));
  o.cma.chunk_size = 16384;
  o.cma.parallel = 2;
  return o;
}

/// Why cma is not offered here (empty: it is).
std::string cma_missing() {
  for (const MethodInfo& m : probe_methods(options("probe")))
    if (m.method == "cma") return m.available ? std::string() : m.detail;
  return "this build has no cma method";
}

bool has_endpoint(const RdmaMetadata& m, const std::string& method) {
  return std::any_of(m.endpoints.begin(), m.endpoints.end(),
                     [&](const Endpoint& e) { return e.method == method; });
}

/// Copies the simulated driver has made in this process (every kind, synchronous ones too).
unsigned long long device_copies() {
  auto* fn = test::simulated_function<void(unsigned long long*)>("ferry_fake_cuda_counters");
  unsigned long long out[4] = {};
  if (fn != nullptr) fn(out);
  return out[3];
}

/// No device copy runs after an operation's end: the counter stands still (call it before
/// anything else here copies).
void expect_no_copy_after_the_end(const char* what) {
  const unsigned long long before = device_copies();
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(device_copies(), before) << "a device copy ran after " << what;
}

/// Every staging chunk is back while the connectors still live (their pools go with them).
void expect_chunks_back() {
  EXPECT_TRUE(eventually([] { return cuda::StagingPool::held_in_process() == 0; }))
      << cuda::StagingPool::held_in_process() << " staging chunks still held";
}

using test::where;

class CudaCma : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kFakeDriver);
    const std::optional<Error> why = cuda::unavailable();
    ASSERT_FALSE(why) << why->what();
    if (const std::string missing = cma_missing(); !missing.empty())
      GTEST_SKIP() << "cma is not offered on this host: " << missing;
  }
  void TearDown() override {
    // Every staging chunk is back once the operations are over.
    EXPECT_TRUE(eventually([] { return cuda::StagingPool::held_in_process() == 0; }))
        << cuda::StagingPool::held_in_process() << " staging chunks still held";
  }
};

// (the active side's device, size, read or write); the owner's memory is host memory.
using Case = std::tuple<int, std::size_t, bool>;

class CudaCmaPairs : public ::testing::WithParamInterface<Case>, public CudaCma {};

TEST_P(CudaCmaPairs, BytesArriveWhole) {
  const auto [device, size, reading] = GetParam();
  Connector owner(options("owner"));
  Connector peer(options("peer"));
  if (reading) {
    Memory src(-1, size);
    Memory dst(device, size);
    src.fill(size + 7);
    auto readable = owner.create_readable({src.descriptor()});
    auto read = peer.begin_read(readable.metadata(), {dst.descriptor()});
    ASSERT_TRUE(read.wait_for_completion(kWait));
    ASSERT_TRUE(readable.wait_for_completion(kWait));
    EXPECT_EQ(read.method(), "cma");
    EXPECT_EQ(readable.method(), "cma");
    EXPECT_EQ(dst.mismatch(size + 7), -1);
    expect_chunks_back();
  } else {
    Memory src(device, size);
    Memory dst(-1, size);
    src.fill(size + 9);
    auto writable = owner.create_writable({dst.descriptor()});
    auto write = peer.begin_write({src.descriptor()}, writable.metadata());
    ASSERT_TRUE(write.wait_for_completion(kWait));
    ASSERT_TRUE(writable.wait_for_completion(kWait));
    EXPECT_EQ(write.method(), "cma");
    EXPECT_EQ(writable.method(), "cma");
    EXPECT_EQ(dst.mismatch(size + 9), -1);
    expect_chunks_back();
  }
}

INSTANTIATE_TEST_SUITE_P(All, CudaCmaPairs,
                         ::testing::Combine(::testing::Values(0, 1),
                                            ::testing::Values(std::size_t{1}, std::size_t{4097},
                                                              (std::size_t{2} << 20) + 1,
                                                              std::size_t{64} << 20),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<Case>& p) {
                           return where(std::get<0>(p.param)) + "_" +
                                  std::to_string(std::get<1>(p.param)) +
                                  (std::get<2>(p.param) ? "_read" : "_write");
                         });

TEST_F(CudaCma, ScatterListsMixHostAndDeviceMemoryOnTheActiveSide) {
  ConnectorOptions small = options("peer");
  small.cma.chunk_size = 1u << 20;  // units end inside pieces, and pieces inside units
  Connector owner(options("owner"));
  Connector peer(small);
  // The owner's host pieces and the active side's mixed ones are cut differently.
  const std::vector<std::pair<int, std::size_t>> theirs = {
      {-1, 3000}, {-1, (3u << 20) + 5}, {-1, 7}, {-1, 100000 + 1000 + 1 - 3000}};
  const std::vector<std::pair<int, std::size_t>> ours = {{-1, 1000}, {0, (3u << 20) + 5}, {0, 3},
                                                         {-1, 4},    {1, 100000},         {0, 1}};
  std::size_t a = 0;
  std::size_t b = 0;
  for (auto [o, s] : theirs) a += s;
  for (auto [o, s] : ours) b += s;
  ASSERT_EQ(a, b);
  {
    Pieces src(theirs, 31);
    Pieces dst(ours, 0);
    auto readable = owner.create_readable(src.descriptors);
    auto read = peer.begin_read(readable.metadata(), dst.descriptors);
    ASSERT_TRUE(read.wait_for_completion(kWait));
    ASSERT_TRUE(readable.wait_for_completion(kWait));
    EXPECT_EQ(read.method(), "cma");
    dst.expect_stream(31);
  }
  {
    Pieces src(ours, 32);
    Pieces dst(theirs, 0);
    auto writable = owner.create_writable(dst.descriptors);
    auto write = peer.begin_write(src.descriptors, writable.metadata());
    ASSERT_TRUE(write.wait_for_completion(kWait));
    ASSERT_TRUE(writable.wait_for_completion(kWait));
    EXPECT_EQ(write.method(), "cma");
    dst.expect_stream(32);
  }
  expect_chunks_back();
}

TEST_F(CudaCma, ManyTransfersAtOnceShareThePool) {
  // More units in flight than the pool has chunks: transfers wait for chunks and go on.
  Connector owner(options("owner"));
  Connector peer(options("peer"));
  constexpr std::size_t kSize = (8u << 20) + 11;
  std::vector<std::unique_ptr<Memory>> srcs;
  std::vector<std::unique_ptr<Memory>> dsts;
  std::vector<ReadableOperation> readables;
  std::vector<ReadOperation> reads;
  for (int i = 0; i < 6; ++i) {
    srcs.push_back(std::make_unique<Memory>(-1, kSize));
    dsts.push_back(std::make_unique<Memory>(i % 2, kSize));
    srcs.back()->fill(100 + static_cast<std::uint64_t>(i));
    readables.push_back(owner.create_readable({srcs.back()->descriptor()}));
  }
  for (int i = 0; i < 6; ++i)
    reads.push_back(peer.begin_read(readables[static_cast<std::size_t>(i)].metadata(),
                                    {dsts[static_cast<std::size_t>(i)]->descriptor()}));
  for (auto& r : reads) ASSERT_TRUE(r.wait_for_completion(kWait));
  for (auto& r : readables) ASSERT_TRUE(r.wait_for_completion(kWait));
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(reads[static_cast<std::size_t>(i)].method(), "cma");
    EXPECT_EQ(dsts[static_cast<std::size_t>(i)]->mismatch(100 + static_cast<std::uint64_t>(i)), -1);
  }
  expect_chunks_back();
}

constexpr std::size_t kBig = std::size_t{32} << 20;
constexpr std::byte kSentinel{0xab};

TEST_F(CudaCma, CancelOfAReadIntoDeviceMemoryMidTransfer) {
  Connector owner(slow("owner"));
  Connector reader(slow("reader"));
  Memory src(-1, kBig);
  Memory dst(1, kBig);
  src.fill(3);
  auto readable = owner.create_readable({src.descriptor()});
  auto read = reader.begin_read(readable.metadata(), {dst.descriptor()});
  ASSERT_TRUE(eventually([&] { return readable.status() == OperationStatus::in_progress; }));
  std::this_thread::sleep_for(50ms);
  read.cancel();
  EXPECT_EQ(read.status(), OperationStatus::cancelled) << "the read was over before cancel()";
  EXPECT_EQ(read.method(), "cma");
  expect_no_copy_after_the_end("cancel()");
  expect_chunks_back();
  // The destination is ours again: no host-to-device copy may land in it.
  dst.set(kSentinel);
  EXPECT_EQ(ended_with(readable), ErrorCode::Cancelled);
  std::this_thread::sleep_for(50ms);
  EXPECT_TRUE(dst.all(kSentinel)) << "a byte landed after cancel()";
}

TEST_F(CudaCma, CancelOfAWriteFromDeviceMemoryMidTransfer) {
  Connector owner(slow("owner"));
  Connector writer(slow("writer"));
  Memory src(0, kBig);
  Memory dst(-1, kBig);
  src.fill(4);
  auto writable = owner.create_writable({dst.descriptor()});
  auto write = writer.begin_write({src.descriptor()}, writable.metadata());
  ASSERT_TRUE(eventually([&] { return writable.status() == OperationStatus::in_progress; }));
  std::this_thread::sleep_for(50ms);
  write.cancel();
  EXPECT_EQ(write.status(), OperationStatus::cancelled) << "the write was over before cancel()";
  EXPECT_EQ(write.method(), "cma");
  expect_no_copy_after_the_end("cancel()");
  expect_chunks_back();
  // No process_vm_writev of this write runs after cancel() returned.
  dst.set(kSentinel);
  EXPECT_EQ(ended_with(writable), ErrorCode::Cancelled);
  std::this_thread::sleep_for(50ms);
  EXPECT_TRUE(dst.all(kSentinel)) << "a byte landed after cancel()";
}

TEST_F(CudaCma, ADeadlineExpiresMidTransfer) {
  Connector owner(slow("owner"));
  Connector peer(slow("peer"));
  OperationOptions o;
  o.timeout = 300ms;
  {
    Memory src(-1, kBig);
    Memory dst(0, kBig);
    src.fill(7);
    auto readable = owner.create_readable({src.descriptor()});
    auto read = peer.begin_read(readable.metadata(), {dst.descriptor()}, o);
    EXPECT_EQ(ended_with(read), ErrorCode::Timeout);
    EXPECT_EQ(read.method(), "cma");
    expect_no_copy_after_the_end("the deadline");
    expect_chunks_back();
    dst.set(kSentinel);
    EXPECT_EQ(ended_with(readable), ErrorCode::Timeout);
    std::this_thread::sleep_for(50ms);
    EXPECT_TRUE(dst.all(kSentinel)) << "a byte landed after the deadline";
  }
  {
    Memory src(1, kBig);
    Memory dst(-1, kBig);
    src.fill(8);
    auto writable = owner.create_writable({dst.descriptor()});
    auto write = peer.begin_write({src.descriptor()}, writable.metadata(), o);
    EXPECT_EQ(ended_with(write), ErrorCode::Timeout);
    EXPECT_EQ(write.method(), "cma");
    expect_no_copy_after_the_end("the deadline");
    expect_chunks_back();
    dst.set(kSentinel);
    EXPECT_EQ(ended_with(writable), ErrorCode::Timeout);
    std::this_thread::sleep_for(50ms);
    EXPECT_TRUE(dst.all(kSentinel)) << "a byte landed after the deadline";
  }
}

TEST_F(CudaCma, PassiveDeviceMemoryIsNotOfferedByCma) {
  Connector owner(options("owner"));
  Connector peer(options("peer"));
  constexpr std::size_t kSize = (1u << 20) + 5;
  Memory src(0, kSize);
  src.fill(41);
  Memory dst(-1, kSize);
  auto readable = owner.create_readable({src.descriptor()});
  EXPECT_FALSE(has_endpoint(readable.metadata(), "cma"));
  EXPECT_TRUE(has_endpoint(readable.metadata(), "tcp"));
  auto read = peer.begin_read(readable.metadata(), {dst.descriptor()});
  ASSERT_TRUE(read.wait_for_completion(kWait));
  EXPECT_EQ(read.method(), "tcp");
  EXPECT_EQ(dst.mismatch(41), -1);
  // Device memory on both sides: tcp too (cuda_ipc passes over a peer in this process).
  Memory both(1, kSize);
  auto writable = owner.create_writable({both.descriptor()});
  EXPECT_FALSE(has_endpoint(writable.metadata(), "cma"));
  auto write = peer.begin_write({src.descriptor()}, writable.metadata());
  ASSERT_TRUE(write.wait_for_completion(kWait));
  EXPECT_EQ(write.method(), "tcp");
  EXPECT_EQ(both.mismatch(41), -1);

  // A connector with cma alone cannot serve device memory at all, and says why.
  Connector only(options("only", {"cma"}));
  test::expect_error([&] { (void)only.create_readable({src.descriptor()}); },
                     ErrorCode::Unsupported, "cma does not serve CUDA memory");
  // Host memory it serves as before, to a peer whose memory is on the device.
  Memory host(-1, kSize);
  host.fill(42);
  auto served = only.create_readable({host.descriptor()});
  Memory into(1, kSize);
  auto read2 = peer.begin_read(served.metadata(), {into.descriptor()});
  ASSERT_TRUE(read2.wait_for_completion(kWait));
  EXPECT_EQ(read2.method(), "cma");
  EXPECT_EQ(into.mismatch(42), -1);
}

TEST_F(CudaCma, HostMemoryTakesNoStagingChunk) {
  // A host-only transfer copies straight between the two address spaces, as before: the
  // simulated driver's copies are slow, and a chunk would be held while they run.
  Connector owner(options("owner"));
  Connector peer(options("peer"));
  constexpr std::size_t kSize = std::size_t{32} << 20;
  Memory src(-1, kSize);
  Memory dst(-1, kSize);
  src.fill(51);
  auto readable = owner.create_readable({src.descriptor()});
  auto read = peer.begin_read(readable.metadata(), {dst.descriptor()});
  std::size_t most = 0;
  for (int i = 0; i < 100000 && read.status() != OperationStatus::complete &&
                  read.status() != OperationStatus::errored;
       ++i)
    most = std::max(most, cuda::StagingPool::held_in_process());
  ASSERT_TRUE(read.wait_for_completion(kWait));
  EXPECT_EQ(read.method(), "cma");
  EXPECT_EQ(most, 0u);
  EXPECT_EQ(dst.mismatch(51), -1);
}

// ---- The owner in another process (tests/support/peer_main.cpp, host memory) ------------

TEST_F(CudaCma, AnOwnerInAnotherProcess) {
  Connector us(options("parent", {"cma"}));
  test::ChildProcess child(test::peer_command({"cma-owner"}), {"FERRY_TRANSPORTS=tcp,cma"});
  constexpr std::size_t kSize = (5u << 20) + 17;
  {
    child.send_line("readable " + std::to_string(kSize) + " 61");
    auto meta = RdmaMetadata::from_json(test::expect_prefix(child.read_line(60s), "META "));
    Memory into(1, kSize);
    auto read = us.begin_read(meta, {into.descriptor()});
    ASSERT_TRUE(read.wait_for_completion(kWait));
    EXPECT_EQ(read.method(), "cma");
    EXPECT_EQ(into.mismatch(61), -1);
    child.send_line("wait");
    EXPECT_EQ(child.read_line(60s), "DONE complete");
  }
  {
    child.send_line("writable " + std::to_string(kSize));
    auto meta = RdmaMetadata::from_json(test::expect_prefix(child.read_line(60s), "META "));
    Memory from(0, kSize);
    from.fill(62);
    auto write = us.begin_write({from.descriptor()}, meta);
    ASSERT_TRUE(write.wait_for_completion(kWait));
    EXPECT_EQ(write.method(), "cma");
    child.send_line("wait");
    EXPECT_EQ(child.read_line(60s), "DONE complete");
    child.send_line("check 62");
    EXPECT_EQ(child.read_line(60s), "CHECK ok");
  }
  child.send_line("quit");
  const int status = child.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
}

TEST_F(CudaCma, AnOwnerKilledMidReadErrorsTheRead) {
  ConnectorOptions o = slow("parent");
  o.transports = {"cma"};
  Connector us(o);
  test::ChildProcess child(test::peer_command({"doomed-owner"}), {"FERRY_TRANSPORTS=tcp,cma"});
  child.send_line("readable " + std::to_string(kBig) + " 77");
  auto meta = RdmaMetadata::from_json(test::expect_prefix(child.read_line(60s), "META "));
  Memory into(0, kBig);
  const unsigned long long copies = device_copies();
  auto read = us.begin_read(meta, {into.descriptor()});
  // A unit reached the device (counted by the driver: reading the memory while copies write it
  // would race with them).
  ASSERT_TRUE(eventually([&] { return device_copies() > copies; }, 30s)) << "no byte arrived";
  ASSERT_EQ(read.status(), OperationStatus::in_progress) << "finished before the kill";
  EXPECT_EQ(read.method(), "cma");
  child.kill(SIGKILL);
  EXPECT_EQ(ended_with(read, 10s), ErrorCode::PeerLost);
  ASSERT_TRUE(read.error());
  EXPECT_NE(read.error()->message().find("doomed-owner"), std::string::npos)
      << read.error()->message();
  expect_no_copy_after_the_end("the owner's loss");
  expect_chunks_back();
  (void)child.wait();
}

}  // namespace
}  // namespace ferry
