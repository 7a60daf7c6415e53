#include "transport/verbs/verbs_device.hpp"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace ferry::transport::verbs {

namespace {

constexpr int kPollBatch = 32;
constexpr unsigned kAckBatch = 64;  // completion events acknowledged in one call
constexpr int kCqSize = 4096;
/// While work is under way, the completion queues are polled this often even without an
/// event: a missed wakeup costs at most this much.
constexpr std::chrono::milliseconds kWatchdog{20};

bool set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  return flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

std::string sys_text(int err) { return std::strerror(err); }

}  // namespace

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

Devices::Devices(const Context& ctx, const VerbsApi& api, const VerbsOptions& options,
                 Handler& handler, Counters& counters)
    : ctx_(ctx), api_(api), handler_(handler), counters_(counters), spin_(options.spin) {
  open_all(options);
  watchdog_ = loop::Timer::timer(ctx_.loop, this);
  gpudirect_ = std::make_unique<GpuDirect>(ctx_, api_, *this, counters_);
}

Devices::~Devices() { close(); }

void Devices::open_all(const VerbsOptions& options) {
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
    dev->max_msg = options.max_wr_bytes;
    if (!dev->ports.empty() && dev->ports[0].max_msg_sz != 0)
      dev->max_msg = std::min<std::uint64_t>(dev->max_msg, dev->ports[0].max_msg_sz);
    dev->windows =
        options.memory_windows && (dev->attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B) != 0;
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
    const int cq_size = std::min(kCqSize, std::max(dev->attr.max_cqe, 1));
    dev->cq = api_.create_cq(dev->ctx, cq_size, dev.get(), dev->channel, 0);
    if (dev->cq == nullptr) {
      fail("ibv_create_cq failed");
      api_.destroy_comp_channel(dev->channel);
      continue;
    }
    api_.req_notify_cq(dev->cq, 0);
    dev->comp_poll = loop::Poll::poll(ctx_.loop, dev->channel->fd, dev.get());
    uv_poll_start(dev->comp_poll.get(), UV_READABLE, &Devices::on_comp);
    dev->async_poll = loop::Poll::poll(ctx_.loop, dev->ctx->async_fd, dev.get());
    uv_poll_start(dev->async_poll.get(), UV_READABLE, &Devices::on_async);
    devices_.push_back(std::move(dev));
  }
  api_.free_devices(list);
  if (devices_.empty()) throw Error(ErrorCode::Unsupported, "verbs: no usable device: " + failures);
}

void Devices::close() {
  if (closed_) return;
  closed_ = true;
  watchdog_.reset();
  for (auto& dev : devices_) {
    dev->comp_poll.reset();
    dev->async_poll.reset();
    if (dev->unacked != 0) api_.ack_cq_events(dev->cq, dev->unacked);
    dev->unacked = 0;
    if (dev->cq != nullptr) api_.destroy_cq(dev->cq);
    if (dev->channel != nullptr) api_.destroy_comp_channel(dev->channel);
    dev->cq = nullptr;
    dev->channel = nullptr;
  }
  gpudirect_.reset();
}

Device* Devices::find(ibv_context* ctx) {
  for (auto& d : devices_)
    if (d->ctx == ctx) return d.get();
  return nullptr;
}

bool Devices::uses_memory_windows() const noexcept {
  return !devices_.empty() &&
         std::all_of(devices_.begin(), devices_.end(), [](const auto& d) { return d->windows; });
}

void Devices::register_pieces(MrSet& set, std::size_t d, std::uint64_t addr, std::uint64_t len,
                              int access) {
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
    if (mr == nullptr) {
      const int err = errno;
      throw Error(err == ENOMEM ? ErrorCode::Internal : ErrorCode::Unsupported,
                  "ibv_reg_mr on " + dev.name + ": " + (err ? sys_text(err) : "refused"));
    }
    on.pieces.push_back({addr + at, n, mr});
    ++counters_.registrations;
  }
}

