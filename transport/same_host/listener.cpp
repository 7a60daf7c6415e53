#include "transport/same_host/listener.hpp"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include <ferry/rdma_metadata.hpp>

#include "loop/ids.hpp"
#include "transport/same_host/owner_info.hpp"
#include "transport/same_host/system.hpp"
#include "transport/token.hpp"
#include "transport/wire/status.hpp"

namespace ferry::transport::same_host {

namespace {

using wire::FrameHeader;
using wire::FrameType;
using wire::StreamConnection;

/// The tag of exposure `id`'s CLAIMED frame, whose payload lives in its claim (operation ids
/// never have bit 63).
constexpr std::uint64_t claimed_tag(std::uint64_t id) noexcept { return id | (1ull << 63); }

int listen_on(const std::string& address) {
  sockaddr_un addr{};
  socklen_t len = 0;
  socket_address(address, addr, len);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(ErrorCode::Internal, "same-host socket: " + errno_text(errno));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    const int err = errno;
    ::close(fd);
    throw Error(ErrorCode::Internal, "cannot listen on " + address + ": " + errno_text(err));
  }
  return fd;
}

}  // namespace

Listener::Listener(const Context& ctx, std::string method, const std::string& prefix,
                   std::uint32_t grant_slots, ClaimPayload payload)
    : ctx_(ctx),
      method_(std::move(method)),
      payload_(std::move(payload)),
      address_("@" + prefix + "-" + loop::hex16(loop::random_u64())),
      grants_(grant_slots),
      exposures_(method_, ctx.defer),
      regions_(method_, exposures_, ctx.defer),
      conns_(ctx.defer) {
  socket_ = std::make_unique<kit::StreamListener>(
      ctx_.loop, listen_on(address_), method_, ctx_.listener,
      [this](std::uint64_t id, const std::string& why) {
        if (StreamConnection* conn = conns_.find(id)) wire::evict(*conn, why);
      },
      [this](int fd) { accept(fd); }, ctx_.log);
  OwnerInfo info;
  info.scope = this_process();
  info.grants_fd = grants_.fd();
  info.grants_bytes = grants_.bytes();
  info_ = to_info(info);
}

Listener::~Listener() { close(); }

void Listener::close() {
  if (closed_) return;
  closed_ = true;
  socket_->close();
  // Peers may still copy under grants of exposures never revoked; the memory is the owner's
  // to keep until they are done (revoke() waits for that; here only as long as peer_timeout,
  // for all of them together).
  const auto deadline = std::chrono::steady_clock::now() + ctx_.peer_timeout;
  for (auto& [id, c] : claimed_) {
    close_grant(c, deadline);
    // Its CLAIMED frame, if still queued, must not read the payload about to go (the
    // connections flush what is queued below).
    if (StreamConnection* conn = conns_.find(c.conn); conn != nullptr && !c.payload.empty())
      conn->release(claimed_tag(id));
  }
  claimed_.clear();
  regions_.clear();
  exposures_.clear();
  conns_.clear([](StreamConnection& c) { c.close_gracefully(); });
  for (auto& [id, p] : peers_) close_fetched(p.pidfd);
  peers_.clear();
}

void Listener::accept(int fd) {
  Peer p;
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
    p.pid = cred.pid;
    p.uid = cred.uid;
    p.gid = cred.gid;
    // Watching the peer's process lets revoke() stop waiting for a peer that died mid-copy.
    // Without one (the peer is gone already, or the kernel refuses), revoke() cannot see it
    // exit and waits for peer_timeout at most.
    try {
      p.pidfd = open_pidfd(cred.pid);
    } catch (const Error&) {
      p.pidfd = -1;
    }
  }
  const std::uint64_t id = next_conn_++;
  conns_.add(id, std::make_unique<StreamConnection>(
                     ctx_.loop, static_cast<StreamConnection::Handler&>(*this),
                     StreamConnection::Role::server, fd, id, "pid " + std::to_string(p.pid),
                     ctx_.peer_timeout, false,
                     StreamConnection::Hello{ctx_.local_name, ctx_.local_id}, ctx_.log));
  peers_[id] = std::move(p);
  socket_->admission().accepted(id);
}

