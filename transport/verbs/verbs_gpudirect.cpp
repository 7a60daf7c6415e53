// CUDA memory registered with the NIC (GPUDirect RDMA).
//
// Each allocation is registered whole (the cache keys CUDA memory by allocation) with the
// device's primary context current, by the first way that works, remembered per device so that
// a failing way is not tried at every registration:
//  1. dmabuf: the driver exports the allocation (cuMemGetHandleForAddressRange, from its base
//     to the page that holds its last byte), and ibv_reg_dmabuf_mr registers the range from the
//     fd at the offset of its first byte, reached at the device address (iova);
//  2. nvidia-peermem: ibv_reg_mr of the device pointer;
//  3. neither: the registration is marked staged. An active transfer moves such memory through
//     pinned host chunks registered with the NIC; expose() refuses it, since the owner of
//     one-sided RDMA cannot stage: its connector then offers other methods.

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>

#include "transport/cuda/copy_engine.hpp"
#include "transport/cuda/cuda_api.hpp"
#include "transport/transport.hpp"
#include "transport/verbs/verbs_device.hpp"

namespace ferry::transport::verbs {

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

struct GpuDirect::State {
  /// Whether a way for the NIC to reach a CUDA device's memory works, learned at the first
  /// registration that tells and kept.
  enum class Way : std::uint8_t { untried, works, fails };
  struct CudaDevice {
    CUdevice device = 0;
    CUcontext context = nullptr;  ///< its primary context, retained
    Way dmabuf = Way::untried;
    Way peermem = Way::untried;
    std::string no_dmabuf;   ///< why dmabuf did not work (last refusal)
    std::string no_peermem;  ///< why peermem did not
  };

  State(const Context& c, const VerbsApi& a, Devices& d, Counters& n)
      : cuda(c.cuda), api(a), devices(d), counters(n) {}
  ~State() {
    for (auto& [ordinal, d] : cuda_devices) (void)cuda->device_primary_ctx_release(d.device);
  }

  CudaDevice& device(int ordinal) {
    if (auto it = cuda_devices.find(ordinal); it != cuda_devices.end()) return it->second;
    CudaDevice d;
    CUresult r = cuda->device_get(&d.device, ordinal);
    if (r == CUDA_SUCCESS) r = cuda->device_primary_ctx_retain(&d.context, d.device);
    if (r != CUDA_SUCCESS)
      throw Error(ErrorCode::Internal, "verbs cannot use cuda:" + std::to_string(ordinal) + ": " +
                                           cuda::result_text(cuda, r));
    return cuda_devices.emplace(ordinal, d).first->second;
  }

  bool by_gpudirect(MrSet& set, int ordinal, std::uint64_t base, std::uint64_t size,
                    std::uint64_t addr, std::uint64_t len, int access);
  /// Registers by dmabuf; throws Error(Unsupported) saying why it cannot, with nothing of it
  /// left in `set`.
  void by_dmabuf(MrSet& set, std::uint64_t base, std::uint64_t addr, std::uint64_t len, int access);

