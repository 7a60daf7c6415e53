#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "loop/ids.hpp"
#include "transport/tcp/socket.hpp"
#include "transport/verbs/verbs_internal.hpp"

#ifdef FERRY_WITH_CUDA
#include "transport/cuda/copy_engine.hpp"  // the staging members' destructors
#endif

namespace ferry::transport::verbs {

namespace {

constexpr int kResolveMs = 2000;

/// What connect and accept ask of the connection: our private data, RDMA READs in flight
/// within the device's limits, and retries (a peer short of receive buffers is waited for).
rdma_conn_param conn_param(const Device& dev, CmPrivate& priv) {
  rdma_conn_param param{};
  param.private_data = &priv;
  param.private_data_len = sizeof priv;
  param.responder_resources =
      static_cast<std::uint8_t>(std::min(16, std::max(1, dev.attr.max_qp_rd_atom)));
  param.initiator_depth =
      static_cast<std::uint8_t>(std::min(16, std::max(1, dev.attr.max_qp_init_rd_atom)));
  param.retry_count = 7;
  param.rnr_retry_count = 7;
  return param;
}

/// The table to call: `api`, else the system's; throws Error(Unsupported) when that cannot
/// be loaded.
const VerbsApi& pick(const VerbsApi* api) {
  if (api != nullptr) return *api;
  std::string why;
  const VerbsApi* system = system_verbs(&why);
  if (system == nullptr) throw Error(ErrorCode::Unsupported, "verbs: " + why);
  return *system;
}

void* id_ptr(std::uint64_t id) { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(id)); }
std::uint64_t ptr_id(void* p) {
  return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p));
}

}  // namespace

VerbsTransport::VerbsTransport(uv_loop_t* loop, Defer defer, Options options)
    : loop_(loop),
      defer_(defer),
      options_(std::move(options)),
      api_(pick(options_.api)),
      exposures_("verbs", std::move(defer)) {
  caps_.method = "verbs";
  caps_.rank = 300;
  caps_.memory_kinds = bit(MemoryKind::host);
#ifdef FERRY_WITH_CUDA
  cuda_ = options_.cuda;
  if (cuda_ != nullptr) caps_.memory_kinds |= bit(MemoryKind::cuda);
#endif
  caps_.same_host_only = false;
  caps_.passive_cpu_free = true;
  if (options_.queue_depth < 4 || options_.signal_every == 0 || options_.max_wr_bytes == 0)
    throw Error(ErrorCode::InvalidArgument,
                "verbs.queue_depth must be at least 4, signal_every and max_wr_bytes positive");
  registrations_ = RegistrationCache([this](const Region& r) { return register_region(r); });

  tcp::SocketAddress bind;
  if (!tcp::SocketAddress::from_parts(options_.bind_address, options_.port, bind))
    throw Error(ErrorCode::InvalidArgument,
                "verbs: bind address '" + options_.bind_address + "' is not a numeric address");
  open_devices();
  watchdog_ = loop::Timer::timer(loop_, this);
  cm_channel_ = api_.create_event_channel();
  if (cm_channel_ == nullptr ||
      ::fcntl(cm_channel_->fd, F_SETFL, ::fcntl(cm_channel_->fd, F_GETFL) | O_NONBLOCK) != 0) {
    close();
    throw Error(ErrorCode::Unsupported, "verbs: cannot make an rdma_cm event channel");
  }
  if (api_.create_id(cm_channel_, &listener_, nullptr, RDMA_PS_TCP) != 0) {
    listener_ = nullptr;
    close();
    throw Error(ErrorCode::Unsupported, "verbs: rdma_create_id failed");
  }
  if (api_.bind_addr(listener_, const_cast<sockaddr*>(bind.get())) != 0 ||
      api_.listen(listener_, 128) != 0) {
    const int err = errno;
    close();
    throw Error(ErrorCode::Unsupported,
                "verbs: rdma_cm cannot listen on " + bind.to_string() + ": " + std::strerror(err));
  }
  const std::uint16_t port = ntohs(api_.get_src_port(listener_));
  tcp::SocketAddress at;
  tcp::SocketAddress::from_parts(options_.bind_address, port, at);
  address_ = at.to_string();
  cm_poll_ = loop::Poll::poll(loop_, cm_channel_->fd, this);
  uv_poll_start(cm_poll_.get(), UV_READABLE, &VerbsTransport::on_cm);
}

