#include "sdk/src/region_state.hpp"

#include <algorithm>

#include "loop/ids.hpp"
#include "sdk/src/core.hpp"
#include "sdk/src/region_metadata.hpp"
#include "sdk/src/stream_match.hpp"
#include "sdk/src/subject_pairing.hpp"
#include "sidechannel/pairing.hpp"
#include "transport/token.hpp"

namespace ferry::detail {

namespace {

transport::Access access_of(RegionAccess a) { return static_cast<transport::Access>(a); }

OperationKind kind_of(transport::Access a) {
  return a == transport::Access::read ? OperationKind::read : OperationKind::write;
}

bool allows(RegionAccess offered, RegionAccess wanted) {
  return (static_cast<unsigned>(wanted) & ~static_cast<unsigned>(offered)) == 0;
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
  if (options.on_event) {
    try {
      options.on_event(event);
    } catch (const std::exception& e) {
      core->loop->log().error("region " + id_hex + ": an event callback threw: " + e.what());
    }
  }
  const bool last = event.type == RegionEvent::Type::ended;
  {
    std::lock_guard lock(mu_);
    if (options.queue_events) {
      queue_.push_back(std::move(event));
      while (queue_.size() > std::max<std::size_t>(options.max_queued_events, 1)) {
        queue_.pop_front();
        ++dropped_;
      }
    }
    if (last) ended_ = true;
  }
  cv_.notify_all();
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

// ---------------------------------------------------------------------------------------------
// The peer's side.

AttachmentState::AttachmentState(std::shared_ptr<Core> core_, std::uint64_t id_,
                                 std::optional<RegionAccess> access)
    : core(std::move(core_)), id(id_), wanted(access) {}

AttachmentState::~AttachmentState() = default;

void AttachmentState::arm(std::chrono::milliseconds timeout) {
  core->attachments[id] = weak_from_this();
  if (timeout.count() <= 0) return;
  deadline_ = loop::Timer::timer(core->loop->uv(), this);
  uv_update_time(core->loop->uv());
  uv_timer_start(deadline_.get(), &AttachmentState::on_deadline,
                 static_cast<std::uint64_t>(timeout.count()) + 1, 0);
  attach_timeout_ = timeout;
}

void AttachmentState::on_deadline(uv_timer_t* timer) {
  auto* self = static_cast<AttachmentState*>(timer->data);
  if (self == nullptr || self->state() != Attachment::State::attaching) return;
  auto keep = self->shared_from_this();
  std::string text =
      "attaching: the deadline of " + std::to_string(self->attach_timeout_.count()) + " ms passed";
  if (!self->subject_.empty() && !self->metadata())
    text += " while asking for the region's metadata at subject '" + self->subject_ +
            "': nobody served it";
  self->fail(Error(ErrorCode::Timeout, text));
}

void AttachmentState::start(const RegionMetadata& m) {
  m.validate();
  {
    std::lock_guard lock(mu_);
    metadata_ = m;
  }
  if (wanted && !allows(m.access, *wanted))
    throw Error(ErrorCode::KindMismatch, std::string("the region allows ") + to_string(m.access) +
                                             "; this attachment asked for " + to_string(*wanted));
  for (auto& [t, e] : core->choose(operation_view(m), transport::bit(transport::MemoryKind::host)))
    if (t->serves_regions()) candidates_.emplace_back(t, e);
  next_ = 0;
  if (candidates_.empty())
    throw Error(ErrorCode::NoCommonMethod,
                "no method both sides offer serves regions (peer '" + m.owner.name + "')");
  if (!try_next())
    throw Error(ErrorCode::NoCommonMethod,
                "no method could attach to peer '" + m.owner.name + "' (" + tried_ + ")");
}

bool AttachmentState::try_next() {
  const RegionMetadata& m = *metadata_;
  while (next_ < candidates_.size()) {
    auto [t, endpoint] = candidates_[next_++];
    transport::AttachSpec spec;
    loop::parse_hex16(m.region_id, spec.region);
    transport::token_from_hex(m.token, spec.token);
    spec.access = access_of(wanted.value_or(m.access));
    spec.endpoint = endpoint;
    spec.peer_name = m.owner.name;
    try {
      transport_ = t;
      remote_ = t->attach(std::move(spec), *this);
      return true;
    } catch (const Error& e) {
      if (e.code() == ErrorCode::InvalidMetadata || e.code() == ErrorCode::InvalidState) throw;
      tried_ += (tried_.empty() ? "" : "; ") + t->capabilities().method + ": " + e.message();
    }
  }
  return false;
}

void AttachmentState::on_attached() {
  {
    std::lock_guard lock(mu_);
    method_ = transport_->capabilities().method;
    direct_ = remote_->direct();
    state_.store(Attachment::State::attached, std::memory_order_release);
  }
  deadline_.reset();
  cv_.notify_all();
  auto keep = shared_from_this();
  std::vector<std::shared_ptr<RegionTransfer>> waiting;
  waiting.swap(waiting_);
  for (auto& t : waiting) begin(t);
}

void AttachmentState::on_attach_failed(const Error& error, bool setup) {
  auto keep = shared_from_this();
  remote_.reset();
  const std::string method = transport_ != nullptr ? transport_->capabilities().method : "";
  tried_ += (tried_.empty() ? "" : "; ") + method + ": " + error.message();
  try {
    if (setup && try_next()) return;
  } catch (const Error& e) {
    fail(e);
    return;
  }
  fail(candidates_.size() <= 1 || !setup
           ? error
           : Error(error.code(), "no method could attach to peer '" + metadata_->owner.name +
                                     "' (" + tried_ + ")"));
}

void AttachmentState::fail(const Error& error) {
  if (state() == Attachment::State::detached) return;
  ended(error);
}

void AttachmentState::on_detached(const Error& error) {
  auto keep = shared_from_this();
  ended(error);
}

void AttachmentState::ended(const Error& error) {
  auto keep = shared_from_this();
  {
    std::lock_guard lock(mu_);
    if (state() == Attachment::State::detached) return;
    error_ = error;
    direct_.reset();
    state_.store(Attachment::State::detached, std::memory_order_release);
  }
  cv_.notify_all();
  deadline_.reset();
  if (!requests_.empty() && core->nats)
    for (std::uint64_t r : requests_) core->nats->cancel_request(r);
  requests_.clear();
  retry_.reset();
  core->attachments.erase(id);
  // Transfers under way or waiting end with the attachment's error; then the transport lets go
  // of the attachment (a DETACH when it was attached and the owner did not end it).
  std::vector<std::shared_ptr<RegionTransfer>> ops;
  ops.swap(waiting_);
  for (auto& [raw, weak] : running_)
    if (auto op = weak.lock()) ops.push_back(std::move(op));
  running_.clear();
  for (auto& op : ops)
    op->finish(error.code() == ErrorCode::Cancelled ? OperationStatus::cancelled
                                                    : OperationStatus::errored,
               error);
  remote_.reset();
}

void AttachmentState::detach(const Error& reason) { ended(reason); }

void AttachmentState::begin(const std::shared_ptr<RegionTransfer>& op) {
  switch (state()) {
    case Attachment::State::attaching:
      waiting_.push_back(op);
      return;
    case Attachment::State::attached:
      running_[op.get()] = op;
      try {
        op->go(*transport_, *remote_, *metadata_);
      } catch (const Error& e) {
        op->finish(OperationStatus::errored, e);
      }
      return;
    case Attachment::State::detached: {
      auto e = error();
      op->finish(OperationStatus::errored,
                 e ? *e : Error(ErrorCode::InvalidState, "the attachment has ended"));
      return;
    }
  }
}

void AttachmentState::forget(RegionTransfer* op) {
  running_.erase(op);
  std::erase_if(waiting_, [op](const auto& w) { return w.get() == op; });
}

std::optional<Error> AttachmentState::error() const {
  std::lock_guard lock(mu_);
  return error_;
}

std::optional<RegionMetadata> AttachmentState::metadata() const {
  std::lock_guard lock(mu_);
  return metadata_;
}

std::shared_ptr<const transport::DirectCopy> AttachmentState::direct() const {
  std::lock_guard lock(mu_);
  return direct_;
}

void AttachmentState::notify_direct(const transport::TransferSpec& spec) {
  if (remote_ && state() == Attachment::State::attached) remote_->ended(spec, std::nullopt);
}

std::string AttachmentState::method() const {
  std::lock_guard lock(mu_);
  return method_;
}

void AttachmentState::wait_attached() const {
  if (core->loop->in_loop_thread())
    throw Error(ErrorCode::WrongThread, "wait_attached() on the connector's loop thread");
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return state() != Attachment::State::attaching; });
  if (state() == Attachment::State::detached)
    throw error_ ? *error_ : Error(ErrorCode::InvalidState, "the attachment has ended");
}

void AttachmentState::ask(const std::string& subject) {
  subject_ = subject;
  request();
}

void AttachmentState::request() {
  auto& nats = *core->nats;
  sidechannel::MetadataRequest req{OperationKind::read, core->identity.name};
  std::weak_ptr<AttachmentState> weak = weak_from_this();
  auto rid = std::make_shared<std::uint64_t>(0);
  *rid =
      nats.request(subject_, sidechannel::encode(req), [weak, rid](const sidechannel::Message& m) {
        auto self = weak.lock();
        if (!self) return;
        std::erase(self->requests_, *rid);
        if (self->state() != Attachment::State::attaching || self->metadata()) return;
        if (m.no_responders || m.data.find("\"ended\"") != std::string::npos) {
          // Nobody serves it (yet): ask again after 1, 2, 4 ... ms, up to a quarter second.
          using std::chrono::milliseconds;
          self->backoff_ = std::clamp(self->backoff_ * 2, milliseconds(1), milliseconds(250));
          if (!self->retry_) self->retry_ = loop::Timer::timer(self->core->loop->uv(), self.get());
          uv_timer_start(self->retry_.get(), &AttachmentState::on_retry,
                         static_cast<std::uint64_t>(self->backoff_.count()), 0);
          return;
        }
        for (std::uint64_t r : self->requests_) self->core->nats->cancel_request(r);
        self->requests_.clear();
        self->retry_.reset();
        try {
          self->start(RegionMetadata::from_json(m.data));
        } catch (const Error& e) {
          self->fail(Error(e.code(),
                           "the region metadata served at '" + self->subject_ + "': " + e.message(),
                           e.field()));
        }
      });
  requests_.push_back(*rid);
  while (requests_.size() > 4) {
    nats.cancel_request(requests_.front());
    requests_.erase(requests_.begin());
  }
}

void AttachmentState::on_retry(uv_timer_t* timer) {
  auto* self = static_cast<AttachmentState*>(timer->data);
  if (self == nullptr || self->state() != Attachment::State::attaching || !self->core->nats) return;
  auto keep = self->shared_from_this();
  self->request();
}

// ---------------------------------------------------------------------------------------------
// Transfers.

RegionTransfer::RegionTransfer(std::shared_ptr<Core> core_, std::uint64_t id_, OperationKind kind_,
                               std::vector<Descriptor> local_,
                               std::shared_ptr<AttachmentState> attachment,
                               std::vector<RegionRange> remote, std::vector<std::uint64_t> blocks,
                               std::string tag)
    : OperationState(std::move(core_), id_, kind_, false, std::move(local_)),
      attachment_(std::move(attachment)),
      remote_(std::move(remote)),
      blocks_(std::move(blocks)),
      tag_(std::move(tag)) {}

void RegionTransfer::launch() {
  attachment_->begin(std::static_pointer_cast<RegionTransfer>(shared_from_this()));
}

void RegionTransfer::go(transport::Transport& transport, transport::RemoteRegion& remote,
                        const RegionMetadata& m) {
  const RegionAccess need = kind == OperationKind::read ? RegionAccess::read : RegionAccess::write;
  if (!allows(attachment_->wanted.value_or(m.access), need))
    throw Error(ErrorCode::KindMismatch, std::string("the attachment allows ") +
                                             to_string(attachment_->wanted.value_or(m.access)) +
                                             "; this transfer would " +
                                             (need == RegionAccess::read ? "read" : "write"));
  transport::TransferSpec spec;
  spec.access = kind == OperationKind::read ? transport::Access::read : transport::Access::write;
  spec.segments = region_segments(m, blocks_.empty() ? remote_ : block_ranges(m, blocks_), local);
  spec.region_tag = tag_;
  for (const Descriptor& d : local)
    registrations_.push_back(transport.register_memory(region_of(d)));
  set_method(transport.capabilities().method);
  transfer_ = remote.start(std::move(spec), *this);
}

void RegionTransfer::release(OperationStatus final_status, const Error& reason) {
  if (transfer_) {
    if (final_status != OperationStatus::complete) transfer_->cancel(reason);
    transfer_.reset();
  }
  registrations_.clear();
  attachment_->forget(this);
}

void RegionTransfer::on_transfer_complete() { finish(OperationStatus::complete, std::nullopt); }

void RegionTransfer::on_transfer_failed(const Error& error) {
  finish(OperationStatus::errored, error);
}

// ---------------------------------------------------------------------------------------------

std::vector<RegionRange> block_ranges(const RegionMetadata& m,
                                      const std::vector<std::uint64_t>& blocks) {
  if (m.block_size == 0)
    throw Error(ErrorCode::InvalidArgument, "region " + m.region_id + " has no block layout");
  if (blocks.empty()) throw Error(ErrorCode::InvalidArgument, "the block list is empty");
  const std::uint64_t count = m.block_count();
  std::vector<RegionRange> out;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i] >= count)
      throw Error(ErrorCode::InvalidArgument, "block " + std::to_string(blocks[i]) + " (entry " +
                                                  std::to_string(i) + ") is past the region's " +
                                                  std::to_string(count) + " blocks");
    const std::uint64_t offset = blocks[i] * m.block_size;
    if (!out.empty() && out.back().offset + out.back().length == offset)
      out.back().length += m.block_size;
    else
      out.push_back({offset, m.block_size});
  }
  return out;
}

