// On a real GPU, through the system's driver (libcuda.so.1): transfers between this process
// and another (this binary again, tests/cuda/peer_child.hpp) by each method that moves CUDA
// memory, host and device memory on either side, 1 B to 1 GiB, data verified through the
// driver; cancel mid-transfer; the IPC cache across a free and a new allocation. Skipped where
// there is no GPU (label cuda). Run by hand against the simulated driver, with
// FERRY_CUDA_DRIVER naming libferry_fake_cuda.so, it checks its own logic.
#include <gtest/gtest.h>

#include <ferry/ferry.hpp>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "tests/cuda/device_memory.hpp"
#include "tests/cuda/peer_child.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using test::Memory;

constexpr auto kWait = std::chrono::seconds(300);
constexpr int kHost = -1;

/// Why this host cannot run the GPU tests with `method`, or empty.
std::string missing(const std::string& method) {
  if (const std::optional<Error> why = transport::cuda::unavailable())
    return "no usable CUDA driver here: " + why->message();
  const auto* api = &transport::cuda::system_cuda();
  int count = 0;
  if (api->device_get_count(&count) != CUDA_SUCCESS || count == 0)
    return "the CUDA driver sees no GPU";
  ConnectorOptions o = test::named("probe");
  o.transports = {method};
  for (const MethodInfo& m : probe_methods(o)) {
    if (m.method != method) continue;
    if (!m.available) return method + " is not offered here: " + m.detail;
    return {};
  }
  return method + " is not built into this ferry";
}

/// Whether `method` lets a peer reach memory of `device` (host: -1).
bool exposes(const std::string& method, int device) {
  if (method == "cuda_ipc") return device >= 0;
  if (method == "cma") return device < 0;  // cma stages CUDA memory on the active side only
  return true;
}

using test::where;

using test::operations_by;

// The other process: its method from the environment.
TEST(GpuPeer, DISABLED_Serve) {
  ConnectorOptions o = test::named("child");
  if (const char* m = std::getenv("FERRY_GPU_TEST_METHOD")) o.transports = {m};
  test::serve_peer_commands(o, kWait);
}

class GpuTest {
 protected:
  void start(const std::string& method) {
    method_ = method;
    child_ = std::make_unique<test::PeerChild>(
        "GpuPeer.DISABLED_Serve", std::vector<std::string>{"FERRY_GPU_TEST_METHOD=" + method});
    ConnectorOptions o = test::named("parent");
    o.transports = {method};
    us_ = std::make_unique<Connector>(o);
  }
  void stop() {
    us_.reset();
    if (child_) child_->finish();
  }

  std::string method_;
  std::unique_ptr<test::PeerChild> child_;
  std::unique_ptr<Connector> us_;
};

// ---- Pairings ----------------------------------------------------------------------------

/// (method, our memory, the child's memory)
class GpuPairs : public GpuTest,
                 public ::testing::TestWithParam<std::tuple<std::string, int, int>> {
 protected:
  void SetUp() override {
    if (const std::string why = missing(std::get<0>(GetParam())); !why.empty()) GTEST_SKIP() << why;
    start(std::get<0>(GetParam()));
  }
  void TearDown() override { stop(); }
};