VerbsTransport::~VerbsTransport() { close(); }

std::vector<Endpoint> VerbsTransport::endpoints() const {
  return {Endpoint{caps_.method, address_, {}}};
}

std::optional<Error> VerbsTransport::parse_endpoint(const Endpoint& endpoint,
                                                    tcp::SocketAddress& out) {
  if (tcp::SocketAddress::parse(endpoint.address, out)) return std::nullopt;
  return Error(ErrorCode::InvalidMetadata,
               "verbs endpoint address '" + endpoint.address + "' is not a numeric ip:port",
               "endpoints");
}

std::optional<Error> VerbsTransport::endpoint_error(const Endpoint& endpoint) const {
  tcp::SocketAddress a;
  return parse_endpoint(endpoint, a);
}

std::string VerbsTransport::unreachable(const Endpoint& endpoint) const {
  tcp::SocketAddress a;
  if (!tcp::SocketAddress::parse(endpoint.address, a))
    return "'" + endpoint.address + "' is not a numeric ip:port";
  return {};
}

void VerbsTransport::close() {
  if (closed_) return;
  closed_ = true;
  life_.reset();
  cm_poll_.reset();
  watchdog_.reset();
  for (auto& [id, t] : transfers_) {
    t->finished = true;
    t->owner = nullptr;
    // Its copies end here; its chunks' memory stays until the pool goes, after the queue
    // pairs below.
    if (!t->chunks.empty()) drop_chunks(*t);
  }
  transfers_.clear();
  pending_.clear();
  // Queue pairs to error first: peers see the connection end (not a dead key), and no work
  // request of ours touches memory after this.
  for (auto& [id, c] : conns_) {
    if (c->state == Conn::State::up && c->cm != nullptr) api_.disconnect(c->cm);
    if (c->qp != nullptr) {
      ibv_qp_attr attr{};
      attr.qp_state = IBV_QPS_ERR;
      api_.modify_qp(c->qp, &attr, IBV_QP_STATE);
    }
  }
  // Then the keys die: no window or registration of ours serves anyone after this.
  std::vector<std::uint64_t> ids;
  for (auto& [id, s] : served_) ids.push_back(id);
  for (std::uint64_t id : ids) end_served(id);
  exposures_.clear();
  for (auto& dev : devices_)
    if (dev->cq != nullptr) drain(*dev);
  std::vector<std::uint64_t> cids;
  for (auto& [id, c] : conns_) cids.push_back(id);
  for (std::uint64_t id : cids) destroy_conn(id);
  links_.clear();
  if (listener_ != nullptr) api_.destroy_id(listener_);
  listener_ = nullptr;
  if (cm_channel_ != nullptr) api_.destroy_event_channel(cm_channel_);
  cm_channel_ = nullptr;
  registrations_ = RegistrationCache(nullptr);
  for (auto& dev : devices_) {
    dev->comp_poll.reset();
    dev->async_poll.reset();
    if (dev->unacked != 0) api_.ack_cq_events(dev->cq, dev->unacked);
    dev->unacked = 0;
    if (dev->cq != nullptr) api_.destroy_cq(dev->cq);
    if (dev->channel != nullptr) api_.destroy_comp_channel(dev->channel);
    dev->cq = nullptr;
    dev->channel = nullptr;
  }
  close_cuda();
  devices_.clear();  // protection domains go with the last registration in them
}

// ---------------------------------------------------------------------------------------
// rdma_cm events