std::vector<transport::Segment> region_segments(const RegionMetadata& m,
                                                const std::vector<RegionRange>& remote,
                                                const std::vector<Descriptor>& local) {
  if (remote.empty()) throw Error(ErrorCode::InvalidArgument, "the range list is empty");
  const std::uint64_t total = m.total_size();
  // Where each descriptor starts in the region's byte stream.
  std::vector<std::uint64_t> starts;
  starts.reserve(m.descriptors.size());
  std::uint64_t at = 0;
  for (const RemoteDescriptor& d : m.descriptors) {
    starts.push_back(at);
    at += d.size;
  }
  std::vector<RemoteDescriptor> pieces;
  std::uint64_t wanted = 0;
  std::size_t separate = 0;
  for (std::size_t i = 0; i < remote.size(); ++i) {
    const RegionRange& r = remote[i];
    if (r.length == 0 || r.offset > total || r.length > total - r.offset)
      throw Error(ErrorCode::InvalidArgument,
                  "range " + std::to_string(i) + " (" + std::to_string(r.length) +
                      " bytes at offset " + std::to_string(r.offset) +
                      ") is empty or outside the region's " + std::to_string(total) + " bytes");
    wanted += r.length;
    std::uint64_t offset = r.offset;
    std::uint64_t left = r.length;
    auto d = static_cast<std::size_t>(std::upper_bound(starts.begin(), starts.end(), offset) -
                                      starts.begin() - 1);
    while (left > 0) {
      const RemoteDescriptor& desc = m.descriptors[d];
      const std::uint64_t in = offset - starts[d];
      const std::uint64_t n = std::min(left, desc.size - in);
      const std::uint64_t addr = desc.ptr + in;
      if (!pieces.empty() && pieces.back().ptr + pieces.back().size == addr &&
          pieces.back().device == desc.device) {
        pieces.back().size += n;
      } else {
        pieces.push_back({addr, n, desc.device});
        ++separate;
      }
      offset += n;
      left -= n;
      ++d;
    }
  }
  if (separate > Attachment::kMaxRanges)
    throw Error(ErrorCode::InvalidArgument,
                "the transfer reaches " + std::to_string(separate) +
                    " separate ranges of the region; one transfer reaches at most " +
                    std::to_string(Attachment::kMaxRanges) +
                    " (split it, or name adjacent blocks)");
  std::uint64_t have = 0;
  for (const Descriptor& d : local) have += d.size();
  if (have != wanted)
    throw Error(ErrorCode::SizeMismatch, "the ranges hold " + std::to_string(wanted) +
                                             " bytes; the local descriptors " +
                                             std::to_string(have));
  return match_streams(pieces, local);
}

}  // namespace ferry::detail
