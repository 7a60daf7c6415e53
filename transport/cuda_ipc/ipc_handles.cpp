#include "transport/cuda_ipc/ipc_handles.hpp"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>

#include <unistd.h>

#include <ferry/error.hpp>

#include "transport/cuda/copy_engine.hpp"
#include "transport/same_host/system.hpp"

namespace ferry::transport::cuda_ipc {

namespace {

void put64(std::byte* out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::byte>(v >> (8 * i));
}

std::uint64_t get64(const std::byte* in) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(in[i]) << (8 * i);
  return v;
}

CUdeviceptr address(const void* p) {
  return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
}

}  // namespace

std::vector<std::byte> encode_ranges(const std::vector<IpcRange>& ranges) {
  std::vector<std::byte> out(ranges.size() * kIpcRangeBytes);
  std::byte* p = out.data();
  for (const IpcRange& r : ranges) {
    put64(p, r.base);
    put64(p + 8, r.size);
    put64(p + 16, static_cast<std::uint64_t>(r.kind) |
                      (static_cast<std::uint64_t>(static_cast<std::uint32_t>(r.fd)) << 32));
    put64(p + 24, r.generation);
    std::memcpy(p + 32, r.device.data(), r.device.size());
    std::memcpy(p + 48, r.handle.data(), r.handle.size());
    p += kIpcRangeBytes;
  }
  return out;
}

bool decode_ranges(const std::byte* data, std::size_t bytes, std::vector<IpcRange>& out) {
  if (bytes == 0 || bytes % kIpcRangeBytes != 0 || bytes / kIpcRangeBytes > kMaxIpcRanges)
    return false;
  out.clear();
  for (const std::byte* p = data; p < data + bytes; p += kIpcRangeBytes) {
    IpcRange r;
    r.base = get64(p);
    r.size = get64(p + 8);
    if (r.size == 0 || r.base + r.size < r.base) return false;
    const std::uint64_t kind_fd = get64(p + 16);
    const auto kind = static_cast<std::uint32_t>(kind_fd);
    if (kind > static_cast<std::uint32_t>(IpcKind::vmm)) return false;
    r.kind = static_cast<IpcKind>(kind);
    r.fd = static_cast<std::int32_t>(static_cast<std::uint32_t>(kind_fd >> 32));
    if (r.kind == IpcKind::vmm && r.fd < 0) return false;
    r.generation = get64(p + 24);
    std::memcpy(r.device.data(), p + 32, r.device.size());
    r.device.back() = '\0';
    std::memcpy(r.handle.data(), p + 48, r.handle.size());
    out.push_back(r);
  }
  return true;
}

// ---------------------------------------------------------------------------------------
// The owner's side

VmmExports::~VmmExports() {
  for (auto& [base, e] : entries_) drop(e);
}

void VmmExports::drop(Entry& e) {
  if (e.fd >= 0) ::close(e.fd);
  (void)api_.mem_release(e.handle);
  e = Entry{};
}

void VmmExports::sweep() {
  for (auto it = entries_.begin(); it != entries_.end();) {
    CUmemGenericAllocationHandle now = 0;
    const bool same =
        api_.mem_retain_allocation_handle(&now, reinterpret_cast<void*>(it->first)) == CUDA_SUCCESS;
    if (same) (void)api_.mem_release(now);
    if (same && now == it->second.handle) {
      ++it;
      continue;
    }
    drop(it->second);
    it = entries_.erase(it);
  }
}

void VmmExports::share(IpcRange& range) {
  if (api_.mem_retain_allocation_handle == nullptr ||
      api_.mem_export_to_shareable_handle == nullptr)
    throw Error(ErrorCode::Unsupported, "this driver has no virtual memory management");
  CUmemGenericAllocationHandle handle = 0;
  CUresult rc = api_.mem_retain_allocation_handle(&handle, reinterpret_cast<void*>(range.base));
  if (rc != CUDA_SUCCESS)
    throw Error(ErrorCode::Unsupported,
                "it is no VMM allocation either (cuMemRetainAllocationHandle: " +
                    cuda::result_text(&api_, rc) + ")");
  // While `handle` is retained here, no other allocation can be given its value: an entry
  // holding the same value is the same allocation.
  if (auto it = entries_.find(range.base);
      it != entries_.end() && it->second.handle == handle && it->second.size == range.size) {
    (void)api_.mem_release(handle);
    range.fd = it->second.fd;
    range.generation = it->second.generation;
    return;
  }
  sweep();
  int fd = -1;
  rc =
      api_.mem_export_to_shareable_handle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (rc != CUDA_SUCCESS || fd < 0) {
    (void)api_.mem_release(handle);
    throw Error(ErrorCode::Unsupported,
                "the VMM allocation cannot be exported as a POSIX fd "
                "(cuMemExportToShareableHandle: " +
                    cuda::result_text(&api_, rc) +
                    "; create it with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR among its "
                    "requestedHandleTypes)");
  }
  if (auto it = entries_.find(range.base); it != entries_.end()) {
    drop(it->second);
    entries_.erase(it);
  }
  Entry e{handle, range.size, fd, next_generation_++};
  entries_[range.base] = e;
  ++exports_;
  range.fd = fd;
  range.generation = e.generation;
}

