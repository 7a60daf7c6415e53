#include "tests/support/fake_transport.hpp"

#include <algorithm>
#include <charconv>
#include <cstring>

#include "loop/ids.hpp"
#include "loop/uv_handle.hpp"
#include "sdk/src/transport_registry.hpp"
#include "transport/kit/remote_region.hpp"

namespace ferry::test {

using transport::Access;
using transport::AttachObserver;
using transport::AttachSpec;
using transport::Exposure;
using transport::ExposureObserver;
using transport::Region;
using transport::Registration;
using transport::Segment;
using transport::Token;
using transport::Transfer;
using transport::TransferObserver;
using transport::TransferSpec;
using transport::kit::Exposures;
using transport::kit::Regions;

// ---------------------------------------------------------------------------------------
// The fabric: every live transport's mailbox by its number.

/// Where other threads leave work for one transport: a queue drained on its loop by a
/// uv_async handle. Posting is safe from any thread until close() has taken the handle away;
/// then it refuses, so a sender learns at once that the peer is gone.
struct FakeMailbox : std::enable_shared_from_this<FakeMailbox> {
  using Task = std::function<void(FakeTransport&)>;

  std::uint64_t id = 0;
  std::mutex mu;
  uv_async_t* async = nullptr;  // guarded by mu; null once the owner closed
  std::vector<Task> queue;      // guarded by mu
  /// Every mailbox that posted here or was posted to from here: told when this one closes.
  /// Kept under mu with the queue, so that a sender whose post succeeded is always told.
  std::map<std::uint64_t, std::weak_ptr<FakeMailbox>> contacts;  // guarded by mu
  FakeTransport* owner = nullptr;                                // the owner's loop thread only

  bool post(Task task, std::uint64_t from, const std::weak_ptr<FakeMailbox>& from_box) {
    std::lock_guard lock(mu);
    if (async == nullptr) return false;
    queue.push_back(std::move(task));
    if (from != 0 && !from_box.expired()) contacts.try_emplace(from, from_box);
    uv_async_send(async);
    return true;
  }

  void remember(std::uint64_t peer, const std::weak_ptr<FakeMailbox>& box) {
    std::lock_guard lock(mu);
    if (async != nullptr) contacts.try_emplace(peer, box);
  }

