#pragma once

// Memory for the CUDA tests: host memory, or device memory of the CUDA driver this process
// loaded (the simulated one of tests/support/fake_cuda/ unless a test says otherwise), filled
// and checked through the driver's synchronous copies.

#include <gtest/gtest.h>

#include <ferry/ferry.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tests/support/patterns.hpp"
#include "transport/cuda/copy_engine.hpp"
#include "transport/cuda/cuda_api.hpp"
#include "transport/cuda/cuda_memory.hpp"

namespace ferry::test {

namespace cuda = transport::cuda;

inline const cuda::CudaApi& api() { return cuda::system_cuda(); }

/// "host" for ordinal -1, else "cuda<N>" (test names).
inline std::string where(int ordinal) {
  return ordinal < 0 ? "host" : "cuda" + std::to_string(ordinal);
}

/// How device memory is made.
enum class Alloc {
  legacy,         ///< cuMemAlloc
  vmm,            ///< cuMemCreate (exportable as a POSIX fd), reserved and mapped
  vmm_no_export,  ///< cuMemCreate without a shareable handle type
};

/// `size` bytes of host memory (ordinal -1) or of device `ordinal`, filled and checked
/// through the driver's synchronous copies.
class Memory {
 public:
  Memory(int ordinal, std::size_t size, Alloc how = Alloc::legacy)
      : ordinal_(ordinal), size_(size), how_(how) {
    if (ordinal_ < 0) {
      host_ = test::buffer(size_);
      return;
    }
    EXPECT_EQ(api().device_get(&dev_, ordinal_), CUDA_SUCCESS);
    EXPECT_EQ(api().device_primary_ctx_retain(&ctx_, dev_), CUDA_SUCCESS);
    cuda::ScopedContext scope(api(), ctx_);
    if (how_ == Alloc::legacy) {
      EXPECT_EQ(api().mem_alloc(&ptr_, size_), CUDA_SUCCESS);
    } else {
      CUmemAllocationProp prop{};
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      prop.location.id = ordinal_;
      prop.requestedHandleTypes =
          how_ == Alloc::vmm ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
      std::size_t grain = 0;
      EXPECT_EQ(
          api().mem_get_allocation_granularity(&grain, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
          CUDA_SUCCESS);
      mapped_ = (size_ + grain - 1) / grain * grain;
      CUmemGenericAllocationHandle handle = 0;
      EXPECT_EQ(api().mem_create(&handle, mapped_, &prop, 0), CUDA_SUCCESS);
      EXPECT_EQ(api().mem_address_reserve(&ptr_, mapped_, 0, 0, 0), CUDA_SUCCESS);
      EXPECT_EQ(api().mem_map(ptr_, mapped_, 0, handle, 0), CUDA_SUCCESS);
      EXPECT_EQ(api().mem_release(handle), CUDA_SUCCESS);  // the mapping holds it
      CUmemAccessDesc access{};
      access.location = prop.location;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      EXPECT_EQ(api().mem_set_access(ptr_, mapped_, &access, 1), CUDA_SUCCESS);
    }
    EXPECT_EQ(api().memset_d8(ptr_, 0, size_), CUDA_SUCCESS);
  }
  ~Memory() {
    if (ordinal_ < 0) return;
    {
      cuda::ScopedContext scope(api(), ctx_);
      if (how_ == Alloc::legacy) {
        (void)api().mem_free(ptr_);
      } else {
        (void)api().mem_unmap(ptr_, mapped_);
        (void)api().mem_address_free(ptr_, mapped_);
      }
    }
    (void)api().device_primary_ctx_release(dev_);
  }
  Memory(const Memory&) = delete;
  Memory& operator=(const Memory&) = delete;

  std::byte* data() const {
    return ordinal_ < 0 ? const_cast<std::byte*>(host_.data()) : reinterpret_cast<std::byte*>(ptr_);
  }
  std::size_t size() const { return size_; }
  Descriptor descriptor() const {
    return ordinal_ < 0 ? Descriptor(data(), size_)
                        : Descriptor(data(), size_, Device::cuda(ordinal_));
  }
  void fill(std::uint64_t seed, std::uint64_t offset = 0) {
    if (ordinal_ < 0) {
      test::fill_pattern(host_.data(), size_, seed, offset);
      return;
    }
    std::vector<std::byte> h = test::buffer(size_);
    test::fill_pattern(h.data(), size_, seed, offset);
    put(h);
  }
  void set(std::byte value) {
    std::vector<std::byte> h(size_, value);
    if (ordinal_ < 0)
      host_ = h;
    else
      put(h);
  }
  std::vector<std::byte> contents() const {
    if (ordinal_ < 0) return host_;
    std::vector<std::byte> h = test::buffer(size_);
    cuda::ScopedContext scope(api(), ctx_);
    EXPECT_EQ(api().memcpy(address(h.data()), ptr_, size_), CUDA_SUCCESS);
    return h;
  }
  long long mismatch(std::uint64_t seed, std::uint64_t offset = 0) const {
    std::vector<std::byte> h = contents();
    return test::first_mismatch(h.data(), size_, seed, offset);
  }
  bool all(std::byte value) const {
    for (std::byte b : contents())
      if (b != value) return false;
    return true;
  }

 private:
  static CUdeviceptr address(const void* p) {
    return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
  }
  void put(const std::vector<std::byte>& h) {
    cuda::ScopedContext scope(api(), ctx_);
    EXPECT_EQ(api().memcpy(ptr_, address(h.data()), size_), CUDA_SUCCESS);
  }

  int ordinal_;
  std::size_t size_;
  Alloc how_;
  std::size_t mapped_ = 0;  // VMM: size_ rounded up to the granularity
  std::vector<std::byte> host_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  CUdeviceptr ptr_ = 0;
};

/// Pieces of one patterned stream, each on its own memory.
struct Pieces {
  std::vector<std::unique_ptr<Memory>> memory;
  std::vector<Descriptor> descriptors;
  Pieces(const std::vector<std::pair<int, std::size_t>>& layout, std::uint64_t seed) {
    std::uint64_t offset = 0;
    for (auto [ordinal, size] : layout) {
      auto& m = memory.emplace_back(std::make_unique<Memory>(ordinal, size));
      if (seed != 0) m->fill(seed, offset);
      descriptors.push_back(m->descriptor());
      offset += size;
    }
  }
  void expect_stream(std::uint64_t seed) const {
    std::uint64_t offset = 0;
    for (std::size_t i = 0; i < memory.size(); ++i) {
      EXPECT_EQ(memory[i]->mismatch(seed, offset), -1) << "piece " << i;
      offset += memory[i]->size();
    }
  }
};

}  // namespace ferry::test
