// cuda_ipc moves CUDA memory between two processes of one host with the GPU, through the CUDA
// IPC handles of the owner's allocations (here those of the simulated driver, whose device
// memory the CPU cannot touch). The other process is this test binary again, running
// CudaIpcChild.DISABLED_Serve, which takes commands on stdin and answers on stdout.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ferry/ferry.hpp>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/cuda/device_memory.hpp"
#include "tests/cuda/peer_child.hpp"
#include "tests/cuda/simulated_driver.hpp"
#include "tests/support/raw_peer.hpp"
#include "tests/support/util.hpp"
#include "transport/token.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using test::api;
using test::Memory;

constexpr auto kWait = std::chrono::seconds(60);

// Before main (ctest sets both too).
const bool kFakeDriver = test::use_simulated_driver("200");

ConnectorOptions ipc_only(const std::string& name) {
  ConnectorOptions o = test::named(name);
  o.transports = {"cuda_ipc"};
  return o;
}

/// Why cuda_ipc is not offered here, or empty.
std::string ipc_missing() {
  for (const MethodInfo& m : probe_methods(ipc_only("probe")))
    if (m.method == "cuda_ipc") return m.available ? std::string() : m.detail;
  return "cuda_ipc is not built into this ferry";
}

/// This process's IPC handles opened and closed, as the simulated driver counts them.
std::pair<unsigned long long, unsigned long long> ipc_counts() {
  auto* fn = test::simulated_function<void(unsigned long long*)>("ferry_fake_cuda_ipc_counts");
  unsigned long long out[2] = {0, 0};
  if (fn != nullptr) fn(out);
  return {out[0], out[1]};
}

/// This process's imports of VMM allocations, as the simulated driver counts them.
unsigned long long vmm_imports() {
  auto* fn = test::simulated_function<unsigned long long()>("ferry_fake_cuda_vmm_imports");
  return fn != nullptr ? fn() : 0;
}

using test::operations_by;

// ---- The other process ------------------------------------------------------------------

TEST(CudaIpcChild, DISABLED_Serve) { test::serve_peer_commands(ipc_only("child"), kWait); }

// ---- The tests ---------------------------------------------------------------------------

class CudaIpc : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kFakeDriver);
    if (const std::string why = ipc_missing(); !why.empty())
      GTEST_SKIP() << "cuda_ipc is not offered here: " << why;
    child_ = std::make_unique<test::PeerChild>("CudaIpcChild.DISABLED_Serve");
  }
  void TearDown() override {
    if (child_) child_->finish();
  }
  std::string answer() { return child_->answer(); }
  RdmaMetadata child_exposes(const std::string& kind, int device, std::size_t size,
                             std::uint64_t seed, const std::string& how = "legacy") {
    return child_->exposes(kind, device, size, seed, how);
  }
  RdmaMetadata child_shares(const std::string& kind, std::uint64_t seed) {
    return child_->shares(kind, seed);
  }
  /// We read SIZE bytes the child exposes on device `theirs.first` into our memory on `ours`
  /// (-1: host), then write ours into a writable of the child's on `theirs.second`; the bytes
  /// are checked on both sides (seeds `seed` and `seed + 1`).
  void read_then_write(Connector& us, int ours, std::pair<int, int> theirs, std::size_t size,
                       std::uint64_t seed, const std::string& how = "legacy") {
    RdmaMetadata readable = child_exposes("read", theirs.first, size, seed, how);
    Memory into(ours, size);
    auto read = us.begin_read(readable, {into.descriptor()});
    ASSERT_TRUE(read.wait_for_completion(kWait));
    EXPECT_EQ(into.mismatch(seed), -1);
    EXPECT_EQ(answer(), "END complete -1");

    RdmaMetadata writable = child_exposes("write", theirs.second, size, seed + 1, how);
    Memory from(ours, size);
    from.fill(seed + 1);
    auto write = us.begin_write({from.descriptor()}, writable);
    ASSERT_TRUE(write.wait_for_completion(kWait));
    EXPECT_EQ(answer(), "END complete -1");  // the child found its pattern
  }

  std::unique_ptr<test::PeerChild> child_;
};

