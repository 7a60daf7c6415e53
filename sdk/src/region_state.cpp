#include "sdk/src/region_state.hpp"

#include <algorithm>

#include "loop/ids.hpp"
#include "sdk/src/core.hpp"
#include "sdk/src/subject_pairing.hpp"
#include "transport/token.hpp"

// A region's owner side (docs/regions.md). The peer's side: region_attachment.cpp.
namespace ferry::detail {

namespace {

OperationKind kind_of(transport::Access a) {
  return a == transport::Access::read ? OperationKind::read : OperationKind::write;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The owner's side.

RegionState::RegionState(std::shared_ptr<Core> core_, std::uint64_t id_,
                         std::vector<Descriptor> local_, RegionOptions options_)
    : core(std::move(core_)),
      id(id_),
      id_hex(loop::hex16(id_)),
      local(std::move(local_)),
      options(std::move(options_)) {}

RegionState::~RegionState() = default;

void RegionState::open() {
  transport::RegionExposure exposure;
  exposure.id = id;
  exposure.token = transport::random_token();
  exposure.access = access_of(options.access);
  RegionMetadata& m = metadata;
  m.region_id = id_hex;
  m.owner = core->identity;
  m.token = transport::token_to_hex(exposure.token);
  m.access = options.access;
  m.block_size = options.block_size;
  std::uint64_t offset = 0;
  for (const Descriptor& d : local) {
    const auto addr = reinterpret_cast<std::uint64_t>(d.ptr());
    m.descriptors.push_back({addr, d.size(), d.device()});
    exposure.regions.push_back(region_of(d));
    starts_.emplace_back(addr, offset);
    offset += d.size();
  }
  std::stable_sort(starts_.begin(), starts_.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  const std::uint8_t kinds = memory_kinds_of(local);
  try {
    std::string refusals;
    for (const auto& t : core->transports) {
      const transport::Capabilities& caps = t->capabilities();
      if (!t->serves_regions()) {
        refusals += (refusals.empty() ? "" : "; ") + caps.method + " does not serve regions";
        continue;
      }
      if ((caps.memory_kinds & kinds) != kinds) continue;
      const std::size_t before = registrations_.size();
      std::string info;
      try {
        for (const transport::Region& r : exposure.regions)
          registrations_.push_back(t->register_exposed(r));
        info = t->serve_region(exposure, *this);
      } catch (const Error& e) {
        if (e.code() != ErrorCode::Unsupported) throw;
        registrations_.resize(before);
        refusals += (refusals.empty() ? "" : "; ") + e.message();
        continue;
      }
      served_on_.push_back(t.get());
      for (const Endpoint& e : t->endpoints()) {
        m.endpoints.push_back(e);
        m.endpoints.back().info = info;
      }
    }
    if (served_on_.empty())
      throw Error(ErrorCode::Unsupported,
                  "no method of this connector can serve this region: " + refusals);
  } catch (...) {
    for (transport::Transport* t : served_on_)
      t->end_region(id, Error(ErrorCode::Cancelled, "the region was refused"));
    served_on_.clear();
    registrations_.clear();
    throw;
  }
  open_.store(true, std::memory_order_release);
  core->regions[id] = weak_from_this();
  core->refresh_gauges();
  if (options.timeout.count() > 0) {
    deadline_ = loop::Timer::timer(core->loop->uv(), this);
    uv_update_time(core->loop->uv());
    uv_timer_start(deadline_.get(), &RegionState::on_deadline,
                   static_cast<std::uint64_t>(options.timeout.count()) + 1, 0);
  }
}

void RegionState::on_deadline(uv_timer_t* timer) {
  auto* self = static_cast<RegionState*>(timer->data);
  if (self == nullptr) return;
  auto keep = self->shared_from_this();
  self->end(Error(ErrorCode::Timeout, "region " + self->id_hex + ": its deadline of " +
                                          std::to_string(self->options.timeout.count()) +
                                          " ms passed"));
}

void RegionState::end(const Error& reason) {
  auto keep = shared_from_this();
  {
    std::lock_guard lock(mu_);
    if (ending_) return;
    ending_ = true;  // an event callback that closes the region again does nothing
  }
  open_.store(false, std::memory_order_release);
  // When end_region returns, no peer's request touches the memory any more.
  for (transport::Transport* t : served_on_) t->end_region(id, reason);
  served_on_.clear();
  registrations_.clear();
  peers_.clear();
  deadline_.reset();
  if (serving != 0 && core->nats) core->nats->unsubscribe(serving, pairing::kEndedAnswer);
  serving = 0;
  core->regions.erase(id);
  core->refresh_gauges();
  {
    std::lock_guard lock(mu_);
    error_ = reason;
  }
  RegionEvent e;
  e.type = RegionEvent::Type::ended;
  e.status =
      reason.code() == ErrorCode::Cancelled ? OperationStatus::cancelled : OperationStatus::errored;
  e.error = reason;
  emit(std::move(e));
}

std::size_t RegionState::revoke(const std::string& who) {
  std::vector<std::uint64_t> hit;
  for (const auto& [att, p] : peers_)
    if (p.info.attachment == who || (!p.info.peer_id.empty() && p.info.peer_id == who))
      hit.push_back(att);
  // A peer's attachments the owner has not heard of yet (their events are on the way) go too:
  // silently, as the owner never saw them come.
  std::size_t unseen = 0;
  for (transport::Transport* t : served_on_)
    for (std::uint64_t att : t->attachments_of_peer(id, who))
      if (peers_.count(att) == 0) {
        t->revoke_attachment(att,
                             Error(ErrorCode::Cancelled,
                                   "the owner revoked this peer's access to region " + id_hex));
        ++unseen;
      }
  for (std::uint64_t att : hit) {
    auto keep = shared_from_this();
    auto it = peers_.find(att);
    const Error reason(ErrorCode::Cancelled,
                       "the owner revoked this peer's access to region " + id_hex);
    // When revoke_attachment returns, that peer's requests touch the memory no more.
    it->second.transport->revoke_attachment(att, reason);
    RegionEvent e = about(att);
    e.type = RegionEvent::Type::detached;
    e.status = OperationStatus::cancelled;
    e.error = reason;
    peers_.erase(it);
    emit(std::move(e));
  }
  return hit.size() + unseen;
}

std::vector<RegionPeer> RegionState::peers() const {
  std::vector<RegionPeer> out;
  for (const auto& [att, p] : peers_) out.push_back(p.info);
  std::sort(out.begin(), out.end(),
            [](const RegionPeer& a, const RegionPeer& b) { return a.attachment < b.attachment; });
  return out;
}

std::optional<Error> RegionState::error() const {
  std::lock_guard lock(mu_);
  return error_;
}

std::uint64_t RegionState::dropped() const {
  std::lock_guard lock(mu_);
  return dropped_;
}

std::optional<RegionEvent> RegionState::next_event(std::chrono::nanoseconds timeout) {
  std::unique_lock lock(mu_);
  if (!core->loop->in_loop_thread() && timeout.count() > 0)
    cv_.wait_for(lock, timeout, [&] { return !queue_.empty() || ended_; });
  if (queue_.empty()) return std::nullopt;
  RegionEvent e = std::move(queue_.front());
  queue_.pop_front();
  return e;
}

void RegionState::emit(RegionEvent event) {
  // Queued first, then pushed: when on_event runs, next_event() returns the event already (a
  // caller woken by on_event and reading the queue finds it there).
  const bool last = event.type == RegionEvent::Type::ended;
  {
    std::lock_guard lock(mu_);
    if (options.queue_events) {
      queue_.push_back(options.on_event ? event : std::move(event));
      while (queue_.size() > std::max<std::size_t>(options.max_queued_events, 1)) {
        queue_.pop_front();
        ++dropped_;
      }
    }
    if (last) ended_ = true;
  }
  cv_.notify_all();
  if (options.on_event) {
    try {
      options.on_event(event);
    } catch (const std::exception& e) {
      core->loop->log().error("region " + id_hex + ": an event callback threw: " + e.what());
    }
  }
}

RegionEvent RegionState::about(std::uint64_t att) const {
  RegionEvent e;
  e.attachment = loop::hex16(att);
  if (auto it = peers_.find(att); it != peers_.end()) {
    e.peer = it->second.info.peer;
    e.peer_id = it->second.info.peer_id;
    e.method = it->second.info.method;
  }
  return e;
}

std::vector<RegionRange> RegionState::offsets(const transport::Ranges& ranges) const {
  std::vector<RegionRange> out;
  out.reserve(ranges.size());
  for (const auto& [addr, len] : ranges) {
    // The last descriptor starting at or below addr holds it (the transport checked the range
    // lies inside the region).
    auto it = std::upper_bound(starts_.begin(), starts_.end(), addr,
                               [](std::uint64_t a, const auto& s) { return a < s.first; });
    if (it == starts_.begin()) continue;
    --it;
    out.push_back({it->second + (addr - it->first), len});
  }
  return out;
}

void RegionState::on_attached(const transport::Attachment& a) {
  auto keep = shared_from_this();  // the event's callback may drop the last handle
  Peer p;
  for (transport::Transport* t : served_on_)
    if (t->capabilities().method == a.method) p.transport = t;
  if (p.transport == nullptr) return;
  p.info.attachment = loop::hex16(a.id);
  p.info.peer = a.peer;
  p.info.peer_id = a.peer_id;
  p.info.method = a.method;
  p.info.access = static_cast<RegionAccess>(a.access);
  peers_[a.id] = p;
  RegionEvent e = about(a.id);
  e.type = RegionEvent::Type::attached;
  emit(std::move(e));
}

void RegionState::on_region_transfer(const transport::RegionNotice& n) {
  auto keep = shared_from_this();
  RegionEvent e = about(n.attachment);
  e.type = RegionEvent::Type::transfer;
  e.kind = kind_of(n.access);
  e.ranges = offsets(n.ranges);
  e.tag = n.tag;
  e.status = n.error ? OperationStatus::errored : OperationStatus::complete;
  e.error = n.error;
  const std::uint64_t bs = options.block_size;
  if (bs != 0 && std::all_of(e.ranges.begin(), e.ranges.end(), [bs](const RegionRange& r) {
        return r.offset % bs == 0 && r.length % bs == 0;
      })) {
    for (const RegionRange& r : e.ranges)
      for (std::uint64_t b = r.offset / bs; b < (r.offset + r.length) / bs; ++b)
        e.blocks.push_back(b);
  }
  emit(std::move(e));
}

void RegionState::on_detached(std::uint64_t att, const std::optional<Error>& error) {
  auto keep = shared_from_this();
  if (peers_.count(att) == 0) return;  // revoked by the owner: its event was emitted then
  RegionEvent e = about(att);
  e.type = RegionEvent::Type::detached;
  e.status = error ? OperationStatus::errored : OperationStatus::complete;
  e.error = error;
  peers_.erase(att);
  emit(std::move(e));
}

}  // namespace ferry::detail
