// With a CUDA driver (the simulated one of tests/support/fake_cuda/, whose device memory the
// CPU cannot touch): descriptors on cuda:N are checked against it, ferry-info lists its
// devices, and the copy engine and staging pool that the methods build on do what they say.
#include <gtest/gtest.h>
#include <uv.h>

#include <ferry/ferry.hpp>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <thread>
#include <vector>

#include "tests/cuda/simulated_driver.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"
#include "transport/cuda/copy_engine.hpp"
#include "transport/cuda/cuda_api.hpp"
#include "transport/cuda/cuda_memory.hpp"

namespace ferry {
namespace {

namespace cuda = transport::cuda;

// Before main (ctest sets both too).
const bool kFakeDriver = test::use_simulated_driver("2000");

/// Device memory of the simulated driver, freed at the end; the thread's context is left as
/// it was.
class DeviceBuffer {
 public:
  DeviceBuffer(const cuda::CudaApi& api, int ordinal, std::size_t size) : api_(api) {
    CUdevice dev = 0;
    EXPECT_EQ(api_.device_get(&dev, ordinal), CUDA_SUCCESS);
    EXPECT_EQ(api_.device_primary_ctx_retain(&ctx_, dev), CUDA_SUCCESS);
    device_ = dev;
    cuda::ScopedContext scope(api_, ctx_);
    EXPECT_EQ(api_.mem_alloc(&ptr_, size), CUDA_SUCCESS);
  }
  ~DeviceBuffer() {
    {
      cuda::ScopedContext scope(api_, ctx_);
      (void)api_.mem_free(ptr_);
    }
    (void)api_.device_primary_ctx_release(device_);
  }
  std::byte* get() const { return reinterpret_cast<std::byte*>(ptr_); }
  CUcontext context() const { return ctx_; }

 private:
  const cuda::CudaApi& api_;
  CUcontext ctx_ = nullptr;
  CUdevice device_ = 0;
  CUdeviceptr ptr_ = 0;
};

class WithCudaDriver : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kFakeDriver);
    const std::optional<Error> why = cuda::unavailable();
    ASSERT_FALSE(why) << why->what();
    api_ = &cuda::system_cuda();
  }
  const cuda::CudaApi* api_ = nullptr;
};

TEST_F(WithCudaDriver, DescriptorsAreCheckedAgainstTheDriver) {
  Connector owner(test::named("owner"));
  std::vector<std::byte> host = test::buffer(4096);
  DeviceBuffer gpu0(*api_, 0, 1 << 20);
  DeviceBuffer gpu1(*api_, 1, 1 << 20);
  test::expect_error(
      [&] { (void)owner.create_readable({Descriptor(host.data(), 4096, Device::cuda(0))}); },
      ErrorCode::InvalidArgument, "descriptor 0 (cuda:0): the memory is not CUDA device memory");
  test::expect_error(
      [&] { (void)owner.create_readable({Descriptor(gpu1.get(), 4096, Device::cuda(0))}); },
      ErrorCode::InvalidArgument, "the memory is on cuda:1, not cuda:0");
  test::expect_error(
      [&] {
        (void)owner.create_readable({Descriptor(gpu0.get() + 4096, 1 << 20, Device::cuda(0))});
      },
      ErrorCode::InvalidArgument, "runs past the end of its allocation");
  test::expect_error(
      [&] { (void)owner.create_readable({Descriptor(gpu0.get(), 4096, Device::cuda(7))}); },
      ErrorCode::InvalidArgument, "there is no device cuda:7 (this host has 2)");
  // Device memory rightly described: accepted (tcp stages it through host memory).
  {
    auto readable = owner.create_readable({Descriptor(gpu0.get() + 4096, 4096, Device::cuda(0))});
    EXPECT_EQ(readable.status(), OperationStatus::initialized);
    EXPECT_NE(readable.metadata().endpoints.size(), 0u);
  }
  // A connector whose methods cannot serve it still refuses it: cma moves CUDA memory on its
  // active side only.
  ConnectorOptions cma_only = test::named("cma-only");
  cma_only.transports = {"cma"};
  Connector host_only(cma_only);
  test::expect_error(
      [&] {
        (void)host_only.create_readable({Descriptor(gpu0.get() + 4096, 4096, Device::cuda(0))});
      },
      ErrorCode::Unsupported, "no method of this connector can serve this memory: cma does not");
  // The checks made no context current on this thread.
  CUcontext current = nullptr;
  ASSERT_EQ(api_->ctx_get_current(&current), CUDA_SUCCESS);
  EXPECT_EQ(current, nullptr);
}

/// Runs `loop` until `done()` or 10 s.
void run_until(uv_loop_t* loop, const std::function<bool()>& done) {
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done() && std::chrono::steady_clock::now() < until) uv_run(loop, UV_RUN_NOWAIT);
}

class CopyEngineTest : public WithCudaDriver {
 protected:
  void SetUp() override {
    WithCudaDriver::SetUp();
    ASSERT_EQ(uv_loop_init(&loop_), 0);
  }
  void TearDown() override {
    uv_run(&loop_, UV_RUN_NOWAIT);  // the engine's handle closes
    EXPECT_EQ(uv_loop_close(&loop_), 0);
  }
  uv_loop_t loop_{};
};