std::optional<Error> Listener::on_hello(StreamConnection& conn, const FrameHeader&,
                                        FrameHeader& reply) {
  socket_->admission().heard(conn.id());
  // This connection's probe: a nonce of its own, at an address of this process. The peer
  // reads it there; nobody else learns it.
  Peer& p = peers_[conn.id()];
  p.probe = std::make_unique<Token>(random_token());
  reply.addr = reinterpret_cast<std::uint64_t>(p.probe->data());
  reply.token = *p.probe;
  return std::nullopt;
}

Listener::Claimant Listener::claimant(const StreamConnection& conn) {
  const Peer& p = peers_[conn.id()];
  return Claimant{p.pid, p.uid, p.gid, conn.describe_peer()};
}

bool Listener::peer_idle(std::uint64_t conn_id) const {
  auto it = peers_.find(conn_id);
  // Gone: its connection closed while a grant of it was quarantined. The slot may be reused
  // (a late copy of that peer's is refused by the slot's next generation).
  if (it == peers_.end()) return true;
  return process_exited(it->second.pidfd) ||
         (it->second.pid > 0 && process_stopped(it->second.pid));
}

bool Listener::close_grant(const Claimed& claim,
                           std::optional<std::chrono::steady_clock::time_point> deadline) {
  const auto now = std::chrono::steady_clock::now();
  auto p = peers_.find(claim.conn);
  const bool stalled = p != peers_.end() && p->second.stalled;
  if (grants_.close(claim.grant, stalled ? now : deadline.value_or(now + ctx_.peer_timeout),
                    [this, c = claim.conn] { return peer_idle(c); }))
    return true;
  if (p != peers_.end() && !stalled) {
    // Held past peer_timeout: broken or hostile. Its other grants close without a wait, and
    // the connection goes (after this call: the caller may be walking the claims).
    p->second.stalled = true;
    life_.defer(ctx_.defer, [this, c = claim.conn] {
      if (StreamConnection* conn = conns_.find(c))
        wire::evict(*conn, "a copy held its grant past peer_timeout");
    });
  }
  return false;
}

void Listener::expose(const Exposure& exposure, ExposureObserver& observer) {
  exposures_.add(exposure, observer);
}

void Listener::revoke(std::uint64_t id, const Error& reason) {
  if (StreamConnection* conn = end_claim(exposures_.revoke(id), id)) {
    // The claimant learns why at once (its next copy is refused in any case).
    FrameHeader h;
    h.type = FrameType::status;
    h.op_id = id;
    h.status = wire::to_wire(reason.code());
    conn->send(h, std::string_view(reason.message()).substr(0, wire::kMaxMessage));
  }
}

StreamConnection* Listener::end_claim(std::uint64_t conn_id, std::uint64_t id) {
  StreamConnection* conn = conn_id == 0 ? nullptr : conns_.find(conn_id);
  if (auto it = claimed_.find(id); it != claimed_.end()) {
    // Its CLAIMED frame, if still queued, must not read the payload about to go.
    if (StreamConnection* c = conns_.find(it->second.conn);
        c != nullptr && !it->second.payload.empty())
      c->release(claimed_tag(id));
    // cancel()'s promise: once this returns, no copy of the peer touches the memory. Copies
    // last a chunk; a peer that outlives peer_timeout holding the grant is reported.
    if (!close_grant(it->second))
      ctx_.log.error(method_ + ": a peer still held a copy grant on operation " + loop::hex16(id) +
                     " " + std::to_string(ctx_.peer_timeout.count()) +
                     " ms after it ended; its memory may still be touched by that copy");
    claimed_.erase(it);
  }
  // The claim no longer waits for this peer (an attachment, idle between transfers, never did).
  if (conn != nullptr && !regions_.is_attachment(id)) conn->expect_answers(-1);
  return conn;
}

void Listener::finish_exposure(std::uint64_t id, std::optional<Error> peer_error) {
  end_claim(exposures_.finish(id, std::move(peer_error)), id);
}

