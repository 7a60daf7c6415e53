#include "transport/tcp/tcp_transport.hpp"

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

/// An active transfer: its segments are cut into requests of at most chunk_size bytes, with
/// at most `window` bytes requested and not yet done.
class TcpTransfer final : public Transfer {
 public:
  TcpTransfer(TcpTransport& transport, std::uint64_t transfer_id, TransferSpec what,
              TransferObserver& obs)
      : owner(&transport), id(transfer_id), spec(std::move(what)), observer(&obs) {
    for (const Segment& s : spec.segments) total += s.len;
  }
  ~TcpTransfer() override {
    if (owner != nullptr) owner->forget_transfer(*this);
  }
  void cancel(const Error& reason) override {
    if (owner != nullptr) owner->cancel_transfer(*this, reason);
  }
  std::optional<Token> claim_secret() const override { return secret; }

  TcpTransport* owner;  // null once the transport let go of it
  std::uint64_t id;
  TransferSpec spec;
  TransferObserver* observer;
  Connection* conn = nullptr;
  std::size_t seg = 0;
  std::uint64_t seg_off = 0;
  std::uint64_t inflight = 0;
  std::uint64_t done = 0;
  std::uint64_t total = 0;
  bool done_sent = false;
  bool finished = false;  // succeeded or failed; nothing more is sent or received for it
  bool notified = false;
  std::optional<Token> secret;             // the owner's claim secret, once it sent it
  std::unordered_set<std::uint64_t> reqs;  // requests awaiting an answer
};

namespace {

Connection::Sink fatal(std::string why) {
  Connection::Sink s;
  s.fatal = true;
  s.error = std::move(why);
  return s;
}

ErrorCode code_from_wire(std::uint32_t status) {
  if (status >= static_cast<std::uint32_t>(ErrorCode::InvalidArgument) &&
      status <= static_cast<std::uint32_t>(ErrorCode::Internal))
    return static_cast<ErrorCode>(status);
  return ErrorCode::ProtocolError;
}

}  // namespace

TcpTransport::TcpTransport(uv_loop_t* loop, Defer defer, Options options)
    : loop_(loop),
      defer_(defer),
      options_(std::move(options)),
      exposures_("tcp", std::move(defer)) {
  caps_.method = "tcp";
  caps_.rank = 100;
  caps_.memory_kinds = bit(MemoryKind::host);
  caps_.same_host_only = false;
  caps_.passive_cpu_free = false;
  if (options_.chunk_size == 0 || options_.window < options_.chunk_size)
    throw Error(ErrorCode::InvalidArgument, "tcp.window must be at least tcp.chunk_size (> 0)");
  SocketAddress bind_addr;
  if (!SocketAddress::from_parts(options_.bind_address, options_.port, bind_addr))
    throw Error(ErrorCode::InvalidArgument,
                "tcp.bind_address '" + options_.bind_address + "' is not a numeric IP address");
  if (bind_addr.is_wildcard() && options_.advertise_address.empty())
    throw Error(
        ErrorCode::InvalidArgument,
        "binding the wildcard address " + options_.bind_address + " needs tcp.advertise_address");

  listen_fd_ = ::socket(bind_addr.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) throw Error(ErrorCode::Internal, "socket: " + socket_error_text(errno));
  int one = 1;
  setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(listen_fd_, bind_addr.get(), bind_addr.length) != 0 ||
      ::listen(listen_fd_, SOMAXCONN) != 0) {
    int err = errno;
    ::close(listen_fd_);
    throw Error(ErrorCode::Internal,
                "cannot listen on " + bind_addr.to_string() + ": " + socket_error_text(err));
  }
  SocketAddress bound;
  bound.length = sizeof bound.storage;
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound.storage), &bound.length);
  if (options_.advertise_address.empty()) {
    advertised_ = bound.to_string();
  } else {
    SocketAddress adv;
    if (!SocketAddress::from_parts(options_.advertise_address, bound.port(), adv)) {
      ::close(listen_fd_);
      throw Error(
          ErrorCode::InvalidArgument,
          "tcp.advertise_address '" + options_.advertise_address + "' is not a numeric IP address");
    }
    advertised_ = adv.to_string();
  }

  try {
    listen_poll_ = loop::Poll::poll(loop_, listen_fd_, this);
  } catch (...) {
    ::close(listen_fd_);
    throw;
  }
  uv_poll_start(listen_poll_.get(), UV_READABLE, &TcpTransport::on_listen);
  listen_retry_ = loop::Timer::timer(loop_, this);
  sweep_ = loop::Timer::timer(loop_, this);

  // Never accept so many connections that the process runs out of descriptors for everything
  // else (NATS, client connections, the application's own files).
  rlimit nofile{};
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur != RLIM_INFINITY) {
    const auto reserve = std::min<rlim_t>(nofile.rlim_cur / 4, 256);
    const auto usable = static_cast<std::size_t>(nofile.rlim_cur - reserve);
    max_accepted_ = std::max<std::size_t>(1, std::min(options_.max_connections, usable));
  } else {
    max_accepted_ = options_.max_connections;
  }
}

