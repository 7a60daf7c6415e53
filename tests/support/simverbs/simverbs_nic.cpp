// The simulated NIC of this process: one thread, an epoll loop over the connections' Unix
// stream sockets, the listeners, and an eventfd doorbell. It runs the wire protocol
// (simverbs_state.hpp): executes the requests that arrive against this process's registration
// table, streams payloads straight between sockets and registered memory, matches responses to
// the requests of the local QP in FIFO order, and runs the rdma_cm handshake.

#include <arpa/inet.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>

#include "tests/support/simverbs/simverbs_state.hpp"

namespace ferry::test::simverbs::detail {
namespace {

constexpr uint64_t kBellSerial = 0;
constexpr std::size_t kRateChunk = 64u << 10;
const unsigned char kZeros[64u << 10] = {};

Qp* qp_of(Conn* c) { return c->id != nullptr ? c->id->qp : nullptr; }

bool on_nic_thread() { return sim().running && sim().nic.get_id() == std::this_thread::get_id(); }

sockaddr_un abstract_name(const std::string& ip, uint16_t port, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::string name = "ferry-simverbs-" + ip + "-" + std::to_string(port);
  std::memcpy(a.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}

void tune(int fd) {
  int size = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
}

void watch(int fd, uint64_t serial, uint32_t events) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = serial;
  epoll_ctl(sim().ep, EPOLL_CTL_ADD, fd, &ev);
}

void set_mask(Conn* c) {
  Sim& s = sim();
  if (c->fd < 0) return;
  uint32_t want = c->in == In::Stalled ? 0u : static_cast<uint32_t>(EPOLLIN);
  if (!c->outs.empty() && !s.rate_blocked) want |= EPOLLOUT;
  if (want == c->mask) return;
  c->mask = want;
  epoll_event ev{};
  ev.events = want;
  ev.data.u64 = c->serial;
  epoll_ctl(s.ep, EPOLL_CTL_MOD, c->fd, &ev);
}

Conn* new_conn(int fd) {
  Sim& s = sim();
  Conn* c = new Conn;
  c->serial = s.next_serial++;
  c->fd = fd;
  c->mask = EPOLLIN;
  s.conns[c->serial] = c;
  watch(fd, c->serial, EPOLLIN);
  return c;
}

// Reads into `p`: > 0 bytes read, 0 nothing there now, -1 the connection failed (handled).
ssize_t rd(Conn* c, void* p, std::size_t n) {
  for (;;) {
    ssize_t r = ::recv(c->fd, p, n, MSG_DONTWAIT);
    if (r > 0) return r;
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    conn_failed(c);
    return -1;
  }
}

// Writes from `p`: > 0 bytes written, 0 the socket is full, -1 the connection failed.
ssize_t wr(Conn* c, const void* p, std::size_t n) {
  for (;;) {
    ssize_t r = ::send(c->fd, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r > 0) return r;
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    conn_failed(c);
    return -1;
  }
}

void respond(Conn* c, Ft type, ibv_wc_status st) {
  Hdr h;
  h.type = static_cast<uint8_t>(type);
  h.status = static_cast<uint8_t>(st);
  queue_out(c, frame(h));
}

void recv_wc(Qp* q, const RecvWr& r, ibv_wc_status st, ibv_wc_opcode op, uint32_t len,
             const Hdr* imm, uint32_t src_qp) {
  ibv_wc wc{};
  wc.wr_id = r.wr_id;
  wc.status = st;
  wc.opcode = op;
  wc.byte_len = len;
  wc.qp_num = q->qp.qp_num;
  wc.src_qp = src_qp;
  if (imm != nullptr) {
    wc.imm_data = imm->imm;
    wc.wc_flags = IBV_WC_WITH_IMM;
  }
  add_wc(q->rcq, wc);
}

// A response to the oldest request of the local QP still awaiting one.
void on_response(Conn* c, ibv_wc_status st) {
  Qp* q = qp_of(c);
  if (q == nullptr || q->st == IBV_QPS_ERR || q->inflight.empty()) return;
  uint64_t seq = q->inflight.front();
  q->inflight.pop_front();
  if (SendWr* w = find_wr(q, seq); w != nullptr && !w->done) {
    w->done = true;
    w->status = st;
  }
  drain_sq(q);
}

// A local buffer of request `seq` died while its payload was going out.
void fail_request(Conn* c, uint64_t seq, ibv_wc_status st) {
  Qp* q = qp_of(c);
  if (q == nullptr || q->st == IBV_QPS_ERR) return;
  SendWr* w = find_wr(q, seq);
  if (w == nullptr || w->done) return;
  w->done = true;
  w->status = st;
  q->inflight.erase(std::remove(q->inflight.begin(), q->inflight.end(), seq), q->inflight.end());
  enter_error(q, false);
}

void on_cm(Conn* c) {
  Sim& s = sim();
  const Hdr& h = c->h;
  switch (static_cast<Ft>(h.type)) {
    case Ft::CmReq: {
      if (c->cm != CmState::ReqWait) return conn_failed(c);
      Id* l = c->listener;
      if (l == nullptr || !l->listening || !l->dev->port_up) return close_conn(c);
      Id* n = new Id;
      n->ch = l->ch;
      n->dev = l->dev;
      n->passive = true;
      n->bound = true;
      n->port = l->port;
      n->conn = c;
      n->id.verbs = l->id.verbs;
      n->id.channel = l->id.channel;
      n->id.context = l->id.context;
      n->id.ps = l->id.ps;
      n->id.port_num = 1;
      n->id.qp_type = IBV_QPT_RC;
      n->id.route.addr.src_sin.sin_family = AF_INET;
      n->id.route.addr.src_sin.sin_addr = l->dev->ip;
      n->id.route.addr.src_sin.sin_port = htons(l->port);
      n->id.route.addr.dst_sin.sin_family = AF_INET;
      n->id.route.addr.dst_sin.sin_addr.s_addr = htonl(static_cast<uint32_t>(h.addr >> 16));
      n->id.route.addr.dst_sin.sin_port = htons(static_cast<uint16_t>(h.addr & 0xffff));
      s.ids[&n->id] = n;
      c->id = n;
      c->listener = nullptr;
      c->remote_qpn = static_cast<uint32_t>(h.aux);
      c->cm = CmState::ReqDelivered;
      push_cm(n, RDMA_CM_EVENT_CONNECT_REQUEST, 0, c->cm_payload.data(), c->cm_payload.size(), l,
              c->remote_qpn);
      return;
    }
    case Ft::CmRep: {
      if (c->cm != CmState::Connecting || c->id == nullptr) return;
      c->remote_qpn = static_cast<uint32_t>(h.aux);
      c->cm = CmState::Established;
      if (Qp* q = qp_of(c); q != nullptr && (q->st == IBV_QPS_INIT || q->st == IBV_QPS_RTR))
        q->st = IBV_QPS_RTS;
      Hdr rtu;
      rtu.type = static_cast<uint8_t>(Ft::CmRtu);
      queue_out(c, frame(rtu));
      push_cm(c->id, RDMA_CM_EVENT_ESTABLISHED, 0, c->cm_payload.data(), c->cm_payload.size(),
              nullptr, c->remote_qpn);
      return;
    }
    case Ft::CmRtu:
      if (c->cm == CmState::Accepted && c->id != nullptr) {
        c->cm = CmState::Established;
        push_cm(c->id, RDMA_CM_EVENT_ESTABLISHED, 0, nullptr, 0, nullptr, c->remote_qpn);
      }
      return;
    case Ft::CmRej:
      if (c->cm == CmState::Connecting && c->id != nullptr) {
        c->cm = CmState::Rejected;
        push_cm(c->id, RDMA_CM_EVENT_REJECTED, kRejectConsumer, c->cm_payload.data(),
                c->cm_payload.size());
        close_conn(c);
      }
      return;
    case Ft::CmDreq:
      if (c->cm == CmState::Established || c->cm == CmState::Accepted) {
        c->cm = CmState::Disconnected;
        if (Qp* q = qp_of(c)) enter_error(q, false);
        if (c->id != nullptr) push_cm(c->id, RDMA_CM_EVENT_DISCONNECTED, 0, nullptr, 0);
      }
      return;
    default:
      return;
  }
}

void start_stream(Conn* c) {
  c->in = In::Stream;
  c->pi = 0;
  c->poff = 0;
  c->sdone = 0;
  c->toff = 0;
}

// A header has arrived (or a stalled one is looked at again).
void on_header(Conn* c) {
  const Hdr& h = c->h;
  auto t = static_cast<Ft>(h.type);
  c->in = In::Header;
  c->pending = IBV_WC_SUCCESS;
  c->midway = IBV_WC_SUCCESS;
  c->sink = Sink::Discard;
  c->pieces.clear();
  switch (t) {
    case Ft::CmReq:
    case Ft::CmRep:
    case Ft::CmRej:
      if (h.len > 256) return conn_failed(c);
      c->cm_payload.assign(h.len, '\0');
      c->cm_off = 0;
      if (h.len > 0)
        c->in = In::Cm;
      else
        on_cm(c);
      return;
    case Ft::CmRtu:
    case Ft::CmDreq:
      return on_cm(c);
    case Ft::Write:
    case Ft::WriteImm:
    case Ft::Send:
    case Ft::SendImm: {
      Qp* q = qp_of(c);
      bool live = q != nullptr && q->st == IBV_QPS_RTS;
      if (live && t != Ft::Write && q->rq.empty()) {
        c->in = In::Stalled;  // receiver not ready: hold it until a receive is posted
        return;
      }
      if (!live) {
        c->pending = IBV_WC_WR_FLUSH_ERR;  // dropped without a response
      } else if (t == Ft::Write || t == Ft::WriteImm) {
        if (check_remote(h.rkey, h.addr, h.len, IBV_ACCESS_REMOTE_WRITE, q->qp.qp_num) != nullptr) {
          c->sink = Sink::Remote;
          c->sink_qpn = q->qp.qp_num;
          c->pieces.push_back({h.rkey, h.addr, h.len});
        } else {
          c->pending = IBV_WC_REM_ACCESS_ERR;
        }
      } else {
        uint64_t room = 0;
        for (const ibv_sge& g : q->rq.front().sges) room += g.length;
        if (h.len > room) {
          c->pending = IBV_WC_REM_INV_REQ_ERR;
        } else {
          c->sink = Sink::Local;
          for (const ibv_sge& g : q->rq.front().sges)
            c->pieces.push_back({g.lkey, g.addr, g.length});
        }
      }
      return start_stream(c);
    }
    case Ft::Read: {
      Qp* q = qp_of(c);
      if (q == nullptr || q->st != IBV_QPS_RTS) return;
      if (check_remote(h.rkey, h.addr, h.len, IBV_ACCESS_REMOTE_READ, q->qp.qp_num) == nullptr) {
        respond(c, Ft::ReadResp, IBV_WC_REM_ACCESS_ERR);
        enter_error(q, false);
        return;
      }
      Hdr r;
      r.type = static_cast<uint8_t>(Ft::ReadResp);
      r.len = h.len;
      Out o = frame(r);
      o.stream = true;
      o.remote = true;
      o.qpn = q->qp.qp_num;
      o.total = h.len;
      o.pieces.push_back({h.rkey, h.addr, h.len});
      queue_out(c, std::move(o));
      return;
    }
    case Ft::Ack:
      return on_response(c, static_cast<ibv_wc_status>(h.status));
    case Ft::ReadResp: {
      if (h.status != 0) return on_response(c, static_cast<ibv_wc_status>(h.status));
      Qp* q = qp_of(c);
      SendWr* w = q != nullptr && q->st == IBV_QPS_RTS && !q->inflight.empty()
                      ? find_wr(q, q->inflight.front())
                      : nullptr;
      if (w != nullptr && w->op == IBV_WR_RDMA_READ && !w->done) {
        c->sink = Sink::Local;
        for (const ibv_sge& g : w->sges) c->pieces.push_back({g.lkey, g.addr, g.length});
      }
      return start_stream(c);
    }
    default:
      return conn_failed(c);
  }
}

// The trailer of a data frame has arrived.
void on_frame_end(Conn* c) {
  const Hdr& h = c->h;
  auto t = static_cast<Ft>(h.type);
  uint32_t trailer = 0;
  std::memcpy(&trailer, c->tbuf, sizeof trailer);
  c->in = In::Header;
  if (t == Ft::ReadResp) {
    ibv_wc_status st = trailer != 0                  ? IBV_WC_REM_ACCESS_ERR
                       : c->midway != IBV_WC_SUCCESS ? c->midway
                                                     : IBV_WC_SUCCESS;
    return on_response(c, st);
  }
  Qp* q = qp_of(c);
  if (c->pending == IBV_WC_WR_FLUSH_ERR || q == nullptr || q->st != IBV_QPS_RTS) return;
  if (trailer != 0) return;  // the requester gave up midway; it is in error already
  if (c->pending == IBV_WC_REM_ACCESS_ERR || c->midway == IBV_WC_REM_ACCESS_ERR) {
    respond(c, Ft::Ack, IBV_WC_REM_ACCESS_ERR);
    return enter_error(q, false);
  }
  if (t == Ft::Write) return respond(c, Ft::Ack, IBV_WC_SUCCESS);
  if (q->rq.empty()) return;  // cannot be: checked at the header, and only error clears it
  RecvWr r = std::move(q->rq.front());
  q->rq.pop_front();
  const Hdr* imm = t == Ft::Send ? nullptr : &h;
  if (c->pending == IBV_WC_REM_INV_REQ_ERR) {
    recv_wc(q, r, IBV_WC_LOC_LEN_ERR, IBV_WC_RECV, h.len, nullptr, c->remote_qpn);
    respond(c, Ft::Ack, IBV_WC_REM_INV_REQ_ERR);
    return enter_error(q, false);
  }
  if (c->midway == IBV_WC_LOC_PROT_ERR) {
    recv_wc(q, r, IBV_WC_LOC_PROT_ERR, IBV_WC_RECV, h.len, nullptr, c->remote_qpn);
    respond(c, Ft::Ack, IBV_WC_REM_OP_ERR);
    return enter_error(q, false);
  }
  recv_wc(q, r, IBV_WC_SUCCESS, t == Ft::WriteImm ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV, h.len,
          imm, c->remote_qpn);
  respond(c, Ft::Ack, IBV_WC_SUCCESS);
}

// One step of a payload: into registered memory when it passes its check, else discarded.
ssize_t recv_stream_step(Conn* c) {
  Sim& s = sim();
  uint64_t left = c->h.len - c->sdone;
  std::size_t chunk = static_cast<std::size_t>(std::min<uint64_t>(left, kChunk));
  uint8_t* dst = nullptr;
  if (c->sink != Sink::Discard) {
    Qp* q = qp_of(c);
    if (q == nullptr || q->st != IBV_QPS_RTS) c->sink = Sink::Discard;
  }
  if (c->sink != Sink::Discard) {
    while (c->pi < c->pieces.size() && c->poff == c->pieces[c->pi].len) {
      ++c->pi;
      c->poff = 0;
    }
    if (c->pi < c->pieces.size()) {
      const Piece& p = c->pieces[c->pi];
      chunk = static_cast<std::size_t>(std::min<uint64_t>(chunk, p.len - c->poff));
      dst = c->sink == Sink::Remote
                ? check_remote(p.key, p.addr + c->poff, chunk, IBV_ACCESS_REMOTE_WRITE, c->sink_qpn)
                : check_local(p.key, p.addr + c->poff, chunk, true);
      if (dst == nullptr)
        c->midway = c->sink == Sink::Remote ? IBV_WC_REM_ACCESS_ERR : IBV_WC_LOC_PROT_ERR;
    }
    if (dst == nullptr) c->sink = Sink::Discard;
  }
  if (dst == nullptr) {
    dst = reinterpret_cast<uint8_t*>(s.scratch.data());
    chunk = std::min(chunk, s.scratch.size());
  }
  ssize_t n = rd(c, dst, chunk);
  if (n > 0) {
    c->sdone += static_cast<uint64_t>(n);
    if (c->sink != Sink::Discard) c->poff += static_cast<uint64_t>(n);
  }
  return n;
}

// Reads and handles what the connection has, up to a budget. False when it failed.
bool read_in(Conn* c) {
  std::size_t budget = kReadBudget;
  while (c->fd >= 0 && budget > 0) {
    ssize_t n = 0;
    // Reads on into buf[off, size); true once it is full.
    auto fill = [&](void* buf, std::size_t size, std::size_t& off) {
      n = rd(c, static_cast<char*>(buf) + off, size - off);
      if (n > 0) off += static_cast<std::size_t>(n);
      return n > 0 && off == size;
    };
    switch (c->in) {
      case In::Stalled:
        on_header(c);
        if (c->in == In::Stalled) return true;
        continue;
      case In::Header:
        if (fill(c->hbuf, sizeof c->hbuf, c->hoff)) {
          c->hoff = 0;
          std::memcpy(&c->h, c->hbuf, sizeof c->h);
          on_header(c);
        }
        break;
      case In::Cm:
        if (fill(c->cm_payload.data(), c->cm_payload.size(), c->cm_off)) {
          c->in = In::Header;
          on_cm(c);
        }
        break;
      case In::Stream:
        if (c->sdone == c->h.len) {
          c->in = In::Trailer;
          continue;
        }
        n = recv_stream_step(c);
        break;
      case In::Trailer:
        if (fill(c->tbuf, sizeof c->tbuf, c->toff)) {
          c->toff = 0;
          on_frame_end(c);
        }
        break;
    }
    if (n < 0) return false;
    if (n == 0) return true;
    budget -= std::min(budget, static_cast<std::size_t>(n));
  }
  return c->fd >= 0;
}

// Sends what the connection has queued until the socket is full. False when it failed.
bool flush_out(Conn* c) {
  Sim& s = sim();
  while (c->fd >= 0 && !c->outs.empty()) {
    Out& o = c->outs.front();
    if (!o.started) {
      o.started = true;
      if (o.request)
        if (SendWr* w = find_wr(qp_of(c), o.seq)) w->on_wire = true;
    }
    while (o.off < o.bytes.size()) {
      ssize_t n = wr(c, o.bytes.data() + o.off, o.bytes.size() - o.off);
      if (n <= 0) return n == 0;
      o.off += static_cast<std::size_t>(n);
    }
    if (o.stream) {
      while (o.sent < o.total) {
        std::size_t chunk = static_cast<std::size_t>(std::min<uint64_t>(o.total - o.sent, kChunk));
        auto now = Clock::now();
        if (s.cfg.rate_mbps > 0) {
          if (now < s.next_send_ok) {
            s.rate_blocked = true;
            return true;
          }
          chunk = std::min(chunk, kRateChunk);
        }
        const void* src = nullptr;
        if (o.use_inline) {
          src = o.inline_data.data() + o.sent;
        } else {
          while (o.pi < o.pieces.size() && o.poff == o.pieces[o.pi].len) {
            ++o.pi;
            o.poff = 0;
          }
          const Piece& p = o.pieces[o.pi];
          chunk = static_cast<std::size_t>(std::min<uint64_t>(chunk, p.len - o.poff));
          if (o.trailer == 0) {
            src = o.remote
                      ? check_remote(p.key, p.addr + o.poff, chunk, IBV_ACCESS_REMOTE_READ, o.qpn)
                      : check_local(p.key, p.addr + o.poff, chunk, false);
            if (src == nullptr) {
              o.trailer = o.remote ? IBV_WC_REM_ACCESS_ERR : IBV_WC_LOC_PROT_ERR;
              if (o.request) fail_request(c, o.seq, IBV_WC_LOC_PROT_ERR);
              // A READ's source went away under the responder: its QP fails too, as for an
              // access error found when the request arrived.
              if (Qp* q = qp_of(c); o.remote && q != nullptr) enter_error(q, false);
            }
          }
          if (src == nullptr) {
            src = kZeros;
            chunk = std::min(chunk, sizeof kZeros);
          }
        }
        ssize_t n = wr(c, src, chunk);
        if (n <= 0) return n == 0;
        o.sent += static_cast<uint64_t>(n);
        if (!o.use_inline) o.poff += static_cast<uint64_t>(n);
        if (s.cfg.rate_mbps > 0) {
          double bytes_per_s = static_cast<double>(s.cfg.rate_mbps) * 125000.0;
          auto cost = std::chrono::nanoseconds(
              static_cast<int64_t>(static_cast<double>(n) * 1e9 / bytes_per_s));
          s.next_send_ok = std::max(now, s.next_send_ok) + cost;
        }
      }
      unsigned char tb[4];
      std::memcpy(tb, &o.trailer, sizeof tb);
      while (o.toff < sizeof tb) {
        ssize_t n = wr(c, tb + o.toff, sizeof tb - o.toff);
        if (n <= 0) return n == 0;
        o.toff += static_cast<std::size_t>(n);
      }
    }
    c->outs.pop_front();
  }
  return c->fd >= 0;
}

void pump(Conn* c, uint32_t events) {
  if (c->doomed || c->fd < 0) return;
  if (!flush_out(c)) return;
  if (!read_in(c)) return;
  if (!flush_out(c)) return;
  if ((events & (EPOLLHUP | EPOLLERR)) != 0 && c->in == In::Stalled) return conn_failed(c);
  if (c->close_after_flush && c->outs.empty()) return close_conn(c);
  set_mask(c);
}

void accept_all(Id* x) {
  Sim& s = sim();
  for (;;) {
    int fd = ::accept4(x->lfd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR) continue;
      return;
    }
    track(fd);
    tune(fd);
    Conn* c = new_conn(fd);
    c->listener = x;
    c->cm = CmState::ReqWait;
    (void)s;
  }
}

int next_timeout(Sim& s) {
  if (!s.dirty.empty()) return 0;
  auto now = Clock::now();
  auto until = now + std::chrono::milliseconds(500);
  for (const auto& e : s.delayed) until = std::min(until, e.first);
  if (s.rate_blocked) until = std::min(until, s.next_send_ok);
  if (until <= now) return 0;
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count();
  return static_cast<int>(ms) + 1;
}

void nic_main(Sim* sp) {
  Sim& s = *sp;
  epoll_event evs[64];
  std::unique_lock lock(g_mu);
  while (!s.stop) {
    int timeout = next_timeout(s);
    lock.unlock();
    int n = epoll_wait(s.ep, evs, 64, timeout);
    lock.lock();
    if (s.stop) break;
    for (int i = 0; i < n; ++i) {
      uint64_t serial = evs[i].data.u64;
      if (serial == kBellSerial) {
        uint64_t v;
        while (::read(s.bell, &v, sizeof v) < 0 && errno == EINTR) {
        }
        s.bell_pending = false;
        continue;
      }
      if (auto l = s.listeners.find(serial); l != s.listeners.end()) {
        accept_all(l->second);
        continue;
      }
      if (auto it = s.conns.find(serial); it != s.conns.end()) pump(it->second, evs[i].events);
    }
    if (s.rate_blocked && Clock::now() >= s.next_send_ok) {
      s.rate_blocked = false;
      for (auto& [serial, c] : s.conns)
        if (!c->outs.empty()) mark_dirty(c);
    }
    std::vector<uint64_t> dirty;
    dirty.swap(s.dirty);
    for (uint64_t serial : dirty) {
      auto it = s.conns.find(serial);
      if (it == s.conns.end()) continue;
      it->second->dirty = false;
      pump(it->second, 0);
    }
    deliver_due_events();
    for (auto it = s.conns.begin(); it != s.conns.end();) {
      if (it->second->doomed) {
        delete it->second;
        it = s.conns.erase(it);
      } else {
        ++it;
      }
    }
  }
}

}  // namespace

