// A peer's attachment to a region and the transfers on it (docs/regions.md). The owner's
// side: region_state.cpp.
#include "sdk/src/region_state.hpp"

#include <algorithm>

#include "loop/ids.hpp"
#include "sdk/src/core.hpp"
#include "sdk/src/region_metadata.hpp"
#include "sdk/src/stream_match.hpp"
#include "sidechannel/pairing.hpp"
#include "transport/token.hpp"

namespace ferry::detail {

// ---------------------------------------------------------------------------------------------
// The peer's side.

AttachmentState::AttachmentState(std::shared_ptr<Core> core_, std::uint64_t id_,
                                 std::optional<RegionAccess> access)
    : core(std::move(core_)), id(id_), wanted(access) {}

AttachmentState::~AttachmentState() = default;

void AttachmentState::arm(std::chrono::milliseconds timeout) {
  core->attachments[id] = weak_from_this();
  core->refresh_gauges();
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
            "': nobody served it" + self->core->nats_note();
  self->fail(Error(ErrorCode::Timeout, text));
}

void AttachmentState::start(const RegionMetadata& m) {
  m.validate();
  {
    std::lock_guard lock(mu_);
    metadata_ = m;
  }
  if (wanted && !region_allows(m.access, *wanted))
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
    for (const RemoteDescriptor& d : m.descriptors) spec.ranges.emplace_back(d.ptr, d.size);
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
  core->refresh_gauges();
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
  if (!region_allows(attachment_->wanted.value_or(m.access), need))
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