TEST_F(CudaIpc, TheChildReadsAndWritesOurDeviceMemory) {
  Connector us(ipc_only("parent"));
  for (std::size_t size :
       {std::size_t{1}, std::size_t{4097}, (std::size_t{5} << 20) + 17, std::size_t{64} << 20}) {
    SCOPED_TRACE("size " + std::to_string(size));
    Memory source(1, size);
    source.fill(21);
    auto readable = us.create_readable({source.descriptor()});
    child_->send_line("begin read 0 21 " + readable.metadata().to_json());
    EXPECT_EQ(answer(), "END complete -1");
    ASSERT_TRUE(readable.wait_for_completion(kWait));

    Memory target(0, size);
    auto writable = us.create_writable({target.descriptor()});
    child_->send_line("begin write 1 22 " + writable.metadata().to_json());
    EXPECT_EQ(answer(), "END complete -1");
    ASSERT_TRUE(writable.wait_for_completion(kWait));
    EXPECT_EQ(target.mismatch(22), -1);
  }
  EXPECT_EQ(operations_by(us, "cuda_ipc"), 8u);
}

// Regions (docs/regions.md): attached once, then reads and writes under the attachment's grant
// and handles, the owner told of each.
TEST_F(CudaIpc, ARegionOfTheChildsDeviceMemoryIsAttachedOnceThenReadAndWritten) {
  Connector us(ipc_only("parent"));
  const std::size_t size = (std::size_t{3} << 20) + 5;
  RegionMetadata region = child_->region(1, size, 51, 52);
  auto att = us.attach(region);
  // Several reads of parts, from host and device memory, on the one attachment.
  Memory into(0, size);
  const std::size_t half = size / 2;
  auto a = att.read({{0, half}},
                    {Descriptor(into.descriptor().bytes(), half, into.descriptor().device())});
  auto b = att.read({{half, size - half}}, {Descriptor(into.descriptor().bytes() + half,
                                                       size - half, into.descriptor().device())});
  ASSERT_TRUE(a.wait_for_completion(kWait));
  ASSERT_TRUE(b.wait_for_completion(kWait));
  EXPECT_EQ(att.method(), "cuda_ipc");
  EXPECT_EQ(into.mismatch(51), -1);
  Memory from(-1, size);
  from.fill(52);
  auto w = att.write({from.descriptor()}, {{0, size}});
  ASSERT_TRUE(w.wait_for_completion(kWait));
  EXPECT_EQ(answer(), "END complete -1");  // the child's event came, and its memory holds ours
  EXPECT_EQ(operations_by(us, "cuda_ipc"), 3u);
}

TEST_F(CudaIpc, WeReadAndWriteTheChildsDeviceMemory) {
  Connector us(ipc_only("parent"));
  const std::size_t size = (std::size_t{9} << 20) + 3;
  RdmaMetadata readable = child_exposes("read", 0, size, 31);
  Memory into(1, size);
  auto read = us.begin_read(readable, {into.descriptor()});
  ASSERT_TRUE(read.wait_for_completion(kWait));
  EXPECT_EQ(into.mismatch(31), -1);
  EXPECT_EQ(answer(), "END complete -1");

  RdmaMetadata writable = child_exposes("write", 1, size, 32);
  Memory from(0, size);
  from.fill(32);
  auto write = us.begin_write({from.descriptor()}, writable);
  ASSERT_TRUE(write.wait_for_completion(kWait));
  EXPECT_EQ(answer(), "END complete -1");  // the child found its pattern
  EXPECT_EQ(operations_by(us, "cuda_ipc"), 2u);
}

TEST_F(CudaIpc, OurHostMemoryReadsAndWritesTheChildsDeviceMemory) {
  // The owner's memory is CUDA, ours host: the GPU copies between the opened allocation and
  // our memory.
  Connector us(ipc_only("parent"));
  for (std::size_t size : {std::size_t{1}, (std::size_t{6} << 20) + 5}) {
    SCOPED_TRACE("size " + std::to_string(size));
    read_then_write(us, -1, {1, 0}, size, 33);
  }
  EXPECT_EQ(operations_by(us, "cuda_ipc"), 4u);
}

