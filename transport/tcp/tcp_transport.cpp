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

TcpTransport::TcpTransport(uv_loop_t* loop, Defer defer, Options options)
    : loop_(loop),
      defer_(defer),
      options_(std::move(options)),
      exposures_("tcp", std::move(defer)) {
  caps_.method = "tcp";
  caps_.rank = 100;
  caps_.memory_kinds = bit(MemoryKind::host);
#ifdef FERRY_WITH_CUDA
  cuda_ = options_.cuda;
  if (cuda_ != nullptr) caps_.memory_kinds |= bit(MemoryKind::cuda);
#endif
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
#ifdef FERRY_WITH_CUDA
  // Copies in flight end first (the engine waits for them, without their completions).
  copies_.reset();
  server_staged_.clear();
  receiving_.clear();
  waiting_reads_.clear();
  parked_done_.clear();
#endif
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
#ifdef FERRY_WITH_CUDA
  // Last: the connections above may have sent their last frames from staging chunks.
  client_staging_.reset();
  server_staging_.reset();
  if (staging_ctx_ != nullptr) {
    CUdevice dev = 0;
    if (cuda_->device_get(&dev, staging_device_) == CUDA_SUCCESS)
      (void)cuda_->device_primary_ctx_release(dev);
    staging_ctx_ = nullptr;
  }
#endif
}

// ---------------------------------------------------------------------------------------
// Listener

void TcpTransport::on_listen(uv_poll_t* handle, int status, int) {
  auto* self = static_cast<TcpTransport*>(handle->data);
  if (status < 0 || self == nullptr || self->closed_) return;
  loop::guarded(self->options_.log, "tcp listener", [self] { self->accept_all(); });
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
      options_.log.warning("tcp: accepting a connection failed (" + socket_error_text(errno) +
                           "); pausing the listener for 100 ms");
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
                                              peer.to_string(), options_.peer_timeout, false,
                                              options_.log);
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
#ifdef FERRY_WITH_CUDA
    if (!receiving_.empty() && staged_payload(conn, h, intact)) return;
#endif
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
#ifdef FERRY_WITH_CUDA
  if (p.staging != nullptr) {
    // The bytes are in a staging chunk: the chunk is done once they are in the device.
    stage_read_landed(*tit->second, h.req_id, p);
    return;
  }
#endif
  chunk_done(*tit->second, h.req_id, p.len);
}

void TcpTransport::on_sent(Connection& conn, std::uint64_t tag) {
  if (conn.role() != Connection::Role::server) return;
#ifdef FERRY_WITH_CUDA
  if ((tag & kStagedTag) != 0) {
    // DATA sent from a staging chunk: the chunk is free again.
    auto it = server_staged_.find(tag);
    if (it == server_staged_.end()) return;
    const std::uint64_t op = it->second.op;
    std::byte* chunk = it->second.chunk;
    server_staged_.erase(it);
    server_staging_->release(chunk);
    if (exposures_.sent(op)) finish_exposure(op, std::nullopt);
    return;
  }
#endif
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
      // Before the peer's HELLO, nothing of either side's memory was touched: another method
      // may still work.
      finish_transfer(*t, error, /*setup=*/!conn.greeted());
      t->conn = nullptr;  // the connection is about to be destroyed
    }
  } else {
#ifdef FERRY_WITH_CUDA
    drop_staged_conn(conn.id());
#endif
    exposures_.lose_connection(
        conn.id(), Error(ErrorCode::PeerLost, "peer " + who + " disconnected: " + reason));
  }
  std::erase_if(pending_, [&](const auto& kv) { return kv.second.conn == conn.id(); });
  bury(conn);
}

}  // namespace ferry::transport::tcp
