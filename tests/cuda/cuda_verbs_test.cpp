// verbs moves CUDA memory, on the simulated driver (tests/support/fake_cuda/: device memory the
// CPU cannot touch) and the simulated RDMA fabric (tests/support/simverbs/): registration by
// dmabuf, by peermem, and staging through pinned host chunks when the NIC reaches neither;
// every pairing of host and device memory both ways, 1 B to 24 MiB; scatter lists mixing kinds;
// an owner whose device memory no NIC reaches is served by tcp; cancel and deadlines
// mid-transfer on the staging path; registrations cached, and not reused for freed memory.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <ferry/ferry.hpp>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "sdk/src/transport_registry.hpp"
#include "tests/cuda/device_memory.hpp"
#include "tests/cuda/simulated_driver.hpp"
#include "tests/support/child_process.hpp"
#include "tests/support/sim_verbs.hpp"
#include "tests/support/simverbs/simverbs.hpp"
#include "tests/support/util.hpp"
#include "transport/cuda/copy_engine.hpp"
#include "transport/cuda/cuda_api.hpp"
#include "transport/cuda/cuda_memory.hpp"

namespace ferry {
namespace {

namespace cuda = transport::cuda;
namespace sim = test::simverbs;
using test::ended_with;
using test::eventually;
using test::Memory;
using test::Pieces;
using namespace std::chrono_literals;

constexpr auto kWait = std::chrono::seconds(120);
constexpr std::size_t kMiB = std::size_t{1} << 20;

// Before main (ctest sets both too).
const bool kFakeDriver = test::use_simulated_driver("200");

using test::where;

ConnectorOptions options(std::string name) {
  ConnectorOptions o = test::named(std::move(name));
  o.transports = {"tcp", "verbs"};
  o.nats.use_environment = false;
  return o;
}

/// The fabric's GPUDirect knobs, and a NIC slowed down so that a transfer can be caught
/// mid-way.
void fabric(bool dmabuf, bool peermem, std::uint64_t rate_mbps = 0) {
  sim::Config c = sim::current_config();
  c.dmabuf = dmabuf;
  c.peermem = peermem;
  c.rate_mbps = rate_mbps;
  sim::configure(c);
}

class CudaVerbs : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kFakeDriver);
    const std::optional<Error> why = cuda::unavailable();
    ASSERT_FALSE(why) << why->what();
    test::use_simulated_verbs();
    fabric(true, false);
  }
  void TearDown() override {
    detail::remove_method("verbs");
    fabric(true, false);
    // Every staging chunk is back once the operations are over.
    EXPECT_TRUE(eventually([] { return cuda::StagingPool::held_in_process() == 0; }))
        << cuda::StagingPool::held_in_process() << " staging chunks still held";
  }

  /// Moves `size` bytes from memory on `from` to memory on `to` (-1: host), by a read (the
  /// active side holds `to`) or a write (it holds `from`); returns the method that moved them.
  static std::string move(Connector& owner, Connector& peer, int from, int to, std::size_t size,
                          bool reading, std::uint64_t seed) {
    // Whole pages: the simulated driver packs smaller allocations 512 bytes apart, and exports
    // (dmabuf) no page that two allocations share (the real driver does).
    const std::size_t room = (size + 4095) / 4096 * 4096;
    Memory src(from, room);
    Memory dst(to, room);
    src.fill(seed);
    auto part = [size](const Memory& m, int ordinal) {
      return ordinal < 0 ? Descriptor(m.data(), size)
                         : Descriptor(m.data(), size, Device::cuda(ordinal));
    };
    std::string method;
    if (reading) {
      auto readable = owner.create_readable({part(src, from)});
      auto read = peer.begin_read(readable.metadata(), {part(dst, to)});
      EXPECT_TRUE(read.wait_for_completion(kWait));
      EXPECT_TRUE(readable.wait_for_completion(kWait));
      method = read.method();
    } else {
      auto writable = owner.create_writable({part(dst, to)});
      auto write = peer.begin_write({part(src, from)}, writable.metadata());
      EXPECT_TRUE(write.wait_for_completion(kWait));
      EXPECT_TRUE(writable.wait_for_completion(kWait));
      method = write.method();
    }
    const std::vector<std::byte> got = dst.contents();
    EXPECT_EQ(test::first_mismatch(got.data(), size, seed, 0), -1)
        << where(from) << " to " << where(to);
    return method;
  }
};

// (source memory, destination memory, size, read or write)
using Pairing = std::tuple<int, int, std::size_t, bool>;