void VerbsTransport::on_cm(uv_poll_t* handle, int status, int) {
  auto* self = static_cast<VerbsTransport*>(handle->data);
  if (self == nullptr || status < 0) return;
  loop::guarded(self->options_.log, "verbs rdma_cm events", [self] { self->cm_ready(); });
}

void VerbsTransport::cm_ready() {
  while (!closed_) {
    rdma_cm_event* ev = nullptr;
    if (api_.get_cm_event(cm_channel_, &ev) != 0) break;  // EAGAIN: no more
    // Copy what the event says and acknowledge it at once: destroying an id waits for the
    // acknowledgement of its events.
    rdma_cm_event copy = *ev;
    std::string priv;
    if (copy.param.conn.private_data != nullptr && copy.param.conn.private_data_len != 0)
      priv.assign(static_cast<const char*>(copy.param.conn.private_data),
                  copy.param.conn.private_data_len);
    if (copy.event == RDMA_CM_EVENT_CONNECT_REQUEST) {
      // The new id is ours to accept or reject; handle it before the ack.
      copy.param.conn.private_data = priv.data();
      rdma_cm_id* refused = on_connect_request(copy);
      api_.ack_cm_event(ev);
      if (refused != nullptr) api_.destroy_id(refused);  // only after the ack: it waits for it
      continue;
    }
    api_.ack_cm_event(ev);
    copy.param.conn.private_data = priv.data();
    cm_event(copy);
  }
}

void VerbsTransport::cm_event(rdma_cm_event& ev) {
  if (ev.id == nullptr || ev.id == listener_) return;
  Conn* conn = conn_of(ptr_id(ev.id->context));
  if (conn == nullptr || conn->state == Conn::State::failed) return;
  const std::string what = cm_event_text(ev.event);
  switch (ev.event) {
    case RDMA_CM_EVENT_ADDR_RESOLVED: {
      conn->dev = device_of(ev.id->verbs);
      if (conn->dev == nullptr) {
        fail_conn(*conn, ErrorCode::PeerLost, "no device of ours reaches it", true);
        return;
      }
      if (api_.resolve_route(conn->cm, kResolveMs) != 0)
        fail_conn(*conn, ErrorCode::PeerLost,
                  std::string("rdma_resolve_route: ") + std::strerror(errno), true);
      return;
    }
    case RDMA_CM_EVENT_ROUTE_RESOLVED: {
      std::string why;
      if (!make_qp(*conn, why)) {
        fail_conn(*conn, ErrorCode::Internal, why, true);
        return;
      }
      CmPrivate priv;
      priv.id = options_.local_id;
      rdma_conn_param param = conn_param(*conn->dev, priv);
      conn->state = Conn::State::connecting;
      if (api_.connect(conn->cm, &param) != 0)
        fail_conn(*conn, ErrorCode::PeerLost, std::string("rdma_connect: ") + std::strerror(errno),
                  true);
      return;
    }
    case RDMA_CM_EVENT_ESTABLISHED:
      on_established(*conn, ev);
      return;
    case RDMA_CM_EVENT_ADDR_ERROR:
    case RDMA_CM_EVENT_ROUTE_ERROR:
    case RDMA_CM_EVENT_UNREACHABLE:
    case RDMA_CM_EVENT_REJECTED:
    case RDMA_CM_EVENT_CONNECT_ERROR:
      fail_conn(*conn, ErrorCode::PeerLost, what, conn->state != Conn::State::up);
      return;
    case RDMA_CM_EVENT_DISCONNECTED:
    case RDMA_CM_EVENT_DEVICE_REMOVAL:
      // A local port going down may reach us as a disconnect before its async event (or a
      // flushed completion) does: the port is named either way.
      fail_conn(*conn, ErrorCode::PeerLost, what + port_down(*conn));
      return;
    default:
      return;
  }
}

