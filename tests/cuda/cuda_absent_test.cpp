// Where CUDA cannot be used (no driver here: this process points FERRY_CUDA_DRIVER at a
// library that does not exist, as on a host without a GPU), descriptors on cuda:N are refused
// with Unsupported naming the reason, at the call that names them, and nothing else changes.
#include <gtest/gtest.h>

#include <ferry/ferry.hpp>

#include <cstdlib>
#include <functional>

#include "build_config.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

// Before main, so before anything could load the driver: the same on hosts that have one.
const bool kNoDriver = [] {
  ::setenv("FERRY_CUDA_DRIVER", "/nonexistent/ferry-test/libcuda.so.1", 1);
  return true;
}();

#if FERRY_HAS_CUDA
constexpr const char* kReason = "no CUDA driver: /nonexistent/ferry-test/libcuda.so.1 cannot be";
#else
constexpr const char* kReason = "built without CUDA";
#endif

class NoCudaDriver : public ::testing::Test {
 protected:
  Connector owner_{test::named("owner")};
  Connector peer_{test::named("peer")};
  std::vector<std::byte> a_ = test::patterned(4096, 7);
  std::vector<std::byte> b_ = test::buffer(4096);
};

TEST_F(NoCudaDriver, PassiveOperationsOnCudaDescriptorsAreRefusedWithTheReason) {
  ASSERT_TRUE(kNoDriver);
  Descriptor on_gpu(a_.data(), 16, Device::cuda(0));
  test::expect_error([&] { (void)owner_.create_readable({on_gpu}); }, ErrorCode::Unsupported,
                     std::string("descriptor 0 (cuda:0): "));
  test::expect_error([&] { (void)owner_.create_readable({on_gpu}); }, ErrorCode::Unsupported,
                     kReason);
  // The second of a list, and on another device: named as such.
  test::expect_error(
      [&] {
        (void)owner_.create_writable(
            {Descriptor(a_.data(), 16), Descriptor(a_.data() + 16, 16, Device::cuda(3))});
      },
      ErrorCode::Unsupported, "descriptor 1 (cuda:3)");
}

TEST_F(NoCudaDriver, ActiveOperationsOnCudaDescriptorsAreRefusedAtTheCall) {
  auto readable = owner_.create_readable({Descriptor(a_.data(), 4096)});
  auto writable = owner_.create_writable({Descriptor(b_.data(), 4096)});
  Descriptor on_gpu(b_.data(), 4096, Device::cuda(0));
  test::expect_error([&] { (void)peer_.begin_read(readable.metadata(), {on_gpu}); },
                     ErrorCode::Unsupported, kReason);
  test::expect_error([&] { (void)peer_.begin_write({on_gpu}, writable.metadata()); },
                     ErrorCode::Unsupported, kReason);
  // The passive operations are untouched by the refusals.
  EXPECT_EQ(readable.status(), OperationStatus::initialized);
  EXPECT_EQ(writable.status(), OperationStatus::initialized);
}

TEST_F(NoCudaDriver, MetadataOfCudaMemoryFindsNoMethodHere) {
  // A peer with CUDA offers its memory; no method of this connector moves it.
  auto readable = owner_.create_readable({Descriptor(a_.data(), 4096)});
  RdmaMetadata m = readable.metadata();
  m.descriptors[0].device = Device::cuda(0);
  test::expect_error([&] { (void)peer_.begin_read(m, {Descriptor(b_.data(), 4096)}); },
                     ErrorCode::NoCommonMethod, "needs host+cuda");
}

TEST_F(NoCudaDriver, HostMemoryMovesAsBefore) {
  Descriptor on_gpu(a_.data(), 4096, Device::cuda(0));
  test::expect_error([&] { (void)owner_.create_readable({on_gpu}); }, ErrorCode::Unsupported,
                     kReason);
  auto readable = owner_.create_readable({Descriptor(a_.data(), 4096)});
  auto read = peer_.begin_read(readable.metadata(), {Descriptor(b_.data(), 4096)});
  ASSERT_TRUE(read.wait_for_completion(std::chrono::seconds(20)));
  EXPECT_EQ(read.status(), OperationStatus::complete);
  EXPECT_EQ(test::first_mismatch(b_.data(), b_.size(), 7), -1);
}

TEST(NoCudaDriverMethods, TcpCudaIpcAndVerbsSayTheyMoveCuda) {
  // Built with CUDA, tcp stages CUDA memory, cuda_ipc copies it and verbs registers or stages
  // it where the driver is usable (the refusals above come from the missing driver); built
  // without, no method moves it.
  for (const MethodInfo& m : probe_methods()) {
#if FERRY_HAS_CUDA
    EXPECT_EQ(m.moves_cuda, m.method == "tcp" || m.method == "cuda_ipc" || m.method == "verbs")
        << m.method;
    if (m.method == "cuda_ipc") {
      EXPECT_FALSE(m.available);
      EXPECT_NE(m.detail.find("no CUDA driver"), std::string::npos) << m.detail;
    }
#else
    EXPECT_FALSE(m.moves_cuda) << m.method;
#endif
    EXPECT_EQ(m.moves_host, m.method != "cuda_ipc") << m.method;
  }
}

}  // namespace
}  // namespace ferry