TEST_F(CudaIpc, VmmAllocationsAreSharedThroughTheOwnersFds) {
  Connector us(ipc_only("parent"));
  const std::size_t size = (std::size_t{7} << 20) + 11;
  const auto imports = vmm_imports();
  read_then_write(us, 1, {0, 1}, size, 35, "vmm");
  EXPECT_EQ(operations_by(us, "cuda_ipc"), 2u);
  EXPECT_EQ(vmm_imports() - imports, 2u);
}

TEST_F(CudaIpc, AVmmAllocationIsImportedOnceAndAgainWhenFreedAndMadeAgain) {
  Connector us(ipc_only("parent"));
  const std::size_t size = std::size_t{4} << 20;
  Memory into(0, size);
  const auto imports = vmm_imports();
  child_->send_line("hold 0 " + std::to_string(size) + " vmm");
  ASSERT_EQ(answer(), "HELD");
  std::uint64_t base = 0;
  for (std::uint64_t seed : {71, 72}) {
    RdmaMetadata readable = child_shares("read", seed);
    base = readable.descriptors[0].ptr;
    auto read = us.begin_read(readable, {into.descriptor()});
    ASSERT_TRUE(read.wait_for_completion(kWait));
    EXPECT_EQ(into.mismatch(seed), -1);
    EXPECT_EQ(answer(), "END complete -1");
  }
  EXPECT_EQ(vmm_imports() - imports, 1u);  // one allocation, imported once
  // Freed, and another made at the same address with other bytes: imported again, and no
  // byte read through the old mapping.
  child_->send_line("free");
  ASSERT_EQ(answer(), "FREED");
  child_->send_line("hold 0 " + std::to_string(size) + " vmm");
  ASSERT_EQ(answer(), "HELD");
  RdmaMetadata readable = child_shares("read", 73);
  EXPECT_EQ(readable.descriptors[0].ptr, base);
  auto read = us.begin_read(readable, {into.descriptor()});
  ASSERT_TRUE(read.wait_for_completion(kWait));
  EXPECT_EQ(into.mismatch(73), -1);
  EXPECT_EQ(answer(), "END complete -1");
  EXPECT_EQ(vmm_imports() - imports, 2u);
}

TEST_F(CudaIpc, AVmmAllocationWithoutAShareableHandleIsNotOffered) {
  child_->send_line("expose read 0 4096 37 vmm-no-export");
  const std::string refused = answer();
  // The child offers cuda_ipc only, and cuda_ipc cannot share this memory: the expose fails,
  // saying why (with another method, tcp, say, the operation would go that way).
  EXPECT_EQ(refused.rfind("REFUSED ", 0), 0u) << refused;
  EXPECT_NE(refused.find("requestedHandleTypes"), std::string::npos) << refused;
}

TEST_F(CudaIpc, AnAllocationIsOpenedOnceAndAgainWhenFreedAndMadeAgain) {
  Connector us(ipc_only("parent"));
  const std::size_t size = std::size_t{3} << 20;
  Memory into(0, size);
  const auto before = ipc_counts();
  const std::uint64_t seeds[] = {42, 43};
  RdmaMetadata first = child_exposes("read", 0, size, seeds[0]);
  const std::uint64_t first_base = first.descriptors[0].ptr;
  {
    auto read = us.begin_read(first, {into.descriptor()});
    ASSERT_TRUE(read.wait_for_completion(kWait));
    EXPECT_EQ(into.mismatch(seeds[0]), -1);
    EXPECT_EQ(answer(), "END complete -1");
  }
  EXPECT_EQ(ipc_counts().first - before.first, 1u);
  // The child freed that buffer; its next one of the same size is made at the same address
  // (the simulated driver reuses addresses first fit, as real allocators do), with other bytes.
  RdmaMetadata second = child_exposes("read", 0, size, seeds[1]);
  EXPECT_EQ(second.descriptors[0].ptr, first_base);
  {
    auto read = us.begin_read(second, {into.descriptor()});
    ASSERT_TRUE(read.wait_for_completion(kWait));
    // Not the old mapping's bytes: the cache saw another allocation behind the address.
    EXPECT_EQ(into.mismatch(seeds[1]), -1);
    EXPECT_EQ(answer(), "END complete -1");
  }
  const auto after = ipc_counts();
  EXPECT_EQ(after.first - before.first, 2u);    // opened again
  EXPECT_EQ(after.second - before.second, 1u);  // the stale mapping closed
}

