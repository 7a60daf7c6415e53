#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "transport/verbs/verbs_internal.hpp"

namespace ferry::transport::verbs {

namespace {

constexpr int kPollBatch = 32;
constexpr unsigned kAckBatch = 64;  // completion events acknowledged in one call
constexpr int kCqSize = 4096;

bool set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  return flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

std::string sys_text(int err) { return std::strerror(err); }

}  // namespace

// ---------------------------------------------------------------------------------------
// Registrations

MrSet::~MrSet() { clear(); }

void MrSet::clear() {
  for (auto& d : devices)
    for (const Piece& p : d.pieces) d.pd->api->dereg_mr(p.mr);
  for (auto& d : devices) d.pieces.clear();
}

ibv_mr* MrSet::find(const ibv_context* ctx, std::uint64_t addr, std::uint64_t& room) const {
  if (addr < base || addr - base >= size) return nullptr;
  for (const auto& d : devices) {
    if (d.pd->ctx != ctx) continue;
    auto it = std::upper_bound(d.pieces.begin(), d.pieces.end(), addr,
                               [](std::uint64_t a, const Piece& p) { return a < p.addr; });
    if (it == d.pieces.begin()) return nullptr;
    --it;
    if (addr - it->addr >= it->len) return nullptr;
    room = it->addr + it->len - addr;
    return it->mr;
  }
  return nullptr;
}

bool VerbsTransport::register_pieces(MrSet& set, std::size_t d, std::uint64_t addr,
                                     std::uint64_t len, int access) {
  MrSet::OnDevice& on = set.devices[d];
  const Device& dev = *devices_[d];
  // Pieces of whole pages below the device's limit (a limit of 0 means none).
  const std::uint64_t piece = dev.max_mr == 0
                                  ? std::max<std::uint64_t>(len, 1)
                                  : std::max<std::uint64_t>(dev.max_mr & ~4095ull, 4096);
  for (std::uint64_t at = 0; at < len; at += piece) {
    const std::uint64_t n = std::min(piece, len - at);
    errno = 0;
    ibv_mr* mr = api_.reg_mr(on.pd->pd, reinterpret_cast<void*>(addr + at), n, access);
    if (mr == nullptr) return false;
    on.pieces.push_back({addr + at, n, mr});
    ++counters_.registrations;
  }
  return true;
}

std::shared_ptr<MrSet> VerbsTransport::register_everywhere(const Region& region, int access) {
  auto set = std::make_shared<MrSet>();
  set->base = reinterpret_cast<std::uint64_t>(region.ptr);
  set->size = region.size;
  for (auto& dev : devices_) set->devices.push_back({dev->pd, {}});
  if (region.kind == MemoryKind::cuda) {
    register_cuda(*set, access);
    return set;
  }
  for (std::size_t d = 0; d < devices_.size(); ++d) {
    if (register_pieces(*set, d, set->base, set->size, access)) continue;
    const int err = errno;
    // What was registered is released with `set`.
    throw Error(err == ENOMEM ? ErrorCode::Internal : ErrorCode::Unsupported,
                "verbs: cannot register " + std::to_string(set->size) + " bytes on " +
                    devices_[d]->name + ": " + (err ? sys_text(err) : "refused"));
  }
  return set;
}

std::shared_ptr<void> VerbsTransport::register_region(const Region& region) {
  // Cached registrations give no remote access of their own: a peer reaches memory only
  // through a window bound for its claim (or a registration of the operation's own).
  int access = IBV_ACCESS_LOCAL_WRITE;
  if (std::any_of(devices_.begin(), devices_.end(), [](const auto& d) { return d->windows; }))
    access |= IBV_ACCESS_MW_BIND;
  return register_everywhere(region, access);
}

std::shared_ptr<const Registration> VerbsTransport::register_memory(const Region& region) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  if (region.kind == MemoryKind::cuda && !caps_.moves(MemoryKind::cuda))
    throw Error(ErrorCode::Unsupported, "verbs moves host memory only here (no CUDA driver)");
  // CUDA memory the NIC cannot reach is registered all the same (marked staged): an active
  // transfer stages it; expose() refuses it.
  return registrations_.acquire(region);
}

bool VerbsTransport::uses_memory_windows() const noexcept {
  return !devices_.empty() &&
         std::all_of(devices_.begin(), devices_.end(), [](const auto& d) { return d->windows; });
}

// ---------------------------------------------------------------------------------------
// Devices

std::string VerbsTransport::unavailable(const VerbsApi* api) {
  std::string why;
  if (api == nullptr) api = system_verbs(&why);
  if (api == nullptr) return why;
  int n = 0;
  errno = 0;
  ibv_device** list = api->get_device_list(&n);
  if (list == nullptr && errno == ENOSYS)
    return "no RDMA support in the kernel (ibv_get_device_list: ENOSYS)";
  if (list == nullptr)
    return std::string("ibv_get_device_list failed: ") +
           (errno != 0 ? sys_text(errno) : "no reason given");
  api->free_device_list(list);
  if (n == 0) return "no RDMA device found";
  return {};
}