std::shared_ptr<MrSet> Devices::register_everywhere(const Region& region, int access) {
  auto set = std::make_shared<MrSet>();
  set->base = reinterpret_cast<std::uint64_t>(region.ptr);
  set->size = region.size;
  for (auto& dev : devices_) set->devices.push_back({dev->pd, {}});
  if (region.kind == MemoryKind::cuda) {
    gpudirect_->register_cuda(*set, access);
    return set;
  }
  try {
    for (std::size_t d = 0; d < devices_.size(); ++d)
      register_pieces(*set, d, set->base, set->size, access);
  } catch (const Error& e) {
    // What was registered is released with `set`.
    throw Error(e.code(),
                "verbs: cannot register " + std::to_string(set->size) + " bytes: " + e.message());
  }
  return set;
}

void Devices::on_comp(uv_poll_t* handle, int status, int) {
  auto* dev = static_cast<Device*>(handle->data);
  if (dev == nullptr || status < 0) return;
  loop::guarded(dev->owner->ctx_.log, "the verbs completion poller",
                [dev] { dev->owner->comp_ready(*dev); });
}

void Devices::comp_ready(Device& dev) {
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
    if (closed_) return;
    if (spin_.count() > 0) {
      const auto until = std::chrono::steady_clock::now() + spin_;
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

std::size_t Devices::drain(Device& dev) {
  std::size_t total = 0;
  ibv_wc wc[kPollBatch];
  while (!closed_ && dev.cq != nullptr) {
    const int n = api_.poll_cq(dev.cq, kPollBatch, wc);
    if (n <= 0) break;
    for (int i = 0; i < n; ++i) handler_.completion(wc[i]);
    total += static_cast<std::size_t>(n);
    counters_.completions += static_cast<std::uint64_t>(n);
    if (n < kPollBatch) break;
  }
  return total;
}

std::size_t Devices::drain_all() {
  std::size_t found = 0;
  for (auto& dev : devices_) found += drain(*dev);
  return found;
}

void Devices::arm_watchdog() {
  // Cheap while the timer runs (every completion passes here): the timer itself stops once
  // nothing is under way. Idle, nothing polls: the completion channel alone wakes the loop.
  if (!watchdog_ || closed_ || uv_is_active(reinterpret_cast<uv_handle_t*>(watchdog_.get())))
    return;
  if (handler_.busy())
    uv_timer_start(watchdog_.get(), &Devices::on_watchdog,
                   static_cast<std::uint64_t>(kWatchdog.count()),
                   static_cast<std::uint64_t>(kWatchdog.count()));
}

void Devices::on_watchdog(uv_timer_t* timer) {
  auto* self = static_cast<Devices*>(timer->data);
  if (self == nullptr) return;
  loop::guarded(self->ctx_.log, "the verbs watchdog", [self, timer] {
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
    if (!self->handler_.busy()) uv_timer_stop(timer);
  });
}

void Devices::on_async(uv_poll_t* handle, int status, int) {
  auto* dev = static_cast<Device*>(handle->data);
  if (dev == nullptr || status < 0) return;
  loop::guarded(dev->owner->ctx_.log, "verbs async events",
                [dev] { dev->owner->async_ready(*dev); });
}

void Devices::async_ready(Device& dev) {
  for (;;) {
    ibv_async_event ev{};
    if (api_.get_async_event(dev.ctx, &ev) != 0) break;
    const int port = ev.element.port_num;
    if (ev.event_type == IBV_EVENT_PORT_ERR && port >= 1 &&
        port <= static_cast<int>(dev.ports.size()))
      dev.ports[port - 1].state = IBV_PORT_DOWN;
    if (ev.event_type == IBV_EVENT_PORT_ACTIVE && port >= 1 &&
        port <= static_cast<int>(dev.ports.size()))
      dev.ports[port - 1].state = IBV_PORT_ACTIVE;
    const ibv_async_event copy = ev;
    api_.ack_async_event(&ev);
    handler_.async_event(dev, copy);
    if (closed_) return;
  }
}

}  // namespace ferry::transport::verbs