rdma_cm_id* VerbsTransport::on_connect_request(rdma_cm_event& ev) {
  rdma_cm_id* id = ev.id;
  CmPrivate priv;
  if (ev.param.conn.private_data_len < sizeof priv) {
    api_.reject(id, nullptr, 0);
    return id;
  }
  std::memcpy(&priv, ev.param.conn.private_data, sizeof priv);
  if (priv.magic != kCmMagic || priv.version != 1 || closed_) {
    api_.reject(id, nullptr, 0);
    return id;
  }
  auto conn = std::make_shared<Conn>();
  conn->owner = this;
  conn->id = next_conn_++;
  conn->cm = id;
  conn->active = false;
  conn->state = Conn::State::accepting;
  conn->peer_id = loop::hex16(priv.id);
  conn->dev = device_of(id->verbs);
  id->context = id_ptr(conn->id);
  conns_[conn->id] = conn;
  std::string why;
  if (conn->dev == nullptr || !make_qp(*conn, why)) {
    api_.reject(id, nullptr, 0);
    fail_conn(*conn, ErrorCode::Internal, why);
    return nullptr;
  }
  CmPrivate mine;
  mine.id = options_.local_id;
  rdma_conn_param param = conn_param(*conn->dev, mine);
  if (api_.accept(id, &param) != 0)
    fail_conn(*conn, ErrorCode::PeerLost, std::string("rdma_accept: ") + std::strerror(errno));
  return nullptr;
}

bool VerbsTransport::make_qp(Conn& conn, std::string& why) {
  Device& dev = *conn.dev;
  ibv_qp_init_attr attr{};
  attr.send_cq = dev.cq;
  attr.recv_cq = dev.cq;
  attr.qp_type = IBV_QPT_RC;
  attr.sq_sig_all = 0;
  attr.cap.max_send_wr = options_.queue_depth;
  attr.cap.max_recv_wr = kRecvSlots;
  attr.cap.max_send_sge = static_cast<std::uint32_t>(dev.max_sge);
  attr.cap.max_recv_sge = 1;
  if (api_.create_qp(conn.cm, dev.pd->pd, &attr) != 0) {
    why = std::string("rdma_create_qp: ") + std::strerror(errno);
    return false;
  }
  conn.qp = conn.cm->qp;
  conn.qp_num = conn.qp->qp_num;
  by_qp_[conn.qp_num] = conn.id;
  conn.bufs.resize(static_cast<std::size_t>(kRecvSlots + kSendSlots) * kCtlBytes);
  conn.bufs_mr =
      api_.reg_mr(dev.pd->pd, conn.bufs.data(), conn.bufs.size(), IBV_ACCESS_LOCAL_WRITE);
  if (conn.bufs_mr == nullptr) {
    why = std::string("cannot register control buffers: ") + std::strerror(errno);
    return false;
  }
  for (std::uint32_t s = 0; s < kSendSlots; ++s) conn.free_sends.push_back(kSendSlots - 1 - s);
  for (std::uint32_t s = 0; s < kRecvSlots; ++s) post_recv(conn, s);
  return true;
}

void VerbsTransport::post_recv(Conn& conn, std::uint32_t slot) {
  ibv_sge sge{};
  sge.addr = reinterpret_cast<std::uint64_t>(conn.bufs.data()) + std::uint64_t{slot} * kCtlBytes;
  sge.length = kCtlBytes;
  sge.lkey = conn.bufs_mr->lkey;
  ibv_recv_wr wr{};
  wr.wr_id = kRecvBit | slot;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  if (api_.post_recv(conn.qp, &wr, &bad) == 0) ++conn.recvs_posted;
}

