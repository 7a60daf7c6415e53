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
// Client side: active transfers

namespace {

// The address of a tcp endpoint in `out`, or why start() refuses it.
std::optional<Error> parse_endpoint(const Endpoint& endpoint, SocketAddress& out) {
  if (SocketAddress::parse(endpoint.address, out)) return std::nullopt;
  return Error(ErrorCode::InvalidMetadata,
               "tcp endpoint '" + endpoint.address + "' is not a numeric ip:port", "endpoints");
}

}  // namespace

std::optional<Error> TcpTransport::endpoint_error(const Endpoint& endpoint) const {
  SocketAddress addr;
  return parse_endpoint(endpoint, addr);
}

std::unique_ptr<Transfer> TcpTransport::start(TransferSpec spec, TransferObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  SocketAddress addr;
  if (auto e = parse_endpoint(spec.endpoint, addr)) throw *e;
  auto t = std::make_unique<TcpTransfer>(*this, next_transfer_++, std::move(spec), observer);
  transfers_[t->id] = t.get();
  std::string error;
  t->conn = connect_to(addr, t->spec.peer_name, error);
  if (t->conn == nullptr) {
    finish_transfer(*t,
                    Error(ErrorCode::PeerLost, "cannot connect to peer '" + t->spec.peer_name +
                                                   "' at " + addr.to_string() + ": " + error),
                    /*setup=*/true);
    return t;
  }
  pump(*t);
  return t;
}

Connection* TcpTransport::connect_to(const SocketAddress& address, const std::string& peer_name,
                                     std::string& error) {
  std::string key = address.to_string();
  // A connection that is closing (after a protocol error) takes no new requests.
  if (auto it = pool_.find(key); it != pool_.end() && it->second->usable()) return it->second;
  int fd = -1;
  try {
    fd = make_stream_socket(address.family(), options_.peer_timeout);
  } catch (const Error& e) {
    error = e.message();
    return nullptr;
  }
  bool connecting = false;
  if (::connect(fd, address.get(), address.length) != 0) {
    if (errno != EINPROGRESS) {
      error = socket_error_text(errno);
      ::close(fd);
      return nullptr;
    }
    connecting = true;
  }
  std::uint64_t id = next_conn_++;
  auto conn = std::make_unique<Connection>(loop_, handler(), Connection::Role::client, fd, id, key,
                                           options_.peer_timeout, connecting, options_.log);
  conn->set_peer_name(peer_name);
  Connection* raw = conn.get();
  conns_[id] = std::move(conn);
  pool_[key] = raw;
  FrameHeader hello;
  hello.type = FrameType::hello;
  hello.op_id = options_.local_id;  // HELLO carries the connector's id here
  raw->send(hello, options_.local_name.substr(0, 256));
  if (!raw->open()) {
    error = "connection closed at once";
    return nullptr;
  }
  return raw;
}

void TcpTransport::pump(TcpTransfer& t) {
  const bool writing = t.spec.access == Access::write;
  Connection::Cork cork(*t.conn);
  while (!t.finished && t.seg < t.spec.segments.size() && t.inflight < options_.window) {
    const Segment& s = t.spec.segments[t.seg];
    std::uint64_t len = std::min<std::uint64_t>(options_.chunk_size, s.len - t.seg_off);
    std::uint64_t req = next_req_++;
    FrameHeader h;
    h.type = writing ? FrameType::write : FrameType::read;
    h.req_id = req;
    h.op_id = t.spec.remote_id;
    h.addr = s.remote_addr + t.seg_off;
    h.len = len;
    h.token = t.spec.token;
    std::byte* local = s.local + t.seg_off;
    std::byte* chunk = nullptr;
    const int ordinal = s.cuda_device;
#ifdef FERRY_WITH_CUDA
    if (ordinal >= 0) {
      // CUDA memory goes through a staging chunk; none free: go on when one is released.
      try {
        chunk = acquire_chunk(ordinal, /*server=*/false);
      } catch (const Error& e) {
        staging_failed(t, e);
        return;
      }
      if (chunk == nullptr) {
        t.waiting_chunk = true;
        break;
      }
    }
#endif
    add_pending(req, Pending{t.id, writing ? PendingKind::write_chunk : PendingKind::read_chunk,
                             local, len, t.conn->id(), chunk, ordinal});
    t.reqs.insert(req);
    t.inflight += len;
    t.seg_off += len;
    if (t.seg_off == s.len) {
      ++t.seg;
      t.seg_off = 0;
    }
    if (chunk == nullptr) {
      t.conn->send(h, {}, writing ? local : nullptr, writing ? t.id : 0);
      continue;
    }
#ifdef FERRY_WITH_CUDA
    t.staged[req].chunk = chunk;
    if (writing) {
      // The WRITE leaves once its bytes are out of the device (staged_write_ready).
      stage_write(t, req, h, local, ordinal);
      if (t.finished) return;
    } else {
      t.conn->send(h);
    }
#endif
  }
  // A write is announced done right behind its last chunk; the peer answers DONE only after
  // every chunk before it is in its memory, so that answer completes the transfer.
  if (writing && !t.finished && !t.done_sent && t.seg == t.spec.segments.size() && t.copying == 0) {
    t.done_sent = true;
    send_done(*t.conn, t, nullptr);
  }
}

