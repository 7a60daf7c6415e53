// On a real GPU, through the system's driver (libcuda.so.1): skipped where there is none.
// The same checks as cuda_driver_test, against what the simulated driver imitates.
#include <gtest/gtest.h>
#include <uv.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "tests/support/patterns.hpp"
#include "transport/cuda/copy_engine.hpp"
#include "transport/cuda/cuda_api.hpp"
#include "transport/cuda/cuda_memory.hpp"

namespace ferry {
namespace {

namespace cuda = transport::cuda;

class RealGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::optional<Error> why = cuda::unavailable())
      GTEST_SKIP() << "no usable CUDA driver here: " << why->message();
    api_ = &cuda::system_cuda();
    int count = 0;
    if (api_->device_get_count(&count) != CUDA_SUCCESS || count == 0)
      GTEST_SKIP() << "the CUDA driver sees no GPU";
    ASSERT_EQ(api_->device_get(&device_, 0), CUDA_SUCCESS);
    ASSERT_EQ(api_->device_primary_ctx_retain(&ctx_, device_), CUDA_SUCCESS);
    cuda::ScopedContext scope(*api_, ctx_);
    ASSERT_EQ(api_->mem_alloc(&ptr_, kSize), CUDA_SUCCESS);
  }
  void TearDown() override {
    if (ctx_ == nullptr) return;
    {
      cuda::ScopedContext scope(*api_, ctx_);
      if (ptr_ != 0) (void)api_->mem_free(ptr_);
    }
    (void)api_->device_primary_ctx_release(device_);
  }
  std::byte* gpu() const { return reinterpret_cast<std::byte*>(ptr_); }

  static constexpr std::size_t kSize = std::size_t{256} << 20;
  const cuda::CudaApi* api_ = nullptr;
  CUdevice device_ = 0;
  CUcontext ctx_ = nullptr;
  CUdeviceptr ptr_ = 0;
};

TEST_F(RealGpu, DeviceRangesAreCheckedAgainstTheDriver) {
  EXPECT_FALSE(cuda::check_device_range(gpu(), kSize, 0));
  EXPECT_FALSE(cuda::check_device_range(gpu() + 4096, 4096, 0));
  auto past = cuda::check_device_range(gpu() + 4096, kSize, 0);
  ASSERT_TRUE(past);
  EXPECT_EQ(past->code(), ErrorCode::InvalidArgument);
  std::vector<std::byte> host(4096);
  auto not_device = cuda::check_device_range(host.data(), host.size(), 0);
  ASSERT_TRUE(not_device);
  EXPECT_EQ(not_device->code(), ErrorCode::InvalidArgument);
}

TEST_F(RealGpu, CopyEngineMovesBytesBothWays) {
  uv_loop_t loop{};
  ASSERT_EQ(uv_loop_init(&loop), 0);
  std::vector<std::byte> source = test::patterned(kSize, 21);
  std::vector<std::byte> back = test::buffer(kSize);
  int finished = 0;
  {
    cuda::CopyEngine engine(&loop, *api_);
    engine.copy(0, gpu(), source.data(), kSize, [&](const std::optional<Error>& e) {
      EXPECT_FALSE(e);
      ++finished;
    });
    engine.copy(0, back.data(), gpu(), kSize, [&](const std::optional<Error>& e) {
      EXPECT_FALSE(e);
      ++finished;
    });
    // The engine's handle keeps the loop alive until both are reported.
    uv_run(&loop, UV_RUN_DEFAULT);
  }
  uv_run(&loop, UV_RUN_NOWAIT);
  EXPECT_EQ(uv_loop_close(&loop), 0);
  EXPECT_EQ(finished, 2);
  EXPECT_EQ(test::first_mismatch(back.data(), kSize, 21), -1);
  CUcontext current = nullptr;
  ASSERT_EQ(api_->ctx_get_current(&current), CUDA_SUCCESS);
  EXPECT_EQ(current, nullptr);
}

}  // namespace
}  // namespace ferry
