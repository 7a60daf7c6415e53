#include "transport/same_host/link.hpp"

#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>

#include <algorithm>
#include <cerrno>

#include "transport/kit/exposures.hpp"
#include "transport/token.hpp"
#include "transport/wire/status.hpp"

namespace ferry::transport::same_host {

namespace {

using wire::FrameHeader;
using wire::FrameType;
using wire::StreamConnection;

}  // namespace

Link::Link(const Context& ctx, Client& client, std::string method, std::uint64_t id,
           const std::string& address, const OwnerInfo& info, const std::string& peer_name,
           std::uint64_t max_payload)
    : ctx_(ctx),
      client_(client),
      method_(std::move(method)),
      peer_name_(peer_name),
      max_payload_(max_payload),
      owner_(std::make_shared<OwnerProcess>()),
      pending_([this](std::uint64_t, int delta) { conn_->expect_answers(delta); }) {
  const std::string who = "peer '" + peer_name + "' (pid " + std::to_string(info.scope.pid) + ")";
  if (auto why = scope_mismatch(info.scope))
    throw Error(why->code(), method_ + ": " + who + ": " + why->message());
  owner_->pid = info.scope.pid;
  // Pin the process first: from here on its pid cannot mean another process to us.
  // (A kernel without pidfd_open gives none: the link goes on without it.)
  try {
    owner_->pidfd = open_pidfd(info.scope.pid);
  } catch (const Error& e) {
    // In our own PID namespace, PeerLost: the owner is gone, which another method cannot fix
    // either.
    Error gone(e.code(), method_ + ": no process " + std::to_string(info.scope.pid) + " for " +
                             who + " (" + e.message() + ")");
    gone.set_retryable(e.retryable());
    throw gone;
  }
  sockaddr_un addr{};
  socklen_t len = 0;
  if (!socket_address(address, addr, len))
    throw Error(ErrorCode::InvalidMetadata,
                method_ + " endpoint '" + address + "' is not an abstract socket name",
                "endpoints");
  const int sock = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (sock < 0) throw Error(ErrorCode::Internal, method_ + " socket: " + errno_text(errno));
  // A Unix socket connects at once, or not at all (EAGAIN: the owner's backlog is full).
  if (::connect(sock, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    const int err = errno;
    ::close(sock);
    throw Error(ErrorCode::PeerLost,
                "cannot connect to " + who + " at " + address + ": " + errno_text(err));
  }
  // The socket must be the named process's: metadata that names one process and the socket
  // of another would make us that other's deputy.
  ucred cred{};
  socklen_t cred_len = sizeof cred;
  if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0 ||
      cred.pid != info.scope.pid) {
    ::close(sock);
    throw Error(ErrorCode::AccessDenied, method_ + ": the socket " + address + " is not " + who +
                                             "'s (it belongs to pid " + std::to_string(cred.pid) +
                                             ")");
  }
  int grants = -1;
  try {
    grants = fetch_fd(owner_->pidfd, info.scope.pid, info.grants_fd);
  } catch (const Error& e) {
    ::close(sock);
    throw Error(e.code(), method_ + ": cannot take the grant table of " + who + ": " + e.message());
  }
  try {
    owner_->grants = std::make_unique<GrantView>(grants, info.grants_bytes);
  } catch (const Error& e) {
    ::close(sock);
    // ProtocolError: the owner's table is not what a table must be (never mapped).
    throw Error(e.code(), method_ + ": " + who + ": " + e.message());
  }
  conn_ = std::make_unique<StreamConnection>(
      ctx_.loop, static_cast<StreamConnection::Handler&>(*this), StreamConnection::Role::client,
      sock, id, address, ctx_.peer_timeout, false,
      StreamConnection::Hello{ctx_.local_name, ctx_.local_id}, ctx_.log);
  conn_->set_peer_name(peer_name);
  if (!conn_->open())
    throw Error(ErrorCode::PeerLost, "the connection to " + who + " closed at once");
  keepalive_ = loop::Timer::timer(ctx_.loop, this);
}

Link::~Link() = default;

std::string Link::describe() const {
  return "peer '" + peer_name_ + "' (pid " + std::to_string(owner_->pid) + ")";
}

std::optional<Error> Link::on_hello(StreamConnection&, const FrameHeader& hello, FrameHeader&) {
  // The owner's probe: the nonce its HELLO gives must be what this connection's probe address
  // holds in the process behind the socket. This also asks the kernel whether we may copy at
  // all (ptrace rules).
  Token seen{};
  iovec local{seen.data(), seen.size()};
  iovec remote{reinterpret_cast<void*>(hello.addr), seen.size()};
  if (::process_vm_readv(static_cast<pid_t>(owner_->pid), &local, 1, &remote, 1, 0) !=
      static_cast<ssize_t>(seen.size())) {
    const int err = errno;
    std::string why =
        method_ + ": process_vm_readv toward " + describe() + " refused: " + errno_text(err);
    if (err == EPERM)
      why +=
          " (ptrace rules: Yama's ptrace_scope, or the owner's credentials or user namespace "
          "differ from ours)";
    refusal_ = Error(err == ESRCH ? ErrorCode::PeerLost : ErrorCode::Unsupported, why);
    if (err == ESRCH) refusal_->set_retryable(false);  // the owner's process is gone
    return refusal_;
  }
  if (!tokens_equal(seen, hello.token)) {
    refusal_ = Error(ErrorCode::Unsupported, method_ + ": process " + std::to_string(owner_->pid) +
                                                 " is not " + describe() +
                                                 " (its probe does not hold the nonce)");
    return refusal_;
  }
  proven_ = true;
  std::vector<std::uint64_t> unsent = std::move(unsent_);
  unsent_.clear();
  for (std::uint64_t id : unsent)
    if (Claimant* c = client_.claimant(id)) send_claim(id, *c);
  std::vector<std::uint64_t> regions = std::move(unsent_regions_);
  unsent_regions_.clear();
  for (std::uint64_t key : regions)
    if (RegionAttach* a = client_.attaching(key)) send_attach(key, *a);
  return std::nullopt;
}

void Link::attach(std::uint64_t transfer) {
  transfers_.insert(transfer);
  if (transfers_.size() == 1 && keepalive_) {
    const auto period =
        static_cast<std::uint64_t>(std::max<long long>(1, ctx_.peer_timeout.count() / 3));
    uv_timer_start(
        keepalive_.get(),
        [](uv_timer_t* t) {
          if (t->data != nullptr) static_cast<Link*>(t->data)->keepalive();
        },
        period, period);
  }
}

void Link::detach(std::uint64_t transfer) {
  transfers_.erase(transfer);
  std::erase(unsent_, transfer);
  if (transfers_.empty() && keepalive_) uv_timer_stop(keepalive_.get());
}

void Link::keepalive() {
  // The owner waits for us while we copy under its grant: this tells it we are alive. (It
  // tells us nothing of the owner: its kernel takes these into a buffer even when the owner
  // is stopped.)
  if (!conn_->open()) return;
  FrameHeader h;
  h.type = FrameType::status;
  conn_->send(h);
}

void Link::claim(std::uint64_t transfer, Claimant& c) {
  if (!proven_) {
    unsent_.push_back(transfer);
    return;
  }
  send_claim(transfer, c);
}

void Link::send_claim(std::uint64_t transfer, Claimant& c) {
  // The ranges of the owner's memory this transfer touches: the owner checks each before it
  // grants anything.
  c.ranges = kit::claim_payload(c.transfer_spec->segments);
  c.claim_req = pending_.add(conn_->id(), Request{transfer, Kind::claim});
  FrameHeader h;
  h.type = FrameType::claim;
  h.req_id = c.claim_req;
  h.op_id = c.transfer_spec->remote_id;
  h.token = c.transfer_spec->token;
  h.flags = static_cast<std::uint16_t>(c.transfer_spec->access);
  h.len = c.ranges.size();
  conn_->send(h, {}, c.ranges.data(), transfer);
}

void Link::send_done(std::uint64_t transfer, Claimant& c, const Error* error) {
  if (c.done_sent || !conn_->open()) return;
  c.done_sent = true;
  std::erase(unsent_, transfer);
  FrameHeader h;
  h.type = FrameType::done;
  h.op_id = c.transfer_spec->remote_id;
  h.token = c.transfer_spec->token;
  h.flags = static_cast<std::uint16_t>(c.transfer_spec->access);
  std::string message;
  if (error != nullptr) {
    h.status = wire::to_wire(error->code());
    message = error->message().substr(0, wire::kMaxMessage);
  }
  if (error == nullptr && c.transfer_spec->access == Access::write)
    h.req_id = c.done_req = pending_.add(conn_->id(), Request{transfer, Kind::done});
  conn_->send(h, message);
}

void Link::attach_region(std::uint64_t key, RegionAttach& a) {
  regions_.insert(key);
  if (!proven_) {
    unsent_regions_.push_back(key);
    return;
  }
  send_attach(key, a);
}

void Link::send_attach(std::uint64_t key, RegionAttach& a) {
  a.attach_req = pending_.add(conn_->id(), Request{key, Kind::attach});
  FrameHeader h;
  h.type = FrameType::attach;
  h.req_id = a.attach_req;
  h.op_id = a.region;
  h.token = a.token;
  h.flags = static_cast<std::uint16_t>(a.access);
  conn_->send(h);
}

void Link::drop_region(std::uint64_t key, RegionAttach& a, bool detach) {
  regions_.erase(key);
  std::erase(unsent_regions_, key);
  // Its ATTACHED payload, if being received, lands nowhere now. An ATTACH still unanswered
  // stays awaited: its answer finds the attachment gone and detaches it at the owner.
  conn_->drop_sink(region_sink(key));
  if (!detach || !a.attached || !conn_->open()) return;
  FrameHeader h;
  h.type = FrameType::detach;
  h.op_id = a.attachment;
  h.token = a.secret;
  conn_->send(h);
}

void Link::send_ended(std::uint64_t transfer, Claimant& c, const Error* error) {
  if (c.done_sent || !conn_->open()) return;
  c.done_sent = true;
  (void)transfer;
  send_ended(*c.transfer_spec, error);
}

void Link::send_ended(const TransferSpec& spec, const Error* error) {
  if (!conn_->open()) return;
  FrameHeader h;
  h.type = FrameType::ended;
  h.op_id = spec.remote_id;
  h.token = spec.token;
  h.flags = static_cast<std::uint16_t>(spec.access);
  if (error != nullptr) h.status = wire::to_wire(error->code());
  // Kept by the link until it leaves: the transfer may be gone before that.
  const std::uint64_t key = kNoticeTag | next_notice_++;
  auto& ranges = notices_[key] = kit::claim_payload(spec.segments);
  h.len = ranges.size();
  conn_->send(h, spec.region_tag ? *spec.region_tag : std::string(), ranges.data(), key);
}

void Link::await_notice(Claimant& c) {
  if (c.ended_by_owner) return;
  c.ended_by_owner = true;
  conn_->expect_answers(+1);
}

void Link::release(std::uint64_t transfer, Claimant& c) {
  if (c.ended_by_owner) conn_->expect_answers(-1);
  c.ended_by_owner = false;
  pending_.forget(c.claim_req);
  pending_.forget(c.done_req);
  std::erase(unsent_, transfer);
  conn_->release(transfer);
  conn_->drop_sink(transfer);  // CLAIMED's payload being received
}

wire::Sink Link::on_frame(StreamConnection& conn, const FrameHeader& h, std::string message) {
  switch (h.type) {
    case FrameType::claimed:
      return on_claimed(h);
    case FrameType::attached:
      return on_attached(h);
    case FrameType::status:
      on_status(h, message);
      return {};
    default:
      (void)conn;
      return wire::fatal("unexpected frame type " + std::to_string(static_cast<int>(h.type)) +
                         " from a " + method_ + " server");
  }
}

wire::Sink Link::on_claimed(const FrameHeader& h) {
  if (h.len > max_payload_)
    return wire::fatal("CLAIMED with " + std::to_string(h.len) + " bytes of payload");
  const Request* r = pending_.find(h.req_id, conn_->id());
  Claimant* c = r == nullptr ? nullptr : client_.claimant(r->transfer);
  if (c == nullptr || r->kind != Kind::claim) return {};  // dropped
  c->payload.assign(h.len, std::byte{0});
  wire::Sink sink;
  sink.dest = c->payload.data();
  sink.tag = r->transfer;
  return sink;
}

wire::Sink Link::on_attached(const FrameHeader& h) {
  if (h.len > max_payload_)
    return wire::fatal("ATTACHED with " + std::to_string(h.len) + " bytes of payload");
  const Request* r = pending_.find(h.req_id, conn_->id());
  RegionAttach* a = r == nullptr ? nullptr : client_.attaching(r->transfer);
  if (a == nullptr || r->kind != Kind::attach) return {};  // dropped
  a->payload.assign(h.len, std::byte{0});
  wire::Sink sink;
  sink.dest = a->payload.data();
  sink.tag = region_sink(r->transfer);
  return sink;
}

void Link::on_payload(StreamConnection& conn, const FrameHeader& h, std::uint64_t, bool intact) {
  // Toward a client only CLAIMED and ATTACHED carry a payload: the claim is granted (the
  // attachment made) once it is whole.
  std::optional<Request> r = pending_.take(h.req_id, conn.id());
  if (!r) return;
  const Grant grant{static_cast<std::uint32_t>(h.addr), static_cast<std::uint32_t>(h.addr >> 32)};
  if (h.type == FrameType::attached) {
    RegionAttach* a = r->kind == Kind::attach ? client_.attaching(r->transfer) : nullptr;
    if (a == nullptr && r->kind == Kind::attach && conn_->open()) {
      // Detached (or given up) while its ATTACH was on the way: the owner made the attachment
      // for nobody; end it there.
      FrameHeader d;
      d.type = FrameType::detach;
      d.op_id = h.op_id;
      d.token = h.token;
      conn_->send(d);
      return;
    }
    if (a == nullptr || (!intact && h.len != 0)) return;
    if (!owner_->grants->holds(grant)) {
      conn_->fail_after_notice(wire::to_wire(ErrorCode::ProtocolError),
                               "ATTACHED names a grant outside the owner's table");
      return;
    }
    a->grant = grant;
    a->attachment = h.op_id;
    a->secret = h.token;
    a->attached = true;
    client_.region_attached(r->transfer);
    return;
  }
  Claimant* c = r->kind == Kind::claim ? client_.claimant(r->transfer) : nullptr;
  // A payload of no bytes has no sink to land in: it is whole all the same.
  if (c == nullptr || (!intact && h.len != 0)) return;
  if (!owner_->grants->holds(grant)) {
    conn_->fail_after_notice(wire::to_wire(ErrorCode::ProtocolError),
                             "CLAIMED names a grant outside the owner's table");
    return;
  }
  c->grant = grant;
  c->claimed = true;
  client_.granted(r->transfer, h.token);
}

void Link::on_status(const FrameHeader& h, const std::string& message) {
  if (h.req_id == 0 && h.op_id != 0) {
    // The owner ended operation op_id (cancelled, deadline, closed) and says why.
    const Error ended(wire::from_wire(h.status),
                      "peer " + conn_->describe_peer() +
                          " ended the operation: " + wire::reason_of(h.status, message));
    // One transfer of an operation; every transfer of an attachment, and the attachment.
    std::vector<std::uint64_t> hit;
    for (std::uint64_t id : transfers_)
      if (Claimant* c = client_.claimant(id);
          c != nullptr && c->transfer_spec->remote_id == h.op_id)
        hit.push_back(id);
    for (std::uint64_t id : hit) client_.ended(id, ended, false);
    std::vector<std::uint64_t> regions;
    for (std::uint64_t key : regions_)
      if (RegionAttach* a = client_.attaching(key); a != nullptr && a->attachment == h.op_id)
        regions.push_back(key);
    for (std::uint64_t key : regions) client_.region_ended(key, ended, false);
    return;
  }
  if (h.req_id == 0) {
    conn_->set_notice(h.status, message);
    return;
  }
  std::optional<Request> r = pending_.take(h.req_id, conn_->id());
  if (r && r->kind == Kind::attach) {
    if (h.status == 0 || client_.attaching(r->transfer) == nullptr) return;
    client_.region_ended(
        r->transfer,
        Error(wire::from_wire(h.status),
              "peer " + conn_->describe_peer() + " refused: " + wire::reason_of(h.status, message)),
        false);
    return;
  }
  if (!r || client_.claimant(r->transfer) == nullptr) return;
  if (h.status == 0) {
    if (r->kind == Kind::done) client_.ended(r->transfer, std::nullopt, false);
    return;
  }
  client_.ended(r->transfer,
                Error(wire::from_wire(h.status), "peer " + conn_->describe_peer() + " refused: " +
                                                     wire::reason_of(h.status, message)),
                false);
}

void Link::on_closed(StreamConnection& conn, const std::string& reason) {
  const std::string who = conn.describe_peer();
  const Error error =
      refusal_ ? *refusal_
      : conn.notice().empty()
          ? Error(ErrorCode::PeerLost, "connection to peer " + who + " lost: " + reason)
          : Error(wire::from_wire(conn.notice_status()),
                  "peer " + who + " closed the connection: " + conn.notice());
  keepalive_.reset();
  pending_.drop_connection(conn.id());
  std::vector<std::uint64_t> on_it(transfers_.begin(), transfers_.end());
  for (std::uint64_t id : on_it)
    if (Claimant* c = client_.claimant(id))
      // Before the claim was granted, nothing of either side's memory was touched.
      client_.ended(id, error, /*setup=*/!c->claimed);
  std::vector<std::uint64_t> regions(regions_.begin(), regions_.end());
  regions_.clear();
  for (std::uint64_t key : regions)
    if (RegionAttach* a = client_.attaching(key))
      client_.region_ended(key, error, /*setup=*/!a->attached && !conn.greeted());
  client_.link_closed(*this);
}

}  // namespace ferry::transport::same_host