TEST_F(CopyEngineTest, CopiesBothWaysCompleteOnTheLoopThread) {
  const std::size_t size = 3 << 20;
  std::vector<std::byte> source = test::patterned(size, 11);
  std::vector<std::byte> back = test::buffer(size);
  DeviceBuffer gpu(*api_, 1, size);
  {
    cuda::CopyEngine engine(&loop_, *api_);
    std::vector<std::string> order;
    const auto loop_thread = std::this_thread::get_id();
    engine.copy(1, gpu.get(), source.data(), size, [&](const std::optional<Error>& e) {
      EXPECT_FALSE(e);
      EXPECT_EQ(std::this_thread::get_id(), loop_thread);
      order.push_back("h2d");
    });
    // Queued behind the first on the device's stream: the bytes come back whole.
    engine.copy(1, back.data(), gpu.get(), size, [&](const std::optional<Error>& e) {
      EXPECT_FALSE(e);
      order.push_back("d2h");
    });
    EXPECT_TRUE(order.empty());  // never from inside copy()
    EXPECT_EQ(engine.in_flight(), 2u);
    run_until(&loop_, [&] { return order.size() == 2; });
    EXPECT_EQ(order, (std::vector<std::string>{"h2d", "d2h"}));
    EXPECT_EQ(engine.in_flight(), 0u);
  }
  EXPECT_EQ(test::first_mismatch(back.data(), size, 11), -1);
  CUcontext current = nullptr;
  ASSERT_EQ(api_->ctx_get_current(&current), CUDA_SUCCESS);
  EXPECT_EQ(current, nullptr);
}

TEST_F(CopyEngineTest, ACancelledCopyIsOverWhenCancelReturnsAndNeverReported) {
  const std::size_t size = 1 << 20;
  std::vector<std::byte> source = test::patterned(size, 5);
  std::vector<std::byte> back = test::buffer(size);
  DeviceBuffer gpu(*api_, 0, size);
  cuda::CopyEngine engine(&loop_, *api_);
  bool reported = false;
  // Each copy of the simulated driver takes 2 ms here: the first is still running.
  engine.copy(0, gpu.get(), source.data(), size, [&](const std::optional<Error>&) {});
  std::uint64_t id = engine.copy(0, back.data(), gpu.get(), size,
                                 [&](const std::optional<Error>&) { reported = true; });
  engine.cancel(id);
  // Nothing touches `back` any more: its bytes are final now.
  EXPECT_EQ(test::first_mismatch(back.data(), size, 5), -1);
  run_until(&loop_, [&] { return engine.in_flight() == 0; });
  uv_run(&loop_, UV_RUN_NOWAIT);
  EXPECT_FALSE(reported);
}

TEST_F(CopyEngineTest, CopiesInFlightAtDestructionAreWaitedForAndNotReported) {
  const std::size_t size = 1 << 20;
  std::vector<std::byte> back = test::buffer(size);
  std::vector<std::byte> source = test::patterned(size, 9);
  DeviceBuffer gpu(*api_, 0, size);
  bool reported = false;
  {
    cuda::CopyEngine engine(&loop_, *api_);
    engine.copy(0, gpu.get(), source.data(), size, [&](const std::optional<Error>&) {});
    engine.copy(0, back.data(), gpu.get(), size,
                [&](const std::optional<Error>&) { reported = true; });
  }
  EXPECT_EQ(test::first_mismatch(back.data(), size, 9), -1);
  uv_run(&loop_, UV_RUN_NOWAIT);
  EXPECT_FALSE(reported);
}

TEST_F(CopyEngineTest, ACopyTheDriverRefusesThrows) {
  cuda::CopyEngine engine(&loop_, *api_);
  std::vector<std::byte> host = test::buffer(64);
  test::expect_error([&] { engine.copy(5, host.data(), host.data() + 32, 16, {}); },
                     ErrorCode::Internal, "cuDeviceGet");
  EXPECT_EQ(engine.in_flight(), 0u);
}

TEST_F(WithCudaDriver, StagingPoolHandsOutPinnedChunksUpToItsLimit) {
  DeviceBuffer gpu(*api_, 0, 4096);
  cuda::StagingPool pool(*api_, 1 << 20, 2);
  int released = 0;
  pool.set_on_release([&] { ++released; });
  std::byte* a = pool.acquire(gpu.context());
  std::byte* b = pool.acquire(gpu.context());
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_NE(a, b);
  EXPECT_EQ(pool.acquire(gpu.context()), nullptr);
  EXPECT_EQ(pool.held(), 2u);
  // Pinned host memory, as the driver sees it.
  unsigned int type = 0;
  CUpointer_attribute attr = CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
  void* data = &type;
  ASSERT_EQ(api_->pointer_get_attributes(
                1, &attr, &data, static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(a))),
            CUDA_SUCCESS);
  EXPECT_EQ(type, CU_MEMORYTYPE_HOST);
  std::memset(a, 1, 1 << 20);  // the CPU may write it
  pool.release(a);
  EXPECT_EQ(released, 1);
  EXPECT_EQ(pool.acquire(gpu.context()), a);
  pool.release(a);
  pool.release(b);
  test::expect_error([&] { cuda::StagingPool(*api_, 1 << 20, 1); }, ErrorCode::InvalidArgument,
                     "two chunks or more");
}

}  // namespace
}  // namespace ferry
