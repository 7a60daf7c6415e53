// The public Region and Attachment handles, and the Connector calls that make them: argument
// checks on the calling thread, then the work on the loop (sdk/src/region_state.cpp).
#include <ferry/connector.hpp>
#include <ferry/region.hpp>

#include "loop/ids.hpp"
#include "sdk/src/core.hpp"
#include "sdk/src/options.hpp"
#include "sdk/src/region_metadata.hpp"
#include "sdk/src/region_state.hpp"
#include "sdk/src/subject_pairing.hpp"

namespace ferry {

namespace {

[[noreturn]] void empty_handle(const char* what) {
  throw Error(ErrorCode::InvalidState, std::string("empty ") + what + " handle");
}

// Runs `fn` on the loop and waits; nothing when the connector is closed (it ended everything).
template <class F>
void on_loop(detail::Core& core, F&& fn) {
  try {
    core.loop->call(std::forward<F>(fn));
  } catch (const Error& e) {
    if (e.code() != ErrorCode::InvalidState) throw;
  }
}

std::chrono::milliseconds transfer_timeout(const detail::Core& core, const TransferOptions& o) {
  if (o.timeout.count() < 0)
    throw Error(ErrorCode::InvalidArgument, "TransferOptions::timeout must not be negative");
  return o.timeout.count() > 0 ? o.timeout : core.options.default_timeout;
}

void check_tag(const std::string& tag) {
  if (tag.size() > 256)
    throw Error(ErrorCode::InvalidArgument, "a transfer's tag holds at most 256 bytes (this one " +
                                                std::to_string(tag.size()) + ")");
  if (!loop::valid_utf8(tag))
    throw Error(ErrorCode::InvalidArgument, "a transfer's tag must be UTF-8 text");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Region

Region::Region() noexcept = default;
Region::Region(std::shared_ptr<detail::RegionState> state) noexcept : state_(std::move(state)) {}
Region::Region(Region&&) noexcept = default;
Region& Region::operator=(Region&& other) noexcept {
  if (this != &other) {
    try {
      if (state_) close();
    } catch (...) {
    }
    state_ = std::move(other.state_);
  }
  return *this;
}
Region::~Region() {
  try {
    if (state_) close();
  } catch (...) {
  }
}

const detail::RegionState& Region::state() const {
  if (!state_) empty_handle("region");
  return *state_;
}

const RegionMetadata& Region::metadata() const { return state().metadata; }
const std::string& Region::id() const { return state().id_hex; }
const std::vector<Descriptor>& Region::descriptors() const { return state().local; }
bool Region::is_open() const noexcept { return state_ && state_->is_open(); }
std::optional<Error> Region::error() const { return state().error(); }
std::uint64_t Region::events_dropped() const { return state().dropped(); }

std::optional<RegionEvent> Region::next_event(std::chrono::nanoseconds timeout) {
  if (!state_) empty_handle("region");
  return state_->next_event(timeout);
}

std::vector<RegionPeer> Region::peers() const {
  if (!state_) empty_handle("region");
  std::vector<RegionPeer> out;
  on_loop(*state_->core, [&] { out = state_->peers(); });
  return out;
}

std::size_t Region::revoke(const std::string& who) {
  if (!state_) empty_handle("region");
  std::size_t n = 0;
  on_loop(*state_->core, [&] { n = state_->revoke(who); });
  return n;
}

void Region::close() {
  if (!state_) empty_handle("region");
  on_loop(*state_->core, [s = state_] {
    s->end(Error(ErrorCode::Cancelled, "the owner closed region " + s->id_hex));
  });
}

// ---------------------------------------------------------------------------------------------
// Attachment

Attachment::Attachment() noexcept = default;
Attachment::Attachment(std::shared_ptr<detail::AttachmentState> state) noexcept
    : state_(std::move(state)) {}
Attachment::Attachment(Attachment&&) noexcept = default;
Attachment& Attachment::operator=(Attachment&& other) noexcept {
  if (this != &other) {
    try {
      if (state_) detach();
    } catch (...) {
    }
    state_ = std::move(other.state_);
  }
  return *this;
}
Attachment::~Attachment() {
  try {
    if (state_) detach();
  } catch (...) {
  }
}

RegionMetadata Attachment::metadata() const {
  if (!state_) empty_handle("attachment");
  auto m = state_->metadata();
  if (!m) throw Error(ErrorCode::InvalidState, "the region's metadata is not known yet");
  return *m;
}

Attachment::State Attachment::state() const noexcept {
  return state_ ? state_->state() : State::detached;
}

std::string Attachment::method() const {
  if (!state_) empty_handle("attachment");
  return state_->method();
}

std::optional<Error> Attachment::error() const {
  if (!state_) empty_handle("attachment");
  return state_->error();
}

void Attachment::wait_attached() const {
  if (!state_) empty_handle("attachment");
  state_->wait_attached();
}

void Attachment::detach() {
  if (!state_) empty_handle("attachment");
  on_loop(*state_->core,
          [s = state_] { s->detach(Error(ErrorCode::Cancelled, "the attachment was detached")); });
}

std::vector<Operation> Attachment::submit(std::vector<Transfer> batch) {
  if (!state_) empty_handle("attachment");
  detail::Core& core = *state_->core;
  if (batch.empty()) throw Error(ErrorCode::InvalidArgument, "the batch is empty");
  const std::optional<RegionMetadata> known = state_->metadata();
  std::vector<std::shared_ptr<detail::LoopStart>> starts;
  std::vector<Operation> out;
  starts.reserve(batch.size());
  out.reserve(batch.size());
  for (std::size_t i = 0; i < batch.size(); ++i) {
    Transfer& t = batch[i];
    if (t.kind != OperationKind::read && t.kind != OperationKind::write)
      throw Error(ErrorCode::InvalidArgument,
                  "batch entry " + std::to_string(i) + " is neither a read nor a write");
    detail::check_local(t.local);
    if (t.kind == OperationKind::read) detail::check_writable(t.local, "read");
    check_tag(t.options.tag);
    const auto timeout = transfer_timeout(core, t.options);
    // With the metadata in hand, ranges outside the region are refused here, before anything
    // starts; otherwise when the attachment learns it (the operation's error).
    if (known) (void)detail::region_segments(*known, t.remote, t.local);
    auto op = std::make_shared<detail::RegionTransfer>(
        state_->core, core.next_id(), t.kind, std::move(t.local), state_, std::move(t.remote),
        std::vector<std::uint64_t>{}, std::move(t.options.tag));
    starts.push_back(std::make_shared<detail::LoopStart>(
        op, [](detail::OperationState& o) { static_cast<detail::RegionTransfer&>(o).launch(); },
        timeout));
    out.push_back(Operation(op));
  }
  core.launch(std::move(starts));
  return out;
}

namespace {

/// The most bytes a transfer may have to be copied on the calling thread (where its method
/// can: cma); larger ones go to the loop, whose copies run on libuv's pool in parallel.
constexpr std::uint64_t kDirectMax = 1u << 20;

// A small transfer of host memory on an attachment whose method copies on the calling thread:
// copied here under the attachment's credential, with no thread hop, and complete on return;
// the owner hears of it through the loop. Null when it does not apply, or the copy was refused
// or failed (the usual path then runs it, and says why).
std::shared_ptr<detail::RegionTransfer> direct_transfer(
    const std::shared_ptr<detail::AttachmentState>& att, OperationKind kind,
    const RegionMetadata& m, const std::vector<Descriptor>& local,
    std::vector<transport::Segment> segments, const std::string& tag) {
  auto direct = att->direct();
  if (!direct) return nullptr;
  std::uint64_t total = 0;
  for (const Descriptor& d : local) {
    if (d.device().kind() == DeviceKind::cuda) return nullptr;
    total += d.size();
  }
  const RegionAccess need = kind == OperationKind::read ? RegionAccess::read : RegionAccess::write;
  if (total > kDirectMax || segments.size() > direct->max_segments() ||
      !detail::region_allows(att->wanted.value_or(m.access), need))
    return nullptr;
  const auto access =
      kind == OperationKind::read ? transport::Access::read : transport::Access::write;
  if (direct->copy(access, segments)) return nullptr;
  detail::Core& core = *att->core;
  auto op = std::make_shared<detail::RegionTransfer>(att->core, core.next_id(), kind, local, att,
                                                     std::vector<RegionRange>{},
                                                     std::vector<std::uint64_t>{}, tag);
  op->completed_here(att->method());
  transport::TransferSpec spec;
  spec.access = access;
  spec.segments = std::move(segments);
  spec.region_tag = tag;
  (void)core.loop->post([att, spec = std::move(spec)] { att->notify_direct(spec); });
  return op;
}

std::shared_ptr<detail::RegionTransfer> start_transfer(
    const std::shared_ptr<detail::AttachmentState>& att, OperationKind kind,
    std::vector<RegionRange> remote, std::vector<std::uint64_t> blocks,
    std::vector<Descriptor> local, TransferOptions options) {
  detail::Core& core = *att->core;
  detail::check_local(local);
  if (kind == OperationKind::read) detail::check_writable(local, "read");
  check_tag(options.tag);
  const auto timeout = transfer_timeout(core, options);
  std::optional<RegionMetadata> known = att->metadata();
  if (known) {
    auto segments = detail::region_segments(
        *known, blocks.empty() ? remote : detail::block_ranges(*known, blocks), local);
    if (auto op = direct_transfer(att, kind, *known, local, std::move(segments), options.tag))
      return op;
  } else if (blocks.empty() && remote.empty()) {
    throw Error(ErrorCode::InvalidArgument, "the range list is empty");
  }
  auto op = std::make_shared<detail::RegionTransfer>(att->core, core.next_id(), kind,
                                                     std::move(local), att, std::move(remote),
                                                     std::move(blocks), std::move(options.tag));
  core.launch({std::make_shared<detail::LoopStart>(
      op, [](detail::OperationState& o) { static_cast<detail::RegionTransfer&>(o).launch(); },
      timeout)});
  return op;
}

void check_blocks(const std::vector<std::uint64_t>& blocks) {
  if (blocks.empty()) throw Error(ErrorCode::InvalidArgument, "the block list is empty");
}

}  // namespace

ReadOperation Attachment::read(std::vector<RegionRange> remote, std::vector<Descriptor> local,
                               TransferOptions options) {
  if (!state_) empty_handle("attachment");
  return ReadOperation(start_transfer(state_, OperationKind::read, std::move(remote), {},
                                      std::move(local), std::move(options)));
}

WriteOperation Attachment::write(std::vector<Descriptor> local, std::vector<RegionRange> remote,
                                 TransferOptions options) {
  if (!state_) empty_handle("attachment");
  return WriteOperation(start_transfer(state_, OperationKind::write, std::move(remote), {},
                                       std::move(local), std::move(options)));
}

ReadOperation Attachment::read_blocks(const std::vector<std::uint64_t>& blocks,
                                      std::vector<Descriptor> local, TransferOptions options) {
  if (!state_) empty_handle("attachment");
  check_blocks(blocks);
  return ReadOperation(start_transfer(state_, OperationKind::read, {}, blocks, std::move(local),
                                      std::move(options)));
}

WriteOperation Attachment::write_blocks(std::vector<Descriptor> local,
                                        const std::vector<std::uint64_t>& blocks,
                                        TransferOptions options) {
  if (!state_) empty_handle("attachment");
  check_blocks(blocks);
  return WriteOperation(start_transfer(state_, OperationKind::write, {}, blocks, std::move(local),
                                       std::move(options)));
}

// ---------------------------------------------------------------------------------------------
// Connector

Region Connector::create_region(std::vector<Descriptor> local, RegionOptions options) {
  detail::Core& core = this->core();
  detail::check_local(local);
  if (options.access != RegionAccess::read && options.access != RegionAccess::write &&
      options.access != RegionAccess::read_write)
    throw Error(ErrorCode::InvalidArgument, "RegionOptions::access is not a known access");
  if (options.access != RegionAccess::read) detail::check_writable(local, "create_region");
  if (options.timeout.count() < 0)
    throw Error(ErrorCode::InvalidArgument, "RegionOptions::timeout must not be negative");
  std::uint64_t total = 0;
  for (const Descriptor& d : local) total += d.size();
  if (options.block_size != 0 && total % options.block_size != 0)
    throw Error(ErrorCode::InvalidArgument, "the region's " + std::to_string(total) +
                                                " bytes are not a whole number of blocks of " +
                                                std::to_string(options.block_size));
  if (!options.subject.empty()) {
    detail::check_subject(options.subject, core.nats_prefix);
    if (!core.has_nats)
      throw Error(ErrorCode::InvalidState,
                  "serving at a subject needs the NATS side channel (NatsOptions::servers or "
                  "FERRY_NATS_URL)");
    core.require_open_side_channel("serving at a subject");
  }
  auto region = core.loop->call([&] {
    if (core.closed) throw Error(ErrorCode::InvalidState, "the connector is closed");
    auto r = std::make_shared<detail::RegionState>(core_, core.next_id(), std::move(local),
                                                   std::move(options));
    r->open();
    if (!r->options.subject.empty()) {
      try {
        detail::pairing::serve_region(core, *r);
      } catch (...) {
        r->end(Error(ErrorCode::Cancelled, "the region was refused"));
        throw;
      }
    }
    return r;
  });
  if (region->served.valid() && !core.loop->in_loop_thread())
    region->served.wait_for(core.options.nats.request_timeout);
  return Region(std::move(region));
}

namespace {

std::chrono::milliseconds attach_timeout(const detail::Core& core, const AttachOptions& o) {
  if (o.timeout.count() < 0)
    throw Error(ErrorCode::InvalidArgument, "AttachOptions::timeout must not be negative");
  if (o.timeout.count() > 0) return o.timeout;
  if (core.options.default_timeout.count() > 0) return core.options.default_timeout;
  return std::chrono::seconds(30);
}

void check_access(const std::optional<RegionAccess>& a) {
  if (a && *a != RegionAccess::read && *a != RegionAccess::write && *a != RegionAccess::read_write)
    throw Error(ErrorCode::InvalidArgument, "AttachOptions::access is not a known access");
}

}  // namespace

Attachment Connector::attach(const RegionMetadata& remote, AttachOptions options) {
  detail::Core& core = this->core();
  remote.validate();
  check_access(options.access);
  if (options.access && !detail::region_allows(remote.access, *options.access))
    throw Error(ErrorCode::KindMismatch,
                std::string("the region allows ") + to_string(remote.access) +
                    "; this attachment asked for " + to_string(*options.access));
  core.precheck(detail::operation_view(remote), transport::bit(transport::MemoryKind::host));
  const auto timeout = attach_timeout(core, options);
  auto att = std::make_shared<detail::AttachmentState>(core_, core.next_id(), options.access);
  core.loop->call([&] {
    if (core.closed) throw Error(ErrorCode::InvalidState, "the connector is closed");
    att->arm(timeout);
    try {
      att->start(remote);
    } catch (const Error& e) {
      att->detach(e);
      throw;
    }
  });
  return Attachment(std::move(att));
}

Attachment Connector::attach(const Subject& subject, AttachOptions options) {
  detail::Core& core = this->core();
  detail::check_subject(subject.name, core.nats_prefix);
  if (!core.has_nats)
    throw Error(ErrorCode::InvalidState,
                "attaching by subject needs the NATS side channel (NatsOptions::servers or "
                "FERRY_NATS_URL)");
  core.require_open_side_channel("attaching by subject");
  check_access(options.access);
  const auto timeout = attach_timeout(core, options);
  auto att = std::make_shared<detail::AttachmentState>(core_, core.next_id(), options.access);
  core.loop->call([&] {
    if (core.closed) throw Error(ErrorCode::InvalidState, "the connector is closed");
    att->arm(timeout);
    att->ask(subject.name);
  });
  return Attachment(std::move(att));
}

}  // namespace ferry
