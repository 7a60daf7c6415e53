// CUDA memory on the verbs method.
//
// Registration: each allocation is registered whole (the cache keys CUDA memory by allocation)
// with the device's primary context current, by the first way that works, remembered per
// device so that a failing way is not tried at every registration:
//  1. dmabuf: the driver exports the allocation (cuMemGetHandleForAddressRange, from its base
//     to the page that holds its last byte), and ibv_reg_dmabuf_mr registers the range from
//     the fd at the offset of its first byte, reached at the device address (iova);
//  2. nvidia-peermem: ibv_reg_mr of the device pointer;
//  3. neither: the registration is marked staged. An active transfer moves such memory through
//     pinned host chunks registered with the NIC (RDMA READ into a chunk then a host-to-device
//     copy; a device-to-host copy then RDMA WRITE from the chunk); expose() refuses it, since
//     the owner of one-sided RDMA cannot stage: its connector then offers other methods.

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "transport/verbs/verbs_internal.hpp"

#ifdef FERRY_WITH_CUDA
#include "transport/cuda/copy_engine.hpp"
#include "transport/cuda/cuda_api.hpp"
#endif

namespace ferry::transport::verbs {

bool VerbsTransport::staged_segment(const VerbsTransfer& t, std::size_t i) {
  if (t.spec.segments[i].cuda_device < 0 || i >= t.regs.size() || !t.regs[i]) return false;
  const auto* set = static_cast<const MrSet*>(t.regs[i]->handle.get());
  return set != nullptr && set->staged;
}

std::shared_ptr<const Registration> VerbsTransport::acquire(const Region& region) {
  if (region.kind == MemoryKind::cuda) return acquire_cuda(region);
  return registrations_.acquire(region);
}

#ifdef FERRY_WITH_CUDA

namespace {

CUdeviceptr dptr(std::uint64_t a) { return static_cast<CUdeviceptr>(a); }
std::uint64_t page_bytes() { return static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE)); }

std::string hex(std::uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

/// Deregisters the pieces each device of `set` got after `before` (a failed attempt).
void roll_back(MrSet& set, const std::vector<std::size_t>& before) {
  for (std::size_t d = 0; d < set.devices.size(); ++d) {
    auto& pieces = set.devices[d].pieces;
    for (std::size_t i = before[d]; i < pieces.size(); ++i)
      set.devices[d].pd->api->dereg_mr(pieces[i].mr);
    pieces.resize(before[d]);
  }
}

std::vector<std::size_t> sizes(const MrSet& set) {
  std::vector<std::size_t> out;
  for (const auto& d : set.devices) out.push_back(d.pieces.size());
  return out;
}

}  // namespace

VerbsTransport::CudaDevice& VerbsTransport::cuda_device(int ordinal) {
  if (auto it = cuda_devices_.find(ordinal); it != cuda_devices_.end()) return it->second;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  CUresult r = cuda_->device_get(&dev, ordinal);
  if (r == CUDA_SUCCESS) r = cuda_->device_primary_ctx_retain(&ctx, dev);
  if (r != CUDA_SUCCESS)
    throw Error(ErrorCode::Internal, "verbs cannot use cuda:" + std::to_string(ordinal) + ": " +
                                         cuda::result_text(cuda_, r));
  CudaDevice d;
  d.device = dev;
  d.context = ctx;
  return cuda_devices_.emplace(ordinal, d).first->second;
}

std::shared_ptr<const Registration> VerbsTransport::acquire_cuda(const Region& region) {
  if (cuda_ == nullptr) throw Error(ErrorCode::Unsupported, "verbs has no CUDA driver");
  CUdeviceptr base = 0;
  std::size_t size = 0;
  const auto addr = reinterpret_cast<std::uint64_t>(region.ptr);
  if (CUresult r = cuda_->mem_get_address_range(&base, &size, dptr(addr)); r != CUDA_SUCCESS)
    throw Error(ErrorCode::InvalidArgument, "verbs: " + hex(addr) + " is not CUDA device memory: " +
                                                cuda::result_text(cuda_, r));
  // A registration cached for memory freed since (the driver reuses addresses) would let the
  // NIC reach the old allocation's pages, and one the new allocation touches would be merged
  // with it: drop every such registration that this allocation meets.
  const std::uint64_t lo = base;
  const std::uint64_t hi = base + size;
  for (std::uint64_t p : {lo - 1, lo, hi - 1, hi}) {
    if (p == ~std::uint64_t{0}) continue;
    auto reg = registrations_.find(p, 1);
    if (!reg || reg->kind != MemoryKind::cuda) continue;
    const auto* set = static_cast<const MrSet*>(reg->handle.get());
    bool live = set != nullptr;
    for (std::size_t i = 0; live && i < set->buffers.size(); ++i) {
      const auto [b, id] = set->buffers[i];
      unsigned long long now = 0;
      CUpointer_attribute attr = CU_POINTER_ATTRIBUTE_BUFFER_ID;
      void* data = &now;
      CUdeviceptr start = 0;
      live = cuda_->pointer_get_attributes(1, &attr, &data, dptr(b)) == CUDA_SUCCESS && now == id &&
             cuda_->mem_get_address_range(&start, nullptr, dptr(b)) == CUDA_SUCCESS && start == b;
    }
    if (!live)
      registrations_.invalidate(
          Region{reinterpret_cast<std::byte*>(reg->base), reg->size, MemoryKind::cuda, -1});
  }
  return registrations_.acquire(
      Region{reinterpret_cast<std::byte*>(base), size, MemoryKind::cuda, region.cuda_device});
}