std::string pairing_name(const ::testing::TestParamInfo<Pairing>& p) {
  return where(std::get<0>(p.param)) + "_to_" + where(std::get<1>(p.param)) + "_" +
         std::to_string(std::get<2>(p.param)) + (std::get<3>(p.param) ? "_read" : "_write");
}

const auto kPairings = ::testing::Combine(
    ::testing::Values(-1, 0), ::testing::Values(-1, 0, 1),
    ::testing::Values(std::size_t{1}, std::size_t{4097}, 2 * kMiB + 1, 24 * kMiB),
    ::testing::Bool());

// GPUDirect by dmabuf: device memory on either side is registered with the NIC and moved by
// one-sided RDMA, no copy through the host.
class CudaVerbsDmabuf : public ::testing::WithParamInterface<Pairing>, public CudaVerbs {};

TEST_P(CudaVerbsDmabuf, BytesArriveWhole) {
  const auto [from, to, size, reading] = GetParam();
  Connector owner(options("owner"));
  Connector peer(options("peer"));
  const auto before = sim::counters();
  EXPECT_EQ(move(owner, peer, from, to, size, reading, size + 7), "verbs");
  const auto after = sim::counters();
  if (from >= 0 || to >= 0) {
    EXPECT_GT(after.dmabuf_mrs, before.dmabuf_mrs) << "device memory not registered by dmabuf";
  }
  EXPECT_EQ(after.refused_mrs, before.refused_mrs);
}

INSTANTIATE_TEST_SUITE_P(All, CudaVerbsDmabuf, kPairings, pairing_name);

// Neither dmabuf nor peermem: the active side stages its device memory through pinned host
// chunks; the owner's device memory is not offered by verbs, and tcp moves it.
class CudaVerbsStaged : public ::testing::WithParamInterface<Pairing>, public CudaVerbs {};

TEST_P(CudaVerbsStaged, BytesArriveWhole) {
  const auto [from, to, size, reading] = GetParam();
  fabric(false, false);
  Connector owner(options("owner"));
  Connector peer(options("peer"));
  const auto before = sim::counters();
  const int owners = reading ? from : to;
  const std::string method = move(owner, peer, from, to, size, reading, size + 9);
  EXPECT_EQ(method, owners >= 0 ? "tcp" : "verbs");
  const auto after = sim::counters();
  EXPECT_EQ(after.dmabuf_mrs, before.dmabuf_mrs);
  EXPECT_EQ(after.peermem_mrs, before.peermem_mrs);
}

INSTANTIATE_TEST_SUITE_P(All, CudaVerbsStaged, kPairings, pairing_name);

// nvidia-peermem (simulated): ibv_reg_mr of device memory works where dmabuf does not.
TEST_F(CudaVerbs, PeermemRegistersDeviceMemoryWithoutDmabuf) {
  fabric(false, true);
  Connector owner(options("owner"));
  Connector peer(options("peer"));
  const auto before = sim::counters();
  EXPECT_EQ(move(owner, peer, 0, 1, 5 * kMiB + 3, true, 21), "verbs");
  EXPECT_EQ(move(owner, peer, 1, 0, 5 * kMiB + 3, false, 22), "verbs");
  const auto after = sim::counters();
  EXPECT_GT(after.peermem_mrs, before.peermem_mrs);
  EXPECT_EQ(after.dmabuf_mrs, before.dmabuf_mrs);
  EXPECT_EQ(cuda::StagingPool::held_in_process(), 0u);
}

// Two small allocations share a page, which the simulated driver does not export: the active
// side stages into them, an owner's is served by tcp; the device's later allocations still go
// by dmabuf (one allocation's refusal does not condemn the way).
TEST_F(CudaVerbs, AnAllocationTheDriverCannotExportIsStagedAlone) {
  Connector owner(options("owner"));
  Connector peer(options("peer"));
  Memory a(0, 1000);
  Memory b(0, 1000);
  Memory host(-1, 1000);
  host.fill(61);
  auto readable = owner.create_readable({host.descriptor()});
  auto read = peer.begin_read(readable.metadata(), {b.descriptor()});
  ASSERT_TRUE(read.wait_for_completion(kWait));
  EXPECT_EQ(read.method(), "verbs");
  EXPECT_EQ(b.mismatch(61), -1);
  a.fill(62);
  auto theirs = owner.create_readable({a.descriptor()});
  auto read_a = peer.begin_read(theirs.metadata(), {host.descriptor()});
  ASSERT_TRUE(read_a.wait_for_completion(kWait));
  EXPECT_EQ(read_a.method(), "tcp");
  EXPECT_EQ(host.mismatch(62), -1);
  const auto before = sim::counters();
  EXPECT_EQ(move(owner, peer, 0, 0, 3 * kMiB, true, 63), "verbs");
  EXPECT_GT(sim::counters().dmabuf_mrs, before.dmabuf_mrs);
}