TEST_P(GpuPairs, BytesArriveWholeBothWays) {
  const auto [method, ours, theirs] = GetParam();
  const std::size_t sizes[] = {1, 4097, (std::size_t{64} << 20) + 1, std::size_t{1} << 30};
  std::uint64_t expected = 0;
  std::uint64_t seed = 100;
  for (std::size_t size : sizes) {
    SCOPED_TRACE("size " + std::to_string(size));
    // We are the active side; the child exposes.
    if (exposes(method, theirs)) {
      RdmaMetadata readable = child_->exposes("read", theirs, size, ++seed);
      Memory into(ours, size);
      auto read = us_->begin_read(readable, {into.descriptor()});
      ASSERT_TRUE(read.wait_for_completion(kWait));
      EXPECT_EQ(into.mismatch(seed), -1);
      EXPECT_EQ(child_->answer(), "END complete -1");

      RdmaMetadata writable = child_->exposes("write", theirs, size, ++seed);
      Memory from(ours, size);
      from.fill(seed);
      auto write = us_->begin_write({from.descriptor()}, writable);
      ASSERT_TRUE(write.wait_for_completion(kWait));
      EXPECT_EQ(child_->answer(), "END complete -1");  // the child found the pattern
      expected += 2;
    }
    // The child is the active side; we expose.
    if (exposes(method, ours)) {
      Memory source(ours, size);
      source.fill(++seed);
      auto readable = us_->create_readable({source.descriptor()});
      child_->send_line("begin read " + std::to_string(theirs) + " " + std::to_string(seed) + " " +
                        readable.metadata().to_json());
      EXPECT_EQ(child_->answer(), "END complete -1");
      ASSERT_TRUE(readable.wait_for_completion(kWait));

      Memory target(ours, size);
      auto writable = us_->create_writable({target.descriptor()});
      child_->send_line("begin write " + std::to_string(theirs) + " " + std::to_string(++seed) +
                        " " + writable.metadata().to_json());
      EXPECT_EQ(child_->answer(), "END complete -1");
      ASSERT_TRUE(writable.wait_for_completion(kWait));
      EXPECT_EQ(target.mismatch(seed), -1);
      expected += 2;
    }
  }
  EXPECT_EQ(operations_by(*us_, method), expected);  // all of ours, by `method`
}

std::vector<std::tuple<std::string, int, int>> pairings() {
  std::vector<std::tuple<std::string, int, int>> out;
  for (const char* method : {"cuda_ipc", "tcp", "cma"})
    for (int ours : {kHost, 0})
      for (int theirs : {kHost, 0})
        if (exposes(method, ours) || exposes(method, theirs))
          if (ours >= 0 || theirs >= 0) out.emplace_back(method, ours, theirs);
  return out;
}

std::string pairing_name(const ::testing::TestParamInfo<std::tuple<std::string, int, int>>& p) {
  return std::get<0>(p.param) + "_ours_" + where(std::get<1>(p.param)) + "_theirs_" +
         where(std::get<2>(p.param));
}

INSTANTIATE_TEST_SUITE_P(All, GpuPairs, ::testing::ValuesIn(pairings()), pairing_name);

// ---- Cancel ------------------------------------------------------------------------------

class GpuCancel : public GpuTest, public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (const std::string why = missing(GetParam()); !why.empty()) GTEST_SKIP() << why;
    start(GetParam());
  }
  void TearDown() override { stop(); }
};

TEST_P(GpuCancel, NothingLandsAfterCancelReturns) {
  const std::string method = GetParam();
  const int theirs = exposes(method, 0) ? 0 : kHost;
  const std::size_t size = std::size_t{1} << 30;
  RdmaMetadata readable = child_->exposes("read", theirs, size, 7);
  Memory into(0, size);
  into.set(std::byte{0x5a});
  auto read = us_->begin_read(readable, {into.descriptor()});
  std::this_thread::sleep_for(2ms);
  read.cancel();
  const OperationStatus status = read.status();
  const std::vector<std::byte> at_cancel = into.contents();
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(into.contents(), at_cancel);  // no copy landed after cancel() returned
  const std::string end = child_->answer();
  if (status == OperationStatus::cancelled) {
    EXPECT_TRUE(end == "END Cancelled -1" || end == "END PeerLost -1") << end;
  } else {
    // 1 GiB in 2 ms: done before the cancel, which then changes nothing.
    EXPECT_EQ(status, OperationStatus::complete);
    EXPECT_EQ(end, "END complete -1");
  }
}

INSTANTIATE_TEST_SUITE_P(All, GpuCancel, ::testing::Values("cuda_ipc", "tcp", "cma"));

