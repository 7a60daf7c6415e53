#pragma once

// Device memory for ferry's samples and benchmarks: `size` bytes of CUDA device `ordinal`,
// allocated with the driver ferry loads at run time (transport/cuda/cuda_api.hpp) and filled
// and read only through the driver's synchronous copies (device memory need not be reachable
// by the CPU). Programs that use it are built with FERRY_WITH_CUDA where ferry has CUDA
// memory; without it, making one throws "ferry was built without CUDA".

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "build_config.hpp"
#if FERRY_HAS_CUDA
#include "transport/cuda/cuda_api.hpp"
#endif

namespace ferry_samples {

/// "host" -> -1, "cuda:N" -> N. Throws std::invalid_argument otherwise.
inline int parse_device(const std::string& text) {
  if (text == "host" || text == "cpu") return -1;
  const std::string prefix = "cuda:";
  if (text.rfind(prefix, 0) == 0 && text.size() > prefix.size() &&
      text.find_first_not_of("0123456789", prefix.size()) == std::string::npos)
    return std::stoi(text.substr(prefix.size()));
  throw std::invalid_argument("not a device: '" + text + "' (host or cuda:N)");
}

class DeviceMemory {
 public:
  /// Throws std::runtime_error naming why when CUDA cannot be used.
  DeviceMemory(int ordinal, std::size_t size) : ordinal_(ordinal), size_(size) {
#if FERRY_HAS_CUDA
    namespace cuda = ferry::transport::cuda;
    try {
      api_ = &cuda::system_cuda();
    } catch (const ferry::Error& e) {
      throw std::runtime_error("cuda:" + std::to_string(ordinal) + ": " + e.message());
    }
    check(api_->device_get(&dev_, ordinal_), "cuDeviceGet");
    check(api_->device_primary_ctx_retain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
    Scope scope(*this);
    CUresult r = api_->mem_alloc(&ptr_, size_);
    if (r != CUDA_SUCCESS) {
      (void)api_->device_primary_ctx_release(dev_);
      check(r, "cuMemAlloc of " + std::to_string(size_) + " bytes");
    }
#else
    throw std::runtime_error("cuda:" + std::to_string(ordinal) + ": ferry was built without CUDA");
#endif
  }
  ~DeviceMemory() {
#if FERRY_HAS_CUDA
    {
      Scope scope(*this);
      (void)api_->mem_free(ptr_);
    }
    (void)api_->device_primary_ctx_release(dev_);
#endif
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  int ordinal() const { return ordinal_; }
  std::size_t size() const { return size_; }
  /// The device address, for descriptors; never to be dereferenced by the CPU.
  std::byte* data() const {
#if FERRY_HAS_CUDA
    return reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(ptr_));
#else
    return nullptr;
#endif
  }
  /// Copies `n` bytes from host memory `src` to `offset` of this memory.
  void write(std::size_t offset, const void* src, std::size_t n) {
#if FERRY_HAS_CUDA
    Scope scope(*this);
    check(api_->memcpy(ptr_ + offset, address(src), n), "cuMemcpy to the device");
#else
    (void)offset, (void)src, (void)n;
#endif
  }
  /// Copies `n` bytes at `offset` of this memory to host memory `dst`.
  void read(std::size_t offset, void* dst, std::size_t n) const {
#if FERRY_HAS_CUDA
    Scope scope(*this);
    check(api_->memcpy(address(dst), ptr_ + offset, n), "cuMemcpy from the device");
#else
    (void)offset, (void)dst, (void)n;
#endif
  }

 private:
#if FERRY_HAS_CUDA
  // The memory's context current on this thread for a scope, the previous one after it.
  struct Scope {
    const DeviceMemory& m;
    CUcontext previous = nullptr;
    explicit Scope(const DeviceMemory& mem) : m(mem) {
      (void)m.api_->ctx_get_current(&previous);
      if (previous != m.ctx_) (void)m.api_->ctx_set_current(m.ctx_);
    }
    ~Scope() {
      if (previous != m.ctx_) (void)m.api_->ctx_set_current(previous);
    }
  };
  static CUdeviceptr address(const void* p) {
    return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
  }
  void check(CUresult r, const std::string& what) const {
    if (r != CUDA_SUCCESS)
      throw std::runtime_error("cuda:" + std::to_string(ordinal_) + ": " + what + ": " +
                               ferry::transport::cuda::result_text(api_, r));
  }
  const ferry::transport::cuda::CudaApi* api_ = nullptr;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  CUdeviceptr ptr_ = 0;
#endif
  int ordinal_;
  std::size_t size_;
};

}  // namespace ferry_samples