wire::Sink Listener::on_frame(StreamConnection& conn, const FrameHeader& h, std::string message) {
  switch (h.type) {
    case FrameType::claim:
      return receive_claim(conn, h);
    case FrameType::done:
      serve_done(conn, h, message);
      return {};
    case FrameType::attach:
      serve_attach(conn, h);
      return {};
    case FrameType::ended: {
      if (h.len == 0 || h.len % 16 != 0 || h.len > kit::Regions::kMaxEndedBytes)
        return wire::fatal("ENDED of " + std::to_string(h.len) + " bytes of ranges");
      Peer& p = peers_[conn.id()];
      p.refused.reset();
      p.tag = std::move(message);
      p.claim.resize(h.len);
      wire::Sink sink;
      sink.dest = p.claim.data();
      return sink;
    }
    case FrameType::detach:
      serve_detach(conn, h);
      return {};
    case FrameType::status:
      return {};  // a keepalive: the peer is there, copying
    default:
      return wire::fatal("unexpected frame type " + std::to_string(static_cast<int>(h.type)) +
                         " from a " + method_ + " client");
  }
}

wire::Sink Listener::receive_claim(StreamConnection& conn, const FrameHeader& h) {
  if (h.len == 0 || h.len % 16 != 0 || h.len > kMaxClaimBytes)
    return wire::fatal("CLAIM of " + std::to_string(h.len) + " bytes of ranges");
  Peer& p = peers_[conn.id()];
  p.refused.reset();
  // Nothing is sized by what a peer says before it shows a live token of the right kind: a
  // refused claim's ranges are read and dropped.
  const auto access = static_cast<Access>(h.flags);
  auto v = exposures_.check(h.op_id, h.token, access, 0, 0, conn.id());
  if (h.flags != static_cast<std::uint16_t>(Access::read) &&
      h.flags != static_cast<std::uint16_t>(Access::write))
    v = {ErrorCode::ProtocolError, "CLAIM names no access kind"};
  if (!v.ok()) {
    p.refused = Error(v.code, v.message);
    return {};
  }
  // At most a range per descriptor of either side, and one more per seam between them.
  const std::uint64_t most =
      16 * (2 * std::uint64_t{RdmaMetadata::kMaxDescriptors} + v.entry->exposure.regions.size());
  if (h.len > most) return wire::fatal("CLAIM of " + std::to_string(h.len) + " bytes of ranges");
  p.claim.resize(h.len);
  wire::Sink sink;
  sink.dest = p.claim.data();
  return sink;
}

void Listener::on_payload(StreamConnection& conn, const FrameHeader& h, std::uint64_t,
                          bool intact) {
  // Toward a server only a CLAIM and an ENDED carry a payload (their ranges).
  Peer& p = peers_[conn.id()];
  if (h.type == FrameType::ended) {
    if (intact) serve_ended(conn, h);
    return;
  }
  if (p.refused) {
    const Error refused = *p.refused;
    p.refused.reset();
    reply(conn, h.req_id, &refused);
    return;
  }
  if (intact) serve_claim(conn, h);
}