void TcpTransport::send_done(Connection& conn, TcpTransfer& t, const Error* error) {
  std::uint64_t req = next_req_++;
  FrameHeader h;
  h.type = FrameType::done;
  h.req_id = req;
  h.op_id = t.spec.remote_id;
  h.token = t.spec.token;
  h.flags = static_cast<std::uint16_t>(t.spec.access);
  std::string message;
  if (error != nullptr) {
    h.status = static_cast<std::uint32_t>(error->code());
    message = error->message().substr(0, kMaxMessage);
  }
  // Only a successful write waits for the answer; the rest are notices.
  bool awaited = error == nullptr && t.spec.access == Access::write;
  add_pending(req, Pending{awaited ? t.id : 0, PendingKind::done, nullptr, 0, conn.id()});
  if (awaited) t.reqs.insert(req);
  // A write's DONE is tagged with the transfer: if the transfer is cancelled before it
  // leaves, it is dropped with the chunks ahead of it, and never claims success.
  conn.send(h, message, nullptr, awaited ? t.id : 0);
}

Connection::Sink TcpTransport::client_frame(Connection& conn, const FrameHeader& h,
                                            std::string message) {
  if (!conn.greeted()) {
    if (h.type != FrameType::hello) {
      if (h.type == FrameType::status && h.status != 0)
        return fatal("peer refused the connection: " + message);
      return fatal("expected HELLO as the first frame");
    }
    conn.set_greeted();
    if (conn.peer_name().empty()) conn.set_peer_name(message.substr(0, 256));
    return {};
  }
  switch (h.type) {
    case FrameType::claimed:
      // Meant for the transfer of this connection toward that operation (one at most: the
      // owner binds an operation to one connection, and to one claim).
      for (auto& [id, t] : transfers_)
        if (t->conn == &conn && !t->finished && !t->secret && t->spec.remote_id == h.op_id) {
          t->secret = h.token;
          break;
        }
      return {};
    case FrameType::data: {
      auto it = pending_.find(h.req_id);
      if (it == pending_.end() || it->second.conn != conn.id()) {
        // The answer to a request of a transfer since cancelled: drop its bytes.
        if (h.len > std::max(options_.max_request, options_.chunk_size))
          return fatal("DATA of " + std::to_string(h.len) + " bytes for no request");
        return {};
      }
      const Pending& p = it->second;
      if (p.kind != PendingKind::read_chunk || h.len != p.len)
        return fatal("DATA does not match read request " + std::to_string(h.req_id));
      Connection::Sink sink;
      sink.dest = p.staging != nullptr ? p.staging : p.local;
      sink.tag = p.transfer;
      return sink;
    }
    case FrameType::status: {
      if (h.req_id == 0 && h.op_id != 0) {
        // The owner ended operation op_id (cancelled, deadline, closed) and says why.
        ErrorCode code = code_from_wire(h.status);
        Error ended(code, "peer " + conn.describe_peer() + " ended the operation: " +
                              (message.empty() ? std::string(to_string(code)) : message));
        for (auto& [id, t] : transfers_)
          if (t->conn == &conn && !t->finished && t->spec.remote_id == h.op_id) {
            finish_transfer(*t, ended);
            break;
          }
        return {};
      }
      if (h.req_id == 0) {
        // The server explains why it is about to close the connection.
        conn.set_notice(h.status, message);
        return {};
      }
      auto it = pending_.find(h.req_id);
      // Answers count only from the connection the request went out on.
      if (it == pending_.end() || it->second.conn != conn.id()) return {};
      Pending p = it->second;
      erase_pending(it);
      auto tit = transfers_.find(p.transfer);
      if (tit == transfers_.end() || tit->second->finished) return {};
      TcpTransfer& t = *tit->second;
      t.reqs.erase(h.req_id);
      if (h.status != 0) {
        ErrorCode code = code_from_wire(h.status);
        Error refused(code, "peer " + conn.describe_peer() + " refused: " +
                                (message.empty() ? std::string(to_string(code)) : message));
        finish_transfer(t, refused);
        // The passive side learns that this peer gave up, instead of waiting for its deadline
        // (it ignores the notice if the operation is another peer's, or over).
        if (p.kind != PendingKind::done) send_done(conn, t, &refused);
        return {};
      }
      switch (p.kind) {
        case PendingKind::write_chunk:
          chunk_done(t, h.req_id, p.len);
          break;
        case PendingKind::done:
          // The server answers DONE only after every frame before it: success while chunks
          // are unanswered is a lie, and waiting for them would hang (nothing more is due).
          if (t.done == t.total)
            finish_transfer(t, std::nullopt);
          else
            finish_transfer(t, Error(ErrorCode::ProtocolError,
                                     "peer " + conn.describe_peer() +
                                         " answered DONE before the write's last chunk (" +
                                         std::to_string(t.done) + " of " + std::to_string(t.total) +
                                         " bytes acknowledged)"));
          break;
        case PendingKind::read_chunk:
          return fatal("a read request was answered with success but no data");
      }
      return {};
    }
    default:
      return fatal("unexpected frame type " + std::to_string(static_cast<int>(h.type)) +
                   " from a server");
  }
}