  const cuda::CudaApi* cuda;
  const VerbsApi& api;
  Devices& devices;
  Counters& counters;
  std::map<int, CudaDevice> cuda_devices;
};

GpuDirect::GpuDirect(const Context& ctx, const VerbsApi& api, Devices& devices, Counters& counters)
    : state_(ctx.cuda != nullptr ? std::make_unique<State>(ctx, api, devices, counters) : nullptr) {
}

GpuDirect::~GpuDirect() = default;

void* GpuDirect::context(int ordinal) {
  if (!state_) throw Error(ErrorCode::Unsupported, "verbs has no CUDA driver");
  return state_->device(ordinal).context;
}

Region GpuDirect::allocation_of(const Region& region, kit::RegistrationCache& cache) {
  if (!state_) throw Error(ErrorCode::Unsupported, "verbs has no CUDA driver");
  const cuda::CudaApi* api = state_->cuda;
  CUdeviceptr base = 0;
  std::size_t size = 0;
  const auto addr = reinterpret_cast<std::uint64_t>(region.ptr);
  if (CUresult r = api->mem_get_address_range(&base, &size, dptr(addr)); r != CUDA_SUCCESS)
    throw Error(ErrorCode::InvalidArgument,
                "verbs: " + hex(addr) + " is not CUDA device memory: " + cuda::result_text(api, r));
  // A registration cached for memory freed since (the driver reuses addresses) would let the
  // NIC reach the old allocation's pages, and one the new allocation touches would be merged
  // with it: drop every such registration that this allocation meets.
  const std::uint64_t lo = base;
  const std::uint64_t hi = base + size;
  for (std::uint64_t p : {lo - 1, lo, hi - 1, hi}) {
    if (p == ~std::uint64_t{0}) continue;
    auto reg = cache.find(p, 1);
    if (!reg || reg->kind != MemoryKind::cuda) continue;
    const auto* set = static_cast<const MrSet*>(reg->handle.get());
    bool live = set != nullptr;
    for (std::size_t i = 0; live && i < set->buffers.size(); ++i) {
      const auto [b, id] = set->buffers[i];
      unsigned long long now = 0;
      CUpointer_attribute attr = CU_POINTER_ATTRIBUTE_BUFFER_ID;
      void* data = &now;
      CUdeviceptr start = 0;
      live = api->pointer_get_attributes(1, &attr, &data, dptr(b)) == CUDA_SUCCESS && now == id &&
             api->mem_get_address_range(&start, nullptr, dptr(b)) == CUDA_SUCCESS && start == b;
    }
    if (!live)
      cache.invalidate(
          Region{reinterpret_cast<std::byte*>(reg->base), reg->size, MemoryKind::cuda, -1});
  }
  return Region{reinterpret_cast<std::byte*>(base), size, MemoryKind::cuda, region.cuda_device};
}

void GpuDirect::register_cuda(MrSet& set, int access) {
  if (!state_) throw Error(ErrorCode::Unsupported, "verbs has no CUDA driver");
  const cuda::CudaApi* api = state_->cuda;
  const std::uint64_t end = set.base + set.size;
  for (std::uint64_t at = set.base; at < end;) {
    CUdeviceptr base = 0;
    std::size_t size = 0;
    int ordinal = -1;
    unsigned long long buffer = 0;
    CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                   CU_POINTER_ATTRIBUTE_BUFFER_ID};
    void* data[] = {&ordinal, &buffer};
    CUresult r = api->mem_get_address_range(&base, &size, dptr(at));
    if (r == CUDA_SUCCESS) r = api->pointer_get_attributes(2, attrs, data, dptr(at));
    if (r != CUDA_SUCCESS)
      throw Error(ErrorCode::InvalidArgument,
                  "verbs: " + hex(at) + " is not CUDA device memory: " + cuda::result_text(api, r));
    const std::uint64_t stop = std::min<std::uint64_t>(end, base + size);
    if (set.cuda_device < 0) set.cuda_device = ordinal;
    set.buffers.emplace_back(base, buffer);
    if (!set.staged && !state_->by_gpudirect(set, ordinal, base, size, at, stop - at, access)) {
      set.clear();
      set.staged = true;
    }
    at = stop;
  }
}

bool GpuDirect::State::by_gpudirect(MrSet& set, int ordinal, std::uint64_t base, std::uint64_t size,
                                    std::uint64_t addr, std::uint64_t len, int access) {
  CudaDevice& cd = device(ordinal);
  cuda::ScopedContext scope(*cuda, cd.context);
  const std::string name = "cuda:" + std::to_string(ordinal);
  if (cd.dmabuf != Way::fails) {
    const std::optional<Error> refused = refusal([&] { by_dmabuf(set, base, addr, len, access); });
    if (!refused) {
      cd.dmabuf = Way::works;
      return true;
    }
    // An allocation that does not fill whole pages (small ones share pages with others) says
    // nothing of the rest: the way is judged by allocations of whole pages alone.
    if (base % page_bytes() == 0 && size % page_bytes() == 0) {
      if (cd.dmabuf == Way::works)
        throw Error(ErrorCode::Internal,
                    "verbs: cannot register memory of " + name +
                        " by dmabuf, which worked before: " + refused->message());
      cd.dmabuf = Way::fails;
    }
    cd.no_dmabuf = refused->message();
  }
  if (cd.peermem != Way::fails) {
    const auto before = sizes(set);
    const std::optional<Error> refused = refusal([&] {
      for (std::size_t d = 0; d < devices.all().size(); ++d)
        devices.register_pieces(set, d, addr, len, access);
    });
    if (refused) {
      roll_back(set, before);
      const std::string why = "device memory: " + refused->message();
      if (cd.peermem == Way::works)
        throw Error(ErrorCode::Internal, "verbs: cannot register memory of " + name +
                                             " by ibv_reg_mr, which worked before: " + why);
      cd.peermem = Way::fails;
      cd.no_peermem = why;
      return false;
    }
    cd.peermem = Way::works;
    ++counters.peermem_registrations;
    return true;
  }
  return false;
}

