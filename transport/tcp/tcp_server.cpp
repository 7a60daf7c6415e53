#include "transport/tcp/tcp_internal.hpp"

#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>

#include "loop/ids.hpp"
#include "loop/uv_handle.hpp"

namespace ferry::transport::tcp {

// ---------------------------------------------------------------------------------------
// Server side: serving exposures

std::shared_ptr<const Registration> TcpTransport::register_memory(const Region& region) {
  if (!caps_.moves(region.kind)) throw Error(ErrorCode::Unsupported, "tcp moves host memory only");
  return registrations_.acquire(region);
}

std::string TcpTransport::expose(const Exposure& exposure, ExposureObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  exposures_.add(exposure, observer);
  return {};
}

void TcpTransport::revoke(std::uint64_t id, const Error& reason) {
  if (Connection* conn = end_claim(exposures_.revoke(id), id, reason)) {
    // The owner ended the operation (cancelled, deadline, shutdown): its claimant learns why
    // at once, instead of an access refusal for its next request.
    FrameHeader h;
    h.type = FrameType::status;
    h.op_id = id;
    h.status = static_cast<std::uint32_t>(reason.code());
    conn->send(h, std::string_view(reason.message()).substr(0, kMaxMessage));
  }
}

Connection* TcpTransport::end_claim(std::uint64_t conn_id, std::uint64_t id, const Error& reason) {
  Connection* conn = conn_id == 0 ? nullptr : find_conn(conn_id);
  if (conn == nullptr) return nullptr;
  conn->expect_answers(-1);  // the claim no longer waits for this peer
  // Read responses still queued become error answers that tell the claimant why (one partly
  // sent finishes from a copy); a payload being received is drained, not stored.
  auto replace = [&](FrameHeader& h, std::string& message) {
    h.type = FrameType::status;
    h.status = static_cast<std::uint32_t>(reason.code());
    message = reason.message().substr(0, kMaxMessage);
  };
  conn->release(id, replace);
  conn->drop_sink(id);
#ifdef FERRY_WITH_CUDA
  if (!server_staged_.empty() || !parked_done_.empty()) drop_staged(id, conn, replace);
#endif
  return conn;
}

void TcpTransport::reply_status(Connection& conn, std::uint64_t req, ErrorCode code,
                                const std::string& msg) {
  FrameHeader h;
  h.type = FrameType::status;
  h.req_id = req;
  h.status = static_cast<std::uint32_t>(code);
  conn.send(h, std::string_view(msg).substr(0, kMaxMessage));
}

void TcpTransport::reply_ok(Connection& conn, std::uint64_t req) {
  FrameHeader h;
  h.type = FrameType::status;
  h.req_id = req;
  conn.send(h);
}

void TcpTransport::claim(Exposures::Entry& entry, Connection& conn) {
  auto secret =
      exposures_.claim(entry, conn.id(), conn.peer_name(), conn.describe_peer(), conn.peer_id());
  if (!secret) return;
  unclaimed_.erase(conn.id());
  // While it serves a claimed operation, the connection waits for its peer: a peer that goes
  // silent (stopped, or cut off without a reset) is dropped after peer_timeout, and the
  // operation errors, instead of waiting forever.
  conn.expect_answers(+1);
  // The claim's secret goes to the claimant alone, ahead of the answer to its request.
  FrameHeader h;
  h.type = FrameType::claimed;
  h.op_id = entry.exposure.id;
  h.token = *secret;
  conn.send(h);
}

void TcpTransport::finish_exposure(std::uint64_t id, std::optional<Error> peer_error) {
  // Requests of this peer still queued (a peer that ended with an error may have left some)
  // must not read the memory once the operation is over.
  Error reason = peer_error ? *peer_error : Error(ErrorCode::Cancelled, "the operation ended");
  end_claim(exposures_.finish(id, std::move(peer_error)), id, reason);
}

Connection::Sink TcpTransport::serve_frame(Connection& conn, const FrameHeader& h,
                                           std::string message) {
  if (!conn.greeted()) {
    if (h.type != FrameType::hello) return fatal("expected HELLO as the first frame");
    conn.set_peer_name(message.substr(0, 256));
    conn.set_greeted();
    if (h.op_id != 0) {
      char id[24];
      std::snprintf(id, sizeof id, "%016llx", static_cast<unsigned long long>(h.op_id));
      conn.set_peer_id(id);
    }
    FrameHeader reply;
    reply.type = FrameType::hello;
    reply.op_id = options_.local_id;
    conn.send(reply, options_.local_name.substr(0, 256));
    return {};
  }
  switch (h.type) {
    case FrameType::read:
      serve_read(conn, h);
      return {};
    case FrameType::write:
      return serve_write(conn, h);
    case FrameType::done:
      serve_done(conn, h, message);
      return {};
    default:
      return fatal("unexpected frame type " + std::to_string(static_cast<int>(h.type)) +
                   " from a client");
  }
}

void TcpTransport::serve_read(Connection& conn, const FrameHeader& h) {
  if (h.len == 0 || h.len > options_.max_request) {
    reply_status(conn, h.req_id, ErrorCode::AccessDenied,
                 "read of " + std::to_string(h.len) + " bytes: requests take 1 to " +
                     std::to_string(options_.max_request) + " bytes");
    return;
  }
  auto v = exposures_.check(h.op_id, h.token, Access::read, h.addr, h.len, conn.id());
  if (!v.ok()) {
    reply_status(conn, h.req_id, v.code, v.message);
    return;
  }
  claim(*v.entry, conn);
#ifdef FERRY_WITH_CUDA
  if (cuda_ != nullptr) {
    if (int ordinal = region_device(*v.entry, v.ptr); ordinal >= 0) {
      serve_read_staged(conn, h, v.ptr, ordinal);
      return;
    }
  }
#endif
  exposures_.sending(h.op_id);
  FrameHeader d;
  d.type = FrameType::data;
  d.req_id = h.req_id;
  d.len = h.len;
  conn.send(d, {}, v.ptr, h.op_id);
}

Connection::Sink TcpTransport::serve_write(Connection& conn, const FrameHeader& h) {
  // A write's payload follows its header; one too large to skip ends the connection.
  if (h.len > options_.max_request)
    return fatal("write of " + std::to_string(h.len) + " bytes exceeds the limit of " +
                 std::to_string(options_.max_request));
  if (h.len == 0) return {};
  auto v = exposures_.check(h.op_id, h.token, Access::write, h.addr, h.len, conn.id());
  if (!v.ok()) return {};  // discarded; on_payload answers with the refusal
  claim(*v.entry, conn);
#ifdef FERRY_WITH_CUDA
  if (cuda_ != nullptr) {
    if (int ordinal = region_device(*v.entry, v.ptr); ordinal >= 0)
      return serve_write_staged(conn, h, v.ptr, ordinal);
  }
#endif
  Connection::Sink sink;
  sink.dest = v.ptr;
  sink.tag = h.op_id;
  return sink;
}

void TcpTransport::serve_done(Connection& conn, const FrameHeader& h, const std::string& message) {
  if (h.flags != static_cast<std::uint16_t>(Access::read) &&
      h.flags != static_cast<std::uint16_t>(Access::write)) {
    reply_status(conn, h.req_id, ErrorCode::ProtocolError, "DONE names no access kind");
    return;
  }
  auto access = static_cast<Access>(h.flags);
  auto v = exposures_.check(h.op_id, h.token, access, 0, 0, conn.id());
  if (!v.ok()) {
    reply_status(conn, h.req_id, v.code, v.message);
    return;
  }
  claim(*v.entry, conn);
#ifdef FERRY_WITH_CUDA
  if (h.status == 0 && access == Access::write && writes_copying(h.op_id)) {
    // Bytes of earlier WRITEs are still on their way into the device: answer once they are
    // all there (served_write_copied serves this DONE again).
    parked_done_[h.op_id] = ParkedDone{conn.id(), h, message};
    return;
  }
#endif
  if (h.status == 0 && access == Access::write) {
    // A writable is complete only when every byte it exposes was written at least once.
    if (auto short_of = exposures_.unwritten(h.op_id); !short_of.empty()) {
      std::string why = "peer " + conn.describe_peer() + " said it was done " + short_of;
      reply_status(conn, h.req_id, ErrorCode::ProtocolError, why);
      finish_exposure(h.op_id, Error(ErrorCode::ProtocolError, why));
      return;
    }
  }
  reply_ok(conn, h.req_id);
  if (h.status == 0) {
    // A readable is done only once every byte it queued has left its memory.
    if (access == Access::read && !exposures_.done_reading(h.op_id)) return;
    finish_exposure(h.op_id, std::nullopt);
    return;
  }
  ErrorCode code = code_from_wire(h.status);
  finish_exposure(h.op_id,
                  Error(code, "peer " + conn.describe_peer() + " ended the transfer: " +
                                  (message.empty() ? std::string(to_string(code)) : message)));
}

}  // namespace ferry::transport::tcp