// Without memory windows each exposed operation registers its device memory with remote access
// of its own, by dmabuf too.
TEST_F(CudaVerbs, WithoutMemoryWindowsDeviceMemoryIsRegisteredPerOperation) {
  ConnectorOptions o = options("owner");
  o.verbs.memory_windows = false;
  Connector owner(o);
  Connector peer(options("peer"));
  for (bool reading : {true, false}) {
    const auto before = sim::counters();
    EXPECT_EQ(move(owner, peer, 0, 1, 3 * kMiB + 1, reading, reading ? 81 : 82), "verbs");
    EXPECT_GT(sim::counters().dmabuf_mrs, before.dmabuf_mrs);
  }
}

TEST_F(CudaVerbs, AnOwnerWhoseDeviceMemoryNoNicReachesDoesNotOfferVerbs) {
  fabric(false, false);
  Connector owner(options("owner"));
  Memory mem(1, 4096);
  auto readable = owner.create_readable({mem.descriptor()});
  for (const Endpoint& e : readable.metadata().endpoints) EXPECT_NE(e.method, "verbs");
  // Host memory still is.
  std::vector<std::byte> host(4096);
  auto host_readable = owner.create_readable({Descriptor(host.data(), host.size())});
  bool verbs = false;
  for (const Endpoint& e : host_readable.metadata().endpoints) verbs |= e.method == "verbs";
  EXPECT_TRUE(verbs);
  readable.cancel();
  host_readable.cancel();
}

TEST_F(CudaVerbs, ConnectorsSayVerbsMovesDeviceMemory) {
  Connector c(options("c"));
  bool seen = false;
  for (const MethodInfo& m : c.methods()) {
    if (m.method != "verbs") continue;
    seen = true;
    EXPECT_TRUE(m.available) << m.detail;
    EXPECT_TRUE(m.moves_cuda);
    EXPECT_TRUE(m.moves_host);
  }
  EXPECT_TRUE(seen);
}

// Host pieces go straight by RDMA, device pieces through staging chunks, in one transfer.
TEST_F(CudaVerbs, StagedScatterListsMixHostAndDeviceMemory) {
  fabric(false, false);
  Connector owner(options("owner"));
  Connector peer(options("peer"));
  const std::vector<std::pair<int, std::size_t>> ours = {
      {-1, 1000}, {0, 3 * kMiB + 5}, {-1, 7}, {1, 100000}, {0, 1}, {-1, 4096}};
  std::size_t total = 0;
  for (auto [o, s] : ours) total += s;
  for (bool reading : {true, false}) {
    Pieces theirs({{-1, total}}, reading ? 31 : 0);
    Pieces local(ours, reading ? 0 : 32);
    if (reading) {
      auto readable = owner.create_readable(theirs.descriptors);
      auto read = peer.begin_read(readable.metadata(), local.descriptors);
      ASSERT_TRUE(read.wait_for_completion(kWait));
      ASSERT_TRUE(readable.wait_for_completion(kWait));
      EXPECT_EQ(read.method(), "verbs");
      local.expect_stream(31);
    } else {
      auto writable = owner.create_writable(theirs.descriptors);
      auto write = peer.begin_write(local.descriptors, writable.metadata());
      ASSERT_TRUE(write.wait_for_completion(kWait));
      ASSERT_TRUE(writable.wait_for_completion(kWait));
      EXPECT_EQ(write.method(), "verbs");
      theirs.expect_stream(32);
    }
  }
}

TEST_F(CudaVerbs, ManyStagedTransfersAtOnceShareThePool) {
  fabric(false, false);
  Connector owner(options("owner"));
  Connector peer(options("peer"));
  constexpr std::size_t kSize = 8 * kMiB + 11;
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
    EXPECT_EQ(reads[static_cast<std::size_t>(i)].method(), "verbs");
    EXPECT_EQ(dsts[static_cast<std::size_t>(i)]->mismatch(100 + static_cast<std::uint64_t>(i)), -1);
  }
}