std::vector<IpcRange> export_ranges(const cuda::CudaApi& api, const std::vector<Region>& regions,
                                    VmmExports* vmm) {
  std::vector<IpcRange> out;
  for (const Region& region : regions) {
    const CUdeviceptr at = address(region.ptr);
    bool known = false;
    for (const IpcRange& r : out)
      if (at >= r.base && at - r.base < r.size) known = true;
    if (known) continue;
    CUdevice dev = 0;
    CUcontext ctx = nullptr;
    CUresult rc = api.device_get(&dev, region.cuda_device);
    if (rc == CUDA_SUCCESS) rc = api.device_primary_ctx_retain(&ctx, dev);
    if (rc != CUDA_SUCCESS)
      throw Error(ErrorCode::Unsupported,
                  "cuda_ipc: no context for cuda:" + std::to_string(region.cuda_device) + ": " +
                      cuda::result_text(&api, rc));
    IpcRange r;
    std::string why;
    {
      cuda::ScopedContext scope(api, ctx);
      CUdeviceptr base = 0;
      std::size_t size = 0;
      rc = api.mem_get_address_range(&base, &size, at);
      r.base = base;
      r.size = size;
      if (rc == CUDA_SUCCESS) {
        (void)api.device_get_pci_bus_id(r.device.data(), static_cast<int>(r.device.size()), dev);
        r.device.back() = '\0';
        CUipcMemHandle handle{};
        rc = api.ipc_get_mem_handle(&handle, base);
        std::memcpy(r.handle.data(), handle.reserved, r.handle.size());
        if (rc != CUDA_SUCCESS) {
          why = "cuIpcGetMemHandle: " + cuda::result_text(&api, rc);
          r.handle = {};
          r.kind = IpcKind::vmm;
          if (vmm == nullptr) {
            why += "; and this transport shares no VMM allocations";
          } else {
            try {
              vmm->share(r);
              rc = CUDA_SUCCESS;
            } catch (const Error& e) {
              why += "; " + e.message();
            }
          }
        }
      } else {
        why = "cuMemGetAddressRange: " + cuda::result_text(&api, rc);
      }
    }
    (void)api.device_primary_ctx_release(dev);
    if (rc != CUDA_SUCCESS)
      throw Error(ErrorCode::Unsupported, "cuda_ipc: the memory cannot be shared (" + why + ")");
    out.push_back(r);
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// The peer's side

IpcImports::~IpcImports() {
  for (auto& [key, m] : mappings_) close(m);
}

void IpcImports::close(Mapping& m) {
  {
    cuda::ScopedContext scope(api_, m.context);
    if (m.range.kind == IpcKind::vmm) {
      (void)api_.mem_unmap(m.local, m.range.size);
      (void)api_.mem_address_free(m.local, m.range.size);
    } else {
      (void)api_.ipc_close_mem_handle(m.local);
    }
  }
  (void)api_.device_primary_ctx_release(m.device);
}

int IpcImports::ordinal_of(const std::array<char, 16>& bus, int fallback) const {
  if (bus[0] == '\0') return fallback;
  int count = 0;
  if (api_.device_get_count(&count) != CUDA_SUCCESS) return fallback;
  for (int i = 0; i < count; ++i) {
    CUdevice dev = 0;
    std::array<char, 16> id{};
    if (api_.device_get(&dev, i) == CUDA_SUCCESS &&
        api_.device_get_pci_bus_id(id.data(), static_cast<int>(id.size()), dev) == CUDA_SUCCESS &&
        std::strncmp(id.data(), bus.data(), id.size()) == 0)
      return i;
  }
  return fallback;
}

namespace {

Error unopened(const std::string& why) {
  return Error(ErrorCode::AccessDenied, "cuda_ipc: cannot open the owner's memory (" + why + ")");
}

}  // namespace

void IpcImports::import(Mapping& m, const FetchFd& fetch) {
  if (api_.mem_import_from_shareable_handle == nullptr || api_.mem_address_reserve == nullptr ||
      api_.mem_map == nullptr || api_.mem_set_access == nullptr)
    throw unopened("this driver has no virtual memory management");
  if (!fetch) throw unopened("the owner's fds cannot be taken here");
  int fd = -1;
  try {
    fd = fetch(m.range.fd);
  } catch (const Error& e) {
    throw unopened("cannot take the owner's fd " + std::to_string(m.range.fd) + ": " + e.message());
  }
  CUmemGenericAllocationHandle handle = 0;
  CUresult rc = api_.mem_import_from_shareable_handle(
      &handle, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)),
      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  same_host::close_fetched(fd);  // fetch_fd made it
  if (rc != CUDA_SUCCESS)
    throw unopened("cuMemImportFromShareableHandle: " + cuda::result_text(&api_, rc));
  std::string why;
  rc = api_.mem_address_reserve(&m.local, m.range.size, 0, 0, 0);
  if (rc != CUDA_SUCCESS) {
    why = "cuMemAddressReserve: " + cuda::result_text(&api_, rc);
  } else if (rc = api_.mem_map(m.local, m.range.size, 0, handle, 0); rc != CUDA_SUCCESS) {
    why = "cuMemMap: " + cuda::result_text(&api_, rc);
    (void)api_.mem_address_free(m.local, m.range.size);
  } else {
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = m.ordinal;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    rc = api_.mem_set_access(m.local, m.range.size, &access, 1);
    if (rc != CUDA_SUCCESS) {
      why = "cuMemSetAccess: " + cuda::result_text(&api_, rc);
      (void)api_.mem_unmap(m.local, m.range.size);
      (void)api_.mem_address_free(m.local, m.range.size);
    }
  }
  (void)api_.mem_release(handle);  // the mapping holds the allocation from here
  if (rc != CUDA_SUCCESS) throw unopened(why);
}

void IpcImports::open_legacy(Mapping& m) {
  CUipcMemHandle handle{};
  std::memcpy(handle.reserved, m.range.handle.data(), m.range.handle.size());
  if (CUresult rc = api_.ipc_open_mem_handle(&m.local, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
      rc != CUDA_SUCCESS)
    throw unopened("cuIpcOpenMemHandle: " + cuda::result_text(&api_, rc));
}

void IpcImports::open(const std::vector<IpcRange>& ranges, int fallback, const FetchFd& fetch) {
  for (const IpcRange& r : ranges) {
    if (auto it = mappings_.find(r.base); it != mappings_.end() && it->second.range == r)
      continue;  // the same allocation: reused
    // Another allocation where opened ones were (they were freed): every mapping that
    // overlaps it goes, also one at a higher address (translate() would find it first for
    // the addresses above its base).
    auto it = mappings_.lower_bound(r.base);
    if (it != mappings_.begin()) {
      auto before = std::prev(it);
      if (before->second.range.base + before->second.range.size > r.base) it = before;
    }
    while (it != mappings_.end() && it->second.range.base < r.base + r.size) {
      close(it->second);
      it = mappings_.erase(it);
      ++replaced_;
    }
    Mapping m;
    m.range = r;
    m.ordinal = ordinal_of(r.device, fallback);
    CUresult rc = api_.device_get(&m.device, m.ordinal);
    if (rc == CUDA_SUCCESS) rc = api_.device_primary_ctx_retain(&m.context, m.device);
    if (rc != CUDA_SUCCESS)
      throw Error(ErrorCode::Internal,
                  "cuda_ipc: no context for cuda:" + std::to_string(m.ordinal) + ": " +
                      cuda::result_text(&api_, rc));
    try {
      cuda::ScopedContext scope(api_, m.context);
      if (r.kind == IpcKind::vmm)
        import(m, fetch);
      else
        open_legacy(m);
    } catch (const Error&) {
      (void)api_.device_primary_ctx_release(m.device);
      throw;
    }
    // The owner's size is a claim; what the driver mapped here is the truth. An owner that
    // states more would have our copies land past the mapping (in memory of ours).
    if (std::optional<Error> lie = oversized(m)) {
      close(m);
      throw *lie;
    }
    ++opens_;
    mappings_.emplace(r.base, m);
  }
}

std::optional<Error> IpcImports::oversized(const Mapping& m) const {
  CUdeviceptr base = 0;
  std::size_t size = 0;
  CUresult rc = CUDA_SUCCESS;
  {
    cuda::ScopedContext scope(api_, m.context);
    rc = api_.mem_get_address_range(&base, &size, m.local);
  }
  if (rc != CUDA_SUCCESS)
    return unopened("cuMemGetAddressRange of the mapping: " + cuda::result_text(&api_, rc));
  const std::uint64_t mapped = base + size - m.local;  // from the mapping's start to its end
  if (m.local < base || m.local - base >= size || m.range.size > mapped)
    return Error(ErrorCode::ProtocolError,
                 "cuda_ipc: the owner states an allocation of " + std::to_string(m.range.size) +
                     " bytes; the driver mapped " + std::to_string(m.local < base ? 0 : mapped));
  return std::nullopt;
}

IpcImports::Place IpcImports::translate(std::uint64_t addr, std::uint64_t len) const {
  auto it = mappings_.upper_bound(addr);
  if (it == mappings_.begin()) return {};
  --it;
  const IpcRange& r = it->second.range;
  if (addr < r.base || len > r.size || addr - r.base > r.size - len) return {};
  return {
      reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(it->second.local)) + (addr - r.base),
      it->second.ordinal};
}

}  // namespace ferry::transport::cuda_ipc