void VerbsTransport::register_cuda(MrSet& set, int access) {
  if (cuda_ == nullptr) throw Error(ErrorCode::Unsupported, "verbs has no CUDA driver");
  const std::uint64_t end = set.base + set.size;
  for (std::uint64_t at = set.base; at < end;) {
    CUdeviceptr base = 0;
    std::size_t size = 0;
    int ordinal = -1;
    unsigned long long buffer = 0;
    CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                   CU_POINTER_ATTRIBUTE_BUFFER_ID};
    void* data[] = {&ordinal, &buffer};
    CUresult r = cuda_->mem_get_address_range(&base, &size, dptr(at));
    if (r == CUDA_SUCCESS) r = cuda_->pointer_get_attributes(2, attrs, data, dptr(at));
    if (r != CUDA_SUCCESS)
      throw Error(ErrorCode::InvalidArgument, "verbs: " + hex(at) + " is not CUDA device memory: " +
                                                  cuda::result_text(cuda_, r));
    const std::uint64_t stop = std::min<std::uint64_t>(end, base + size);
    if (set.cuda_device < 0) set.cuda_device = ordinal;
    set.buffers.emplace_back(base, buffer);
    if (!set.staged && !register_gpudirect(set, ordinal, base, size, at, stop - at, access)) {
      set.clear();
      set.staged = true;
    }
    at = stop;
  }
}

bool VerbsTransport::register_gpudirect(MrSet& set, int ordinal, std::uint64_t base,
                                        std::uint64_t size, std::uint64_t addr, std::uint64_t len,
                                        int access) {
  CudaDevice& cd = cuda_device(ordinal);
  cuda::ScopedContext scope(*cuda_, cd.context);
  const std::string device = "cuda:" + std::to_string(ordinal);
  if (cd.dmabuf != Way::fails) {
    std::string why;
    if (register_dmabuf(set, base, addr, len, access, why)) {
      cd.dmabuf = Way::works;
      return true;
    }
    // An allocation that does not fill whole pages (small ones share pages with others) says
    // nothing of the rest: the way is judged by allocations of whole pages alone.
    if (base % page_bytes() == 0 && size % page_bytes() == 0) {
      if (cd.dmabuf == Way::works)
        throw Error(ErrorCode::Internal, "verbs: cannot register memory of " + device +
                                             " by dmabuf, which worked before: " + why);
      cd.dmabuf = Way::fails;
    }
    cd.no_dmabuf = why;
  }
  if (cd.peermem != Way::fails) {
    const auto before = sizes(set);
    for (std::size_t d = 0; d < devices_.size(); ++d) {
      if (register_pieces(set, d, addr, len, access)) continue;
      const int err = errno != 0 ? errno : EINVAL;
      roll_back(set, before);
      const std::string why =
          "ibv_reg_mr of device memory on " + devices_[d]->name + ": " + std::strerror(err);
      if (cd.peermem == Way::works)
        throw Error(ErrorCode::Internal, "verbs: cannot register memory of " + device +
                                             " by ibv_reg_mr, which worked before: " + why);
      cd.peermem = Way::fails;
      cd.no_peermem = why;
      return false;
    }
    cd.peermem = Way::works;
    ++counters_.peermem_registrations;
    return true;
  }
  return false;
}