void VerbsTransport::open_devices() {
  int n = 0;
  ibv_context** list = api_.get_devices(&n);
  if (list == nullptr || n == 0) {
    if (list != nullptr) api_.free_devices(list);
    throw Error(ErrorCode::Unsupported, "verbs: no RDMA device found");
  }
  std::string failures;
  for (int i = 0; i < n; ++i) {
    auto dev = std::make_unique<Device>();
    dev->owner = this;
    dev->ctx = list[i];
    dev->name = dev->ctx->device != nullptr ? api_.get_device_name(dev->ctx->device) : "?";
    auto fail = [&](const std::string& what) {
      failures += (failures.empty() ? "" : "; ") + dev->name + ": " + what;
    };
    if (api_.query_device(dev->ctx, &dev->attr) != 0) {
      fail("ibv_query_device failed");
      continue;
    }
    for (int p = 1; p <= dev->attr.phys_port_cnt; ++p) {
      ibv_port_attr pa{};
      api_.query_port(dev->ctx, static_cast<std::uint8_t>(p), &pa);
      dev->ports.push_back(pa);
    }
    dev->max_mr = dev->attr.max_mr_size;
    dev->max_sge = std::max(1, std::min(dev->attr.max_sge, 30));
    dev->max_msg = options_.max_wr_bytes;
    if (!dev->ports.empty() && dev->ports[0].max_msg_sz != 0)
      dev->max_msg = std::min<std::uint64_t>(dev->max_msg, dev->ports[0].max_msg_sz);
    dev->windows = options_.memory_windows &&
                   (dev->attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B) != 0;
    auto pd = std::make_shared<DevicePd>();
    pd->api = &api_;
    pd->ctx = dev->ctx;
    pd->pd = api_.alloc_pd(dev->ctx);
    if (pd->pd == nullptr) {
      fail("ibv_alloc_pd failed");
      continue;
    }
    dev->pd = std::move(pd);
    dev->channel = api_.create_comp_channel(dev->ctx);
    if (dev->channel == nullptr || !set_nonblocking(dev->channel->fd) ||
        !set_nonblocking(dev->ctx->async_fd)) {
      fail("cannot make a non-blocking completion channel");
      if (dev->channel != nullptr) api_.destroy_comp_channel(dev->channel);
      continue;
    }
    dev->cq_size = std::min(kCqSize, std::max(dev->attr.max_cqe, 1));
    dev->cq = api_.create_cq(dev->ctx, dev->cq_size, dev.get(), dev->channel, 0);
    if (dev->cq == nullptr) {
      fail("ibv_create_cq failed");
      api_.destroy_comp_channel(dev->channel);
      continue;
    }
    api_.req_notify_cq(dev->cq, 0);
    dev->comp_poll = loop::Poll::poll(loop_, dev->channel->fd, dev.get());
    uv_poll_start(dev->comp_poll.get(), UV_READABLE, &VerbsTransport::on_comp);
    dev->async_poll = loop::Poll::poll(loop_, dev->ctx->async_fd, dev.get());
    uv_poll_start(dev->async_poll.get(), UV_READABLE, &VerbsTransport::on_async);
    devices_.push_back(std::move(dev));
  }
  api_.free_devices(list);
  if (devices_.empty()) throw Error(ErrorCode::Unsupported, "verbs: no usable device: " + failures);
}

Device* VerbsTransport::device_of(ibv_context* ctx) {
  for (auto& d : devices_)
    if (d->ctx == ctx) return d.get();
  return nullptr;
}

// ---------------------------------------------------------------------------------------
// The completion poller: the channel's fd wakes the loop; get every event (acknowledged in
// batches), drain the queue, optionally spin, re-arm, and poll once more, since a completion
// that arrived between the last poll and the re-arm raised no event.

void VerbsTransport::on_comp(uv_poll_t* handle, int status, int) {
  auto* dev = static_cast<Device*>(handle->data);
  if (dev == nullptr || status < 0) return;
  loop::guarded(dev->owner->options_.log, "verbs completion poller", [dev] { dev->owner->comp_ready(*dev); });
}

void VerbsTransport::comp_ready(Device& dev) {
  ++counters_.comp_wakeups;
  for (;;) {
    ibv_cq* cq = nullptr;
    void* cq_context = nullptr;
    if (api_.get_cq_event(dev.channel, &cq, &cq_context) != 0) break;  // EAGAIN: no more
    ++counters_.comp_events;
    if (++dev.unacked >= kAckBatch) {
      api_.ack_cq_events(dev.cq, dev.unacked);
      dev.unacked = 0;
    }
  }
  std::size_t found = 0;
  for (;;) {
    found += drain(dev);
    if (options_.spin.count() > 0) {
      const auto until = std::chrono::steady_clock::now() + options_.spin;
      std::size_t spun = 0;
      while (spun == 0 && std::chrono::steady_clock::now() < until) spun = drain(dev);
      found += spun;
      if (spun != 0) continue;
    }
    api_.req_notify_cq(dev.cq, 0);
    const std::size_t late = drain(dev);
    found += late;
    if (late == 0) break;
  }
  if (found == 0) ++counters_.empty_wakeups;
  arm_watchdog();
}