TcpTransport::~TcpTransport() { close(); }

std::vector<Endpoint> TcpTransport::endpoints() const {
  return {Endpoint{caps_.method, advertised_, {}}};
}

void TcpTransport::close() {
  if (closed_) return;
  closed_ = true;
  life_.reset();
  sweep_.reset();
  unclaimed_.clear();
  if (listen_poll_) {
    listen_poll_.reset();
    ::close(listen_fd_);
    listen_fd_ = -1;
    listen_retry_.reset();
  }
  for (auto& [id, t] : transfers_) {
    t->finished = true;
    t->owner = nullptr;
  }
  transfers_.clear();
  pending_.clear();
  exposures_.clear();
  pool_.clear();
  for (auto& [id, conn] : conns_) conn->close_gracefully();
  conns_.clear();  // closes each socket; no handler calls
  graveyard_.clear();
}

// ---------------------------------------------------------------------------------------
// Listener

void TcpTransport::on_listen(uv_poll_t* handle, int status, int) {
  auto* self = static_cast<TcpTransport*>(handle->data);
  if (status < 0 || self == nullptr || self->closed_) return;
  loop::guarded("tcp listener", [self] { self->accept_all(); });
}

void TcpTransport::accept_all() {
  for (;;) {
    SocketAddress peer;
    peer.length = sizeof peer.storage;
    int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer.storage), &peer.length,
                       SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      // Out of descriptors or memory: the listener stays readable, so stop watching it for a
      // moment instead of spinning, and say so once per pause.
      std::fprintf(stderr, "ferry: tcp accept failed (%s); pausing the listener for 100 ms\n",
                   socket_error_text(errno).c_str());
      uv_poll_stop(listen_poll_.get());
      uv_timer_start(
          listen_retry_.get(),
          [](uv_timer_t* t) {
            auto* self = static_cast<TcpTransport*>(t->data);
            if (self != nullptr && self->listen_poll_)
              uv_poll_start(self->listen_poll_.get(), UV_READABLE, &TcpTransport::on_listen);
          },
          100, 0);
      return;
    }
    // Connections that never claim an operation must not lock real peers out: past the
    // bound, the oldest of them makes room.
    if (!unclaimed_.empty() && unclaimed_.size() >= options_.max_unclaimed)
      evict(unclaimed_.begin()->second, "too many connections that claim no operation");
    if (accepted_ >= max_accepted_) {
      ::close(fd);
      continue;
    }
    ++accepted_;
    apply_peer_options(fd, options_.peer_timeout);
    std::uint64_t id = next_conn_++;
    conns_[id] = std::make_unique<Connection>(loop_, handler(), Connection::Role::server, fd, id,
                                              peer.to_string(), options_.peer_timeout, false);
    unclaimed_.emplace(id, id);
    if (unclaimed_.size() == 1) arm_sweep();
  }
}

void TcpTransport::evict(std::uint64_t id, const std::string& why) {
  unclaimed_.erase(id);
  Connection* conn = find_conn(id);
  if (conn == nullptr || !conn->open()) return;
  // Tell it why, then free the slot at once: an evicted peer that never reads must not keep
  // holding it while a lingering close waits for it.
  FrameHeader h;
  h.type = FrameType::status;
  h.status = static_cast<std::uint32_t>(ErrorCode::AccessDenied);
  conn->send(h, why);
  conn->close_gracefully();
  conn->fail(why);
}

void TcpTransport::arm_sweep() {
  uv_timer_start(
      sweep_.get(),
      [](uv_timer_t* t) {
        if (t->data != nullptr) static_cast<TcpTransport*>(t->data)->sweep();
      },
      static_cast<std::uint64_t>(options_.unclaimed_timeout.count()), 0);
}

void TcpTransport::sweep() {
  // Connections accepted before the cut-off that still claim nothing are closed. The timer
  // runs only while such connections exist, so an idle transport costs no wake-ups.
  const auto now = std::chrono::steady_clock::now();
  std::vector<std::uint64_t> stale;
  for (const auto& [id, conn_id] : unclaimed_) {
    Connection* conn = find_conn(conn_id);
    if (conn != nullptr && now - conn->opened_at() >= options_.unclaimed_timeout)
      stale.push_back(conn_id);
  }
  for (std::uint64_t id : stale)
    evict(id, "no operation claimed within " + std::to_string(options_.unclaimed_timeout.count()) +
                  " ms");
  if (!unclaimed_.empty()) arm_sweep();
}

