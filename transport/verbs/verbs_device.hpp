#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ferry/options.hpp>

#include "loop/uv_handle.hpp"
#include "transport/context.hpp"
#include "transport/kit/registration_cache.hpp"
#include "transport/verbs/verbs_api.hpp"

namespace ferry::transport::verbs {

/// What a verbs transport counts (tests and statistics).
struct Counters {
  std::uint64_t registrations = 0;   ///< memory regions registered
  std::uint64_t windows_bound = 0;   ///< memory windows bound
  std::uint64_t comp_events = 0;     ///< completion channel events read
  std::uint64_t comp_wakeups = 0;    ///< completion channel fd wakeups
  std::uint64_t empty_wakeups = 0;   ///< wakeups that found no completion
  std::uint64_t watchdog_polls = 0;  ///< completion queue polls by the watchdog timer
  std::uint64_t watchdog_found = 0;  ///< ...that found completions (missed wakeups)
  std::uint64_t completions = 0;
  std::uint64_t connections = 0;  ///< connections established (both directions)
  std::uint64_t data_wrs = 0;     ///< RDMA READ/WRITE work requests posted
  std::uint64_t signaled_wrs = 0;
  std::uint64_t dmabuf_registrations = 0;   ///< CUDA memory regions registered by dmabuf
  std::uint64_t peermem_registrations = 0;  ///< ...by ibv_reg_mr of the device pointer
  std::uint64_t staged_chunks = 0;          ///< staging chunks moved for active transfers
};

/// A protection domain, kept while anything registered in it lives.
struct DevicePd {
  const VerbsApi* api = nullptr;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  DevicePd() = default;
  DevicePd(const DevicePd&) = delete;
  DevicePd& operator=(const DevicePd&) = delete;
  ~DevicePd() {
    if (pd != nullptr) api->dealloc_pd(pd);
  }
};

/// One address range registered on every device, in pieces of at most the device's
/// max_mr_size (and, for CUDA memory, within one allocation each): the handle of a
/// Registration. Destructor: deregisters (keys die at once).
struct MrSet {
  struct Piece {
    std::uint64_t addr = 0;
    std::uint64_t len = 0;
    ibv_mr* mr = nullptr;
  };
  struct OnDevice {
    std::shared_ptr<DevicePd> pd;
    std::vector<Piece> pieces;  ///< by address
  };
  std::uint64_t base = 0;
  std::uint64_t size = 0;
  std::vector<OnDevice> devices;
  /// CUDA memory that no device reaches (no dmabuf, no peermem): no piece; an active transfer
  /// stages it through pinned host chunks, and it cannot be exposed.
  bool staged = false;
  int cuda_device = -1;  ///< the first CUDA device of its memory; -1: host memory
  /// CUDA memory: the base and buffer id of each allocation it lies in (the driver reuses
  /// addresses, never buffer ids: a registration whose buffers are gone is stale).
  std::vector<std::pair<std::uint64_t, unsigned long long>> buffers;
  MrSet() = default;
  MrSet(const MrSet&) = delete;
  MrSet& operator=(const MrSet&) = delete;
  ~MrSet();
  /// The MR of device `ctx` holding `addr`, and how many bytes of it lie from `addr` on; null
  /// if none.
  ibv_mr* find(const ibv_context* ctx, std::uint64_t addr, std::uint64_t& room) const;
  /// Deregisters every piece.
  void clear();
};

class Devices;

/// One RDMA device as rdma_cm opened it.
struct Device {
  Devices* owner = nullptr;
  ibv_context* ctx = nullptr;
  std::string name;
  ibv_device_attr attr{};
  std::vector<ibv_port_attr> ports;  ///< by port number - 1
  std::shared_ptr<DevicePd> pd;
  ibv_comp_channel* channel = nullptr;
  ibv_cq* cq = nullptr;
  loop::Poll comp_poll;
  loop::Poll async_poll;
  unsigned unacked = 0;  ///< completion events gotten, not yet acknowledged
  bool windows = false;  ///< type-2 memory windows are in use
  std::uint64_t max_mr = 0;
  std::uint64_t max_msg = 0;  ///< bytes one work request may move
  int max_sge = 1;
};

class GpuDirect;

/// Every device rdma_cm sees, opened (a protection domain, a completion channel and queue,
/// async events each), their completions polled on the loop, and memory registered on all of
/// them. The completion channel's fd wakes the loop; every event is gotten (acknowledged in
/// batches), the queue drained, optionally spun on, re-armed and polled once more, since a
/// completion that arrived between the last poll and the re-arm raised no event. While work is
/// under way (`busy`), a watchdog timer polls too: a missed wakeup costs at most its period.
class Devices {
 public:
  class Handler {
   public:
    virtual void completion(const ibv_wc& wc) = 0;
    /// An async event of `dev` (a port going down, a queue pair's fatal error).
    virtual void async_event(Device& dev, const ibv_async_event& event) = 0;
    /// Whether anything is under way: the watchdog polls only then.
    virtual bool busy() const = 0;

