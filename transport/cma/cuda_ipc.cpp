#include "transport/cma/cuda_ipc.hpp"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>

#include <ferry/error.hpp>

#include "transport/cma/cma_internal.hpp"
#include "transport/cuda/copy_engine.hpp"

namespace ferry::transport::cma {

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
    std::memcpy(p + 16, r.handle.data(), r.handle.size());
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
    std::memcpy(r.handle.data(), p + 16, r.handle.size());
    out.push_back(r);
  }
  return true;
}

std::vector<IpcRange> export_ranges(const cuda::CudaApi& api, const std::vector<Region>& regions) {
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
    {
      cuda::ScopedContext scope(api, ctx);
      CUdeviceptr base = 0;
      std::size_t size = 0;
      rc = api.mem_get_address_range(&base, &size, at);
      CUipcMemHandle handle{};
      if (rc == CUDA_SUCCESS) rc = api.ipc_get_mem_handle(&handle, base);
      r.base = base;
      r.size = size;
      std::memcpy(r.handle.data(), handle.reserved, r.handle.size());
    }
    (void)api.device_primary_ctx_release(dev);
    if (rc != CUDA_SUCCESS)
      throw Error(ErrorCode::Unsupported,
                  "cuda_ipc: the memory has no CUDA IPC handle (cuIpcGetMemHandle: " +
                      cuda::result_text(&api, rc) +
                      "; allocations made by cuMemCreate are not shared this way yet)");
    out.push_back(r);
  }
  return out;
}

IpcImports::~IpcImports() {
  for (auto& [key, m] : mappings_) close(m);
}

void IpcImports::close(Mapping& m) {
  {
    cuda::ScopedContext scope(api_, m.context);
    (void)api_.ipc_close_mem_handle(m.local);
  }
  (void)api_.device_primary_ctx_release(m.device);
}

void IpcImports::open(const std::vector<IpcRange>& ranges, int ordinal) {
  for (const IpcRange& r : ranges) {
    const auto key = std::make_pair(ordinal, r.base);
    if (auto it = mappings_.find(key); it != mappings_.end() && it->second.range == r)
      continue;  // the same allocation: reused
    // Another allocation where opened ones were (they were freed): every mapping of this
    // device that overlaps it goes, also one at a higher address (translate() would find it
    // first for the addresses above its base).
    auto it = mappings_.lower_bound(key);
    if (it != mappings_.begin()) {
      auto before = std::prev(it);
      if (before->first.first == ordinal &&
          before->second.range.base + before->second.range.size > r.base)
        it = before;
    }
    while (it != mappings_.end() && it->first.first == ordinal &&
           it->second.range.base < r.base + r.size) {
      close(it->second);
      it = mappings_.erase(it);
      ++replaced_;
    }
    Mapping m;
    m.range = r;
    CUresult rc = api_.device_get(&m.device, ordinal);
    if (rc == CUDA_SUCCESS) rc = api_.device_primary_ctx_retain(&m.context, m.device);
    if (rc != CUDA_SUCCESS)
      throw Error(ErrorCode::Internal, "cuda_ipc: no context for cuda:" + std::to_string(ordinal) +
                                           ": " + cuda::result_text(&api_, rc));
    CUipcMemHandle handle{};
    std::memcpy(handle.reserved, r.handle.data(), r.handle.size());
    {
      cuda::ScopedContext scope(api_, m.context);
      rc = api_.ipc_open_mem_handle(&m.local, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    }
    if (rc != CUDA_SUCCESS) {
      (void)api_.device_primary_ctx_release(m.device);
      throw Error(ErrorCode::AccessDenied,
                  "cuda_ipc: cannot open the owner's memory (cuIpcOpenMemHandle: " +
                      cuda::result_text(&api_, rc) + ")");
    }
    ++opens_;
    mappings_.emplace(key, m);
  }
}

std::byte* IpcImports::translate(std::uint64_t addr, std::uint64_t len, int ordinal) const {
  auto it = mappings_.upper_bound(std::make_pair(ordinal, addr));
  if (it == mappings_.begin()) return nullptr;
  --it;
  if (it->first.first != ordinal) return nullptr;
  const IpcRange& r = it->second.range;
  if (addr < r.base || len > r.size || addr - r.base > r.size - len) return nullptr;
  return reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(it->second.local)) +
         (addr - r.base);
}

}  // namespace ferry::transport::cma

// ---------------------------------------------------------------------------------------
// The cma transport in its cuda_ipc mode (cma_transport.hpp)