std::size_t VerbsTransport::drain(Device& dev) {
  std::size_t total = 0;
  ibv_wc wc[kPollBatch];
  for (;;) {
    const int n = api_.poll_cq(dev.cq, kPollBatch, wc);
    if (n <= 0) break;
    for (int i = 0; i < n; ++i) completion(wc[i]);
    total += static_cast<std::size_t>(n);
    counters_.completions += static_cast<std::uint64_t>(n);
    if (n < kPollBatch || closed_) break;
  }
  return total;
}

bool VerbsTransport::busy() const {
  // Busy: work requests outstanding, answers awaited, or a claimed operation being served
  // (its DONE will come). Idle, nothing polls: the completion channel alone wakes the loop.
  if (!pending_.empty()) return true;
  for (const auto& [id, t] : transfers_)
    if (!t->finished) return true;
  for (const auto& [id, c] : conns_)
    if (!c->posted.empty()) return true;
  for (const auto& [id, s] : served_)
    if (s->conn != 0) return true;
  return false;
}

void VerbsTransport::arm_watchdog() {
  // Cheap while the timer runs (every completion passes here): the timer itself stops once
  // the transport is idle.
  if (!watchdog_ || closed_ || uv_is_active(reinterpret_cast<uv_handle_t*>(watchdog_.get())))
    return;
  if (busy())
    uv_timer_start(watchdog_.get(), &VerbsTransport::on_watchdog,
                   static_cast<std::uint64_t>(options_.watchdog.count()),
                   static_cast<std::uint64_t>(options_.watchdog.count()));
}

void VerbsTransport::on_watchdog(uv_timer_t* timer) {
  auto* self = static_cast<VerbsTransport*>(timer->data);
  if (self == nullptr) return;
  loop::guarded(self->options_.log, "verbs watchdog", [self, timer] {
    for (auto& dev : self->devices_) {
      ++self->counters_.watchdog_polls;
      if (self->drain(*dev) == 0) continue;
      // A wakeup was missed: the queue may be disarmed. Arm it again, and poll what came
      // in between.
      ++self->counters_.watchdog_found;
      if (self->closed_) return;
      self->api_.req_notify_cq(dev->cq, 0);
      self->drain(*dev);
      if (self->closed_) return;
    }
    if (!self->busy()) uv_timer_stop(timer);
  });
}

// ---------------------------------------------------------------------------------------
// Async events: a port going down fails the connections through it; a queue pair's fatal
// error fails its connection.

void VerbsTransport::on_async(uv_poll_t* handle, int status, int) {
  auto* dev = static_cast<Device*>(handle->data);
  if (dev == nullptr || status < 0) return;
  loop::guarded(dev->owner->options_.log, "verbs async events", [dev] { dev->owner->async_ready(*dev); });
}

void VerbsTransport::async_ready(Device& dev) {
  for (;;) {
    ibv_async_event ev{};
    if (api_.get_async_event(dev.ctx, &ev) != 0) break;
    const ibv_event_type type = ev.event_type;
    std::vector<std::uint64_t> hit;
    std::string why = dev.name + ": " + async_event_text(type);
    switch (type) {
      case IBV_EVENT_PORT_ERR:
        why = dev.name + " port " + std::to_string(ev.element.port_num) + " went down";
        for (auto& [id, c] : conns_)
          if (c->dev == &dev &&
              (c->cm == nullptr || c->cm->port_num == 0 || c->cm->port_num == ev.element.port_num))
            hit.push_back(id);
        if (ev.element.port_num >= 1 && ev.element.port_num <= static_cast<int>(dev.ports.size()))
          dev.ports[ev.element.port_num - 1].state = IBV_PORT_DOWN;
        break;
      case IBV_EVENT_PORT_ACTIVE:
        if (ev.element.port_num >= 1 && ev.element.port_num <= static_cast<int>(dev.ports.size()))
          dev.ports[ev.element.port_num - 1].state = IBV_PORT_ACTIVE;
        break;
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
        if (ev.element.qp != nullptr)
          if (Conn* c = conn_by_qp(ev.element.qp->qp_num)) hit.push_back(c->id);
        break;
      case IBV_EVENT_DEVICE_FATAL:
      case IBV_EVENT_CQ_ERR:
        for (auto& [id, c] : conns_)
          if (c->dev == &dev) hit.push_back(id);
        break;
      default:
        break;
    }
    api_.ack_async_event(&ev);
    for (std::uint64_t id : hit)
      if (Conn* c = conn_of(id)) fail_conn(*c, ErrorCode::PeerLost, why);
  }
}

}  // namespace ferry::transport::verbs