void GpuDirect::State::by_dmabuf(MrSet& set, std::uint64_t base, std::uint64_t addr,
                                 std::uint64_t len, int access) {
  if (!cuda->has_dmabuf()) throw Error(ErrorCode::Unsupported, "the CUDA driver exports no dmabuf");
  if (api.reg_dmabuf_mr == nullptr)
    throw Error(ErrorCode::Unsupported, std::string(api.name) + " has no ibv_reg_dmabuf_mr");
  // The export is page-aligned and starts at the page of the allocation's base, so that a
  // byte's offset in the dmabuf is its distance from there whether the driver exports exactly
  // the range asked for (the real one) or the whole allocation (the simulated one, which
  // therefore refuses an allocation that does not start on a page). It ends with the page of
  // our last byte.
  const std::uint64_t page = page_bytes();
  const std::uint64_t from = base / page * page;
  const std::uint64_t span = (addr + len - from + page - 1) / page * page;
  int fd = -1;
  CUresult r = cuda->mem_get_handle_for_address_range(
      &fd, dptr(from), static_cast<std::size_t>(span), CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (r != CUDA_SUCCESS || fd < 0)
    throw Error(ErrorCode::Unsupported,
                "cuMemGetHandleForAddressRange: " + cuda::result_text(cuda, r));
  const auto before = sizes(set);
  std::optional<Error> refused;
  for (std::size_t d = 0; d < devices.all().size() && !refused; ++d) {
    const Device& dev = *devices.all()[d];
    MrSet::OnDevice& on = set.devices[d];
    const std::uint64_t piece = dev.max_mr == 0
                                    ? std::max<std::uint64_t>(len, 1)
                                    : std::max<std::uint64_t>(dev.max_mr & ~4095ull, 4096);
    for (std::uint64_t at = 0; at < len && !refused; at += piece) {
      const std::uint64_t n = std::min(piece, len - at);
      errno = 0;
      ibv_mr* mr = api.reg_dmabuf_mr(on.pd->pd, addr - from + at, n, addr + at, fd, access);
      if (mr == nullptr) {
        const int err = errno != 0 ? errno : EINVAL;
        refused = Error(ErrorCode::Unsupported,
                        "ibv_reg_dmabuf_mr on " + dev.name + ": " + std::strerror(err));
        break;
      }
      on.pieces.push_back({addr + at, n, mr});
      ++counters.registrations;
    }
  }
  ::close(fd);  // the registrations hold the dmabuf
  if (refused) {
    roll_back(set, before);
    throw *refused;
  }
  ++counters.dmabuf_registrations;
}

Error GpuDirect::unreachable(const MrSet& set) const {
  std::string why;
  if (state_)
    if (auto it = state_->cuda_devices.find(set.cuda_device); it != state_->cuda_devices.end())
      why = "no dmabuf: " + it->second.no_dmabuf + "; no nvidia-peermem: " + it->second.no_peermem;
  return Error(ErrorCode::Unsupported,
               "verbs cannot expose memory of cuda:" + std::to_string(set.cuda_device) +
                   ": the RDMA device cannot reach it (" + why +
                   "); only the active side of an operation stages device memory");
}

}  // namespace ferry::transport::verbs