namespace ferry::transport::cma {

std::vector<std::byte> CmaTransport::handles_of(const Exposure& exposure) const {
  return encode_ranges(export_ranges(*options_.cuda_ipc, exposure.regions));
}

void CmaTransport::ipc_claimed(CmaTransfer& t) {
  std::vector<IpcRange> ranges;
  std::optional<Error> error;
  if (!t.handles_whole || !decode_ranges(t.handles.data(), t.handles.size(), ranges)) {
    error = Error(ErrorCode::ProtocolError,
                  "peer '" + t.spec.peer_name + "' granted a cuda_ipc claim without valid handles");
  } else {
    try {
      if (!t.link->imports) t.link->imports = std::make_shared<IpcImports>(*options_.cuda_ipc);
      // Opened in the context of the device of the transfer's memory; copies on other devices
      // of this process reach the mapping through unified addressing.
      t.link->imports->open(ranges, t.spec.segments.front().cuda_device);
    } catch (const Error& e) {
      error = e;
    }
  }
  t.handles.clear();
  t.handles.shrink_to_fit();
  if (error) {
    finish_transfer(t, *error);
    send_done(t, &*error);
    return;
  }
  if (t.total == 0)
    all_copied(t);
  else
    pump_ipc(t);
}

void CmaTransport::pump_ipc(CmaTransfer& t) {
  if (!engine_) engine_ = std::make_unique<cuda::CopyEngine>(loop_, *options_.cuda_ipc);
  // The device the owner's allocations were opened on (ipc_claimed).
  const int mapped_on = t.spec.segments.front().cuda_device;
  while (!t.finished && !t.ended_by_owner && t.jobs < options_.parallel &&
         t.seg < t.spec.segments.size()) {
    const Segment& s = t.spec.segments[t.seg];
    const std::uint64_t len = std::min<std::uint64_t>(options_.chunk_size, s.len - t.seg_off);
    std::byte* local = s.local + t.seg_off;
    std::byte* remote = t.link->imports->translate(s.remote_addr + t.seg_off, len, mapped_on);
    if (remote == nullptr) {
      const Error error(ErrorCode::ProtocolError,
                        "peer '" + t.spec.peer_name +
                            "' sent cuda_ipc handles that do not cover the claimed memory");
      finish_transfer(t, error);
      send_done(t, &error);
      return;
    }
    // The owner's grant first, held until the driver reports the copy's end: while it is
    // held, the owner's cancel() waits; once the owner has ended it, no copy starts.
    if (!t.link->grants->acquire(t.grant)) {
      if (!t.ended_by_owner) {
        // Its notice, which says why, is on its way (as for cma's copy jobs).
        t.ended_by_owner = true;
        t.link->conn->expect_answers(+1);
      }
      return;
    }
    std::uint64_t id = 0;
    try {
      const bool reading = t.spec.access == Access::read;
      // The copy's id is known once copy() returns, and its end is reported only later.
      auto copy_id = std::make_shared<std::uint64_t>(0);
      id = engine_->copy(s.cuda_device, reading ? local : remote, reading ? remote : local, len,
                         [this, transfer = t.id, life = std::weak_ptr<int>(life_),
                          copy_id](const std::optional<Error>& error) {
                           if (!life.expired()) ipc_copied(transfer, *copy_id, error);
                         });
      *copy_id = id;
    } catch (const Error& e) {
      t.link->grants->release(t.grant);
      finish_transfer(t, e);
      send_done(t, &e);
      return;
    }
    t.copies[id] = len;
    ++t.jobs;
    t.seg_off += len;
    if (t.seg_off == s.len) {
      ++t.seg;
      t.seg_off = 0;
    }
  }
}

void CmaTransport::ipc_copied(std::uint64_t transfer, std::uint64_t copy,
                              const std::optional<Error>& error) {
  auto it = transfers_.find(transfer);
  if (it == transfers_.end()) return;
  CmaTransfer& t = *it->second;
  auto c = t.copies.find(copy);
  if (c == t.copies.end()) return;  // cancelled
  const std::uint64_t len = c->second;
  t.copies.erase(c);
  t.link->grants->release(t.grant);
  --t.jobs;
  if (t.finished) return;
  if (error) {
    const Error failed(ErrorCode::Internal, "cuda_ipc copy failed: " + error->message());
    finish_transfer(t, failed);
    send_done(t, &failed);
    return;
  }
  t.done += len;
  if (t.done == t.total && t.jobs == 0) {
    all_copied(t);
    return;
  }
  pump_ipc(t);
}

void CmaTransport::cancel_copies(CmaTransfer& t) {
  if (t.copies.empty()) return;
  for (const auto& [id, len] : t.copies) {
    if (engine_) engine_->cancel(id);  // returns once the copy touches no memory
    t.link->grants->release(t.grant);
  }
  t.jobs -= static_cast<unsigned>(t.copies.size());
  t.copies.clear();
}

}  // namespace ferry::transport::cma