  static void on_async(uv_async_t* handle) {
    auto* raw = static_cast<FakeMailbox*>(handle->data);
    if (raw == nullptr) return;
    auto self = raw->shared_from_this();
    std::vector<Task> tasks;
    {
      std::lock_guard lock(self->mu);
      tasks.swap(self->queue);
    }
    for (auto& task : tasks) {
      if (self->owner == nullptr) break;  // closed by an earlier task of this batch
      loop::guarded(loop::Log{}, "fake transport", [&] { task(*self->owner); });
    }
  }
};

namespace {

struct Fabric {
  std::mutex mu;
  std::uint64_t next = 1;
  std::unordered_map<std::uint64_t, std::weak_ptr<FakeMailbox>> boxes;
};

Fabric& fabric() {
  static Fabric* f = new Fabric;  // never destroyed: transports may close during exit
  return *f;
}

std::shared_ptr<FakeMailbox> find_box(std::uint64_t id) {
  Fabric& f = fabric();
  std::lock_guard lock(f.mu);
  auto it = f.boxes.find(id);
  return it == f.boxes.end() ? nullptr : it->second.lock();
}

// "fake:<n>" -> n; 0 for anything else.
std::uint64_t parse_address(const std::string& address) {
  constexpr std::string_view prefix = "fake:";
  if (address.size() <= prefix.size() || address.compare(0, prefix.size(), prefix) != 0) return 0;
  std::uint64_t n = 0;
  const char* begin = address.data() + prefix.size();
  const char* end = address.data() + address.size();
  auto [ptr, ec] = std::from_chars(begin, end, n);
  if (ec != std::errc() || ptr != end || *begin == '+') return 0;
  return n;
}

std::string kinds_text(std::uint8_t kinds) {
  std::string out;
  if ((kinds & transport::bit(transport::MemoryKind::host)) != 0) out += "host";
  if ((kinds & transport::bit(transport::MemoryKind::cuda)) != 0)
    out += out.empty() ? "cuda" : "+cuda";
  return out.empty() ? "no" : out;
}

}  // namespace

void FakeControl::set_policy(const FaultPolicy& policy) {
  std::lock_guard lock(mu_);
  policy_ = policy;
}

FaultPolicy FakeControl::policy() const {
  std::lock_guard lock(mu_);
  return policy_;
}

// ---------------------------------------------------------------------------------------
// Messages between transports: values only, never a pointer into the sender.

struct FakeTransport::Request {
  std::uint64_t from = 0;  ///< the sender's number: the "connection" an exposure binds to
  std::string from_name;
  std::string from_id;  ///< the sender's connector id (16 hex digits), or empty
  std::uint64_t transfer = 0;
  std::uint64_t req = 0;  ///< 0: a notice nobody waits for
  std::uint64_t op = 0;
  Token token{};
  Access access = Access::read;
  std::uint64_t addr = 0;
  std::uint64_t len = 0;
  std::vector<std::byte> bytes;  ///< a write's payload, copied on the sender's loop; ENDED's ranges
  bool done = false;             ///< DONE: the sender finished (with `error`: failed)
  std::optional<Error> error;
  /// With `done`: an ENDED instead, a transfer on attachment `op` ended; its tag for the owner,
  /// and `bytes` the ranges it reached, as kit::claim_payload writes them.
  std::optional<std::string> tag;
};

struct FakeTransport::Reply {
  std::uint64_t transfer = 0;
  std::uint64_t req = 0;
  std::optional<Error> refusal;  ///< the owner's code and message
  std::vector<std::byte> bytes;  ///< a read's payload, copied on the owner's loop
  std::optional<Token> secret;   ///< the claim's secret, to the claimant alone
};

/// An active transfer: one chunk requested at a time.
class FakeTransfer final : public Transfer {
 public:
  FakeTransfer(FakeTransport& transport, std::uint64_t transfer_id, TransferSpec what,
               TransferObserver& obs)
      : owner(&transport), id(transfer_id), spec(std::move(what)), observer(&obs) {}
  ~FakeTransfer() override {
    if (owner != nullptr) owner->forget(*this);
  }
  void cancel(const Error& reason) override {
    if (owner != nullptr) owner->cancel_transfer(*this, reason);
  }
  std::optional<Token> claim_secret() const override { return secret; }

  FakeTransport* owner;  // null once the transport let go of it
  std::uint64_t id;
  TransferSpec spec;
  TransferObserver* observer;
  std::uint64_t peer = 0;  // the owner's number; 0 until it was found
  std::string peer_desc;
  std::size_t seg = 0;
  std::uint64_t seg_off = 0;
  std::uint64_t req = 0;  // the request whose answer is awaited; 0: none
  FakeTransport::Waiting waiting = FakeTransport::Waiting::none;
  std::byte* chunk_local = nullptr;
  std::uint64_t chunk_len = 0;
  std::uint64_t chunks = 0;
  bool finished = false;  // succeeded or failed: nothing more is sent or copied for it
  bool notified = false;
  std::optional<Token> secret;
};

/// An attachment to a peer's region, the active side: see the file comment.
class FakeRemoteRegion final : public transport::kit::RemoteRegionBase {
 public:
  FakeRemoteRegion(FakeTransport& transport, std::uint64_t region_key, AttachSpec what,
                   AttachObserver& obs)
      : RemoteRegionBase(transport.defer_, std::move(what), obs),
        owner(&transport),
        key(region_key) {}
  ~FakeRemoteRegion() override {
    if (owner != nullptr) owner->forget_region(*this);
  }
  std::unique_ptr<Transfer> start(TransferSpec s, TransferObserver& obs) override {
    check_attached();
    if (owner == nullptr) throw Error(ErrorCode::InvalidState, "the transport is closed");
    if (auto refused = refuse_outside(s, obs)) return refused;
    s.remote_id = attachment;
    s.token = secret;
    s.endpoint = spec().endpoint;
    s.peer_name = spec().peer_name;
    if (!s.region_tag) s.region_tag = std::string();
    return owner->start(std::move(s), obs);
  }