Connection* TcpTransport::find_conn(std::uint64_t id) {
  auto it = conns_.find(id);
  return it == conns_.end() ? nullptr : it->second.get();
}

void TcpTransport::add_pending(std::uint64_t req, const Pending& p) {
  pending_[req] = p;
  if (Connection* c = find_conn(p.conn)) c->expect_answers(+1);
}

void TcpTransport::erase_pending(std::unordered_map<std::uint64_t, Pending>::iterator it) {
  if (Connection* c = find_conn(it->second.conn)) c->expect_answers(-1);
  pending_.erase(it);
}

void TcpTransport::erase_pending(std::uint64_t req) {
  if (auto it = pending_.find(req); it != pending_.end()) erase_pending(it);
}

void TcpTransport::bury(Connection& conn) {
  if (conn.role() == Connection::Role::server) --accepted_;
  unclaimed_.erase(conn.id());
  auto it = conns_.find(conn.id());
  if (it == conns_.end()) return;
  // The connection may be on the stack below us; it is destroyed after this loop callback.
  graveyard_.push_back(std::move(it->second));
  conns_.erase(it);
  if (graveyard_.size() == 1) {
    defer_([this, life = std::weak_ptr<int>(life_)] {
      if (!life.expired()) graveyard_.clear();
    });
  }
}

// ---------------------------------------------------------------------------------------
// Connection events

Connection::Sink TcpTransport::on_frame(Connection& conn, const FrameHeader& h,
                                        std::string message) {
  if (conn.role() == Connection::Role::server) return serve_frame(conn, h, std::move(message));
  return client_frame(conn, h, std::move(message));
}

void TcpTransport::on_payload(Connection& conn, const FrameHeader& h, std::uint64_t, bool intact) {
  if (conn.role() == Connection::Role::server) {
    // The end of a WRITE: answer it now that its bytes are in memory (or were refused).
    if (intact && exposures_.find(h.op_id) != nullptr) {
      exposures_.landed(h.op_id, h.addr, h.len);
      reply_ok(conn, h.req_id);
      return;
    }
    if (h.len == 0) {
      reply_status(conn, h.req_id, ErrorCode::AccessDenied, "empty write");
      return;
    }
    auto v = exposures_.check(h.op_id, h.token, Access::write, h.addr, h.len, conn.id());
    if (v.ok())
      reply_status(conn, h.req_id, ErrorCode::Cancelled, "the operation ended while bytes arrived");
    else
      reply_status(conn, h.req_id, v.code, v.message);
    return;
  }
  // The end of a DATA frame.
  auto it = pending_.find(h.req_id);
  if (it == pending_.end()) return;  // its transfer was cancelled; the bytes were dropped
  Pending p = it->second;
  erase_pending(it);
  auto tit = transfers_.find(p.transfer);
  if (!intact || tit == transfers_.end() || tit->second->finished) return;
  chunk_done(*tit->second, h.req_id, p.len);
}

void TcpTransport::on_sent(Connection& conn, std::uint64_t tag) {
  if (conn.role() != Connection::Role::server) return;
  if (exposures_.sent(tag)) finish_exposure(tag, std::nullopt);
}

void TcpTransport::on_closed(Connection& conn, const std::string& reason) {
  const std::string who = conn.describe_peer();
  if (conn.role() == Connection::Role::client) {
    if (auto it = pool_.find(conn.peer_address()); it != pool_.end() && it->second == &conn)
      pool_.erase(it);
    // A server that explained itself before closing (a protocol error: a configuration
    // mismatch, say) has not been lost: retrying would fail the same way.
    Error error = conn.notice().empty()
                      ? Error(ErrorCode::PeerLost, "connection to peer " + who + " lost: " + reason)
                      : Error(code_from_wire(conn.notice_code()),
                              "peer " + who + " closed the connection: " + conn.notice());
    for (auto& [id, t] : transfers_) {
      if (t->conn != &conn) continue;
      finish_transfer(*t, error);
      t->conn = nullptr;  // the connection is about to be destroyed
    }
  } else {
    exposures_.lose_connection(
        conn.id(), Error(ErrorCode::PeerLost, "peer " + who + " disconnected: " + reason));
  }
  std::erase_if(pending_, [&](const auto& kv) { return kv.second.conn == conn.id(); });
  bury(conn);
}

// ---------------------------------------------------------------------------------------
// Server side: serving exposures

std::shared_ptr<const Registration> TcpTransport::register_memory(const Region& region) {
  if (region.kind != MemoryKind::host)
    throw Error(ErrorCode::Unsupported, "tcp moves host memory only");
  return registrations_.acquire(region);
}