// A NIC at 400 Mbit/s moves 32 MiB in about 0.7 s: a cancel after 100 ms lands mid-way.
constexpr std::size_t kBig = 32 * kMiB;
constexpr std::byte kSentinel{0xab};

TEST_F(CudaVerbs, CancelOfAStagedReadMidTransfer) {
  fabric(false, false, 400);
  Connector owner(options("owner"));
  Connector reader(options("reader"));
  Memory src(-1, kBig);
  Memory dst(0, kBig);
  src.fill(3);
  auto readable = owner.create_readable({src.descriptor()});
  auto read = reader.begin_read(readable.metadata(), {dst.descriptor()});
  ASSERT_TRUE(eventually([&] { return readable.status() == OperationStatus::in_progress; }));
  std::this_thread::sleep_for(100ms);
  read.cancel();
  EXPECT_EQ(read.status(), OperationStatus::cancelled);
  EXPECT_EQ(read.method(), "verbs");
  EXPECT_EQ(cuda::StagingPool::held_in_process(), 0u) << "cancel() kept staging chunks";
  // The destination is ours again: no RDMA or copy may land in it.
  dst.set(kSentinel);
  EXPECT_EQ(ended_with(readable), ErrorCode::Cancelled);
  std::this_thread::sleep_for(100ms);
  EXPECT_TRUE(dst.all(kSentinel)) << "a byte landed after cancel()";
}

TEST_F(CudaVerbs, CancelOfAStagedWriteMidTransfer) {
  fabric(false, false, 400);
  Connector owner(options("owner"));
  Connector writer(options("writer"));
  Memory src(1, kBig);
  Memory dst(-1, kBig);
  src.fill(4);
  auto writable = owner.create_writable({dst.descriptor()});
  auto write = writer.begin_write({src.descriptor()}, writable.metadata());
  ASSERT_TRUE(eventually([&] { return writable.status() == OperationStatus::in_progress; }));
  std::this_thread::sleep_for(100ms);
  write.cancel();
  EXPECT_EQ(write.status(), OperationStatus::cancelled);
  EXPECT_EQ(write.method(), "verbs");
  EXPECT_EQ(cuda::StagingPool::held_in_process(), 0u) << "cancel() kept staging chunks";
  EXPECT_EQ(ended_with(writable), ErrorCode::Cancelled);
  // The writable's memory is its owner's again: nothing may land in it.
  dst.set(kSentinel);
  std::this_thread::sleep_for(100ms);
  EXPECT_TRUE(dst.all(kSentinel)) << "a byte landed after the write was cancelled";
}

TEST_F(CudaVerbs, ADeadlineExpiresMidStagedTransfer) {
  fabric(false, false, 400);
  Connector owner(options("owner"));
  Connector reader(options("reader"));
  Memory src(-1, kBig);
  Memory dst(0, kBig);
  src.fill(7);
  auto readable = owner.create_readable({src.descriptor()});
  OperationOptions o;
  o.timeout = 300ms;
  auto read = reader.begin_read(readable.metadata(), {dst.descriptor()}, o);
  EXPECT_EQ(ended_with(read), ErrorCode::Timeout);
  dst.set(kSentinel);
  EXPECT_NE(ended_with(readable), ErrorCode::Internal);
  std::this_thread::sleep_for(100ms);
  EXPECT_TRUE(dst.all(kSentinel)) << "a byte landed after the deadline";

  // And a write whose deadline passes: the owner's side ends too.
  Memory wsrc(1, kBig);
  Memory wdst(-1, kBig);
  auto writable = owner.create_writable({wdst.descriptor()});
  auto write = reader.begin_write({wsrc.descriptor()}, writable.metadata(), o);
  EXPECT_EQ(ended_with(write), ErrorCode::Timeout);
  EXPECT_NE(ended_with(writable), ErrorCode::Internal);
}

// The owner goes away mid-transfer: the staged read ends with an error, and nothing lands in
// its memory once it has.
TEST_F(CudaVerbs, AnOwnerThatGoesAwayEndsAStagedRead) {
  fabric(false, false, 400);
  auto owner = std::make_unique<Connector>(options("owner"));
  Connector reader(options("reader"));
  Memory src(-1, kBig);
  Memory dst(1, kBig);
  src.fill(9);
  auto readable = owner->create_readable({src.descriptor()});
  auto read = reader.begin_read(readable.metadata(), {dst.descriptor()});
  ASSERT_TRUE(eventually([&] { return readable.status() == OperationStatus::in_progress; }));
  std::this_thread::sleep_for(100ms);
  owner.reset();
  const ErrorCode code = ended_with(read);
  EXPECT_TRUE(code == ErrorCode::PeerLost || code == ErrorCode::Cancelled ||
              code == ErrorCode::AccessDenied)
      << to_string(code);
  dst.set(kSentinel);
  std::this_thread::sleep_for(100ms);
  EXPECT_TRUE(dst.all(kSentinel)) << "a byte landed after the read ended";
}

