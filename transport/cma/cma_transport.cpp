#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "loop/ids.hpp"
#include "transport/cma/cma_internal.hpp"
#include "transport/exposure_table.hpp"
#ifdef FERRY_WITH_CUDA
#include "transport/cma/cuda_ipc.hpp"
#include "transport/cuda/copy_engine.hpp"
#else
// Without CUDA nothing makes these (there is no cuda_ipc mode); empty types let the members
// that would hold them be destroyed.
namespace ferry::transport::cuda {
class CopyEngine {};
}  // namespace ferry::transport::cuda
namespace ferry::transport::cma {
class VmmExports {};
}  // namespace ferry::transport::cma
#endif

namespace ferry::transport::cma {

namespace {

constexpr std::size_t kMaxAccepted = 1024;

}  // namespace

// ---------------------------------------------------------------------------------------
// The endpoint

std::string to_info(const OwnerInfo& info) {
  nlohmann::json j;
  j["pid"] = info.scope.pid;
  j["boot_id"] = info.scope.boot_id;
  j["pid_ns"] = info.scope.pid_ns;
  j["probe"] = loop::hex16(info.probe);
  j["nonce"] = token_to_hex(info.nonce);
  j["grants"] = {{"fd", info.grants_fd}, {"bytes", info.grants_bytes}};
  return j.dump();
}

OwnerInfo parse_info(const std::string& text) {
  auto bad = [](const std::string& why) {
    return Error(ErrorCode::InvalidMetadata, "cma endpoint info: " + why, "endpoints");
  };
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object()) throw bad("not a JSON object");
  OwnerInfo info;
  try {
    info.scope.pid = j.at("pid").get<std::int64_t>();
    info.scope.boot_id = j.at("boot_id").get<std::string>();
    info.scope.pid_ns = j.at("pid_ns").get<std::uint64_t>();
    const std::string probe = j.at("probe").get<std::string>();
    if (!loop::parse_hex16(probe, info.probe)) throw bad("probe is not 16 hex digits");
    if (!token_from_hex(j.at("nonce").get<std::string>(), info.nonce))
      throw bad("nonce is not 32 hex digits");
    info.grants_fd = j.at("grants").at("fd").get<int>();
    info.grants_bytes = j.at("grants").at("bytes").get<std::uint64_t>();
  } catch (const nlohmann::json::exception& e) {
    throw bad(e.what());
  }
  if (info.scope.pid <= 0 || info.scope.pid > (1 << 22)) throw bad("pid out of range");
  if (info.scope.boot_id.empty() || info.scope.boot_id.size() > 64) throw bad("bad boot_id");
  if (info.grants_fd < 0 || info.grants_bytes == 0 || info.grants_bytes > (64u << 20))
    throw bad("bad grant table");
  return info;
}

bool socket_address(const std::string& address, sockaddr_un& out, socklen_t& len) {
  if (address.size() < 2 || address.front() != '@' || address.size() > sizeof out.sun_path)
    return false;
  for (char c : address.substr(1))
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.')
      return false;
  out = {};
  out.sun_family = AF_UNIX;
  // An abstract name: a leading NUL, then the name, not NUL-terminated.
  std::memcpy(out.sun_path + 1, address.data() + 1, address.size() - 1);
  len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size());
  return true;
}

std::string CmaTransport::unavailable(bool ptracer_any) { return unavailable_reason(ptracer_any); }