std::string TcpTransport::expose(const Exposure& exposure, ExposureObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  exposures_.add(exposure, observer);
  return {};
}

void TcpTransport::revoke(std::uint64_t id, const Error& reason) {
  const std::uint64_t bound = exposures_.revoke(id);
  if (bound == 0) return;
  release_served(bound, id, reason);
  if (Connection* conn = find_conn(bound)) {
    conn->expect_answers(-1);
    // The owner ended the operation (cancelled, deadline, shutdown): its claimant learns why
    // at once, instead of an access refusal for its next request.
    FrameHeader h;
    h.type = FrameType::status;
    h.op_id = id;
    h.status = static_cast<std::uint32_t>(reason.code());
    conn->send(h, std::string_view(reason.message()).substr(0, kMaxMessage));
  }
}

void TcpTransport::release_served(std::uint64_t conn_id, std::uint64_t id, const Error& reason) {
  Connection* conn = find_conn(conn_id);
  if (conn == nullptr) return;
  // Read responses still queued become error answers that tell the claimant why (one partly
  // sent finishes from a copy); a payload being received is drained, not stored.
  conn->release(id, [&](FrameHeader& h, std::string& message) {
    h.type = FrameType::status;
    h.status = static_cast<std::uint32_t>(reason.code());
    message = reason.message().substr(0, kMaxMessage);
  });
  conn->drop_sink(id);
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
  if (std::uint64_t bound = exposures_.finish(id, std::move(peer_error)); bound != 0) {
    release_served(bound, id, reason);
    if (Connection* conn = find_conn(bound)) conn->expect_answers(-1);
  }
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
  if (h.status == 0 && access == Access::write) {
    // A writable is complete only when every byte it exposes was written at least once:
    // bytes written twice do not count twice.
    const std::uint64_t exposed = exposures_.exposed(h.op_id);
    const std::uint64_t written = exposures_.written(h.op_id);
    if (written < exposed) {
      std::string why = "peer " + conn.describe_peer() + " said it was done after writing " +
                        std::to_string(written) + " of " + std::to_string(exposed) + " bytes";
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

// ---------------------------------------------------------------------------------------
// Client side: active transfers

std::unique_ptr<Transfer> TcpTransport::start(TransferSpec spec, TransferObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  SocketAddress addr;
  if (!SocketAddress::parse(spec.endpoint.address, addr))
    throw Error(ErrorCode::InvalidMetadata,
                "tcp endpoint '" + spec.endpoint.address + "' is not a numeric ip:port",
                "endpoints");
  auto t = std::make_unique<TcpTransfer>(*this, next_transfer_++, std::move(spec), observer);
  transfers_[t->id] = t.get();
  std::string error;
  t->conn = connect_to(addr, t->spec.peer_name, error);
  if (t->conn == nullptr) {
    finish_transfer(*t, Error(ErrorCode::PeerLost, "cannot connect to peer '" + t->spec.peer_name +
                                                       "' at " + addr.to_string() + ": " + error));
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
                                           options_.peer_timeout, connecting);
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
    add_pending(req, Pending{t.id, writing ? PendingKind::write_chunk : PendingKind::read_chunk,
                             local, len, t.conn->id()});
    t.reqs.insert(req);
    t.inflight += len;
    t.seg_off += len;
    if (t.seg_off == s.len) {
      ++t.seg;
      t.seg_off = 0;
    }
    t.conn->send(h, {}, writing ? local : nullptr, writing ? t.id : 0);
  }
  // A write is announced done right behind its last chunk; the peer answers DONE only after
  // every chunk before it is in its memory, so that answer completes the transfer.
  if (writing && !t.finished && !t.done_sent && t.seg == t.spec.segments.size()) {
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
      sink.dest = p.local;
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
          if (t.done == t.total) finish_transfer(t, std::nullopt);
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

void TcpTransport::finish_transfer(TcpTransfer& t, std::optional<Error> error) {
  if (t.finished) return;
  t.finished = true;
  for (std::uint64_t req : t.reqs) erase_pending(req);
  t.reqs.clear();
  if (t.conn != nullptr) {
    t.conn->release(t.id);
    t.conn->drop_sink(t.id);
  }
  std::uint64_t id = t.id;
  defer_([this, life = std::weak_ptr<int>(life_), id, error] {
    if (life.expired()) return;
    auto it = transfers_.find(id);
    if (it == transfers_.end() || it->second->notified) return;
    TcpTransfer& tr = *it->second;
    tr.notified = true;
    if (error)
      tr.observer->on_transfer_failed(*error);
    else
      tr.observer->on_transfer_complete();
  });
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