void VerbsTransport::on_established(Conn& conn, const rdma_cm_event& ev) {
  if (conn.active && ev.param.conn.private_data_len >= sizeof(CmPrivate)) {
    CmPrivate priv;
    std::memcpy(&priv, ev.param.conn.private_data, sizeof priv);
    if (priv.magic != kCmMagic) {
      fail_conn(conn, ErrorCode::ProtocolError, "the peer is not a ferry verbs endpoint", true);
      return;
    }
    conn.peer_id = loop::hex16(priv.id);
  }
  conn.timer.reset();
  conn.state = Conn::State::up;
  ++counters_.connections;
  tcp::FrameHeader hello;
  hello.type = tcp::FrameType::hello;
  hello.op_id = options_.local_id;
  send_ctl(conn, hello, std::string_view(options_.local_name).substr(0, 256));
  std::vector<std::uint64_t> waiting = std::move(conn.waiting);
  for (std::uint64_t tid : waiting) {
    auto it = transfers_.find(tid);
    if (it != transfers_.end() && !it->second->finished) begin(*it->second);
  }
}

Conn* VerbsTransport::conn_of(std::uint64_t id) {
  auto it = conns_.find(id);
  return it == conns_.end() ? nullptr : it->second.get();
}

Conn* VerbsTransport::conn_by_qp(std::uint32_t qp_num) {
  auto it = by_qp_.find(qp_num);
  return it == by_qp_.end() ? nullptr : conn_of(it->second);
}

std::shared_ptr<Conn> VerbsTransport::link_to(const tcp::SocketAddress& dst, std::string& why) {
  const std::string address = dst.to_string();
  if (auto it = links_.find(address); it != links_.end()) {
    auto c = conns_.find(it->second);
    if (c != conns_.end() && c->second->state != Conn::State::failed) return c->second;
    links_.erase(it);  // a stale connection is never reused
  }
  auto conn = std::make_shared<Conn>();
  conn->id = next_conn_++;
  conn->active = true;
  conn->address = address;
  if (api_.create_id(cm_channel_, &conn->cm, id_ptr(conn->id), RDMA_PS_TCP) != 0) {
    why = std::string("rdma_create_id: ") + std::strerror(errno);
    return nullptr;
  }
  conns_[conn->id] = conn;
  links_[address] = conn->id;
  if (api_.resolve_addr(conn->cm, nullptr, const_cast<sockaddr*>(dst.get()), kResolveMs) != 0) {
    why = std::string("rdma_resolve_addr: ") + std::strerror(errno);
    conns_.erase(conn->id);
    links_.erase(address);
    api_.destroy_id(conn->cm);
    return nullptr;
  }
  // Connects never block the loop; a peer that never answers fails them after this.
  conn->owner = this;
  conn->timer = loop::Timer::timer(loop_, conn.get());
  uv_timer_start(
      conn->timer.get(),
      [](uv_timer_t* t) {
        auto* c = static_cast<Conn*>(t->data);
        if (c == nullptr) return;
        loop::guarded(c->owner->options_.log, "verbs connect deadline", [c] {
          c->owner->fail_conn(*c, ErrorCode::PeerLost, "no connection within the deadline", true);
        });
      },
      static_cast<std::uint64_t>(options_.peer_timeout.count()) * 2, 0);
  return conn;
}