void Listener::serve_claim(StreamConnection& conn, const FrameHeader& h) {
  std::vector<std::byte> buf = std::move(peers_[conn.id()].claim);
  kit::Exposures::Ranges ranges;
  auto v =
      exposures_.check_claim(h.op_id, h.token, h.flags, buf.data(), buf.size(), conn.id(), ranges);
  if (!v.ok()) {
    const Error refused(v.code, v.message);
    reply(conn, h.req_id, &refused);
    return;
  }
  kit::Exposures::Entry* entry = v.entry;
  if (claimed_.count(h.op_id) != 0) {
    const Error refused(ErrorCode::AccessDenied, "the operation is claimed already");
    reply(conn, h.req_id, &refused);
    return;
  }
  std::vector<std::byte> payload;
  if (payload_) {
    try {
      payload = payload_(entry->exposure, claimant(conn));
    } catch (const Error& e) {
      reply(conn, h.req_id, &e);
      return;
    }
  }
  auto grant = grants_.open();
  if (!grant) {
    const Error refused(ErrorCode::Unsupported, "too many operations claimed at once (" +
                                                    std::to_string(grants_.bytes() / kSlotBytes) +
                                                    ")");
    reply(conn, h.req_id, &refused);
    return;
  }
  auto secret =
      exposures_.claim(*entry, conn.id(), conn.peer_name(), conn.describe_peer(), conn.peer_id());
  if (!secret) {
    grants_.close(*grant, std::chrono::steady_clock::now(), {});
    const Error refused(ErrorCode::AccessDenied, "the operation is claimed already");
    reply(conn, h.req_id, &refused);
    return;
  }
  socket_->admission().claimed(conn.id());
  Claimed& claimed = claimed_[h.op_id] =
      Claimed{conn.id(), *grant, std::move(ranges), std::move(payload)};
  // While it holds the claim, the connection waits for its peer: a peer that goes silent
  // (its keepalives stop) is dropped after peer_timeout and the operation errors.
  conn.expect_answers(+1);
  FrameHeader out;
  out.type = FrameType::claimed;
  out.req_id = h.req_id;
  out.op_id = h.op_id;
  out.token = *secret;
  out.addr = std::uint64_t{grant->slot} | (std::uint64_t{grant->generation} << 32);
  out.len = claimed.payload.size();
  conn.send(out, {}, claimed.payload.data(), claimed.payload.empty() ? 0 : claimed_tag(h.op_id));
}

void Listener::serve_done(StreamConnection& conn, const FrameHeader& h,
                          const std::string& message) {
  if (regions_.is_attachment(h.op_id)) {
    // A transfer on an attachment ends with ENDED; the attachment with DETACH.
    const Error refused(ErrorCode::ProtocolError, "DONE names an attachment");
    reply(conn, h.req_id, &refused);
    return;
  }
  auto v = exposures_.check_done(h.op_id, h.token, h.flags, conn.id());
  if (!v.ok()) {
    const Error refused(v.code, v.message);
    reply(conn, h.req_id, &refused);
    return;
  }
  const auto access = static_cast<Access>(h.flags);
  auto claim = claimed_.find(h.op_id);
  if (h.status != 0) {
    const Error noted(ErrorCode::Cancelled, "noted");
    reply(conn, h.req_id, &noted);
    finish_exposure(h.op_id, wire::ended_by_peer(h.status, message, conn.describe_peer()));
    return;
  }
  if (claim == claimed_.end() || claim->second.conn != conn.id()) {
    const Error refused(ErrorCode::ProtocolError, "DONE for an operation never claimed");
    reply(conn, h.req_id, &refused);
    return;
  }
  if (access == Access::write) {
    // Every range of the claim was copied under the grant before the peer said DONE. A
    // writable is complete only when they cover every byte it exposes.
    for (const auto& [addr, len] : claim->second.ranges) exposures_.landed(h.op_id, addr, len);
    if (auto short_of = exposures_.unwritten(h.op_id, conn.describe_peer())) {
      reply(conn, h.req_id, &*short_of);
      finish_exposure(h.op_id, *short_of);
      return;
    }
  }
  reply(conn, h.req_id, nullptr);
  finish_exposure(h.op_id, std::nullopt);
}

void Listener::on_closed(StreamConnection& conn, const std::string& reason) {
  // Its copies are over (a process closes its sockets last) or bounded by peer_timeout, for
  // all its claims together.
  const auto deadline = std::chrono::steady_clock::now() + ctx_.peer_timeout;
  for (auto it = claimed_.begin(); it != claimed_.end();) {
    if (it->second.conn != conn.id()) {
      ++it;
      continue;
    }
    close_grant(it->second, deadline);
    it = claimed_.erase(it);
  }
  exposures_.lose_connection(conn.id(), Error(ErrorCode::PeerLost, "peer " + conn.describe_peer() +
                                                                       " disconnected: " + reason));
  socket_->admission().closed(conn.id());
  if (auto p = peers_.find(conn.id()); p != peers_.end()) {
    close_fetched(p->second.pidfd);
    peers_.erase(p);
  }
  conns_.bury(conn.id());
}