CmaTransport::CmaTransport(uv_loop_t* loop, Defer defer, Options options)
    : loop_(loop),
      defer_(defer),
      options_(std::move(options)),
      grants_(options_.grant_slots),
      exposures_(options_.cuda_ipc != nullptr ? "cuda_ipc" : "cma", std::move(defer)) {
  caps_.method = ipc() ? "cuda_ipc" : "cma";
  // cuda_ipc first: a copy by the GPU between two device memories beats any other way.
  caps_.rank = ipc() ? 400 : 200;
  // cuda_ipc: the owner's memory is CUDA (register_memory refuses host memory), the active
  // side's either.
  caps_.memory_kinds =
      ipc() ? bit(MemoryKind::cuda) | bit(MemoryKind::host) : bit(MemoryKind::host);
#ifdef FERRY_WITH_CUDA
  // cma: CUDA memory of the active side is staged through pinned host chunks
  // (cma_staging.cpp); the owner's memory is host memory still (register_exposed).
  if (!ipc() && options_.cuda != nullptr) caps_.memory_kinds |= bit(MemoryKind::cuda);
#endif
  caps_.same_host_only = true;
  caps_.passive_cpu_free = true;
  if (options_.chunk_size == 0 || options_.parallel == 0)
    throw Error(ErrorCode::InvalidArgument, "cma.chunk_size and cma.parallel must be positive");
  if (auto why = unavailable_reason(options_.ptracer_any); !why.empty())
    throw Error(ErrorCode::Unsupported, caps_.method + ": " + why);
#ifndef FERRY_WITH_CUDA
  if (ipc()) throw Error(ErrorCode::Unsupported, "cuda_ipc: this ferry was built without CUDA");
#endif
  if (options_.ptracer_any && yama_ptrace_scope() == 1)
    if (auto why = allow_any_ptracer(); !why.empty())
      throw Error(ErrorCode::Unsupported, "cma: " + why);

  probe_ = std::make_unique<Token>(random_token());
  address_ = (ipc() ? "@ferry-cudaipc-" : "@ferry-cma-") + loop::hex16(loop::random_u64());
  sockaddr_un addr{};
  socklen_t len = 0;
  socket_address(address_, addr, len);
  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) throw Error(ErrorCode::Internal, "cma socket: " + errno_text(errno));
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      ::listen(listen_fd_, SOMAXCONN) != 0) {
    const int err = errno;
    ::close(listen_fd_);
    throw Error(ErrorCode::Internal, "cma: cannot listen on " + address_ + ": " + errno_text(err));
  }
  try {
    listen_poll_ = loop::Poll::poll(loop_, listen_fd_, this);
  } catch (...) {
    ::close(listen_fd_);
    throw;
  }
  uv_poll_start(listen_poll_.get(), UV_READABLE, &CmaTransport::on_listen);
  keepalive_ = loop::Timer::timer(loop_, this);

  OwnerInfo info;
  info.scope = this_process();
  info.probe = reinterpret_cast<std::uint64_t>(probe_->data());
  info.nonce = *probe_;
  info.grants_fd = grants_.fd();
  info.grants_bytes = grants_.bytes();
  info_ = to_info(info);
}

CmaTransport::~CmaTransport() { close(); }

std::vector<Endpoint> CmaTransport::endpoints() const {
  return {Endpoint{caps_.method, address_, info_}};
}

std::string CmaTransport::unreachable(const Endpoint& endpoint) const {
  OwnerInfo info;
  try {
    info = parse_info(endpoint.info);
  } catch (const Error& e) {
    return e.message();
  }
  // The driver refuses to open a process's own IPC handles.
  if (ipc() && info.scope.pid == ::getpid())
    return "the peer is this process (CUDA IPC opens only another process's memory)";
  return scope_mismatch(info.scope);
}

std::string scope_mismatch(const ProcessScope& owner) {
  const ProcessScope self = this_process();
  if (owner.boot_id != self.boot_id) return "the peer runs on another host (boot id differs)";
  if (owner.pid_ns != self.pid_ns) return "the peer runs in another PID namespace";
  return {};
}