void VerbsTransport::fail_conn(Conn& conn, ErrorCode code, const std::string& why, bool setup) {
  if (conn.state == Conn::State::failed) return;
  const bool was_up = conn.state == Conn::State::up;
  conn.state = Conn::State::failed;
  if (auto it = links_.find(conn.address); it != links_.end() && it->second == conn.id)
    links_.erase(it);
  const std::uint64_t cid = conn.id;
  // Every transfer on it fails; those still waiting for it failed at set-up.
  std::vector<std::uint64_t> hit = conn.waiting;
  for (auto& [tid, t] : transfers_)
    if (t->conn == cid && !t->finished) hit.push_back(tid);
  conn.waiting.clear();
  conn.ready.clear();
  const std::string text = "verbs connection to " + conn.describe() + " failed: " + why;
  for (std::uint64_t tid : hit) {
    auto it = transfers_.find(tid);
    if (it == transfers_.end() || it->second->finished) continue;
    VerbsTransfer& t = *it->second;
    const bool before = setup || (!t.secret && t.outstanding == 0 && !was_up);
    if (t.ended_by_owner) {
      finish_transfer(t, t.ended_by_owner);
      continue;
    }
    finish_transfer(t,
                    Error(code, "verbs connection to peer '" + t.spec.peer_name + "' at " +
                                    t.spec.endpoint.address + " failed: " + why),
                    before);
  }
  // Every exposure it claimed ends; their keys die now.
  std::vector<std::uint64_t> ended;
  for (auto& [id, s] : served_)
    if (s->conn == cid) ended.push_back(id);
  for (std::uint64_t id : ended) end_served(id);
  exposures_.lose_connection(cid, Error(ErrorCode::PeerLost, text));
  if (conn.qp != nullptr) {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    api_.modify_qp(conn.qp, &attr, IBV_QP_STATE);
  }
  if (was_up && conn.cm != nullptr) api_.disconnect(conn.cm);
  // Destroyed after the current callback: its flushed work requests are drained first.
  defer_([life = std::weak_ptr<int>(life_), this, cid] {
    if (life.expired()) return;
    for (auto& dev : devices_) drain(*dev);
    destroy_conn(cid);
  });
}

void VerbsTransport::destroy_conn(std::uint64_t id) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  std::shared_ptr<Conn> conn = it->second;
  conns_.erase(it);
  if (auto l = links_.find(conn->address); l != links_.end() && l->second == id) links_.erase(l);
  if (conn->qp_num != 0) by_qp_.erase(conn->qp_num);
  conn->timer.reset();
  conn->outbox.clear();  // windows not yet bound belong to their exposures
  if (conn->qp != nullptr) api_.destroy_qp(conn->cm);
  conn->qp = nullptr;
  // With the queue pair gone, none of its work requests is outstanding any more, whether or
  // not their flushed completions were seen.
  for (const Posted& p : conn->posted) {
    if (p.transfer == 0) continue;
    auto t = transfers_.find(p.transfer);
    if (t != transfers_.end() && t->second->outstanding > 0) --t->second->outstanding;
  }
  conn->posted.clear();
  if (conn->bufs_mr != nullptr) api_.dereg_mr(conn->bufs_mr);
  conn->bufs_mr = nullptr;
  if (conn->cm != nullptr) api_.destroy_id(conn->cm);
  conn->cm = nullptr;
}

// ---------------------------------------------------------------------------------------
// Completions

void VerbsTransport::completion(const ibv_wc& wc) {
  Conn* conn = conn_by_qp(wc.qp_num);
  if (conn == nullptr) return;  // a connection already destroyed
  if ((wc.wr_id & kRecvBit) != 0)
    recv_completion(*conn, wc);
  else
    send_completion(*conn, wc);
}

std::string VerbsTransport::why_failed(const Conn& conn, ibv_wc_status status) {
  std::string text = wc_status_text(status);
  if (status == IBV_WC_REM_ACCESS_ERR) return text;
  return text + port_down(conn);
}

std::string VerbsTransport::port_down(const Conn& conn) {
  if (conn.dev == nullptr) return {};
  const std::uint8_t port = conn.cm != nullptr && conn.cm->port_num != 0 ? conn.cm->port_num : 1;
  ibv_port_attr attr{};
  if (api_.query_port(conn.dev->ctx, port, &attr) == 0 && attr.state != IBV_PORT_ACTIVE)
    return " (" + conn.dev->name + " port " + std::to_string(port) + " is down)";
  return {};
}

