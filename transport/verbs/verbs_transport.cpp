#include "transport/verbs/verbs_transport.hpp"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "loop/ids.hpp"
#include "transport/method.hpp"
#include "transport/wire/status.hpp"

namespace ferry::transport {
const Method& verbs_method();
}

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
  try {
    return system_verbs();
  } catch (const Error& e) {
    throw Error(e.code(), "verbs: " + e.message());
  }
}

void* id_ptr(std::uint64_t id) { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(id)); }
std::uint64_t ptr_id(void* p) {
  return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p));
}

}  // namespace

std::optional<Error> VerbsTransport::unavailable(const VerbsApi* api) {
  if (api == nullptr) {
    if (auto why = refusal([&] { api = &system_verbs(); })) return why;
  }
  int n = 0;
  errno = 0;
  ibv_device** list = api->get_device_list(&n);
  if (list == nullptr && errno == ENOSYS)
    return Error(ErrorCode::Unsupported,
                 "no RDMA support in the kernel (ibv_get_device_list: ENOSYS)");
  if (list == nullptr)
    return Error(ErrorCode::Unsupported,
                 std::string("ibv_get_device_list failed: ") +
                     (errno != 0 ? std::strerror(errno) : "no reason given"));
  api->free_device_list(list);
  if (n == 0) return Error(ErrorCode::Unsupported, "no RDMA device found");
  return std::nullopt;
}

VerbsTransport::VerbsTransport(const Context& ctx, const VerbsOptions& options, const VerbsApi* api)
    : ctx_(ctx), options_(options), api_(pick(api)), caps_(verbs_method().capabilities(ctx)) {
  if (options_.queue_depth < 4 || options_.signal_every == 0 || options_.max_wr_bytes == 0)
    throw Error(ErrorCode::InvalidArgument,
                "verbs.queue_depth must be at least 4, signal_every and max_wr_bytes positive");
  wire::SocketAddress bind;
  if (!wire::SocketAddress::from_parts(ctx_.bind_address, options_.port, bind))
    throw Error(ErrorCode::InvalidArgument,
                "verbs: bind address '" + ctx_.bind_address + "' is not a numeric address");
  devices_ = std::make_unique<Devices>(ctx_, api_, options_, static_cast<Devices::Handler&>(*this),
                                       counters_);
  // Cached registrations give no remote access of their own: a peer reaches memory only
  // through a window bound for its claim (or a registration of the operation's own).
  registrations_ = kit::RegistrationCache([this](const Region& region) {
    int access = IBV_ACCESS_LOCAL_WRITE;
    if (std::any_of(devices_->all().begin(), devices_->all().end(),
                    [](const auto& d) { return d->windows; }))
      access |= IBV_ACCESS_MW_BIND;
    return devices_->register_everywhere(region, access);
  });
  server_ = std::make_unique<VerbsServer>(*this, ctx_.defer);
  client_ = std::make_unique<VerbsClient>(*this, ctx_.defer);
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
  wire::SocketAddress at;
  wire::SocketAddress::from_parts(ctx_.bind_address, port, at);
  address_ = at.to_string();
  cm_poll_ = loop::Poll::poll(ctx_.loop, cm_channel_->fd, this);
  uv_poll_start(cm_poll_.get(), UV_READABLE, &VerbsTransport::on_cm);
}

VerbsTransport::~VerbsTransport() { close(); }

std::vector<Endpoint> VerbsTransport::endpoints() const {
  return {Endpoint{caps_.method, address_, {}}};
}

std::optional<Error> VerbsTransport::endpoint_error(const Endpoint& endpoint) const {
  return refusal([&] { (void)wire::endpoint_address(endpoint); });
}

std::optional<Error> VerbsTransport::unreachable(const Endpoint& endpoint) const {
  return endpoint_error(endpoint);
}

void VerbsTransport::close() {
  if (closed_) return;
  linger();
  closed_ = true;
  life_.end();
  cm_poll_.reset();
  if (client_) client_->close();
  // Queue pairs to error first: peers see the connection end (not a dead key), and no work
  // request of ours touches memory after this.
  for (auto& [id, c] : conns_) {
    c->quiet();
    if (c->state == Conn::State::up && c->cm != nullptr) api_.disconnect(c->cm);
    if (c->qp != nullptr) {
      ibv_qp_attr attr{};
      attr.qp_state = IBV_QPS_ERR;
      api_.modify_qp(c->qp, &attr, IBV_QP_STATE);
    }
  }
  // Then the keys die: no window or registration of ours serves anyone after this.
  if (server_) server_->close();
  if (devices_) devices_->drain_all();
  std::vector<std::uint64_t> ids;
  for (auto& [id, c] : conns_) ids.push_back(id);
  for (std::uint64_t id : ids) destroy_conn(id);
  links_.clear();
  if (listener_ != nullptr) api_.destroy_id(listener_);
  listener_ = nullptr;
  if (cm_channel_ != nullptr) api_.destroy_event_channel(cm_channel_);
  cm_channel_ = nullptr;
  registrations_ = kit::RegistrationCache(nullptr);
  client_.reset();                  // its staging chunks' registrations, then the chunks
  if (devices_) devices_->close();  // protection domains go with the last registration in them
}