bool VerbsTransport::register_dmabuf(MrSet& set, std::uint64_t base, std::uint64_t addr,
                                     std::uint64_t len, int access, std::string& why) {
  if (!cuda_->has_dmabuf()) {
    why = "the CUDA driver exports no dmabuf";
    return false;
  }
  if (api_.reg_dmabuf_mr == nullptr) {
    why = std::string(api_.name) + " has no ibv_reg_dmabuf_mr";
    return false;
  }
  // The export is page-aligned and starts at the page of the allocation's base, so that a
  // byte's offset in the dmabuf is its distance from there whether the driver exports exactly
  // the range asked for (the real one) or the whole allocation (the simulated one, which
  // therefore refuses an allocation that does not start on a page). It ends with the page of
  // our last byte.
  const std::uint64_t page = page_bytes();
  const std::uint64_t from = base / page * page;
  const std::uint64_t span = (addr + len - from + page - 1) / page * page;
  int fd = -1;
  CUresult r = cuda_->mem_get_handle_for_address_range(
      &fd, dptr(from), static_cast<std::size_t>(span), CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (r != CUDA_SUCCESS || fd < 0) {
    why = "cuMemGetHandleForAddressRange: " + cuda::result_text(cuda_, r);
    return false;
  }
  const auto before = sizes(set);
  int err = 0;
  for (std::size_t d = 0; d < devices_.size() && err == 0; ++d) {
    const Device& dev = *devices_[d];
    MrSet::OnDevice& on = set.devices[d];
    const std::uint64_t piece = dev.max_mr == 0
                                    ? std::max<std::uint64_t>(len, 1)
                                    : std::max<std::uint64_t>(dev.max_mr & ~4095ull, 4096);
    for (std::uint64_t at = 0; at < len && err == 0; at += piece) {
      const std::uint64_t n = std::min(piece, len - at);
      errno = 0;
      ibv_mr* mr = api_.reg_dmabuf_mr(on.pd->pd, addr - from + at, n, addr + at, fd, access);
      if (mr == nullptr) {
        err = errno != 0 ? errno : EINVAL;
        why = "ibv_reg_dmabuf_mr on " + dev.name + ": " + std::strerror(err);
        break;
      }
      on.pieces.push_back({addr + at, n, mr});
      ++counters_.registrations;
    }
  }
  ::close(fd);  // the registrations hold the dmabuf
  if (err != 0) {
    roll_back(set, before);
    return false;
  }
  ++counters_.dmabuf_registrations;
  return true;
}

std::string VerbsTransport::cuda_unreachable(const MrSet& set) const {
  std::string why;
  if (auto it = cuda_devices_.find(set.cuda_device); it != cuda_devices_.end())
    why = "no dmabuf: " + it->second.no_dmabuf + "; no nvidia-peermem: " + it->second.no_peermem;
  return "verbs cannot expose memory of cuda:" + std::to_string(set.cuda_device) +
         ": the RDMA device cannot reach it (" + why +
         "); only the active side of an operation stages device memory";
}

// ---------------------------------------------------------------------------------------
// Staging, on the active side

bool VerbsTransport::start_chunk(VerbsTransfer& t) {
  const Segment& s = t.spec.segments[t.seg];
  CudaDevice& cd = cuda_device(s.cuda_device);
  if (!staging_) {
    if (!copies_) copies_ = std::make_unique<cuda::CopyEngine>(loop_, *cuda_);
    staging_ = std::make_unique<cuda::StagingPool>(
        *cuda_, static_cast<std::size_t>(options_.staging_chunk),
        std::max<std::size_t>(options_.staging_chunks, 2));
    staging_->set_on_release([this] { chunk_freed(); });
  }
  std::byte* buf = staging_->acquire(cd.context);
  if (buf == nullptr) {
    t.waiting_chunk = true;
    return false;
  }
  auto& reg = chunk_regs_[buf];
  if (!reg) {
    try {
      // Pinned chunks are registered once, as host memory, and kept as long as the pool.
      reg = registrations_.acquire(Region{buf, staging_->chunk_size(), MemoryKind::host, -1});
    } catch (...) {
      chunk_regs_.erase(buf);
      staging_->release(buf);
      throw;
    }
  }
  const std::uint64_t id = next_chunk_++;
  Chunk c;
  c.buf = buf;
  c.ordinal = s.cuda_device;
  c.device = s.local + t.off;
  c.remote = s.remote_addr + t.off;
  c.len = std::min<std::uint64_t>(staging_->chunk_size(), s.len - t.off);
  t.off += c.len;
  if (t.off == s.len) {
    ++t.seg;
    t.off = 0;
  }
  ++counters_.staged_chunks;
  Chunk& held = t.chunks[id] = c;
  if (t.spec.access == Access::read) {
    t.postable.push_back(id);
    return true;
  }
  held.copy = copies_->copy(
      c.ordinal, c.buf, c.device, static_cast<std::size_t>(c.len),
      [this, tid = t.id, id](const std::optional<Error>& error) { chunk_copied(tid, id, error); });
  return true;
}

void VerbsTransport::chunk_moved(VerbsTransfer& t, std::uint64_t id) {
  auto it = t.chunks.find(id);
  if (it == t.chunks.end()) return;
  Chunk& c = it->second;
  if (t.spec.access == Access::write) {
    staging_->release(c.buf);
    t.chunks.erase(it);
    return;
  }
  try {
    c.copy = copies_->copy(c.ordinal, c.device, c.buf, static_cast<std::size_t>(c.len),
                           [this, tid = t.id, id](const std::optional<Error>& error) {
                             chunk_copied(tid, id, error);
                           });
  } catch (const Error& e) {
    staging_failed(t, e);
  }
}

void VerbsTransport::chunk_copied(std::uint64_t transfer, std::uint64_t id,
                                  const std::optional<Error>& error) {
  auto tit = transfers_.find(transfer);
  if (tit == transfers_.end()) return;
  VerbsTransfer& t = *tit->second;
  auto it = t.chunks.find(id);
  if (it == t.chunks.end()) return;
  it->second.copy = 0;
  if (t.finished) return;  // cancel() gives the chunk back
  if (error) {
    staging_failed(t, *error);
    return;
  }
  if (t.spec.access == Access::read) {
    // Its bytes are on the device: the chunk goes back.
    staging_->release(it->second.buf);
    t.chunks.erase(it);
    if (Conn* conn = conn_of(t.conn)) maybe_done(*conn, t);
    return;
  }
  t.postable.push_back(id);
  make_ready(t);
}

void VerbsTransport::drop_chunks(VerbsTransfer& t) {
  for (auto& [id, c] : t.chunks) {
    if (c.copy != 0) copies_->cancel(c.copy);  // waits for a copy under way
    staging_->release(c.buf);
  }
  t.chunks.clear();
  t.postable.clear();
  t.waiting_chunk = false;
}

void VerbsTransport::chunk_freed() {
  if (chunk_wakeup_) return;
  chunk_wakeup_ = true;
  defer_([this, life = std::weak_ptr<int>(life_)] {
    if (life.expired()) return;
    chunk_wakeup_ = false;
    std::vector<std::uint64_t> waiting;
    for (auto& [id, t] : transfers_)
      if (t->waiting_chunk && !t->finished) waiting.push_back(id);
    for (std::uint64_t id : waiting) {
      auto it = transfers_.find(id);
      if (it == transfers_.end() || it->second->finished) continue;
      it->second->waiting_chunk = false;
      make_ready(*it->second);
    }
  });
}

const MrSet* VerbsTransport::chunk_set(const std::byte* buf) const {
  auto it = chunk_regs_.find(const_cast<std::byte*>(buf));
  return it == chunk_regs_.end() ? nullptr : static_cast<const MrSet*>(it->second->handle.get());
}

void VerbsTransport::close_cuda() {
  chunk_regs_.clear();
  copies_.reset();  // waits for copies in flight
  staging_.reset();
  for (auto& [ordinal, d] : cuda_devices_) (void)cuda_->device_primary_ctx_release(d.device);
  cuda_devices_.clear();
}

#else  // !FERRY_WITH_CUDA: no CUDA memory reaches this transport (register_memory refuses it).

std::shared_ptr<const Registration> VerbsTransport::acquire_cuda(const Region&) {
  throw Error(ErrorCode::Unsupported, "verbs: this ferry was built without CUDA");
}
void VerbsTransport::register_cuda(MrSet&, int) {
  throw Error(ErrorCode::Unsupported, "verbs: this ferry was built without CUDA");
}
std::string VerbsTransport::cuda_unreachable(const MrSet&) const { return {}; }
bool VerbsTransport::start_chunk(VerbsTransfer&) {
  throw Error(ErrorCode::Internal, "verbs: staging without CUDA");
}
void VerbsTransport::chunk_moved(VerbsTransfer&, std::uint64_t) {}
void VerbsTransport::chunk_copied(std::uint64_t, std::uint64_t, const std::optional<Error>&) {}
void VerbsTransport::drop_chunks(VerbsTransfer&) {}
void VerbsTransport::chunk_freed() {}
const MrSet* VerbsTransport::chunk_set(const std::byte*) const { return nullptr; }
void VerbsTransport::close_cuda() {}

#endif

void VerbsTransport::make_ready(VerbsTransfer& t) {
  Conn* conn = conn_of(t.conn);
  if (conn == nullptr || conn->state != Conn::State::up || t.finished) return;
  if (std::find(conn->ready.begin(), conn->ready.end(), t.id) == conn->ready.end())
    conn->ready.push_back(t.id);
  pump(*conn);
}

void VerbsTransport::staging_failed(VerbsTransfer& t, const Error& error) {
  if (t.finished) return;
  finish_transfer(t, error);
  Conn* conn = conn_of(t.conn);
  if (conn != nullptr && conn->state == Conn::State::up && t.secret)
    send_done(*conn, Pending{t.id, false, t.spec.remote_id, t.spec.token, t.spec.access}, error);
}

}  // namespace ferry::transport::verbs