void VerbsTransport::send_completion(Conn& conn, const ibv_wc& wc) {
  // Work requests complete in order: one completion retires every unsignalled one before it.
  std::vector<std::uint64_t> touched;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> chunks_moved;  // transfer, chunk
  while (!conn.posted.empty() && conn.posted.front().seq <= wc.wr_id) {
    Posted p = conn.posted.front();
    conn.posted.pop_front();
    if (p.slot >= 0) conn.free_sends.push_back(static_cast<std::uint32_t>(p.slot));
    const bool failed_here = p.seq == wc.wr_id && wc.status != IBV_WC_SUCCESS;
    if (p.transfer != 0) {
      auto it = transfers_.find(p.transfer);
      if (it != transfers_.end() && it->second->outstanding > 0) --it->second->outstanding;
      if (it != transfers_.end() && p.chunk != 0) {
        auto c = it->second->chunks.find(p.chunk);
        if (c != it->second->chunks.end() && c->second.wrs > 0 && --c->second.wrs == 0 &&
            c->second.posted == c->second.len && !failed_here && !it->second->finished)
          chunks_moved.emplace_back(p.transfer, p.chunk);
      }
      if (failed_here) {
        wr_done(conn, p.transfer, &wc);
      } else if (std::find(touched.begin(), touched.end(), p.transfer) == touched.end()) {
        touched.push_back(p.transfer);
      }
    }
  }
  if (wc.status != IBV_WC_SUCCESS && conn.state != Conn::State::failed) {
    fail_conn(conn, wc.status == IBV_WC_RETRY_EXC_ERR ? ErrorCode::PeerLost : ErrorCode::Internal,
              why_failed(conn, wc.status));
    return;
  }
  for (auto [tid, chunk] : chunks_moved) {
    auto it = transfers_.find(tid);
    if (it != transfers_.end() && !it->second->finished) chunk_moved(*it->second, chunk);
  }
  for (std::uint64_t tid : touched) wr_done(conn, tid, nullptr);
  if (conn.state == Conn::State::up) {
    pump_ctl(conn);
    pump(conn);
  }
}

void VerbsTransport::recv_completion(Conn& conn, const ibv_wc& wc) {
  if (conn.recvs_posted > 0) --conn.recvs_posted;
  if (wc.status != IBV_WC_SUCCESS) {
    if (wc.status != IBV_WC_WR_FLUSH_ERR)
      fail_conn(conn, ErrorCode::PeerLost, why_failed(conn, wc.status));
    return;
  }
  if (conn.state == Conn::State::failed) return;
  const auto slot = static_cast<std::uint32_t>(wc.wr_id & ~kRecvBit);
  if (slot >= kRecvSlots || wc.byte_len > kCtlBytes) {
    fail_conn(conn, ErrorCode::ProtocolError, "a control message out of bounds");
    return;
  }
  const char* data =
      reinterpret_cast<const char*>(conn.bufs.data()) + std::size_t{slot} * kCtlBytes;
  conn.inbox.append(data, wc.byte_len);
  post_recv(conn, slot);
  // Whole messages: a 64-byte header, its text, then (CLAIM, CLAIMED) `len` bytes of payload.
  const std::uint64_t cid = conn.id;
  while (true) {
    Conn* c = conn_of(cid);
    if (c == nullptr || c->state == Conn::State::failed) return;
    if (c->inbox.size() < tcp::kHeaderSize) return;
    tcp::FrameHeader h = tcp::decode(reinterpret_cast<const std::byte*>(c->inbox.data()));
    if (auto bad = tcp::malformed(h); !bad.empty()) {
      fail_conn(*c, ErrorCode::ProtocolError, bad);
      return;
    }
    const bool payload = h.type == tcp::FrameType::claim || h.type == tcp::FrameType::claimed;
    if (payload && h.len > kMaxCtlPayload) {
      fail_conn(*c, ErrorCode::ProtocolError, "a control message too long");
      return;
    }
    const std::uint64_t need = tcp::kHeaderSize + h.msg_len + (payload ? h.len : 0);
    if (c->inbox.size() < need) return;
    std::string msg = c->inbox.substr(tcp::kHeaderSize, h.msg_len);
    std::string body = payload ? c->inbox.substr(tcp::kHeaderSize + h.msg_len, h.len) : "";
    c->inbox.erase(0, need);
    on_message(*c, h, std::move(msg), std::move(body));
  }
}