   protected:
    ~Handler() = default;
  };

  /// Throws Error(Unsupported) when no device can be opened.
  Devices(const Context& ctx, const VerbsApi& api, const VerbsOptions& options, Handler& handler,
          Counters& counters);
  ~Devices();
  Devices(const Devices&) = delete;
  Devices& operator=(const Devices&) = delete;

  Device* find(ibv_context* ctx);
  std::vector<std::unique_ptr<Device>>& all() noexcept { return devices_; }
  /// Polls every device's queue until empty; returns how many completions were handled.
  std::size_t drain_all();
  /// Starts the watchdog if anything is under way and it is not running.
  void arm_watchdog();
  /// Whether every device has type-2 memory windows and they are in use.
  bool uses_memory_windows() const noexcept;

  /// Registers `region` on every device, in pieces of at most its max_mr_size, with `access`;
  /// throws Error naming the device's refusal. CUDA memory that no device can reach gives a
  /// set marked `staged`, with no region.
  std::shared_ptr<MrSet> register_everywhere(const Region& region, int access);
  /// Registers [addr, addr + len) of host memory (or device memory the NIC reaches by
  /// peermem) on device `d` of `set`, in pieces. Throws Error naming the device and errno
  /// when a piece is refused (Internal for ENOMEM, else Unsupported); the pieces registered
  /// before stay in `set`.
  void register_pieces(MrSet& set, std::size_t d, std::uint64_t addr, std::uint64_t len,
                       int access);
  GpuDirect& gpudirect() noexcept { return *gpudirect_; }
  /// Stops polling; acknowledges and destroys the queues.
  void close();

 private:
  static void on_comp(uv_poll_t* handle, int status, int events);
  static void on_async(uv_poll_t* handle, int status, int events);
  static void on_watchdog(uv_timer_t* timer);
  void open_all(const VerbsOptions& options);
  void comp_ready(Device& dev);
  std::size_t drain(Device& dev);
  void async_ready(Device& dev);

  Context ctx_;
  const VerbsApi& api_;
  Handler& handler_;
  Counters& counters_;
  std::chrono::microseconds spin_;
  std::vector<std::unique_ptr<Device>> devices_;
  std::unique_ptr<GpuDirect> gpudirect_;
  loop::Timer watchdog_;
  bool closed_ = false;
};

/// CUDA memory registered with the NIC (verbs_gpudirect.cpp; without CUDA, none is):
/// each allocation whole, by the first way that works, remembered per device so that a failing
/// way is not tried at every registration:
///  1. dmabuf: the driver exports the allocation, and ibv_reg_dmabuf_mr registers it;
///  2. nvidia-peermem: ibv_reg_mr of the device pointer;
///  3. neither: the set is marked staged (an active transfer stages it; expose() refuses it).
class GpuDirect {
 public:
  GpuDirect(const Context& ctx, const VerbsApi& api, Devices& devices, Counters& counters);
  ~GpuDirect();
  GpuDirect(const GpuDirect&) = delete;
  GpuDirect& operator=(const GpuDirect&) = delete;

  /// The allocation holding `region` (the cache keys CUDA memory by allocation), after
  /// dropping cached registrations of memory freed since; throws Error(InvalidArgument) for
  /// memory the driver does not know.
  Region allocation_of(const Region& region, kit::RegistrationCache& cache);
  /// Registers the CUDA memory `set` spans, or marks it staged. Throws Error for memory the
  /// driver does not know, or a way that worked before and fails now.
  void register_cuda(MrSet& set, int access);
  /// Why the CUDA memory of a staged registration cannot be served to a peer (Unsupported).
  Error unreachable(const MrSet& set) const;
  /// The primary context of `ordinal`, retained (for staging chunks).
  void* context(int ordinal);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace ferry::transport::verbs