// The cache keeps a device buffer's registration for later operations...
TEST_F(CudaVerbs, RegistrationsOfDeviceMemoryAreCached) {
  Connector owner(options("owner"));
  Connector peer(options("peer"));
  Memory src(0, 3 * kMiB);
  Memory dst(1, 3 * kMiB);
  std::uint64_t after_first = 0;
  for (int round = 0; round < 3; ++round) {
    src.fill(50 + static_cast<std::uint64_t>(round));
    auto readable = owner.create_readable({src.descriptor()});
    auto read = peer.begin_read(readable.metadata(), {dst.descriptor()});
    ASSERT_TRUE(read.wait_for_completion(kWait));
    ASSERT_TRUE(readable.wait_for_completion(kWait));
    EXPECT_EQ(read.method(), "verbs");
    EXPECT_EQ(dst.mismatch(50 + static_cast<std::uint64_t>(round)), -1);
    if (round == 0) after_first = sim::counters().dmabuf_mrs;
  }
  EXPECT_EQ(sim::counters().dmabuf_mrs, after_first) << "registered again";
}

// ...but not once it was freed: the driver hands the same address to the next allocation, whose
// bytes live elsewhere.
TEST_F(CudaVerbs, ARegistrationOfFreedDeviceMemoryIsNotReused) {
  Connector owner(options("owner"));
  Connector peer(options("peer"));
  constexpr std::size_t kSize = 2 * kMiB;
  Memory dst(-1, kSize);
  void* first_address = nullptr;
  for (int round = 0; round < 2; ++round) {
    Memory src(0, kSize);
    if (round == 0) first_address = src.data();
    // The simulated driver reuses addresses first fit, as the real one tends to.
    if (round == 1) {
      ASSERT_EQ(src.data(), first_address);
    }
    src.fill(70 + static_cast<std::uint64_t>(round));
    auto readable = owner.create_readable({src.descriptor()});
    auto read = peer.begin_read(readable.metadata(), {dst.descriptor()});
    ASSERT_TRUE(read.wait_for_completion(kWait));
    ASSERT_TRUE(readable.wait_for_completion(kWait));
    EXPECT_EQ(read.method(), "verbs");
    EXPECT_EQ(dst.mismatch(70 + static_cast<std::uint64_t>(round)), -1) << "round " << round;
  }
}

// Another process (tests/support/peer_main.cpp, on the same fabric and simulated driver) reads
// and writes our device memory by RDMA: the registration by dmabuf serves a peer's requests,
// executed by this process's simulated NIC.
TEST_F(CudaVerbs, AnotherProcessReadsAndWritesOurDeviceMemory) {
  Connector parent(options("parent"));
  test::ChildProcess child(
      test::peer_command({"child"}),
      {std::string(test::kSimVerbsEnv) + "=1",
       "FERRY_SIMVERBS=" + sim::to_string(sim::current_config()), "FERRY_TRANSPORTS=tcp,verbs"});
  constexpr std::size_t kSize = 5 * kMiB + 17;
  const auto before = sim::counters();
  {
    Memory src(1, kSize);
    src.fill(11);
    auto readable = parent.create_readable({src.descriptor()});
    child.send_line("read 11 " + readable.metadata().to_json());
    EXPECT_EQ(child.read_line(120s), "DONE complete");
    ASSERT_TRUE(readable.wait_for_completion(kWait));
    EXPECT_EQ(readable.method(), "verbs");
  }
  {
    Memory dst(0, kSize);
    auto writable = parent.create_writable({dst.descriptor()});
    child.send_line("write 12 " + writable.metadata().to_json());
    EXPECT_EQ(child.read_line(120s), "DONE complete");
    ASSERT_TRUE(writable.wait_for_completion(kWait));
    EXPECT_EQ(writable.method(), "verbs");
    EXPECT_EQ(dst.mismatch(12), -1);
  }
  EXPECT_GT(sim::counters().dmabuf_mrs, before.dmabuf_mrs);
  child.send_line("quit");
  int status = child.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
}

}  // namespace
}  // namespace ferry