void ensure_nic() {
  Sim& s = sim();
  if (s.running) return;
  if (s.ep < 0) s.ep = track(epoll_create1(EPOLL_CLOEXEC));
  if (s.bell < 0) {
    s.bell = track(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    watch(s.bell, kBellSerial, EPOLLIN);
  }
  s.scratch.resize(kChunk);
  s.stop = false;
  s.running = true;
  s.nic = std::thread(nic_main, &s);
}

void ring() {
  Sim& s = sim();
  if (!s.running || s.bell_pending || on_nic_thread()) return;
  s.bell_pending = true;
  uint64_t one = 1;
  while (::write(s.bell, &one, sizeof one) < 0 && errno == EINTR) {
  }
}

void stop_nic() {
  std::thread t;
  {
    std::lock_guard lock(g_mu);
    Sim* s = sim_if_any();
    if (s == nullptr || !s->running) return;
    s->stop = true;
    uint64_t one = 1;
    while (::write(s->bell, &one, sizeof one) < 0 && errno == EINTR) {
    }
    t = std::move(s->nic);
  }
  t.join();
  std::lock_guard lock(g_mu);
  if (Sim* s = sim_if_any()) s->running = false;
}

void mark_dirty(Conn* c) {
  Sim& s = sim();
  if (!c->dirty) {
    c->dirty = true;
    s.dirty.push_back(c->serial);
  }
  ensure_nic();
  ring();
}

void drop_requests(Conn* c) {
  c->outs.remove_if([](const Out& o) { return o.request && !o.started; });
}

void close_conn(Conn* c) {
  if (c->fd >= 0) {
    unwatch(c->fd);
    close_fd(c->fd);
  }
  c->outs.clear();
  if (c->id == nullptr) c->doomed = true;
}

void conn_failed(Conn* c) {
  close_conn(c);
  Id* x = c->id;
  Qp* q = qp_of(c);
  switch (c->cm) {
    case CmState::Connecting:
      if (x != nullptr) push_cm(x, RDMA_CM_EVENT_UNREACHABLE, -ETIMEDOUT, nullptr, 0);
      break;
    case CmState::ReqDelivered:
    case CmState::Accepted:
      if (q != nullptr) enter_error(q, true);
      if (x != nullptr) push_cm(x, RDMA_CM_EVENT_CONNECT_ERROR, -ECONNRESET, nullptr, 0);
      break;
    case CmState::Established:
      if (q != nullptr) enter_error(q, true);
      if (x != nullptr) push_cm(x, RDMA_CM_EVENT_DISCONNECTED, 0, nullptr, 0);
      break;
    default:
      return;
  }
  c->cm = CmState::Failed;
}

void queue_out(Conn* c, Out out) {
  if (c->fd < 0) return;
  c->outs.push_back(std::move(out));
  mark_dirty(c);
}

Out frame(const Hdr& h, const void* payload, std::size_t len) {
  Out o;
  o.bytes.resize(sizeof h + len);
  std::memcpy(o.bytes.data(), &h, sizeof h);
  if (len > 0) std::memcpy(o.bytes.data() + sizeof h, payload, len);
  return o;
}

int listen_socket(Id* x, const in_addr& ip, uint16_t port) {
  Sim& s = sim();
  char text[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &ip, text, sizeof text);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return errno;
  track(fd);
  int err = 0;
  for (int attempt = 0; attempt < 512; ++attempt) {
    uint16_t p = port != 0 ? port : static_cast<uint16_t>(20000 + s.rng() % 40000);
    socklen_t len = 0;
    sockaddr_un a = abstract_name(text, p, &len);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), len) == 0) {
      x->lfd = fd;
      x->port = p;
      return 0;
    }
    err = errno;
    if (port != 0 || err != EADDRINUSE) break;
  }
  close_fd(fd);
  return err;
}

void watch_listener(Id* x) {
  Sim& s = sim();
  ensure_nic();
  x->lserial = s.next_serial++;
  x->listening = true;
  s.listeners[x->lserial] = x;
  watch(x->lfd, x->lserial, EPOLLIN);
  ring();
}

void unwatch(int fd) {
  Sim& s = sim();
  if (s.ep >= 0) epoll_ctl(s.ep, EPOLL_CTL_DEL, fd, nullptr);
}

Conn* connect_socket(Id* x, int* err) {
  char text[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &x->dst.sin_addr, text, sizeof text);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = errno;
    return nullptr;
  }
  track(fd);
  tune(fd);
  socklen_t len = 0;
  sockaddr_un a = abstract_name(text, ntohs(x->dst.sin_port), &len);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), len) != 0 && errno != EINPROGRESS) {
    *err = errno;
    close_fd(fd);
    return nullptr;
  }
  ensure_nic();
  Conn* c = new_conn(fd);
  c->id = x;
  c->cm = CmState::Connecting;
  x->conn = c;
  return c;
}

}  // namespace ferry::test::simverbs::detail