// ---- Regions -----------------------------------------------------------------------------

// A region of the child's device memory (docs/regions.md): attached once, read in parts into
// our device memory and written whole from our host memory; the child's event says the write
// is in, and its bytes are checked through the driver.
class GpuRegion : public GpuTest, public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (const std::string why = missing(GetParam()); !why.empty()) GTEST_SKIP() << why;
    start(GetParam());
  }
  void TearDown() override { stop(); }
};

TEST_P(GpuRegion, AttachedOnceThenReadAndWritten) {
  const std::size_t size = (std::size_t{256} << 20) + 3;
  RegionMetadata region = child_->region(0, size, 61, 62);
  auto att = us_->attach(region);
  Memory into(0, size);
  const std::size_t part = size / 4;
  std::vector<Operation> reads;
  for (std::size_t i = 0; i < 4; ++i) {
    const std::size_t at = i * part;
    const std::size_t len = i == 3 ? size - at : part;
    reads.push_back(att.read({{at, len}}, {Descriptor(into.descriptor().bytes() + at, len,
                                                      into.descriptor().device())}));
  }
  for (auto& r : reads) ASSERT_TRUE(r.wait_for_completion(kWait));
  EXPECT_EQ(att.method(), GetParam());
  EXPECT_EQ(into.mismatch(61), -1);
  Memory from(kHost, size);
  from.fill(62);
  auto w = att.write({from.descriptor()}, {{0, size}});
  ASSERT_TRUE(w.wait_for_completion(kWait));
  EXPECT_EQ(child_->answer(), "END complete -1");
}

INSTANTIATE_TEST_SUITE_P(All, GpuRegion, ::testing::Values("cuda_ipc", "tcp"));

// ---- The IPC cache -----------------------------------------------------------------------

class GpuIpcCache : public GpuTest, public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (const std::string why = missing("cuda_ipc"); !why.empty()) GTEST_SKIP() << why;
    start("cuda_ipc");
  }
  void TearDown() override { stop(); }
};

TEST_P(GpuIpcCache, ReusedWhileTheAllocationLivesAndReopenedWhenItChanges) {
  // Reuse shows here as right bytes on every read; the simulated driver's counters prove the
  // number of opens (cuda_ipc_test).
  const std::string how = GetParam();
  const std::size_t size = std::size_t{64} << 20;
  Memory into(0, size);
  child_->send_line("hold 0 " + std::to_string(size) + " " + how);
  ASSERT_EQ(child_->answer(), "HELD");
  std::uint64_t base = 0;
  for (std::uint64_t seed : {11, 12}) {
    RdmaMetadata readable = child_->shares("read", seed);
    base = readable.descriptors[0].ptr;
    auto read = us_->begin_read(readable, {into.descriptor()});
    ASSERT_TRUE(read.wait_for_completion(kWait));
    EXPECT_EQ(into.mismatch(seed), -1);
    EXPECT_EQ(child_->answer(), "END complete -1");
  }
  child_->send_line("free");
  ASSERT_EQ(child_->answer(), "FREED");
  child_->send_line("hold 0 " + std::to_string(size) + " " + how);
  ASSERT_EQ(child_->answer(), "HELD");
  RdmaMetadata readable = child_->shares("read", 13);
  if (readable.descriptors[0].ptr != base)
    std::cout << "note: the driver made the new allocation at another address\n";
  auto read = us_->begin_read(readable, {into.descriptor()});
  ASSERT_TRUE(read.wait_for_completion(kWait));
  EXPECT_EQ(into.mismatch(13), -1);  // never the freed allocation's bytes
  EXPECT_EQ(child_->answer(), "END complete -1");
}

INSTANTIATE_TEST_SUITE_P(All, GpuIpcCache, ::testing::Values("legacy", "vmm"));

}  // namespace
}  // namespace ferry