  FakeTransport* owner;  // null once the transport let go of it
  const std::uint64_t key;
  std::uint64_t peer = 0;  // the owner's number; 0 until it was found
  std::string peer_desc;
  std::uint64_t attachment = 0;  // its id at the owner, once attached
  Token secret{};
};

// ---------------------------------------------------------------------------------------

FakeTransport::FakeTransport(uv_loop_t* loop, Defer defer, Options options)
    : loop_(loop),
      defer_(defer),
      options_(std::move(options)),
      exposures_(options_.method, std::move(defer)),
      regions_(options_.method, exposures_, defer_) {
  if (options_.chunk_size == 0)
    throw Error(ErrorCode::InvalidArgument, "fake: chunk_size must be positive");
  caps_.method = options_.method;
  caps_.rank = options_.rank;
  caps_.memory_kinds = options_.memory_kinds;
  caps_.same_host_only = options_.same_host_only;
  caps_.passive_cpu_free = false;

  box_ = std::make_shared<FakeMailbox>();
  box_->owner = this;
  box_->async = new uv_async_t{};
  uv_async_init(loop_, box_->async, &FakeMailbox::on_async);
  box_->async->data = box_.get();
  Fabric& f = fabric();
  std::lock_guard lock(f.mu);
  id_ = f.next++;
  box_->id = id_;
  f.boxes[id_] = box_;
  address_ = "fake:" + std::to_string(id_);
}

FakeTransport::~FakeTransport() { close(); }

std::vector<Endpoint> FakeTransport::endpoints() const {
  return {Endpoint{caps_.method, address_, {}}};
}

FaultPolicy FakeTransport::policy() const {
  return options_.control ? options_.control->policy() : FaultPolicy{};
}

void FakeTransport::close() {
  if (closed_) return;
  closed_ = true;
  life_.reset();
  for (auto& [id, t] : transfers_) {
    t->finished = true;
    t->owner = nullptr;
  }
  transfers_.clear();
  for (auto& [key, region] : remote_regions_) region->owner = nullptr;
  remote_regions_.clear();
  regions_.clear();
  exposures_.clear();
  std::map<std::uint64_t, std::weak_ptr<FakeMailbox>> contacts;
  std::vector<FakeMailbox::Task> dropped;
  {
    std::lock_guard lock(box_->mu);
    box_->async->data = nullptr;
    loop::close_and_delete(box_->async);
    box_->async = nullptr;
    dropped.swap(box_->queue);
    contacts.swap(box_->contacts);
  }
  box_->owner = nullptr;
  {
    Fabric& f = fabric();
    std::lock_guard lock(f.mu);
    f.boxes.erase(id_);
  }
  // Every transport this one talked to learns that the link is gone, as a closed socket
  // would tell it: its transfers toward us fail, its exposures we claimed are lost.
  for (auto& [peer, weak] : contacts)
    if (auto box = weak.lock())
      box->post([me = id_](FakeTransport& t) { t.lose_peer(me, "the peer closed"); }, 0, {});
}

bool FakeTransport::send(std::uint64_t to, std::function<void(FakeTransport&)> task) {
  auto box = find_box(to);
  if (!box) return false;
  box_->remember(to, box);
  return box->post(std::move(task), id_, box_);
}

// ---------------------------------------------------------------------------------------
// The owner's side

std::shared_ptr<const Registration> FakeTransport::register_memory(const Region& region) {
  if (!caps_.moves(region.kind))
    throw Error(ErrorCode::Unsupported,
                caps_.method + " moves " + kinds_text(caps_.memory_kinds) + " memory only");
  return registrations_.acquire(region);
}

std::string FakeTransport::expose(const Exposure& exposure, ExposureObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  exposures_.add(exposure, observer);
  return {};
}

void FakeTransport::revoke(std::uint64_t id, const Error& reason) {
  // Memory is copied only on this loop, under a check: once the entry is gone, no later
  // request touches it. A claimant with requests under way is answered with the reason.
  if (std::uint64_t bound = exposures_.revoke(id); bound != 0) tell_revoked(bound, id, reason);
}

void FakeTransport::tell_revoked(std::uint64_t peer, std::uint64_t id, const Error& reason) {
  send(peer, [me = id_, id, reason](FakeTransport& t) { t.on_revoked(me, id, reason); });
}

std::string FakeTransport::describe_peer(std::uint64_t peer) const {
  auto it = peers_.find(peer);
  const std::string address = "fake:" + std::to_string(peer);
  if (it == peers_.end() || it->second.name.empty()) return "at " + address;
  return "'" + it->second.name + "' at " + address;
}

std::optional<Token> FakeTransport::claim(Exposures::Entry& entry, std::uint64_t peer) {
  const Peer& p = peers_[peer];
  return exposures_.claim(entry, peer, p.name, describe_peer(peer), p.id);
}

void FakeTransport::answer(std::uint64_t to, Reply reply) {
  const bool delivered = send(to, [me = id_, r = std::move(reply)](FakeTransport& t) mutable {
    t.on_reply(me, std::move(r));
  });
  if (!delivered) lose_peer(to, "the peer is gone");
}

void FakeTransport::refuse(const Request& r, ErrorCode code, const std::string& message) {
  if (r.req == 0) return;
  Reply reply;
  reply.transfer = r.transfer;
  reply.req = r.req;
  reply.refusal = Error(code, message);
  answer(r.from, std::move(reply));
}

void FakeTransport::serve(Request r) {
  // Every request names its sender, as tcp's HELLO does once per connection.
  peers_[r.from] = Peer{r.from_name, r.from_id};
  if (r.done && r.tag) {
    serve_ended(r);
    return;
  }
  if (r.done && regions_.is_attachment(r.op)) {
    // A transfer on an attachment ends with ENDED; the attachment with DETACH.
    refuse(r, ErrorCode::ProtocolError, "DONE names an attachment");
    return;
  }
  if (r.done) {
    serve_done(r);
    return;
  }
  const char* what = r.access == Access::read ? "read" : "write";
  if (r.len == 0 || r.len > options_.max_request) {
    refuse(r, ErrorCode::AccessDenied,
           std::string(what) + " of " + std::to_string(r.len) + " bytes: requests take 1 to " +
               std::to_string(options_.max_request) + " bytes");
    return;
  }
  auto v = exposures_.check(r.op, r.token, r.access, r.addr, r.len, r.from);
  if (!v.ok()) {
    refuse(r, v.code, v.message);
    return;
  }
  if (r.access == Access::write && r.bytes.size() != r.len) {
    refuse(r, ErrorCode::ProtocolError, "write payload does not match its length");
    return;
  }
  Reply reply;
  reply.transfer = r.transfer;
  reply.req = r.req;
  reply.secret = claim(*v.entry, r.from);
  if (r.access == Access::read) {
    reply.bytes.assign(v.ptr, v.ptr + r.len);
  } else {
    std::memcpy(v.ptr, r.bytes.data(), r.len);
    // An attachment is never done: what it wrote is not counted (and would only grow).
    if (!regions_.is_attachment(r.op)) exposures_.landed(r.op, r.addr, r.len);
  }
  if (options_.control) ++options_.control->chunks_served_;
  answer(r.from, std::move(reply));
}

void FakeTransport::serve_done(Request& r) {
  auto v = exposures_.check(r.op, r.token, r.access, 0, 0, r.from);
  if (!v.ok()) {
    refuse(r, v.code, v.message);
    return;
  }
  std::optional<Token> secret = claim(*v.entry, r.from);
  const std::string who = describe_peer(r.from);
  if (!r.error && r.access == Access::write) {
    // Complete only when every exposed byte was written at least once: bytes written twice
    // do not count twice.
    const std::uint64_t exposed = exposures_.exposed(r.op);
    const std::uint64_t written = exposures_.written(r.op);
    if (written < exposed) {
      const std::string why = "peer " + who + " said it was done after writing " +
                              std::to_string(written) + " of " + std::to_string(exposed) + " bytes";
      refuse(r, ErrorCode::ProtocolError, why);
      exposures_.finish(r.op, Error(ErrorCode::ProtocolError, why));
      return;
    }
  }
  if (r.req != 0) {
    Reply reply;
    reply.transfer = r.transfer;
    reply.req = r.req;
    reply.secret = secret;
    answer(r.from, std::move(reply));
  }
  if (!r.error) {
    exposures_.finish(r.op, std::nullopt);
    return;
  }
  const ErrorCode code = r.error->code();
  const std::string& message = r.error->message();
  exposures_.finish(r.op,
                    Error(code, "peer " + who + " ended the transfer: " +
                                    (message.empty() ? std::string(to_string(code)) : message)));
}

// ---------------------------------------------------------------------------------------
// The active side

std::unique_ptr<Transfer> FakeTransport::start(TransferSpec spec, TransferObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  if (options_.control) ++options_.control->setup_attempts_;
  const std::uint64_t peer = parse_address(spec.endpoint.address);
  if (peer == 0)
    throw Error(ErrorCode::InvalidMetadata,
                caps_.method + " endpoint '" + spec.endpoint.address + "' is not fake:<number>",
                "endpoints");
  const FaultPolicy faults = policy();
  const std::string refused = caps_.method + ": set-up refused by the test's fault policy";
  if (faults.setup == FaultPolicy::Setup::throw_error) throw Error(faults.setup_code, refused);

  auto t = std::make_unique<FakeTransfer>(*this, next_transfer_++, std::move(spec), observer);
  transfers_[t->id] = t.get();
  t->peer_desc = "'" + t->spec.peer_name + "' at " + t->spec.endpoint.address;
  if (faults.setup == FaultPolicy::Setup::report_failure) {
    finish(*t, Error(faults.setup_code, refused), true);
    return t;
  }
  if (!find_box(peer)) {
    // Nothing was touched: another method may still reach the peer.
    finish(*t,
           Error(ErrorCode::PeerLost,
                 "cannot connect to peer " + t->peer_desc + ": no fake transport there"),
           true);
    return t;
  }
  t->peer = peer;
  pump(*t);
  return t;
}

void FakeTransport::pump(FakeTransfer& t) {
  if (t.finished || t.req != 0) return;
  const FaultPolicy faults = policy();
  if (faults.stall_after_chunks != 0 && t.chunks >= faults.stall_after_chunks) return;
  const bool writing = t.spec.access == Access::write;
  while (t.seg < t.spec.segments.size() && t.spec.segments[t.seg].len == 0) ++t.seg;

  Request r = request_from_me();
  r.transfer = t.id;
  r.op = t.spec.remote_id;
  r.token = t.spec.token;
  r.access = t.spec.access;
  bool read_done = false;
  if (t.seg < t.spec.segments.size()) {
    const Segment& s = t.spec.segments[t.seg];
    const std::uint64_t len = std::min(options_.chunk_size, s.len - t.seg_off);
    r.addr = s.remote_addr + t.seg_off;
    r.len = len;
    r.req = next_req_++;
    t.chunk_local = s.local + t.seg_off;
    t.chunk_len = len;
    // The local memory is read here, on this loop: a cancel() later cannot race with it.
    if (writing) r.bytes.assign(t.chunk_local, t.chunk_local + len);
    t.waiting = Waiting::chunk;
    t.seg_off += len;
    if (t.seg_off == s.len) {
      ++t.seg;
      t.seg_off = 0;
    }
  } else {
    // Every chunk is in place. A write waits for the owner's DONE answer (it checks that
    // every byte was written); a read is complete now, and the owner may let go. On an
    // attachment the same, by ENDED: the answer to a write's says its bytes are in.
    r.done = true;
    if (t.spec.region_tag) {
      r.tag = *t.spec.region_tag;
      r.bytes = transport::kit::claim_payload(t.spec.segments);
    }
    if (writing) {
      r.req = next_req_++;
      t.waiting = Waiting::done;
    } else {
      read_done = true;
    }
  }
  t.req = r.req;
  const bool posted =
      send(t.peer, [r = std::move(r)](FakeTransport& owner) mutable { owner.serve(std::move(r)); });
  if (!posted) {
    finish(t, Error(ErrorCode::PeerLost,
                    "connection to peer " + t.peer_desc + " lost: the peer is gone"));
    return;
  }
  if (read_done) finish(t, std::nullopt);
}

void FakeTransport::on_reply(std::uint64_t from, Reply r) {
  auto it = transfers_.find(r.transfer);
  if (it == transfers_.end()) return;  // cancelled since: its bytes are dropped
  FakeTransfer& t = *it->second;
  if (t.finished || t.peer != from || t.req == 0 || t.req != r.req) return;
  t.req = 0;
  if (r.secret && !t.secret) t.secret = r.secret;
  if (r.refusal) {
    const ErrorCode code = r.refusal->code();
    const std::string& message = r.refusal->message();
    Error refused(code, "peer " + t.peer_desc + " refused: " +
                            (message.empty() ? std::string(to_string(code)) : message));
    const bool chunk = t.waiting == Waiting::chunk;
    finish(t, refused);
    // The owner learns that this peer gave up, instead of waiting for its deadline.
    if (chunk) send_done_notice(t, refused);
    return;
  }
  if (t.waiting == Waiting::done) {
    finish(t, std::nullopt);
    return;
  }
  if (t.spec.access == Access::read) {
    if (r.bytes.size() != t.chunk_len) {
      finish(t, Error(ErrorCode::ProtocolError, "peer " + t.peer_desc + " answered a read of " +
                                                    std::to_string(t.chunk_len) + " bytes with " +
                                                    std::to_string(r.bytes.size())));
      return;
    }
    std::memcpy(t.chunk_local, r.bytes.data(), t.chunk_len);
  }
  ++t.chunks;
  const FaultPolicy faults = policy();
  if (faults.drop_after_chunks != 0 && t.chunks >= faults.drop_after_chunks) {
    drop_link("fake:" + std::to_string(t.peer), "dropped by the test's fault policy");
    return;
  }
  pump(t);
}

void FakeTransport::on_revoked(std::uint64_t from, std::uint64_t op, const Error& reason) {
  for (auto& [id, t] : transfers_) {
    if (t->finished || t->peer != from || t->spec.remote_id != op) continue;
    finish(*t, Error(reason.code(), "peer " + t->peer_desc + " refused: " + reason.message()));
  }
  for (auto& [key, region] : remote_regions_)
    if (region->peer == from && region->attachment == op)
      region->on_ended(Error(reason.code(), "peer " + region->peer_desc +
                                                " ended the attachment: " + reason.message()));
}

void FakeTransport::send_done_notice(FakeTransfer& t, const Error& error) {
  if (t.peer == 0) return;
  Request r = request_from_me();
  r.transfer = t.id;
  r.op = t.spec.remote_id;
  r.token = t.spec.token;
  r.access = t.spec.access;
  r.done = true;
  r.error = error;
  if (t.spec.region_tag) {
    r.tag = *t.spec.region_tag;
    r.bytes = transport::kit::claim_payload(t.spec.segments);
  }
  send(t.peer, [r = std::move(r)](FakeTransport& owner) mutable { owner.serve(std::move(r)); });
}

void FakeTransport::finish(FakeTransfer& t, std::optional<Error> error, bool setup) {
  if (t.finished) return;
  t.finished = true;
  t.req = 0;
  defer_([this, life = std::weak_ptr<int>(life_), id = t.id, error = std::move(error), setup] {
    if (life.expired()) return;
    auto it = transfers_.find(id);
    if (it == transfers_.end() || it->second->notified) return;
    FakeTransfer& tr = *it->second;
    tr.notified = true;
    // The observer may destroy the transfer: nothing of it is touched after the call.
    TransferObserver* observer = tr.observer;
    if (!error)
      observer->on_transfer_complete();
    else if (setup)
      observer->on_transfer_setup_failed(*error);
    else
      observer->on_transfer_failed(*error);
  });
}

void FakeTransport::cancel_transfer(FakeTransfer& t, const Error& reason) {
  if (!t.finished) {
    finish(t, reason);  // forget() below drops the observer call
    send_done_notice(t, reason);
  }
  forget(t);
}

void FakeTransport::forget(FakeTransfer& t) {
  if (!t.finished) {
    cancel_transfer(t, Error(ErrorCode::Cancelled, "the operation was destroyed"));
    return;
  }
  transfers_.erase(t.id);
  t.owner = nullptr;
}

// ---------------------------------------------------------------------------------------
// Regions, the owner's side

std::string FakeTransport::serve_region(const transport::RegionExposure& region,
                                        transport::RegionObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  regions_.add(region, observer);
  return {};
}

void FakeTransport::serve_attach(std::uint64_t from, const Peer& who, std::uint64_t key,
                                 std::uint64_t region, const Token& token, Access access) {
  peers_[from] = who;
  Regions::Verdict v = regions_.attach(region, token, static_cast<std::uint16_t>(access), from,
                                       who.name, describe_peer(from), who.id);
  std::optional<Error> refusal;
  if (!v.ok()) refusal = Error(v.code, v.message);
  const bool delivered =
      send(from, [me = id_, key, att = v.attachment, secret = v.secret, refusal](FakeTransport& t) {
        t.on_attach_answer(me, key, att, secret, refusal);
      });
  if (!delivered) lose_peer(from, "the peer is gone");
}

void FakeTransport::serve_ended(Request& r) {
  std::optional<Error> outcome;
  if (r.error) {
    const std::string& message = r.error->message();
    outcome = Error(r.error->code(),
                    "peer " + describe_peer(r.from) + " ended the transfer: " +
                        (message.empty() ? std::string(to_string(r.error->code())) : message));
  }
  Regions::Verdict v =
      regions_.ended(r.op, r.token, static_cast<std::uint16_t>(r.access), std::move(outcome),
                     std::move(*r.tag), r.bytes.data(), r.bytes.size(), r.from);
  if (r.req == 0) return;  // a notice: nobody waits for the answer
  if (!v.ok()) {
    refuse(r, v.code, v.message);
    return;
  }
  Reply reply;
  reply.transfer = r.transfer;
  reply.req = r.req;
  answer(r.from, std::move(reply));
}

void FakeTransport::serve_detach(std::uint64_t from, std::uint64_t attachment,
                                 const Token& secret) {
  regions_.detach(attachment, secret, from);
}

void FakeTransport::revoke_attachment(std::uint64_t attachment, const Error& reason) {
  // As revoke(): once the attachment's exposure is gone, no later chunk touches the memory.
  if (!regions_.is_attachment(attachment)) return;
  if (std::uint64_t peer = regions_.revoke(attachment); peer != 0)
    tell_revoked(peer, attachment, reason);
}

std::vector<std::uint64_t> FakeTransport::attachments_of_peer(std::uint64_t id,
                                                              const std::string& peer_id) const {
  return regions_.attachments_of_peer(id, peer_id);
}

void FakeTransport::end_region(std::uint64_t id, const Error& reason) {
  for (const auto& [attachment, peer] : regions_.end(id))
    if (peer != 0) tell_revoked(peer, attachment, reason);
}

// ---------------------------------------------------------------------------------------
// Regions, the active side

FakeTransport::Request FakeTransport::request_from_me() const {
  Request r;
  r.from = id_;
  r.from_name = options_.local_name;
  r.from_id = options_.local_id != 0 ? loop::hex16(options_.local_id) : std::string();
  return r;
}

std::unique_ptr<transport::RemoteRegion> FakeTransport::attach(AttachSpec spec,
                                                               AttachObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  const std::uint64_t peer = parse_address(spec.endpoint.address);
  if (peer == 0)
    throw Error(ErrorCode::InvalidMetadata,
                caps_.method + " endpoint '" + spec.endpoint.address + "' is not fake:<number>",
                "endpoints");
  const FaultPolicy faults = policy();
  const std::string refused = caps_.method + ": set-up refused by the test's fault policy";
  if (faults.setup == FaultPolicy::Setup::throw_error) throw Error(faults.setup_code, refused);

  auto region =
      std::make_unique<FakeRemoteRegion>(*this, next_region_++, std::move(spec), observer);
  remote_regions_[region->key] = region.get();
  region->peer_desc = "'" + region->spec().peer_name + "' at " + region->spec().endpoint.address;
  if (faults.setup == FaultPolicy::Setup::report_failure) {
    region->on_lost(Error(faults.setup_code, refused), /*setup=*/true);
    return region;
  }
  const Request me = request_from_me();
  const bool posted =
      send(peer, [from = me.from, who = Peer{me.from_name, me.from_id}, key = region->key,
                  id = region->spec().region, token = region->spec().token,
                  access = region->spec().access](FakeTransport& owner) {
        owner.serve_attach(from, who, key, id, token, access);
      });
  if (!posted) {
    region->on_lost(Error(ErrorCode::PeerLost, "cannot connect to peer " + region->peer_desc +
                                                   ": no fake transport there"),
                    /*setup=*/true);
    return region;
  }
  region->peer = peer;
  return region;
}

void FakeTransport::on_attach_answer(std::uint64_t from, std::uint64_t key,
                                     std::uint64_t attachment, const Token& secret,
                                     const std::optional<Error>& refusal) {
  auto it = remote_regions_.find(key);
  if (it == remote_regions_.end() || it->second->peer != from) {
    // Given up while its ATTACH was on the way: end the attachment the owner made for nobody.
    if (!refusal)
      send(from, [me = id_, attachment, secret](FakeTransport& owner) {
        owner.serve_detach(me, attachment, secret);
      });
    return;
  }
  FakeRemoteRegion& region = *it->second;
  if (refusal) {
    const std::string& message = refusal->message();
    region.on_refused(Error(
        refusal->code(),
        "peer " + region.peer_desc +
            " refused: " + (message.empty() ? std::string(to_string(refusal->code())) : message)));
    return;
  }
  region.attachment = attachment;
  region.secret = secret;
  region.on_attach();
}

void FakeTransport::forget_region(FakeRemoteRegion& region) {
  remote_regions_.erase(region.key);
  region.owner = nullptr;
  if (region.peer == 0 || !region.attached()) return;
  // Its transfers still under way end as cancel() ends them (no observer call follows, the
  // owner hears each one ended), then the owner hears the DETACH behind them.
  const Error reason(ErrorCode::Cancelled, "the attachment was detached");
  for (auto& [id, t] : transfers_) {
    if (t->finished || t->peer != region.peer || !t->spec.region_tag ||
        t->spec.remote_id != region.attachment)
      continue;
    finish(*t, reason);
    t->notified = true;  // the deferred report finds it told already
    send_done_notice(*t, reason);
  }
  send(region.peer, [me = id_, attachment = region.attachment, secret = region.secret](
                        FakeTransport& owner) { owner.serve_detach(me, attachment, secret); });
}

// ---------------------------------------------------------------------------------------
// Links

void FakeTransport::lose_peer(std::uint64_t peer, const std::string& why) {
  for (auto& [id, t] : transfers_)
    if (!t->finished && t->peer == peer)
      finish(*t,
             Error(ErrorCode::PeerLost, "connection to peer " + t->peer_desc + " lost: " + why));
  for (auto& [key, region] : remote_regions_)
    if (region->peer == peer)
      region->on_lost(
          Error(ErrorCode::PeerLost, "connection to peer " + region->peer_desc + " lost: " + why),
          /*setup=*/false);
  exposures_.lose_connection(
      peer, Error(ErrorCode::PeerLost, "peer " + describe_peer(peer) + " disconnected: " + why));
}

void FakeTransport::drop_link(const std::string& address, const std::string& why) {
  const std::uint64_t peer = parse_address(address);
  if (peer == 0) return;
  lose_peer(peer, why);
  send(peer, [me = id_, why](FakeTransport& t) { t.lose_peer(me, why); });
}

// ---------------------------------------------------------------------------------------
// Factory

FakeTransportFactory::FakeTransportFactory(FakeTransport::Options base) : method_(base.method) {
  transport::Method method;
  method.name = base.method;
  method.rank = base.rank;
  method.moves = base.memory_kinds;
  method.serves = base.memory_kinds;
  method.same_host_only = base.same_host_only;
  method.make = [base, control = control_, available = available_](
                    const transport::Context& context,
                    const ConnectorOptions&) -> std::unique_ptr<transport::Transport> {
    if (!available->load()) throw Error(ErrorCode::Unsupported, "switched off by the test");
    FakeTransport::Options o = base;
    o.local_name = context.local_name;
    o.local_id = context.local_id;
    o.control = control;
    ++control->made_;
    return std::make_unique<FakeTransport>(context.loop, context.defer, std::move(o));
  };
  detail::add_method(std::move(method));
}

FakeTransportFactory::~FakeTransportFactory() { detail::remove_method(method_); }

}  // namespace ferry::test