void Listener::serve_region(const RegionExposure& region, RegionObserver& observer) {
  regions_.add(region, observer);
}

void Listener::serve_attach(StreamConnection& conn, const FrameHeader& h) {
  auto v = regions_.attach(h.op_id, h.token, h.flags, conn.id(), conn.peer_name(),
                           conn.describe_peer(), conn.peer_id());
  if (!v.ok()) {
    const Error refused(v.code, v.message);
    reply(conn, h.req_id, &refused);
    return;
  }
  // From here on it is refused as a whole when any part of it fails.
  auto refuse = [&](const Error& e) {
    regions_.revoke(v.attachment);
    reply(conn, h.req_id, &e);
  };
  std::vector<std::byte> payload;
  if (payload_) {
    try {
      payload = payload_(exposures_.find(v.attachment)->exposure, claimant(conn));
    } catch (const Error& e) {
      refuse(e);
      return;
    }
  }
  auto grant = grants_.open();
  if (!grant) {
    refuse(Error(ErrorCode::Unsupported, "too many operations and attachments at once (" +
                                             std::to_string(grants_.bytes() / kSlotBytes) + ")"));
    return;
  }
  socket_->admission().claimed(conn.id());
  Claimed& claimed = claimed_[v.attachment] = Claimed{conn.id(), *grant, {}, std::move(payload)};
  FrameHeader out;
  out.type = FrameType::attached;
  out.req_id = h.req_id;
  out.op_id = v.attachment;
  out.token = v.secret;
  out.addr = std::uint64_t{grant->slot} | (std::uint64_t{grant->generation} << 32);
  out.len = claimed.payload.size();
  conn.send(out, {}, claimed.payload.data(),
            claimed.payload.empty() ? 0 : claimed_tag(v.attachment));
}

void Listener::serve_ended(StreamConnection& conn, const FrameHeader& h) {
  Peer& p = peers_[conn.id()];
  std::vector<std::byte> ranges = std::move(p.claim);
  std::string tag = std::move(p.tag);
  // The peer copied under the attachment's grant itself: a write's bytes are in place already.
  std::optional<Error> outcome;
  if (h.status != 0) outcome = wire::ended_by_peer(h.status, {}, conn.describe_peer());
  auto v = regions_.ended(h.op_id, h.token, h.flags, std::move(outcome), std::move(tag),
                          ranges.data(), ranges.size(), conn.id());
  if (h.req_id == 0) return;  // a notice
  if (!v.ok()) {
    const Error refused(v.code, v.message);
    reply(conn, h.req_id, &refused);
    return;
  }
  reply(conn, h.req_id, nullptr);
}

void Listener::serve_detach(StreamConnection& conn, const FrameHeader& h) {
  if (!regions_.holds(h.op_id, h.token, conn.id())) return;
  end_claim(conn.id(), h.op_id);  // its grant closes first (an attachment still)
  regions_.detach(h.op_id, h.token, conn.id());
}

void Listener::end_attachment(std::uint64_t id, const Error& reason) {
  if (!regions_.is_attachment(id)) return;
  // Its exposure may be gone already (the peer detached, or its connection was lost, and the
  // owner has not heard yet): then only the owner's pending event goes.
  const kit::Exposures::Entry* entry = exposures_.find(id);
  // When the grant has closed, no copy of that peer touches the memory.
  if (StreamConnection* conn = entry == nullptr ? nullptr : end_claim(entry->bound_to, id)) {
    FrameHeader h;
    h.type = FrameType::status;
    h.op_id = id;
    h.status = wire::to_wire(reason.code());
    conn->send(h, std::string_view(reason.message()).substr(0, wire::kMaxMessage));
  }
  regions_.revoke(id);
}

void Listener::revoke_attachment(std::uint64_t attachment, const Error& reason) {
  end_attachment(attachment, reason);
}

void Listener::end_region(std::uint64_t id, const Error& reason) {
  for (const auto& [attachment, conn] : regions_.attachments_of(id))
    end_attachment(attachment, reason);
  regions_.end(id);
}

}  // namespace ferry::transport::same_host