void CmaTransport::close() {
  if (closed_) return;
  closed_ = true;
  life_.reset();
  keepalive_.reset();
  if (listen_poll_) {
    listen_poll_.reset();
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
  for (auto& [id, t] : transfers_) {
    t->copy->halt();
#ifdef FERRY_WITH_CUDA
    if (ipc()) cancel_copies(*t);
    if (t->staged) drop_staged(*t);
#endif
    t->finished = true;
    t->owner = nullptr;
  }
  transfers_.clear();
#ifdef FERRY_WITH_CUDA
  engine_.reset();
  staging_.reset();  // every chunk is back (drop_staged above)
#endif
  pending_.clear();
  // Peers may still copy under grants of exposures never revoked; the memory is the owner's
  // to keep until they are done (revoke() waits for that; here only as long as peer_timeout).
  for (auto& [id, c] : claimed_) {
    close_grant(c);
    // Its HANDLES frame, if still queued, must not read the payload about to go (the
    // connections flush what is queued below).
    if (tcp::Connection* conn = find_conn(c.conn); conn != nullptr && !c.handles.empty())
      conn->release(handles_tag(id));
  }
  claimed_.clear();
  exposures_.clear();
  links_.clear();
  for (auto& [id, conn] : conns_) conn->close_gracefully();
  conns_.clear();
  graveyard_.clear();
  for (auto& [id, a] : accepted_)
    if (a.pidfd >= 0) ::close(a.pidfd);
  accepted_.clear();
}

std::shared_ptr<const Registration> CmaTransport::register_memory(const Region& region) {
  // cuda_ipc: the active side's memory may be host memory too (the GPU copies to and from it).
  // cma: CUDA memory of the active side too, where the driver is usable (cma_staging.cpp).
  if (!ipc() && !caps_.moves(region.kind))
    throw Error(ErrorCode::Unsupported, "cma moves host memory only");
  return registrations_.acquire(region);
}

std::shared_ptr<const Registration> CmaTransport::register_exposed(const Region& region) {
  if (ipc()) {
    if (region.kind != MemoryKind::cuda)
      throw Error(ErrorCode::Unsupported,
                  "cuda_ipc shares CUDA memory only (host memory is the cma method's)");
    // Memory that cannot be shared is refused here, so the operation is not offered by this
    // method (another one moves it).
    (void)handles_of(Exposure{0, {}, Access::read, {region}});
  } else if (region.kind != MemoryKind::host) {
    // A peer's process_vm_readv/writev cannot reach this process's device memory: cma stages
    // CUDA memory of its active side only, so the operation is not offered by cma.
    throw Error(ErrorCode::Unsupported,
                "cma does not serve CUDA memory (process_vm_readv/writev cannot reach it; "
                "cuda_ipc or tcp moves it)");
  }
  return register_memory(region);
}

#ifndef FERRY_WITH_CUDA
// Without CUDA there is no cuda_ipc mode (the constructor refuses it).
std::vector<std::byte> CmaTransport::handles_of(const Exposure&) const {
  throw Error(ErrorCode::Unsupported, "cuda_ipc: this ferry was built without CUDA");
}
#endif

// ---------------------------------------------------------------------------------------
// Listener and connections

void CmaTransport::on_listen(uv_poll_t* handle, int status, int) {
  auto* self = static_cast<CmaTransport*>(handle->data);
  if (status < 0 || self == nullptr || self->closed_) return;
  loop::guarded(self->options_.log, "cma listener", [self] { self->accept_all(); });
}

void CmaTransport::accept_all() {
  for (;;) {
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        options_.log.warning("cma: accepting a connection failed: " + errno_text(errno));
      return;
    }
    if (accepted_.size() >= kMaxAccepted) {
      ::close(fd);
      continue;
    }
    ucred cred{};
    socklen_t len = sizeof cred;
    Accepted a;
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
      a.pid = cred.pid;
      // Watching the peer's process lets revoke() stop waiting for a peer that died mid-copy.
      a.pidfd = open_pidfd(cred.pid);
    }
    const std::uint64_t id = next_conn_++;
    conns_[id] = std::make_unique<tcp::Connection>(loop_, handler(), tcp::Connection::Role::server,
                                                   fd, id, "pid " + std::to_string(a.pid),
                                                   options_.peer_timeout, false, options_.log);
    accepted_[id] = a;
  }
}

tcp::Connection* CmaTransport::find_conn(std::uint64_t id) {
  auto it = conns_.find(id);
  return it == conns_.end() ? nullptr : it->second.get();
}

