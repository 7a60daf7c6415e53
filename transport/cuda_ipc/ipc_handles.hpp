#pragma once

// How cuda_ipc shares the owner's CUDA memory: the owner's allocations described (legacy IPC
// handles, or fds of VMM exports) in CLAIMED's payload, and opened by the active side.

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ferry/error.hpp>

#include "transport/cuda/cuda_api.hpp"
#include "transport/memory.hpp"

namespace ferry::transport::cuda_ipc {

/// How the owner shares one allocation.
enum class IpcKind : std::uint32_t {
  legacy = 0,  ///< memory from cuMemAlloc: a legacy IPC handle (cuIpcGetMemHandle)
  vmm = 1,     ///< memory from cuMemCreate: a POSIX fd of the owner's, fetched by the peer
};

/// One allocation of the owner's device memory and how to open it.
struct IpcRange {
  std::uint64_t base = 0;  ///< the allocation's address in the owner
  std::uint64_t size = 0;
  IpcKind kind = IpcKind::legacy;
  /// vmm: the owner's fd of its export (cuMemExportToShareableHandle), which the peer takes a
  /// copy of with pidfd_getfd (the same permission cma's copies need), and the export's
  /// number in the owner: another allocation at the same address comes with another number.
  std::int32_t fd = -1;
  std::uint64_t generation = 0;
  /// The PCI bus id of the device holding it ("0000:3b:00.0"), so that the peer opens it on
  /// that device whatever its own ordinals are.
  std::array<char, 16> device{};
  /// legacy: the handle.
  std::array<std::byte, CU_IPC_HANDLE_SIZE> handle{};
  bool operator==(const IpcRange&) const = default;
};

/// On the wire (CLAIMED's payload), little-endian: 8-byte base, 8-byte size, 4-byte kind, 4-byte
/// fd, 8-byte generation, 16-byte bus id (NUL-padded), the 64-byte handle.
inline constexpr std::size_t kIpcRangeBytes = 48 + CU_IPC_HANDLE_SIZE;
/// Most ranges one CLAIMED carries: one per descriptor of the longest lists, and some.
inline constexpr std::size_t kMaxIpcRanges = 65536;
inline constexpr std::uint64_t kMaxHandleBytes = kIpcRangeBytes * kMaxIpcRanges;

std::vector<std::byte> encode_ranges(const std::vector<IpcRange>& ranges);
/// False when `bytes` is no whole list of ranges, or holds more than kMaxIpcRanges.
bool decode_ranges(const std::byte* data, std::size_t bytes, std::vector<IpcRange>& out);

/// The owner's exports of VMM allocations (cuMemCreate), by address: each allocation is
/// exported once and its fd kept while it stays mapped there, so that a peer's cache of it
/// stays good from one operation to the next. An export holds a reference to its allocation
/// (as the peer's mapping does), so memory the user freed stays until the next export sweeps
/// it out (each export checks every entry) or the transport closes. Loop thread only.
class VmmExports {
 public:
  explicit VmmExports(const cuda::CudaApi& api) : api_(api) {}
  ~VmmExports();
  VmmExports(const VmmExports&) = delete;
  VmmExports& operator=(const VmmExports&) = delete;

  /// Fills `range.fd` and `range.generation` for the VMM allocation mapped at `range.base`
  /// (`range.size` bytes), exporting it if it is new there. Throws Error(Unsupported) naming
  /// the driver's answer when it is no VMM allocation, or one made without
  /// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR. The caller has the device's context current.
  void share(IpcRange& range);
  std::size_t exported() const noexcept { return exports_; }

 private:
  struct Entry {
    CUmemGenericAllocationHandle handle = 0;  // retained
    std::uint64_t size = 0;
    int fd = -1;
    std::uint64_t generation = 0;
  };
  void drop(Entry& e);
  /// Drops the entries whose address no longer maps their allocation.
  void sweep();

  const cuda::CudaApi& api_;
  std::map<std::uint64_t, Entry> entries_;  // by base
  std::uint64_t next_generation_ = 1;
  std::size_t exports_ = 0;
};

/// The owner's side: the allocations that hold `regions` (each once), with how to open them.
/// VMM allocations need `vmm` (else they count as unshareable). Throws Error(Unsupported) for
/// memory that cannot be shared, naming the driver's answer.
std::vector<IpcRange> export_ranges(const cuda::CudaApi& api, const std::vector<Region>& regions,
                                    VmmExports* vmm);

/// Takes a copy of the owner's fd `fd` into this process (for the caller to close); throws
/// Error naming the refusal when it cannot.
using FetchFd = std::function<int(int fd)>;

class IpcImports {
 public:
  explicit IpcImports(const cuda::CudaApi& api) : api_(api) {}
  /// Closes every mapping; no copy may use one any more.
  ~IpcImports();
  IpcImports(const IpcImports&) = delete;
  IpcImports& operator=(const IpcImports&) = delete;

  /// Opens the ranges not opened yet, each on the local device with its bus id (`fallback`
  /// when no local device has it). `fetch` takes copies of the owner's fds. Throws
  /// Error(AccessDenied) when the driver refuses a handle (the owner freed the memory, or it
  /// is another host's).
  void open(const std::vector<IpcRange>& ranges, int fallback, const FetchFd& fetch);
  /// Where the owner's [addr, addr + len) is mapped here (inside one opened range), and the
  /// device it was opened on; null when it is not.
  struct Place {
    std::byte* at = nullptr;
    int device = -1;
  };
  Place translate(std::uint64_t addr, std::uint64_t len) const;

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
    int ordinal = -1;
  };
  void close(Mapping& m);
  /// The local ordinal of the device with bus id `bus`, or `fallback`.
  int ordinal_of(const std::array<char, 16>& bus, int fallback) const;
  /// Maps a VMM allocation (m.range) into this process; the context is current. Throws
  /// Error(AccessDenied) naming the call that failed.
  void import(Mapping& m, const FetchFd& fetch);
  /// Opens a legacy IPC handle (m.range); the context is current. Throws as import() does.
  void open_legacy(Mapping& m);
  /// Error(ProtocolError) when the owner's stated size is more than the driver mapped at
  /// m.local (translate() trusts m.range.size from then on).
  std::optional<Error> oversized(const Mapping& m) const;

  const cuda::CudaApi& api_;
  std::map<std::uint64_t, Mapping> mappings_;  // by owner base (the owner's addresses are unique)
  std::size_t opens_ = 0;
  std::size_t replaced_ = 0;
};

}  // namespace ferry::transport::cuda_ipc