void TcpTransport::chunk_done(TcpTransfer& t, std::uint64_t req, std::uint64_t len) {
  t.reqs.erase(req);
#ifdef FERRY_WITH_CUDA
  if (!t.staged.empty()) release_chunk(t, req);
#endif
  t.inflight -= len;
  t.done += len;
  if (t.done < t.total) {
    pump(t);
    return;
  }
  if (t.spec.access == Access::read) {
    // All bytes are here: the transfer is complete, and the peer learns it may let go.
    send_done(*t.conn, t, nullptr);
    finish_transfer(t, std::nullopt);
  }
  // A write completes when the answer to its DONE arrives.
}

void TcpTransport::finish_transfer(TcpTransfer& t, std::optional<Error> error, bool setup) {
  if (t.finished) return;
  t.finished = true;
  t.waiting_chunk = false;
#ifdef FERRY_WITH_CUDA
  // Copies between the device and staging chunks stop first (cancel waits for one in
  // flight), then the connection lets go of the chunks, then they go back to the pool.
  for (auto& [req, s] : t.staged)
    if (s.copy != 0) copies_->cancel(s.copy);
#endif
  for (std::uint64_t req : t.reqs) erase_pending(req);
  t.reqs.clear();
  if (t.conn != nullptr) {
    t.conn->release(t.id);
    t.conn->drop_sink(t.id);
  }
#ifdef FERRY_WITH_CUDA
  if (!t.staged.empty()) {
    auto staged = std::move(t.staged);
    t.staged.clear();
    t.copying = 0;
    for (auto& [req, s] : staged) client_staging_->release(s.chunk);
  }
#endif
  report_later(defer_, life_, transfers_, t.id, std::move(error), setup);
}

void TcpTransport::cancel_transfer(TcpTransfer& t, const Error& reason) {
  if (!t.finished) {
    finish_transfer(t, reason);
    if (t.conn != nullptr && t.conn->open()) send_done(*t.conn, t, &reason);
  }
  forget_transfer(t);
}

void TcpTransport::forget_transfer(TcpTransfer& t) {
  if (!t.finished) {
    cancel_transfer(t, Error(ErrorCode::Cancelled, "the operation was destroyed"));
    return;
  }
  transfers_.erase(t.id);
  t.owner = nullptr;
}

}  // namespace ferry::transport::tcp