TEST_F(CudaIpc, AnAllocationMadeBelowAnOpenedOneAndCoveringItReplacesIt) {
  Connector us(ipc_only("parent"));
  const std::size_t chunk = std::size_t{4} << 20;
  // The child's buffer at the bottom of its space is held, so the next one lies above it.
  child_->send_line("hold 0 " + std::to_string(chunk));
  ASSERT_EQ(answer(), "HELD");
  RdmaMetadata first = child_exposes("read", 0, chunk, 61);
  {
    Memory into(0, chunk);
    auto read = us.begin_read(first, {into.descriptor()});
    ASSERT_TRUE(read.wait_for_completion(kWait));
    EXPECT_EQ(into.mismatch(61), -1);
    EXPECT_EQ(answer(), "END complete -1");
  }
  // Both freed: a bigger allocation starts below the opened one and covers it.
  child_->send_line("free");
  ASSERT_EQ(answer(), "FREED");
  RdmaMetadata second = child_exposes("read", 0, 3 * chunk, 62);
  ASSERT_LT(second.descriptors[0].ptr, first.descriptors[0].ptr);
  ASSERT_GT(second.descriptors[0].ptr + 3 * chunk, first.descriptors[0].ptr);
  Memory into(0, 3 * chunk);
  auto read = us.begin_read(second, {into.descriptor()});
  ASSERT_TRUE(read.wait_for_completion(kWait));
  // Every byte from the new allocation, none through the old one's mapping.
  EXPECT_EQ(into.mismatch(62), -1);
  EXPECT_EQ(answer(), "END complete -1");
}

TEST_F(CudaIpc, CancelMidTransferEndsBothSidesAndTouchesNothingAfter) {
  ConnectorOptions slow = ipc_only("parent");
  slow.cma.chunk_size = 1u << 20;
  slow.cma.parallel = 1;
  Connector us(slow);
  const std::size_t size = std::size_t{256} << 20;
  RdmaMetadata readable = child_exposes("read", 0, size, 51);
  Memory into(1, size);
  into.set(std::byte{0x5a});
  auto read = us.begin_read(readable, {into.descriptor()});
  // 256 copies of 1 MiB one after the other, each slowed by the simulated driver: still under
  // way after 5 ms.
  std::this_thread::sleep_for(5ms);
  read.cancel();
  EXPECT_EQ(read.status(), OperationStatus::cancelled);
  const std::vector<std::byte> at_cancel = into.contents();
  std::this_thread::sleep_for(50ms);
  // No copy landed after cancel() returned (memcmp: a vector's == reads byte by byte, which
  // ThreadSanitizer instruments: 256 MiB took 20 s there).
  const std::vector<std::byte> later = into.contents();
  ASSERT_EQ(later.size(), at_cancel.size());
  EXPECT_EQ(std::memcmp(later.data(), at_cancel.data(), later.size()), 0);
  EXPECT_NE(into.mismatch(51), -1);  // and the transfer did not finish
  const std::string end = answer();
  EXPECT_TRUE(end == "END Cancelled -1" || end == "END PeerLost -1") << end;
}