bool CmaTransport::peer_idle(std::uint64_t conn_id) const {
  auto it = accepted_.find(conn_id);
  if (it == accepted_.end()) return false;
  return process_exited(it->second.pidfd) ||
         (it->second.pid > 0 && process_stopped(it->second.pid));
}

void CmaTransport::add_pending(std::uint64_t req, const Pending& p) {
  pending_[req] = p;
  if (tcp::Connection* c = find_conn(p.conn)) c->expect_answers(+1);
}

void CmaTransport::erase_pending(std::uint64_t req) {
  auto it = pending_.find(req);
  if (it == pending_.end()) return;
  if (tcp::Connection* c = find_conn(it->second.conn)) c->expect_answers(-1);
  pending_.erase(it);
}

void CmaTransport::bury(tcp::Connection& conn) {
  if (auto a = accepted_.find(conn.id()); a != accepted_.end()) {
    if (a->second.pidfd >= 0) ::close(a->second.pidfd);
    accepted_.erase(a);
  }
  claim_bufs_.erase(conn.id());
  auto it = conns_.find(conn.id());
  if (it == conns_.end()) return;
  graveyard_.push_back(std::move(it->second));
  conns_.erase(it);
  if (graveyard_.size() == 1) {
    defer_([this, life = std::weak_ptr<int>(life_)] {
      if (!life.expired()) graveyard_.clear();
    });
  }
}

tcp::Connection::Sink CmaTransport::on_frame(tcp::Connection& conn, const tcp::FrameHeader& h,
                                             std::string message) {
  if (conn.role() == tcp::Connection::Role::server) return serve_frame(conn, h, std::move(message));
  return client_frame(conn, h, std::move(message));
}

void CmaTransport::on_payload(tcp::Connection& conn, const tcp::FrameHeader& h, std::uint64_t,
                              bool intact) {
  // Toward a server only a CLAIM carries a payload (its ranges); toward a client only the
  // HANDLES of cuda_ipc.
  if (conn.role() == tcp::Connection::Role::server) {
    if (intact) serve_claim(conn, h);
    return;
  }
  if (!intact || h.type != tcp::FrameType::handles) return;
  auto it = pending_.find(h.req_id);
  if (it == pending_.end() || it->second.conn != conn.id()) return;
  if (auto t = transfers_.find(it->second.transfer); t != transfers_.end())
    t->second->handles_whole = true;
}

void CmaTransport::on_closed(tcp::Connection& conn, const std::string& reason) {
  const std::string who = conn.describe_peer();
  if (conn.role() == tcp::Connection::Role::client) {
    std::erase_if(links_, [&](const auto& kv) { return kv.second->conn == &conn; });
    Error error = conn.notice().empty()
                      ? Error(ErrorCode::PeerLost, "connection to peer " + who + " lost: " + reason)
                      : Error(code_from_wire(conn.notice_code()),
                              "peer " + who + " closed the connection: " + conn.notice());
    // Every transfer on it (also those of a link replaced in the pool meanwhile).
    std::vector<CmaTransfer*> on_it;
    for (auto& [id, t] : transfers_)
      if (t->link && t->link->conn == &conn) on_it.push_back(t);
    for (CmaTransfer* t : on_it) t->link->conn = nullptr;
    // Before the claim was granted, nothing of either side's memory was touched.
    for (CmaTransfer* t : on_it) finish_transfer(*t, error, /*setup=*/!t->claimed);
  } else {
    // Its copies are over (a process closes its sockets last) or bounded by peer_timeout.
    for (auto it = claimed_.begin(); it != claimed_.end();) {
      if (it->second.conn != conn.id()) {
        ++it;
        continue;
      }
      close_grant(it->second);
      it = claimed_.erase(it);
    }
    exposures_.lose_connection(
        conn.id(), Error(ErrorCode::PeerLost, "peer " + who + " disconnected: " + reason));
  }
  std::erase_if(pending_, [&](const auto& kv) { return kv.second.conn == conn.id(); });
  bury(conn);
}

}  // namespace ferry::transport::cma
