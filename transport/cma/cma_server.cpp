#include <cstdio>
#include <cstring>

#include "loop/ids.hpp"

#include "transport/cma/cma_internal.hpp"

namespace ferry::transport::cma {

// ---------------------------------------------------------------------------------------
// Server side: serving exposures. The owner's CPU never touches the bytes: it checks the
// claim, hands out a grant, and hears DONE.

std::string CmaTransport::expose(const Exposure& exposure, ExposureObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  exposures_.add(exposure, observer);
  return info_;
}

void CmaTransport::revoke(std::uint64_t id, const Error& reason) {
  const std::uint64_t conn_id = exposures_.revoke(id);
  if (tcp::Connection* conn = end_claim(conn_id, id)) {
    // The claimant learns why at once (its next copy job is refused in any case).
    tcp::FrameHeader h;
    h.type = tcp::FrameType::status;
    h.op_id = id;
    h.status = static_cast<std::uint32_t>(reason.code());
    conn->send(h, std::string_view(reason.message()).substr(0, tcp::kMaxMessage));
  }
}

bool CmaTransport::close_grant(const Claimed& claim) {
  return grants_.close(claim.grant, std::chrono::steady_clock::now() + options_.peer_timeout,
                       [this, c = claim.conn] { return peer_idle(c); });
}

tcp::Connection* CmaTransport::end_claim(std::uint64_t conn_id, std::uint64_t id) {
  tcp::Connection* conn = conn_id == 0 ? nullptr : find_conn(conn_id);
  if (auto it = claimed_.find(id); it != claimed_.end()) {
    // Its HANDLES frame, if still queued, must not read the payload about to go.
    if (tcp::Connection* c = find_conn(it->second.conn);
        c != nullptr && !it->second.handles.empty())
      c->release(handles_tag(id));
    // cancel()'s promise: once this returns, no copy of the peer touches the memory. Copy jobs
    // last a chunk; a peer that outlives peer_timeout holding the grant is reported.
    if (!close_grant(it->second))
      options_.log.error("cma: a peer still held a copy grant on operation " + loop::hex16(id) +
                         " " + std::to_string(options_.peer_timeout.count()) +
                         " ms after it ended; its memory may still be touched by that copy");
    claimed_.erase(it);
  }
  if (conn != nullptr) conn->expect_answers(-1);  // the claim no longer waits for this peer
  return conn;
}

void CmaTransport::finish_exposure(std::uint64_t id, std::optional<Error> peer_error) {
  end_claim(exposures_.finish(id, std::move(peer_error)), id);
}

void CmaTransport::reply_status(tcp::Connection& conn, std::uint64_t req, ErrorCode code,
                                const std::string& msg) {
  tcp::FrameHeader h;
  h.type = tcp::FrameType::status;
  h.req_id = req;
  h.status = static_cast<std::uint32_t>(code);
  conn.send(h, std::string_view(msg).substr(0, tcp::kMaxMessage));
}

tcp::Connection::Sink CmaTransport::serve_frame(tcp::Connection& conn, const tcp::FrameHeader& h,
                                                std::string message) {
  if (!conn.greeted()) {
    if (h.type != tcp::FrameType::hello) return fatal("expected HELLO as the first frame");
    conn.set_peer_name(message.substr(0, 256));
    conn.set_greeted();
    if (h.op_id != 0) conn.set_peer_id(loop::hex16(h.op_id));
    tcp::FrameHeader reply;
    reply.type = tcp::FrameType::hello;
    reply.op_id = options_.local_id;
    conn.send(reply, options_.local_name.substr(0, 256));
    return {};
  }
  switch (h.type) {
    case tcp::FrameType::claim: {
      if (h.len == 0 || h.len % 16 != 0 || h.len > kMaxClaimBytes)
        return fatal("CLAIM of " + std::to_string(h.len) + " bytes of ranges");
      auto& buf = claim_bufs_[conn.id()];
      buf.resize(h.len);
      tcp::Connection::Sink sink;
      sink.dest = buf.data();
      return sink;
    }
    case tcp::FrameType::done:
      serve_done(conn, h, message);
      return {};
    case tcp::FrameType::status:
      return {};  // a keepalive: the peer is there, copying
    default:
      return fatal("unexpected frame type " + std::to_string(static_cast<int>(h.type)) +
                   " from a cma client");
  }
}

void CmaTransport::serve_claim(tcp::Connection& conn, const tcp::FrameHeader& h) {
  std::vector<std::byte> buf = std::move(claim_bufs_[conn.id()]);
  claim_bufs_.erase(conn.id());
  Exposures::Ranges ranges;
  auto v =
      exposures_.check_claim(h.op_id, h.token, h.flags, buf.data(), buf.size(), conn.id(), ranges);
  if (!v.ok()) {
    reply_status(conn, h.req_id, v.code, v.message);
    return;
  }
  Exposures::Entry* entry = v.entry;
  if (claimed_.count(h.op_id) != 0) {
    reply_status(conn, h.req_id, ErrorCode::AccessDenied, "the operation is claimed already");
    return;
  }
  std::vector<std::byte> handles;
  if (ipc()) {
    try {
      handles = handles_of(entry->exposure);
    } catch (const Error& e) {
      reply_status(conn, h.req_id, e.code(), e.message());
      return;
    }
  }
  auto grant = grants_.open();
  if (!grant) {
    reply_status(
        conn, h.req_id, ErrorCode::Unsupported,
        "too many operations claimed at once (" + std::to_string(options_.grant_slots) + ")");
    return;
  }
  auto secret =
      exposures_.claim(*entry, conn.id(), conn.peer_name(), conn.describe_peer(), conn.peer_id());
  if (!secret) {
    grants_.close(*grant, std::chrono::steady_clock::now(), {});
    reply_status(conn, h.req_id, ErrorCode::AccessDenied, "the operation is claimed already");
    return;
  }
  Claimed& claimed = claimed_[h.op_id] =
      Claimed{conn.id(), *grant, std::move(ranges), std::move(handles)};
  // While it holds the claim, the connection waits for its peer: a peer that goes silent
  // (its keepalives stop) is dropped after peer_timeout and the operation errors.
  conn.expect_answers(+1);
  if (!claimed.handles.empty()) {
    // cuda_ipc: the handles of the memory first, to the claimant alone.
    tcp::FrameHeader hh;
    hh.type = tcp::FrameType::handles;
    hh.req_id = h.req_id;
    hh.op_id = h.op_id;
    hh.len = claimed.handles.size();
    conn.send(hh, {}, claimed.handles.data(), handles_tag(h.op_id));
  }
  tcp::FrameHeader reply;
  reply.type = tcp::FrameType::claimed;
  reply.req_id = h.req_id;
  reply.op_id = h.op_id;
  reply.token = *secret;
  reply.addr = grant->slot;
  reply.len = grant->generation;
  conn.send(reply);
}

void CmaTransport::serve_done(tcp::Connection& conn, const tcp::FrameHeader& h,
                              const std::string& message) {
  if (h.flags != static_cast<std::uint16_t>(Access::read) &&
      h.flags != static_cast<std::uint16_t>(Access::write)) {
    reply_status(conn, h.req_id, ErrorCode::ProtocolError, "DONE names no access kind");
    return;
  }
  const auto access = static_cast<Access>(h.flags);
  auto v = exposures_.check(h.op_id, h.token, access, 0, 0, conn.id());
  if (!v.ok()) {
    reply_status(conn, h.req_id, v.code, v.message);
    return;
  }
  auto claim = claimed_.find(h.op_id);
  if (h.status != 0) {
    reply_status(conn, h.req_id, ErrorCode::Cancelled, "noted");
    const ErrorCode code = code_from_wire(h.status);
    finish_exposure(h.op_id,
                    Error(code, "peer " + conn.describe_peer() + " ended the transfer: " +
                                    (message.empty() ? std::string(to_string(code)) : message)));
    return;
  }
  if (claim == claimed_.end() || claim->second.conn != conn.id()) {
    reply_status(conn, h.req_id, ErrorCode::ProtocolError, "DONE for an operation never claimed");
    return;
  }
  if (access == Access::write) {
    // Every range of the claim was copied under the grant before the peer said DONE. A
    // writable is complete only when they cover every byte it exposes.
    for (const auto& [addr, len] : claim->second.ranges) exposures_.landed(h.op_id, addr, len);
    if (auto short_of = exposures_.unwritten(h.op_id); !short_of.empty()) {
      std::string why = "peer " + conn.describe_peer() + " said it was done " + short_of;
      reply_status(conn, h.req_id, ErrorCode::ProtocolError, why);
      finish_exposure(h.op_id, Error(ErrorCode::ProtocolError, why));
      return;
    }
  }
  tcp::FrameHeader ok;
  ok.type = tcp::FrameType::status;
  ok.req_id = h.req_id;
  conn.send(ok);
  finish_exposure(h.op_id, std::nullopt);
}

}  // namespace ferry::transport::cma