TEST_F(CudaIpc, NotChosenForHostMemoryNorWithinOneProcess) {
  ConnectorOptions both = test::named("parent");
  both.transports = {"cuda_ipc", "tcp"};
  Connector a(both);
  both.name = "other";
  Connector b(both);
  const std::size_t size = 1u << 20;
  // Device memory on both sides, but one process: the driver opens no handle of its own.
  Memory source(0, size);
  source.fill(61);
  Memory target(1, size);
  auto readable = a.create_readable({source.descriptor()});
  auto read = b.begin_read(readable.metadata(), {target.descriptor()});
  ASSERT_TRUE(read.wait_for_completion(kWait));
  EXPECT_EQ(target.mismatch(61), -1);
  EXPECT_EQ(operations_by(b, "cuda_ipc"), 0u);
  EXPECT_EQ(operations_by(b, "tcp"), 1u);
  // Host memory: cuda_ipc does not offer it.
  Memory host(-1, size);
  auto host_readable = a.create_readable({host.descriptor()});
  for (const Endpoint& e : host_readable.metadata().endpoints) EXPECT_NE(e.method, "cuda_ipc");
}

// ---- A claimant the kernel would not let read us ------------------------------------------

/// The first frame our cuda_ipc owner answers a CLAIM of `meta` with, the claim sent from a
/// connection made while this thread's effective uid and gid were `uid` (SO_PEERCRED records
/// them at connect()). The raw system call changes this thread's credentials only.
std::optional<test::Frame> claim_as(std::uint32_t uid, const RdmaMetadata& meta) {
  std::string address;
  for (const Endpoint& e : meta.endpoints)
    if (e.method == "cuda_ipc") address = e.address;
  if (address.size() < 2) return std::nullopt;
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path + 1, address.data() + 1, address.size() - 1);
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::nullopt;
  const bool as_other = uid != ::geteuid();
  if (as_other &&
      (::syscall(SYS_setresgid, -1, uid, -1) != 0 || ::syscall(SYS_setresuid, -1, uid, -1) != 0))
    return std::nullopt;
  const int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&sa), len);
  if (as_other) {
    EXPECT_EQ(::syscall(SYS_setresuid, -1, 0, -1), 0);
    EXPECT_EQ(::syscall(SYS_setresgid, -1, 0, -1), 0);
  }
  test::RawClient c(test::RawClient::Adopt{}, rc == 0 ? fd : -1);
  if (rc != 0) ::close(fd);
  if (!c.connected() || !c.greet("claimant")) return std::nullopt;
  test::FrameHeader claim;
  claim.type = test::FrameType::claim;
  claim.req_id = 7;
  claim.op_id = std::stoull(meta.notification_key, nullptr, 16);
  if (!transport::token_from_hex(meta.token, claim.token)) return std::nullopt;
  claim.flags = 1;  // read
  claim.len = 16;
  std::vector<std::byte> range(16);
  std::memcpy(range.data(), &meta.descriptors.at(0).ptr, 8);
  std::memcpy(range.data() + 8, &meta.descriptors.at(0).size, 8);
  if (!c.send_frame(claim, {}, range)) return std::nullopt;
  return c.read_any_frame();
}

TEST(CudaIpcClaimant, OfAnotherUserGetsNoHandleOfOurs) {
  ASSERT_TRUE(kFakeDriver);
  if (const std::string why = ipc_missing(); !why.empty())
    GTEST_SKIP() << "cuda_ipc is not offered here: " << why;
  if (::geteuid() != 0) GTEST_SKIP() << "needs root, to claim as another user";
  Connector owner(ipc_only("owner"));
  Memory source(0, 4096);
  source.fill(5);
  auto refused = owner.create_readable({source.descriptor()});
  auto f = claim_as(65534, refused.metadata());
  ASSERT_TRUE(f.has_value()) << "no answer to the claim";
  EXPECT_EQ(f->header.type, test::FrameType::status) << "the claim of another user was served";
  EXPECT_EQ(f->header.status, test::wire_status(ErrorCode::AccessDenied)) << f->message;
  EXPECT_NE(f->message.find("uid 65534"), std::string::npos) << f->message;
  // The same claim by a process of our own user is served.
  auto served = owner.create_readable({source.descriptor()});
  auto g = claim_as(::geteuid(), served.metadata());
  ASSERT_TRUE(g.has_value()) << "no answer to the claim";
  EXPECT_EQ(g->header.type, test::FrameType::claimed) << g->message;
}

}  // namespace
}  // namespace ferry