void VerbsTransport::linger() {
  // The DONEs of the transfers just cancelled are queued or posted: they tell each peer how
  // its operation ended, where a disconnect alone would say only that the connection went.
  // Give them a moment to leave (they are signalled: their completions say so); a peer that
  // does not take them is not waited for long.
  const auto until = std::chrono::steady_clock::now() +
                     std::min<std::chrono::milliseconds>(ctx_.peer_timeout, kLinger);
  auto telling = [this] {
    return std::any_of(conns_.begin(), conns_.end(), [](const auto& kv) {
      const Conn& c = *kv.second;
      return c.state == Conn::State::up && c.telling();
    });
  };
  while (devices_ && telling() && std::chrono::steady_clock::now() < until) {
    if (devices_->drain_all() == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

std::shared_ptr<const Registration> VerbsTransport::register_memory(const Region& region) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  if (!caps_.moves(region.kind))
    throw Error(ErrorCode::Unsupported, "verbs moves host memory only here (no CUDA driver)");
  // CUDA memory the NIC cannot reach is registered all the same (marked staged): an active
  // transfer stages it; expose() refuses it.
  return registrations_.acquire(region);
}

std::shared_ptr<const Registration> VerbsTransport::acquire(const Region& region) {
  if (region.kind == MemoryKind::cuda)
    return registrations_.acquire(devices_->gpudirect().allocation_of(region, registrations_));
  return registrations_.acquire(region);
}

std::string VerbsTransport::expose(const Exposure& exposure, ExposureObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  server_->expose(exposure, observer);
  return {};
}

void VerbsTransport::revoke(std::uint64_t id, const Error& reason) { server_->revoke(id, reason); }

std::string VerbsTransport::serve_region(const RegionExposure& region, RegionObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  server_->serve_region(region, observer);
  return {};
}

void VerbsTransport::revoke_attachment(std::uint64_t attachment, const Error& reason) {
  server_->revoke_attachment(attachment, reason);
}

void VerbsTransport::end_region(std::uint64_t id, const Error& reason) {
  server_->end_region(id, reason);
}

std::unique_ptr<RemoteRegion> VerbsTransport::attach(AttachSpec spec, AttachObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  return client_->attach(std::move(spec), observer);
}

std::unique_ptr<Transfer> VerbsTransport::start(TransferSpec spec, TransferObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  return client_->start(std::move(spec), observer);
}

bool VerbsTransport::busy() const {
  // Busy: work requests outstanding, answers awaited, or a claimed operation being served
  // (its DONE will come). Idle, nothing polls: the completion channel alone wakes the loop.
  if ((client_ && client_->busy()) || (server_ && server_->serving())) return true;
  for (const auto& [id, c] : conns_)
    if (!c->posted.empty()) return true;
  return false;
}

// ---------------------------------------------------------------------------------------
// rdma_cm events

void VerbsTransport::on_cm(uv_poll_t* handle, int status, int) {
  auto* self = static_cast<VerbsTransport*>(handle->data);
  if (self == nullptr || status < 0) return;
  loop::guarded(self->ctx_.log, "verbs rdma_cm events", [self] { self->cm_ready(); });
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
      rdma_cm_id* refused = server_->connect_request(copy);
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
      conn->dev = devices_->find(ev.id->verbs);
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
      try {
        conn->make_qp(*conn->dev);
      } catch (const Error& e) {
        fail_conn(*conn, e.code(), e.message(), true);
        return;
      }
      by_qp_[conn->qp_num] = conn->id;
      CmPrivate priv;
      priv.id = ctx_.local_id;
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
    case RDMA_CM_EVENT_DEVICE_REMOVAL: {
      // What the peer sent before it went (the DONE of a transfer it cancelled as it closed)
      // may wait in the completion queue: it is read first, so that it, not the disconnect,
      // says how the peer's operations ended.
      const std::uint64_t id = conn->id;
      devices_->drain_all();
      conn = conn_of(id);
      if (conn == nullptr || conn->state == Conn::State::failed) return;
      // A local port going down may reach us as a disconnect before its async event (or a
      // flushed completion) does: the port is named either way.
      fail_conn(*conn, ErrorCode::PeerLost, what + conn->port_down());
      return;
    }
    default:
      return;
  }
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
  conn.established();
  conn.state = Conn::State::up;
  ++counters_.connections;
  wire::FrameHeader hello;
  hello.type = wire::FrameType::hello;
  hello.op_id = ctx_.local_id;
  conn.send_ctl(hello, std::string_view(ctx_.local_name).substr(0, 256));
  // The transfers that waited for the connection claim now.
  std::vector<std::uint64_t> waiting = std::move(conn.waiting);
  conn.waiting.clear();
  client_->connected(conn, waiting);
}

Conn* VerbsTransport::conn_of(std::uint64_t id) {
  auto it = conns_.find(id);
  return it == conns_.end() ? nullptr : it->second.get();
}

std::shared_ptr<Conn> VerbsTransport::new_conn(bool active) {
  auto conn = std::make_shared<Conn>(static_cast<Conn::Owner&>(*this), ctx_, api_, options_,
                                     counters_, next_conn_++, active);
  conns_[conn->id] = conn;
  return conn;
}

std::shared_ptr<Conn> VerbsTransport::link_to(const wire::SocketAddress& dst) {
  const std::string address = dst.to_string();
  if (auto it = links_.find(address); it != links_.end()) {
    auto c = conns_.find(it->second);
    if (c != conns_.end() && c->second->state != Conn::State::failed) return c->second;
    links_.erase(it);  // a stale connection is never reused
  }
  std::shared_ptr<Conn> conn = new_conn(true);
  conn->address = address;
  if (api_.create_id(cm_channel_, &conn->cm, id_ptr(conn->id), RDMA_PS_TCP) != 0) {
    conn->cm = nullptr;
    conns_.erase(conn->id);
    throw Error(ErrorCode::PeerLost, std::string("rdma_create_id: ") + std::strerror(errno));
  }
  links_[address] = conn->id;
  if (api_.resolve_addr(conn->cm, nullptr, const_cast<sockaddr*>(dst.get()), kResolveMs) != 0) {
    const int err = errno;
    conns_.erase(conn->id);
    links_.erase(address);
    throw Error(ErrorCode::PeerLost, std::string("rdma_resolve_addr: ") + std::strerror(err));
  }
  // Connects never block the loop; a peer that never answers fails them after this.
  conn->arm_deadline(ctx_.peer_timeout * 2);
  return conn;
}

void VerbsTransport::fail_conn(Conn& conn, ErrorCode code, const std::string& why, bool setup) {
  if (conn.state == Conn::State::failed) return;
  const bool was_up = conn.state == Conn::State::up;
  conn.state = Conn::State::failed;
  conn.quiet();
  if (auto it = links_.find(conn.address); it != links_.end() && it->second == conn.id)
    links_.erase(it);
  client_->conn_lost(conn, code, why, was_up, setup);
  server_->lose(conn, Error(ErrorCode::PeerLost,
                            "verbs connection to " + conn.describe() + " failed: " + why));
  if (conn.qp != nullptr) {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    api_.modify_qp(conn.qp, &attr, IBV_QP_STATE);
  }
  if (was_up && conn.cm != nullptr) api_.disconnect(conn.cm);
  // Destroyed after the current callback: its flushed work requests are drained first.
  life_.defer(ctx_.defer, [this, cid = conn.id] {
    devices_->drain_all();
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
  conn->outbox.clear();  // windows not yet bound belong to their exposures
  // With the queue pair gone, none of its work requests is outstanding any more, whether or
  // not their flushed completions were seen.
  for (const Posted& p : conn->posted)
    if (p.transfer != 0) client_->wr_retired(p.transfer, p, true);
  conn->posted.clear();
  server_->lose(*conn,
                Error(ErrorCode::PeerLost, "verbs connection to " + conn->describe() + " closed"));
}

// ---------------------------------------------------------------------------------------
// Completions and control messages

void VerbsTransport::completion(const ibv_wc& wc) {
  auto qit = by_qp_.find(wc.qp_num);
  Conn* conn = qit == by_qp_.end() ? nullptr : conn_of(qit->second);
  if (conn == nullptr) return;  // a connection already destroyed
  if ((wc.wr_id & kRecvBit) != 0) {
    if (wc.status != IBV_WC_SUCCESS) {
      if (wc.status != IBV_WC_WR_FLUSH_ERR)
        fail_conn(*conn, ErrorCode::PeerLost, conn->why_failed(wc.status));
      return;
    }
    if (conn->state != Conn::State::failed) conn->received(wc);
    return;
  }
  std::vector<std::uint64_t> touched;
  for (const Posted& p : conn->retire(wc)) {
    if (p.transfer == 0) continue;
    const bool failed_here = p.seq == wc.wr_id && wc.status != IBV_WC_SUCCESS;
    client_->wr_retired(p.transfer, p, failed_here);
    if (failed_here)
      client_->wr_done(*conn, p.transfer, &wc);
    else if (std::find(touched.begin(), touched.end(), p.transfer) == touched.end())
      touched.push_back(p.transfer);
  }
  if (wc.status != IBV_WC_SUCCESS && conn->state != Conn::State::failed) {
    fail_conn(*conn, wc.status == IBV_WC_RETRY_EXC_ERR ? ErrorCode::PeerLost : ErrorCode::Internal,
              conn->why_failed(wc.status));
    return;
  }
  for (std::uint64_t tid : touched) client_->wr_done(*conn, tid, nullptr);
  if (conn->state == Conn::State::up) client_->pump(*conn);
}

void VerbsTransport::async_event(Device& dev, const ibv_async_event& ev) {
  std::vector<std::uint64_t> hit;
  std::string why = dev.name + ": " + async_event_text(ev.event_type);
  switch (ev.event_type) {
    case IBV_EVENT_PORT_ERR:
      why = dev.name + " port " + std::to_string(ev.element.port_num) + " went down";
      for (auto& [id, c] : conns_)
        if (c->dev == &dev &&
            (c->cm == nullptr || c->cm->port_num == 0 || c->cm->port_num == ev.element.port_num))
          hit.push_back(id);
      break;
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
      if (ev.element.qp != nullptr)
        if (auto q = by_qp_.find(ev.element.qp->qp_num); q != by_qp_.end())
          hit.push_back(q->second);
      break;
    case IBV_EVENT_DEVICE_FATAL:
    case IBV_EVENT_CQ_ERR:
      for (auto& [id, c] : conns_)
        if (c->dev == &dev) hit.push_back(id);
      break;
    default:
      break;
  }
  for (std::uint64_t id : hit)
    if (Conn* c = conn_of(id)) fail_conn(*c, ErrorCode::PeerLost, why);
}

wire::Sink VerbsTransport::ctl_frame(Conn& conn, const wire::FrameHeader& h, std::string msg) {
  switch (h.type) {
    case wire::FrameType::hello:
      conn.peer_name = msg.substr(0, 256);
      if (h.op_id != 0) conn.peer_id = loop::hex16(h.op_id);
      server_->heard(conn);
      return {};
    case wire::FrameType::claim:
      return server_->receive_claim(conn, h);
    case wire::FrameType::done:
      server_->serve_done(conn, h, msg);
      return {};
    case wire::FrameType::claimed:
    case wire::FrameType::attached:
      return client_->receive_claimed(conn, h);
    case wire::FrameType::attach:
      server_->serve_attach(conn, h);
      return {};
    case wire::FrameType::ended:
      return server_->receive_ended(conn, h, std::move(msg));
    case wire::FrameType::detach:
      server_->serve_detach(conn, h);
      return {};
    case wire::FrameType::status:
      if (h.req_id != 0)
        client_->on_reply(conn, h, std::move(msg), {});
      else
        client_->on_notice(conn, h, msg);
      return {};
    default:
      return wire::fatal("unexpected control message " + std::to_string(static_cast<int>(h.type)));
  }
}

void VerbsTransport::ctl_payload(Conn& conn, const wire::FrameHeader& h, bool intact) {
  std::string payload = std::move(conn.payload);
  conn.payload.clear();
  if (h.type == wire::FrameType::claim) {
    // A claim refused on its header is answered now that its ranges went by.
    server_->serve_claim(conn, h, intact ? payload : std::string());
    return;
  }
  if (h.type == wire::FrameType::ended) {
    if (intact) server_->serve_ended(conn, h, payload);
    return;
  }
  if (intact) client_->on_reply(conn, h, {}, std::move(payload));
}

void VerbsTransport::conn_failed(Conn& conn, ErrorCode code, const std::string& why) {
  fail_conn(conn, code, why);
}

}  // namespace ferry::transport::verbs
