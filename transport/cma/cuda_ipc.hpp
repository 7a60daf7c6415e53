#pragma once

// The cuda_ipc method's own pieces: the cma transport in its cuda_ipc mode (cma_transport.hpp)
// claims and grants as cma does, but copies device memory with the GPU, through CUDA IPC
// handles of the owner's allocations. Compiled only with FERRY_WITH_CUDA.

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "transport/cuda/cuda_api.hpp"
#include "transport/memory.hpp"

namespace ferry::transport::cma {

/// One allocation of the owner's device memory and its legacy IPC handle (cuIpcGetMemHandle).
struct IpcRange {
  std::uint64_t base = 0;  ///< the allocation's address in the owner
  std::uint64_t size = 0;
  std::array<std::byte, CU_IPC_HANDLE_SIZE> handle{};
  bool operator==(const IpcRange&) const = default;
};

/// On the wire (HANDLES frame): 8-byte base, 8-byte size, the 64-byte handle, little-endian.
inline constexpr std::size_t kIpcRangeBytes = 16 + CU_IPC_HANDLE_SIZE;
/// Most ranges one HANDLES frame carries: one per descriptor of the longest lists, and some.
inline constexpr std::size_t kMaxIpcRanges = 65536;

std::vector<std::byte> encode_ranges(const std::vector<IpcRange>& ranges);
/// False when `bytes` is no whole list of ranges, or holds more than kMaxIpcRanges.
bool decode_ranges(const std::byte* data, std::size_t bytes, std::vector<IpcRange>& out);

/// The owner's side: the allocations that hold `regions` (each once), with their handles.
/// Throws Error(Unsupported) for memory that has no legacy IPC handle (VMM allocations, say),
/// naming the driver's answer.
std::vector<IpcRange> export_ranges(const cuda::CudaApi& api, const std::vector<Region>& regions);

/// The peer's side: an owner's allocations opened in this process (cuIpcOpenMemHandle), cached
/// for the life of the link to that owner, per device and allocation. An allocation the owner
/// freed and reallocated at the same address, or over it, comes with another handle: every
/// old mapping it overlaps is closed and the new one opened. Loop thread only.
class IpcImports {
 public:
  explicit IpcImports(const cuda::CudaApi& api) : api_(api) {}
  /// Closes every mapping; no copy may use one any more.
  ~IpcImports();
  IpcImports(const IpcImports&) = delete;
  IpcImports& operator=(const IpcImports&) = delete;

  /// Opens the ranges not opened yet on device `ordinal`. Throws Error(AccessDenied) when the
  /// driver refuses a handle (the owner freed the memory, or it is another host's).
  void open(const std::vector<IpcRange>& ranges, int ordinal);
  /// Where the owner's [addr, addr + len) is mapped here for device `ordinal` (inside one
  /// opened range), or null.
  std::byte* translate(std::uint64_t addr, std::uint64_t len, int ordinal) const;

  /// For tests: handles opened in all, and mappings closed because the owner's allocation
  /// changed.
  std::size_t opens() const noexcept { return opens_; }
  std::size_t replaced() const noexcept { return replaced_; }

 private:
  struct Mapping {
    IpcRange range;
    CUdeviceptr local = 0;
    CUcontext context = nullptr;
    CUdevice device = 0;
  };
  void close(Mapping& m);

  const cuda::CudaApi& api_;
  std::map<std::pair<int, std::uint64_t>, Mapping> mappings_;  // by (device, owner base)
  std::size_t opens_ = 0;
  std::size_t replaced_ = 0;
};

}  // namespace ferry::transport::cma
