#pragma once

// What the rest of ferry asks about CUDA memory, without <cuda.h>: whether this build has CUDA,
// whether this process can use it, whether a range is device memory of a given device, and
// what the driver and its devices are (for ferry-info). A build without CUDA answers the same
// questions from absent.cpp.

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include <ferry/error.hpp>

namespace ferry::transport::cuda {

struct CudaApi;

/// Whether this ferry was built with CUDA (FERRY_WITH_CUDA): CUDA memory can be moved where a
/// driver is usable.
bool built() noexcept;

/// The driver's table (system_cuda()), or null when this process cannot use CUDA memory
/// (unavailable() says why): for code that hands the table on without calling it (no <cuda.h>
/// needed). Any thread.
const CudaApi* usable_driver();

/// Why this process cannot use CUDA memory (Unsupported: no driver, no GPU, ...); none when
/// it can. The driver is loaded on the first call; any thread.
std::optional<Error> unavailable();

/// Why [ptr, ptr + size) cannot be used as memory of CUDA device `ordinal`: InvalidArgument
/// when it is not device memory, is another device's, or runs past the end of its allocation;
/// Unsupported when CUDA cannot be used here at all (with the reason). None when it can.
/// Any thread.
std::optional<Error> check_device_range(const void* ptr, std::size_t size, int ordinal);

struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  std::string pci_bus_id;
  bool vmm = false;     ///< allocations by cuMemCreate that export POSIX fds
  bool dmabuf = false;  ///< device memory exported as dmabuf (GPUDirect without nvidia-peermem)
};

struct DriverInfo {
  std::string library;  ///< what was loaded ("libcuda.so.1")
  int version = 0;      ///< cuDriverGetVersion: 12040 is 12.4
  std::vector<DeviceInfo> devices;
};

/// The driver and its devices. Throws Error(Unsupported) saying why when CUDA cannot be used
/// here.
DriverInfo describe();

}  // namespace ferry::transport::cuda