// ---------------------------------------------------------------------------------------
// Control messages: SENDs from registered buffers, in order with the data on the same queue

void VerbsTransport::send_ctl(Conn& conn, const tcp::FrameHeader& h, std::string_view msg,
                              std::string_view payload) {
  tcp::FrameHeader out = h;
  out.msg_len = static_cast<std::uint32_t>(std::min<std::size_t>(msg.size(), tcp::kMaxMessage));
  const auto head = tcp::encode(out);
  std::string bytes(reinterpret_cast<const char*>(head.data()), head.size());
  bytes.append(msg.substr(0, out.msg_len));
  bytes.append(payload);
  for (std::size_t at = 0; at < bytes.size(); at += kCtlBytes) {
    CtlItem item;
    item.bytes = bytes.substr(at, kCtlBytes);
    conn.outbox.push_back(std::move(item));
  }
  pump_ctl(conn);
}

void VerbsTransport::pump_ctl(Conn& conn) {
  if (conn.state != Conn::State::up) return;
  while (!conn.outbox.empty() && conn.posted.size() < options_.queue_depth) {
    CtlItem& item = conn.outbox.front();
    ibv_send_wr wr{};
    ibv_sge sge{};
    Posted p;
    p.seq = conn.next_seq;
    wr.wr_id = p.seq;
    if (item.mw != nullptr) {
      wr.opcode = IBV_WR_BIND_MW;
      wr.bind_mw.mw = item.mw;
      wr.bind_mw.rkey = item.rkey;
      wr.bind_mw.bind_info = item.bind;
      wr.send_flags = IBV_SEND_SIGNALED;
    } else {
      if (conn.free_sends.empty()) return;
      p.slot = static_cast<std::int32_t>(conn.free_sends.back());
      std::byte* buf = conn.bufs.data() +
                       (std::size_t{kRecvSlots} + static_cast<std::size_t>(p.slot)) * kCtlBytes;
      std::memcpy(buf, item.bytes.data(), item.bytes.size());
      sge.addr = reinterpret_cast<std::uint64_t>(buf);
      sge.length = static_cast<std::uint32_t>(item.bytes.size());
      sge.lkey = conn.bufs_mr->lkey;
      wr.opcode = IBV_WR_SEND;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.send_flags = IBV_SEND_SIGNALED;
    }
    ibv_send_wr* bad = nullptr;
    if (api_.post_send(conn.qp, &wr, &bad) != 0) {
      fail_conn(conn, ErrorCode::Internal,
                std::string("ibv_post_send of a control message: ") + std::strerror(errno));
      return;
    }
    if (p.slot >= 0) conn.free_sends.pop_back();
    ++conn.next_seq;
    conn.posted.push_back(p);
    conn.outbox.pop_front();
  }
  arm_watchdog();
}

void VerbsTransport::on_message(Conn& conn, const tcp::FrameHeader& h, std::string msg,
                                std::string payload) {
  switch (h.type) {
    case tcp::FrameType::hello:
      conn.peer_name = msg.substr(0, 256);
      if (h.op_id != 0) conn.peer_id = loop::hex16(h.op_id);
      return;
    case tcp::FrameType::claim:
      serve_claim(conn, h, payload);
      return;
    case tcp::FrameType::done:
      serve_done(conn, h, msg);
      return;
    case tcp::FrameType::claimed:
    case tcp::FrameType::status:
      if (h.req_id != 0)
        on_reply(conn, h, std::move(msg), std::move(payload));
      else
        on_notice(conn, h, msg);
      return;
    default:
      fail_conn(conn, ErrorCode::ProtocolError,
                "unexpected control message " + std::to_string(static_cast<int>(h.type)));
      return;
  }
}

}  // namespace ferry::transport::verbs
