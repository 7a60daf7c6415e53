// The simulation's devices, memory, completion queues, queue pairs and rdma_cm ids: the calls
// of the table. The wire and the NIC thread are in simverbs_nic.cpp.

#include <arpa/inet.h>
#include <dlfcn.h>
#include <endian.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "tests/support/simverbs/simverbs_state.hpp"

namespace ferry::test::simverbs {
namespace detail {

std::mutex g_mu;

namespace {

Sim* g_sim = nullptr;
Config g_cfg;
bool g_cfg_set = false;
// States of the parent left behind in a forked child: kept reachable, never used.
Sim* g_forsaken[16] = {};

void atfork_prepare() { g_mu.lock(); }
void atfork_parent() { g_mu.unlock(); }
void atfork_child() {
  if (g_sim != nullptr) {
    // The parent's sockets and pipes must not live on here: a peer of the parent would not
    // see the parent die while this child holds them.
    for (int fd : g_sim->fds) ::close(fd);
    for (Sim*& slot : g_forsaken) {
      if (slot == nullptr) {
        slot = g_sim;
        break;
      }
    }
    g_sim = nullptr;
  }
  g_mu.unlock();
}

// Stops the NIC thread at exit, before the statics it might touch are gone.
struct AtExit {
  ~AtExit() { stop_nic(); }
};
AtExit g_at_exit;

uint64_t num(const std::string& key, const std::string& value) {
  try {
    std::size_t used = 0;
    unsigned long long v = std::stoull(value, &used, 0);
    if (used != value.size()) throw std::invalid_argument(value);
    return v;
  } catch (const std::exception&) {
    throw std::invalid_argument("FERRY_SIMVERBS: bad value for " + key + ": '" + value + "'");
  }
}

void make_devices(Sim& s) {
  uint64_t i = 0;
  for (const DeviceConfig& dc : s.cfg.devices) {
    Dev* d = new Dev;
    d->name = dc.name;
    d->ip_text = dc.ipv4;
    inet_pton(AF_INET, dc.ipv4.c_str(), &d->ip);
    d->guid = 0x0200'5eff'fe00'0000ull | (static_cast<uint64_t>(::getpid() & 0xffff) << 8) | i;
    d->ibdev.node_type = IBV_NODE_CA;
    d->ibdev.transport_type = IBV_TRANSPORT_IB;
    std::snprintf(d->ibdev.name, sizeof d->ibdev.name, "%s", dc.name.c_str());
    std::snprintf(d->ibdev.dev_name, sizeof d->ibdev.dev_name, "uverbs%u",
                  static_cast<unsigned>(i));
    std::snprintf(d->ibdev.dev_path, sizeof d->ibdev.dev_path,
                  "/sys/class/infiniband_verbs/uverbs%u", static_cast<unsigned>(i));
    std::snprintf(d->ibdev.ibdev_path, sizeof d->ibdev.ibdev_path, "/sys/class/infiniband/%s",
                  dc.name.c_str());
    s.devs.push_back(d);
    ++i;
  }
}

}  // namespace

Sim& sim() {
  static std::once_flag atfork_once;
  std::call_once(atfork_once, [] { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); });
  if (g_sim == nullptr) {
    if (!g_cfg_set) {
      g_cfg_set = true;
      if (const char* env = std::getenv("FERRY_SIMVERBS"); env != nullptr && *env != '\0') {
        try {
          g_cfg = parse_config(env);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "simverbs: %s (using the defaults)\n", e.what());
        }
      }
    }
    g_sim = new Sim;
    g_sim->cfg = g_cfg;
    g_sim->rng.seed(std::random_device{}() ^ (static_cast<uint64_t>(::getpid()) << 32) ^
                    static_cast<uint64_t>(Clock::now().time_since_epoch().count()));
    make_devices(*g_sim);
  }
  return *g_sim;
}

Sim* sim_if_any() { return g_sim; }

int track(int fd) {
  if (fd >= 0) sim().fds.insert(fd);
  return fd;
}

void close_fd(int& fd) {
  if (fd < 0) return;
  sim().fds.erase(fd);
  ::close(fd);
  fd = -1;
}

void wake(int wfd) {
  char b = 1;
  while (::write(wfd, &b, 1) < 0 && errno == EINTR) {
  }
}

namespace {

// Makes a T (Ctx, Chan, EvChan) with the pipe of its `events`; null when no pipe could be made.
template <class T>
T* new_piped() {
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return nullptr;
  fcntl(p[1], F_SETFL, fcntl(p[1], F_GETFL) | O_NONBLOCK);
  T* t = new T;
  t->events.rfd = track(p[0]);
  t->events.wfd = track(p[1]);
  return t;
}

template <class T>
void close_pipe(EventPipe<T>& events) {
  close_fd(events.rfd);
  close_fd(events.wfd);
}

template <class T>
void push_event(EventPipe<T>& events, T e) {
  events.q.push_back(std::move(e));
  wake(events.wfd);
}

// Reads one wakeup byte from `fd` (blocking unless the caller made it non-blocking).
bool take_byte(int fd) {
  for (;;) {
    char b;
    ssize_t n = ::read(fd, &b, 1);
    if (n == 1) return true;
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) errno = EIO;
    return false;
  }
}

template <class T>
T* lookup(const std::unordered_map<const void*, T*>& map, const void* key) {
  auto it = map.find(key);
  return it == map.end() ? nullptr : it->second;
}

// The end of a destroy call: `obj`, found under `key`, goes.
template <class T>
int forget(std::unordered_map<const void*, T*>& map, const void* key, T* obj) {
  map.erase(key);
  delete obj;
  return 0;
}

int fail(int err) {
  errno = err;
  return err;
}
int fail_m1(int err) {
  errno = err;
  return -1;
}
std::nullptr_t fail_null(int err) {
  errno = err;
  return nullptr;
}

// The body of the calls that wait for an event: a wakeup byte from `fd`, then (under g_mu)
// the front event of the queue that `owner()` finds, handed to `take`; EINVAL when the owner
// is gone. A byte with no event behind it (the event went with its id or CQ): wait again.
template <class Owner, class Take>
int take_event(int fd, Owner owner, Take take) {
  for (;;) {
    if (!take_byte(fd)) return -1;
    std::lock_guard lock(g_mu);
    auto* o = owner();
    if (o == nullptr) return fail_m1(EINVAL);
    if (o->events.q.empty()) continue;
    auto e = o->events.q.front();
    o->events.q.pop_front();
    take(e);
    return 0;
  }
}

uint32_t new_index(KeyEnt ent) {
  Sim& s = sim();
  for (;;) {
    auto idx = static_cast<uint32_t>(s.rng() & 0xffffff);
    if (idx == 0 || s.keys.count(idx) != 0) continue;
    s.keys[idx] = ent;
    return idx;
  }
}

uint32_t make_key(uint32_t idx) { return idx << 8 | static_cast<uint32_t>(sim().rng() & 0xff); }

Ctx* new_ctx(Dev* d, bool process_wide) {
  Ctx* c = new_piped<Ctx>();
  if (c == nullptr) return nullptr;
  c->dev = d;
  c->process_wide = process_wide;
  c->ctx.device = &d->ibdev;
  c->ctx.async_fd = c->events.rfd;
  c->ctx.cmd_fd = -1;
  c->ctx.num_comp_vectors = 1;
  sim().ctxs[&c->ctx] = c;
  return c;
}

Ctx* process_ctx(Dev* d) {
  if (d->pctx == nullptr) d->pctx = new_ctx(d, true);
  return d->pctx;
}

Dev* dev_of(const ibv_device* device) {
  for (Dev* d : sim().devs)
    if (&d->ibdev == device) return d;
  return nullptr;
}

Dev* dev_by_ip(in_addr ip) {
  Sim& s = sim();
  if (ip.s_addr == htonl(INADDR_ANY)) return s.devs.empty() ? nullptr : s.devs.front();
  for (Dev* d : s.devs)
    if (d->ip.s_addr == ip.s_addr) return d;
  return nullptr;
}

bool in_range(uint64_t base, uint64_t size, uint64_t addr, uint64_t len) {
  return addr >= base && len <= size && addr - base <= size - len;
}

ibv_wc_opcode wc_opcode(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      return IBV_WC_RDMA_WRITE;
    case IBV_WR_RDMA_READ:
      return IBV_WC_RDMA_READ;
    case IBV_WR_BIND_MW:
      return IBV_WC_BIND_MW;
    case IBV_WR_LOCAL_INV:
      return IBV_WC_LOCAL_INV;
    default:
      return IBV_WC_SEND;
  }
}

void chan_push(Cq* cq) { push_event(cq->chan->events, cq); }

void raise_event(Cq* cq) {
  Sim& s = sim();
  if (cq->chan == nullptr) return;
  if (s.delay.count() > 0) {
    s.delayed.emplace_back(Clock::now() + s.delay, cq);
    ensure_nic();
    ring();
  } else {
    chan_push(cq);
  }
}

}  // namespace

void deliver_due_events() {
  Sim& s = sim();
  auto now = Clock::now();
  auto due = [&](const std::pair<Clock::time_point, Cq*>& e) { return e.first <= now; };
  for (auto& e : s.delayed)
    if (due(e)) chan_push(e.second);
  s.delayed.erase(std::remove_if(s.delayed.begin(), s.delayed.end(), due), s.delayed.end());
}

void push_async(Ctx* ctx, ibv_async_event ev) { push_event(ctx->events, ev); }

void add_wc(Cq* cq, const ibv_wc& wc) {
  if (cq->q.size() >= static_cast<std::size_t>(cq->cqe)) {
    if (!cq->overflowed) {
      cq->overflowed = true;
      ibv_async_event ev{};
      ev.element.cq = &cq->cq;
      ev.event_type = IBV_EVENT_CQ_ERR;
      push_async(cq->ctx, ev);
    }
    return;
  }
  cq->q.push_back(wc);
  if (cq->armed) {
    cq->armed = false;
    if (cq->drop_next)
      cq->drop_next = false;
    else
      raise_event(cq);
  }
}

SendWr* find_wr(Qp* q, uint64_t seq) {
  if (q == nullptr || q->sq.empty() || seq < q->sq.front().seq) return nullptr;
  uint64_t i = seq - q->sq.front().seq;
  if (i >= q->sq.size()) return nullptr;
  return &q->sq[static_cast<std::size_t>(i)];
}

void drain_sq(Qp* q) {
  while (!q->sq.empty() && q->sq.front().done) {
    SendWr w = std::move(q->sq.front());
    q->sq.pop_front();
    bool err = w.status != IBV_WC_SUCCESS;
    if (err || w.signaled || q->sig_all) {
      ibv_wc wc{};
      wc.wr_id = w.wr_id;
      wc.status = w.status;
      wc.opcode = wc_opcode(w.op);
      wc.qp_num = q->qp.qp_num;
      wc.byte_len = static_cast<uint32_t>(w.total);
      add_wc(q->scq, wc);
    }
    if (err && q->st != IBV_QPS_ERR) enter_error(q, false);
  }
}

void enter_error(Qp* q, bool retry) {
  if (q->st == IBV_QPS_ERR) return;
  q->st = IBV_QPS_ERR;
  for (SendWr& w : q->sq) {
    if (w.done) continue;
    w.done = true;
    w.status = retry && w.on_wire ? IBV_WC_RETRY_EXC_ERR : IBV_WC_WR_FLUSH_ERR;
  }
  q->inflight.clear();
  if (q->id != nullptr && q->id->conn != nullptr) drop_requests(q->id->conn);
  drain_sq(q);
  while (!q->rq.empty()) {
    ibv_wc wc{};
    wc.wr_id = q->rq.front().wr_id;
    wc.status = IBV_WC_WR_FLUSH_ERR;
    wc.opcode = IBV_WC_RECV;
    wc.qp_num = q->qp.qp_num;
    q->rq.pop_front();
    add_wc(q->rcq, wc);
  }
}

uint8_t* check_remote(uint32_t rkey, uint64_t addr, uint64_t len, int need, uint32_t qpn) {
  Sim& s = sim();
  auto it = s.keys.find(rkey >> 8);
  if (it == s.keys.end()) return nullptr;
  const KeyEnt& k = it->second;
  if (k.kind == KeyEnt::MrRemote) {
    const Mr* m = k.mr;
    if (m->mr.rkey != rkey || (m->access & need) != need) return nullptr;
    auto base = reinterpret_cast<uint64_t>(m->mr.addr);
    if (!in_range(base, m->mr.length, addr, len)) return nullptr;
    return m->at(addr);
  }
  if (k.kind == KeyEnt::Window) {
    const Mw* w = k.mw;
    if (!w->bound || w->rkey != rkey || w->qpn != qpn || w->mr == nullptr) return nullptr;
    if ((w->access & need) != need) return nullptr;
    if (!in_range(w->addr, w->len, addr, len)) return nullptr;
    return w->mr->at(addr);
  }
  return nullptr;
}

uint8_t* check_local(uint32_t lkey, uint64_t addr, uint64_t len, bool need_write) {
  Sim& s = sim();
  auto it = s.keys.find(lkey >> 8);
  if (it == s.keys.end() || it->second.kind != KeyEnt::MrLocal) return nullptr;
  const Mr* m = it->second.mr;
  if (m->mr.lkey != lkey) return nullptr;
  if (need_write && (m->access & IBV_ACCESS_LOCAL_WRITE) == 0) return nullptr;
  auto base = reinterpret_cast<uint64_t>(m->mr.addr);
  if (!in_range(base, m->mr.length, addr, len)) return nullptr;
  return m->at(addr);
}

void push_cm(Id* id, rdma_cm_event_type type, int status, const void* pdata, std::size_t len,
             Id* listen, uint32_t qpn) {
  if (id->ch == nullptr) return;
  CmEv* e = new CmEv;
  e->ev.id = &id->id;
  e->ev.listen_id = listen != nullptr ? &listen->id : nullptr;
  e->ev.event = type;
  e->ev.status = status;
  len = std::min(len, sizeof e->pdata);
  if (len > 0 && pdata != nullptr) {
    std::memcpy(e->pdata, pdata, len);
    e->ev.param.conn.private_data = e->pdata;
    e->ev.param.conn.private_data_len = static_cast<uint8_t>(len);
  }
  e->ev.param.conn.responder_resources = 16;
  e->ev.param.conn.initiator_depth = 16;
  e->ev.param.conn.retry_count = 7;
  e->ev.param.conn.rnr_retry_count = 7;
  e->ev.param.conn.qp_num = qpn;
  push_event(id->ch->events, e);
}

void destroy_qp_locked(Qp* q) {
  Sim& s = sim();
  if (q->id != nullptr) {
    q->id->qp = nullptr;
    q->id->id.qp = nullptr;
    if (q->id->conn != nullptr) drop_requests(q->id->conn);
  }
  q->scq->refs--;
  q->rcq->refs--;
  q->pd->refs--;
  s.qp_by_num.erase(q->qp.qp_num);
  s.qps.erase(&q->qp);
  delete q;
}

void destroy_id_locked(Id* x) {
  Sim& s = sim();
  if (x->qp != nullptr) destroy_qp_locked(x->qp);
  if (x->conn != nullptr) {
    Conn* c = x->conn;
    x->conn = nullptr;
    c->id = nullptr;
    if (c->fd >= 0 && !c->outs.empty()) {
      // A reject or disconnect still on its way: the connection lives on, owned by the NIC,
      // until it has gone out.
      c->close_after_flush = true;
      mark_dirty(c);
    } else {
      if (c->fd >= 0) {
        unwatch(c->fd);
        close_fd(c->fd);
      }
      s.conns.erase(c->serial);
      delete c;
    }
  }
  if (x->lfd >= 0) {
    if (x->listening) unwatch(x->lfd);
    close_fd(x->lfd);
    s.listeners.erase(x->lserial);
  }
  for (auto& [serial, c] : s.conns)
    if (c->listener == x) c->listener = nullptr;
  // Events not yet taken that name this id go with it (their wakeup bytes stay: a reader
  // finding no event behind one reads again). A connection request's new id goes too.
  std::vector<Id*> orphans;
  if (x->ch != nullptr) {
    auto& q = x->ch->events.q;
    for (auto it = q.begin(); it != q.end();) {
      CmEv* e = *it;
      if (e->ev.id == &x->id || e->ev.listen_id == &x->id) {
        if (e->ev.listen_id == &x->id && e->ev.id != &x->id)
          if (Id* o = lookup(s.ids, e->ev.id)) orphans.push_back(o);
        delete e;
        it = q.erase(it);
      } else {
        ++it;
      }
    }
  }
  s.ids.erase(&x->id);
  delete x;
  for (Id* o : orphans) destroy_id_locked(o);
}

namespace {

// ---------------------------------------------------------------------------------------------
// Devices.

ibv_device** get_device_list(int* num_devices) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  auto** list = new ibv_device*[s.devs.size() + 1];
  std::size_t i = 0;
  for (Dev* d : s.devs) list[i++] = &d->ibdev;
  list[i] = nullptr;
  if (num_devices != nullptr) *num_devices = static_cast<int>(i);
  return list;
}

void free_device_list(ibv_device** list) { delete[] list; }

const char* get_device_name(ibv_device* device) {
  std::lock_guard lock(g_mu);
  Dev* d = dev_of(device);
  return d != nullptr ? d->ibdev.name : nullptr;
}

__be64 get_device_guid(ibv_device* device) {
  std::lock_guard lock(g_mu);
  Dev* d = dev_of(device);
  return d != nullptr ? htobe64(d->guid) : 0;
}

ibv_context* open_device(ibv_device* device) {
  std::lock_guard lock(g_mu);
  Dev* d = dev_of(device);
  if (d == nullptr) return fail_null(ENODEV);
  Ctx* c = new_ctx(d, false);
  if (c == nullptr) return nullptr;
  return &c->ctx;
}

int close_device(ibv_context* context) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Ctx* c = lookup(s.ctxs, context);
  if (c == nullptr) return fail_m1(EINVAL);
  if (c->process_wide) return 0;  // rdma_cm's: never closed
  close_pipe(c->events);
  return forget(s.ctxs, context, c);
}

int query_device(ibv_context* context, ibv_device_attr* attr) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Ctx* c = lookup(s.ctxs, context);
  if (c == nullptr || attr == nullptr) return fail(EINVAL);
  const Config& cfg = s.cfg;
  std::memset(attr, 0, sizeof *attr);
  std::snprintf(attr->fw_ver, sizeof attr->fw_ver, "simverbs 1.0");
  attr->node_guid = htobe64(c->dev->guid);
  attr->sys_image_guid = htobe64(c->dev->guid);
  attr->max_mr_size = cfg.max_mr_size;
  attr->page_size_cap = 0xfffff000u;
  attr->vendor_id = 0x5a51;
  attr->vendor_part_id = 1;
  attr->hw_ver = 1;
  attr->max_qp = 1 << 16;
  attr->max_qp_wr = static_cast<int>(cfg.max_qp_wr);
  attr->device_cap_flags = IBV_DEVICE_RC_RNR_NAK_GEN | IBV_DEVICE_PORT_ACTIVE_EVENT |
                           IBV_DEVICE_CHANGE_PHY_PORT | IBV_DEVICE_SYS_IMAGE_GUID;
  if (cfg.mw) attr->device_cap_flags |= IBV_DEVICE_MEM_WINDOW | IBV_DEVICE_MEM_WINDOW_TYPE_2B;
  attr->max_sge = static_cast<int>(cfg.max_sge);
  attr->max_sge_rd = static_cast<int>(cfg.max_sge);
  attr->max_cq = 1 << 16;
  attr->max_cqe = static_cast<int>(cfg.max_cqe);
  attr->max_mr = 1 << 20;
  attr->max_pd = 1 << 16;
  attr->max_qp_rd_atom = 16;
  attr->max_qp_init_rd_atom = 16;
  attr->max_res_rd_atom = 1 << 20;
  attr->max_mw = cfg.mw ? 1 << 20 : 0;
  attr->max_pkeys = 1;
  attr->local_ca_ack_delay = 16;
  attr->phys_port_cnt = 1;
  return 0;
}

int query_port(ibv_context* context, uint8_t port_num, ibv_port_attr* attr) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Ctx* c = lookup(s.ctxs, context);
  if (c == nullptr || attr == nullptr || port_num != 1) return fail(EINVAL);
  std::memset(attr, 0, sizeof *attr);
  bool up = c->dev->port_up;
  attr->state = up ? IBV_PORT_ACTIVE : IBV_PORT_DOWN;
  attr->max_mtu = IBV_MTU_4096;
  attr->active_mtu = IBV_MTU_4096;
  attr->gid_tbl_len = 1;
  attr->port_cap_flags = IBV_PORT_CM_SUP;
  attr->max_msg_sz = s.cfg.max_msg_sz;
  attr->pkey_tbl_len = 1;
  attr->active_width = 2;         // 4x
  attr->active_speed = 32;        // 25 Gb/s per lane
  attr->phys_state = up ? 5 : 3;  // LinkUp : Disabled
  attr->link_layer = IBV_LINK_LAYER_ETHERNET;
  return 0;
}

int query_gid(ibv_context* context, uint8_t port_num, int index, ibv_gid* gid) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Ctx* c = lookup(s.ctxs, context);
  if (c == nullptr || gid == nullptr || port_num != 1 || index != 0) return fail_m1(EINVAL);
  std::memset(gid, 0, sizeof *gid);
  gid->raw[10] = 0xff;
  gid->raw[11] = 0xff;
  std::memcpy(&gid->raw[12], &c->dev->ip, 4);
  return 0;
}

int get_async_event(ibv_context* context, ibv_async_event* event) {
  return take_event(
      context->async_fd, [&] { return lookup(sim().ctxs, context); },
      [&](const ibv_async_event& e) { *event = e; });
}

void ack_async_event(ibv_async_event*) {
  std::lock_guard lock(g_mu);
  sim().counters.async_events_acked++;
}

// ---------------------------------------------------------------------------------------------
// Protection domains, memory regions and windows.

ibv_pd* alloc_pd(ibv_context* context) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Ctx* c = lookup(s.ctxs, context);
  if (c == nullptr) return fail_null(EINVAL);
  Pd* p = new Pd;
  p->ctx = c;
  p->pd.context = context;
  p->pd.handle = static_cast<uint32_t>(s.pds.size() + 1);
  s.pds[&p->pd] = p;
  return &p->pd;
}

int dealloc_pd(ibv_pd* pd) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Pd* p = lookup(s.pds, pd);
  if (p == nullptr) return fail(EINVAL);
  if (p->refs > 0) return fail(EBUSY);
  return forget(s.pds, pd, p);
}

constexpr int kKnownAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                             IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC |
                             IBV_ACCESS_MW_BIND | IBV_ACCESS_RELAXED_ORDERING;

namespace {

std::size_t page() { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }

/// Whether the CPU can read every page of [addr, addr + length), as pinning them requires.
bool readable(const void* addr, std::size_t length) {
  if (length == 0) return true;
  const uint64_t first = reinterpret_cast<uint64_t>(addr) & ~(uint64_t{page()} - 1);
  const uint64_t end = reinterpret_cast<uint64_t>(addr) + length;
  constexpr std::size_t kBatch = 512;
  char sink[kBatch];
  iovec local[kBatch];
  iovec remote[kBatch];
  for (uint64_t at = first; at < end;) {
    std::size_t n = 0;
    for (; n < kBatch && at < end; ++n, at += page()) {
      const uint64_t probe = std::max(at, reinterpret_cast<uint64_t>(addr));
      local[n] = {sink + n, 1};
      remote[n] = {reinterpret_cast<void*>(probe), 1};
    }
    const ssize_t got = ::process_vm_readv(::getpid(), local, n, remote, n, 0);
    // Short: a page in the batch faulted. Refused outright (a seccomp filter): cannot tell.
    if (got >= 0 && got != static_cast<ssize_t>(n)) return false;
    if (got < 0 && errno == EFAULT) return false;
  }
  return true;
}

/// A new region of `pd` answering to [iova, iova + length), its bytes at `cpu` (null: at iova).
Mr* new_mr(Sim& s, Pd* p, ibv_pd* pd, uint64_t iova, std::size_t length, int access, uint8_t* cpu,
           void* map, std::size_t map_len) {
  Mr* m = new Mr;
  m->pd = p;
  m->access = access;
  m->cpu = cpu;
  m->map = map;
  m->map_len = map_len;
  m->mr.context = pd->context;
  m->mr.pd = pd;
  m->mr.addr = reinterpret_cast<void*>(iova);
  m->mr.length = length;
  m->mr.lkey = make_key(new_index({KeyEnt::MrLocal, m, nullptr}));
  m->mr.rkey = make_key(new_index({KeyEnt::MrRemote, m, nullptr}));
  m->mr.handle = m->mr.lkey;
  p->refs++;
  s.mrs[&m->mr] = m;
  return m;
}

/// Maps `length` bytes of dmabuf `fd` from `offset`: the mapping, its length, and where the
/// byte at `offset` lies in it; null when it cannot be mapped.
void* map_dmabuf(int fd, uint64_t offset, std::size_t length, std::size_t& map_len, uint8_t*& cpu) {
  const uint64_t skew = offset % page();
  map_len = (static_cast<std::size_t>(skew) + length + page() - 1) & ~(page() - 1);
  void* map = ::mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                     static_cast<off_t>(offset - skew));
  if (map == MAP_FAILED) return nullptr;
  cpu = static_cast<uint8_t*>(map) + skew;
  return map;
}

/// The simulated nvidia-peermem: the NIC's driver asks the GPU driver for the pages of device
/// memory. Here the GPU driver is the simulated CUDA driver FERRY_CUDA_DRIVER names, already
/// loaded in this process; its dmabuf export of the allocation gives the bytes. False when
/// there is no such driver or the range is none of its memory.
bool peermem_map(const void* addr, std::size_t length, void*& map, std::size_t& map_len,
                 uint8_t*& cpu) {
  using GetRange = int (*)(unsigned long long*, std::size_t*, unsigned long long);
  using GetHandle = int (*)(void*, unsigned long long, std::size_t, int, unsigned long long);
  const char* path = std::getenv("FERRY_CUDA_DRIVER");
  if (path == nullptr) return false;
  void* lib = ::dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return false;
  auto range = reinterpret_cast<GetRange>(::dlsym(lib, "cuMemGetAddressRange_v2"));
  auto handle = reinterpret_cast<GetHandle>(::dlsym(lib, "cuMemGetHandleForAddressRange"));
  bool ok = false;
  unsigned long long base = 0;
  std::size_t size = 0;
  const auto a = reinterpret_cast<unsigned long long>(addr);
  if (range != nullptr && handle != nullptr && range(&base, &size, a) == 0 &&
      a + length <= base + size) {
    const std::size_t span =
        (static_cast<std::size_t>(a - base) + length + page() - 1) & ~(page() - 1);
    int fd = -1;
    constexpr int kDmaBufFd = 1;  // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
    if (handle(&fd, base, span, kDmaBufFd, 0) == 0 && fd >= 0) {
      map = map_dmabuf(fd, a - base, length, map_len, cpu);
      ok = map != nullptr;
      ::close(fd);
    }
  }
  ::dlclose(lib);
  return ok;
}

}  // namespace

ibv_mr* reg_mr(ibv_pd* pd, void* addr, size_t length, int access) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Pd* p = lookup(s.pds, pd);
  bool remote_w = (access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) != 0;
  if (p == nullptr || (access & ~kKnownAccess) != 0 || length > s.cfg.max_mr_size ||
      (addr == nullptr && length > 0) || (remote_w && (access & IBV_ACCESS_LOCAL_WRITE) == 0))
    return fail_null(EINVAL);
  if (!readable(addr, length)) {
    void* map = nullptr;
    std::size_t map_len = 0;
    uint8_t* cpu = nullptr;
    if (!s.cfg.peermem || !peermem_map(addr, length, map, map_len, cpu)) {
      ++s.counters.refused_mrs;
      return fail_null(EFAULT);
    }
    ++s.counters.peermem_mrs;
    return &new_mr(s, p, pd, reinterpret_cast<uint64_t>(addr), length, access, cpu, map, map_len)
                ->mr;
  }
  return &new_mr(s, p, pd, reinterpret_cast<uint64_t>(addr), length, access, nullptr, nullptr, 0)
              ->mr;
}

ibv_mr* reg_dmabuf_mr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                      int access) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Pd* p = lookup(s.pds, pd);
  bool remote_w = (access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) != 0;
  if (p == nullptr || (access & ~kKnownAccess) != 0 || length == 0 || length > s.cfg.max_mr_size ||
      fd < 0 || (remote_w && (access & IBV_ACCESS_LOCAL_WRITE) == 0))
    return fail_null(EINVAL);
  if (!s.cfg.dmabuf) return fail_null(EOPNOTSUPP);
  std::size_t map_len = 0;
  uint8_t* cpu = nullptr;
  void* map = map_dmabuf(fd, offset, length, map_len, cpu);
  if (map == nullptr) return fail_null(errno == 0 ? EINVAL : errno);
  ++s.counters.dmabuf_mrs;
  return &new_mr(s, p, pd, iova, length, access, cpu, map, map_len)->mr;
}

int dereg_mr(ibv_mr* mr) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Mr* m = lookup(s.mrs, mr);
  if (m == nullptr) return fail(EINVAL);
  // The NIC thread touches registered memory only under g_mu and looks its key up for every
  // step: once the keys are gone here, no access is in progress and none can start.
  s.keys.erase(m->mr.lkey >> 8);
  s.keys.erase(m->mr.rkey >> 8);
  for (auto& [k, w] : s.mws) {
    if (w->mr == m) {
      w->bound = false;
      w->mr = nullptr;
    }
  }
  m->pd->refs--;
  if (m->map != nullptr) ::munmap(m->map, m->map_len);
  return forget(s.mrs, mr, m);
}

ibv_mw* alloc_mw(ibv_pd* pd, ibv_mw_type type) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Pd* p = lookup(s.pds, pd);
  if (p == nullptr) return fail_null(EINVAL);
  if (!s.cfg.mw || type != IBV_MW_TYPE_2) return fail_null(EOPNOTSUPP);
  Mw* w = new Mw;
  w->pd = p;
  w->idx = new_index({KeyEnt::Window, nullptr, w});
  w->rkey = make_key(w->idx);
  w->mw.context = pd->context;
  w->mw.pd = pd;
  w->mw.rkey = w->rkey;
  w->mw.handle = w->idx;
  w->mw.type = IBV_MW_TYPE_2;
  p->refs++;
  s.mws[&w->mw] = w;
  return &w->mw;
}

int dealloc_mw(ibv_mw* mw) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Mw* w = lookup(s.mws, mw);
  if (w == nullptr) return fail(EINVAL);
  s.keys.erase(w->idx);
  w->pd->refs--;
  return forget(s.mws, mw, w);
}

// ---------------------------------------------------------------------------------------------
// Completion channels and queues.

ibv_comp_channel* create_comp_channel(ibv_context* context) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  if (lookup(s.ctxs, context) == nullptr) return fail_null(EINVAL);
  Chan* c = new_piped<Chan>();
  if (c == nullptr) return nullptr;
  c->ch.context = context;
  c->ch.fd = c->events.rfd;
  s.chans[&c->ch] = c;
  return &c->ch;
}

int destroy_comp_channel(ibv_comp_channel* channel) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Chan* c = lookup(s.chans, channel);
  if (c == nullptr) return fail(EINVAL);
  if (c->refs > 0) return fail(EBUSY);
  close_pipe(c->events);
  return forget(s.chans, channel, c);
}

ibv_cq* create_cq(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel,
                  int comp_vector) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Ctx* x = lookup(s.ctxs, context);
  Chan* ch = channel != nullptr ? lookup(s.chans, channel) : nullptr;
  if (x == nullptr || cqe < 1 || static_cast<uint32_t>(cqe) > s.cfg.max_cqe ||
      (channel != nullptr && ch == nullptr) || comp_vector != 0)
    return fail_null(EINVAL);
  Cq* c = new Cq;
  c->ctx = x;
  c->chan = ch;
  c->cqe = cqe;
  c->cq.context = context;
  c->cq.channel = channel;
  c->cq.cq_context = cq_context;
  c->cq.cqe = cqe;
  c->cq.handle = static_cast<uint32_t>(s.cqs.size() + 1);
  if (ch != nullptr) ch->refs++;
  s.cqs[&c->cq] = c;
  return &c->cq;
}

int destroy_cq(ibv_cq* cq) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Cq* c = lookup(s.cqs, cq);
  if (c == nullptr) return fail(EINVAL);
  if (c->refs > 0 || c->gotten != c->acked) return fail(EBUSY);
  if (c->chan != nullptr) {
    auto& q = c->chan->events.q;
    q.erase(std::remove(q.begin(), q.end(), c), q.end());
    c->chan->refs--;
  }
  s.delayed.erase(std::remove_if(s.delayed.begin(), s.delayed.end(),
                                 [&](const auto& e) { return e.second == c; }),
                  s.delayed.end());
  return forget(s.cqs, cq, c);
}

int get_cq_event(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) {
  {
    std::lock_guard lock(g_mu);
    sim().counters.get_cq_event++;
  }
  return take_event(
      channel->fd, [&] { return lookup(sim().chans, channel); },
      [&](Cq* q) {
        q->gotten++;
        *cq = &q->cq;
        *cq_context = q->cq.cq_context;
      });
}

void ack_cq_events(ibv_cq* cq, unsigned int nevents) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  s.counters.cq_events_acked += nevents;
  if (Cq* c = lookup(s.cqs, cq)) c->acked += nevents;
}

int req_notify_cq(ibv_cq* cq, int) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  s.counters.req_notify_cq++;
  Cq* c = lookup(s.cqs, cq);
  if (c == nullptr || c->chan == nullptr) return fail(EINVAL);
  c->armed = true;
  return 0;
}

int poll_cq(ibv_cq* cq, int num_entries, ibv_wc* wc) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  s.counters.poll_cq++;
  Cq* c = lookup(s.cqs, cq);
  if (c == nullptr || num_entries < 0) return -EINVAL;
  int n = 0;
  while (n < num_entries && !c->q.empty()) {
    wc[n++] = c->q.front();
    c->q.pop_front();
  }
  if (c->q.empty()) c->overflowed = false;
  return n;
}

// ---------------------------------------------------------------------------------------------
// Queue pairs.

ibv_wc_status bind_window(Qp* q, const ibv_send_wr* wr) {
  Sim& s = sim();
  Mw* w = lookup(s.mws, wr->bind_mw.mw);
  const ibv_mw_bind_info& bi = wr->bind_mw.bind_info;
  Mr* m = lookup(s.mrs, bi.mr);
  if (w == nullptr || m == nullptr || !s.cfg.mw || w->pd != q->pd || m->pd != q->pd || w->bound)
    return IBV_WC_MW_BIND_ERR;
  if ((wr->bind_mw.rkey >> 8) != w->idx) return IBV_WC_MW_BIND_ERR;
  if ((m->access & IBV_ACCESS_MW_BIND) == 0) return IBV_WC_MW_BIND_ERR;
  auto base = reinterpret_cast<uint64_t>(m->mr.addr);
  if (!in_range(base, m->mr.length, bi.addr, bi.length)) return IBV_WC_MW_BIND_ERR;
  auto access = static_cast<int>(bi.mw_access_flags);
  if ((access & ~(IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC |
                  IBV_ACCESS_ZERO_BASED)) != 0)
    return IBV_WC_MW_BIND_ERR;
  if ((access & IBV_ACCESS_REMOTE_WRITE) != 0 && (m->access & IBV_ACCESS_LOCAL_WRITE) == 0)
    return IBV_WC_MW_BIND_ERR;
  w->bound = true;
  w->mr = m;
  w->addr = bi.addr;
  w->len = bi.length;
  w->access = access;
  w->qpn = q->qp.qp_num;
  w->rkey = wr->bind_mw.rkey;
  w->mw.rkey = w->rkey;
  return IBV_WC_SUCCESS;
}

ibv_wc_status invalidate(Qp* q, uint32_t rkey) {
  Sim& s = sim();
  auto it = s.keys.find(rkey >> 8);
  if (it == s.keys.end() || it->second.kind != KeyEnt::Window) return IBV_WC_LOC_PROT_ERR;
  Mw* w = it->second.mw;
  if (!w->bound || w->rkey != rkey || w->pd != q->pd) return IBV_WC_LOC_PROT_ERR;
  w->bound = false;
  w->mr = nullptr;
  return IBV_WC_SUCCESS;
}

// The QP that a post call names; null (with *bad_wr the first WR) when there is none.
template <class Wr>
Qp* post_target(ibv_qp* qp, Wr* wr, Wr** bad_wr) {
  Qp* q = lookup(sim().qps, qp);
  if (q == nullptr && bad_wr != nullptr) *bad_wr = wr;
  return q;
}

// The frame type of a data-carrying send WR.
Ft frame_type(ibv_wr_opcode op) {
  return op == IBV_WR_RDMA_WRITE            ? Ft::Write
         : op == IBV_WR_RDMA_WRITE_WITH_IMM ? Ft::WriteImm
         : op == IBV_WR_SEND                ? Ft::Send
         : op == IBV_WR_SEND_WITH_IMM       ? Ft::SendImm
                                            : Ft::Read;
}

// Starts a WR: local operations run now; data operations become frames on the connection.
void start_wr(Qp* q, SendWr& w) {
  Sim& s = sim();
  auto fail_now = [&](ibv_wc_status st) {
    w.done = true;
    w.status = st;
    q->stopped = true;
  };
  bool data = w.op != IBV_WR_BIND_MW && w.op != IBV_WR_LOCAL_INV;
  if (data && w.total > s.cfg.max_msg_sz) return fail_now(IBV_WC_LOC_LEN_ERR);
  if (w.op == IBV_WR_BIND_MW) return;  // done in post_send, which has the WR
  if (w.op == IBV_WR_LOCAL_INV) {
    w.done = true;
    w.status = invalidate(q, w.rkey);
    if (w.status != IBV_WC_SUCCESS) q->stopped = true;
    return;
  }
  bool read = w.op == IBV_WR_RDMA_READ;
  if (!w.inl) {
    for (const ibv_sge& g : w.sges)
      if (check_local(g.lkey, g.addr, g.length, read) == nullptr)
        return fail_now(IBV_WC_LOC_PROT_ERR);
  }
  Conn* c = q->id != nullptr ? q->id->conn : nullptr;
  if (c == nullptr || c->fd < 0) return fail_now(IBV_WC_RETRY_EXC_ERR);
  Hdr h;
  h.len = static_cast<uint32_t>(w.total);
  h.rkey = w.rkey;
  h.addr = w.raddr;
  h.imm = w.imm;
  h.type = static_cast<uint8_t>(frame_type(w.op));
  Out o = frame(h);
  o.request = true;
  o.seq = w.seq;
  if (!read) {
    o.stream = true;
    o.total = w.total;
    if (w.inl) {
      o.use_inline = true;
      o.inline_data = w.inline_data;
    } else {
      for (const ibv_sge& g : w.sges) o.pieces.push_back({g.lkey, g.addr, g.length});
    }
  }
  q->inflight.push_back(w.seq);
  queue_out(c, std::move(o));
}

int post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Qp* q = post_target(qp, wr, bad_wr);
  if (q == nullptr) return fail(EINVAL);
  int rc = 0;
  for (ibv_send_wr* cur = wr; cur != nullptr; cur = cur->next) {
    auto bad = [&](int err) {
      if (bad_wr != nullptr) *bad_wr = cur;
      rc = err;
    };
    if (q->st == IBV_QPS_RESET || q->st == IBV_QPS_INIT || q->st == IBV_QPS_RTR) {
      bad(EINVAL);
      break;
    }
    if (cur->num_sge < 0 || static_cast<uint32_t>(cur->num_sge) > q->cap.max_send_sge) {
      bad(EINVAL);
      break;
    }
    switch (cur->opcode) {
      case IBV_WR_RDMA_WRITE:
      case IBV_WR_RDMA_WRITE_WITH_IMM:
      case IBV_WR_SEND:
      case IBV_WR_SEND_WITH_IMM:
      case IBV_WR_RDMA_READ:
      case IBV_WR_LOCAL_INV:
        break;
      case IBV_WR_BIND_MW:
        if (lookup(s.mws, cur->bind_mw.mw) == nullptr) {
          bad(EINVAL);
          break;
        }
        break;
      default:
        bad(EINVAL);
        break;
    }
    if (rc != 0) break;
    if (q->sq.size() >= q->cap.max_send_wr) {
      bad(ENOMEM);
      break;
    }
    SendWr w;
    w.seq = q->next_seq++;
    w.wr_id = cur->wr_id;
    w.op = cur->opcode;
    w.signaled = (cur->send_flags & IBV_SEND_SIGNALED) != 0;
    for (int i = 0; i < cur->num_sge; ++i) {
      w.sges.push_back(cur->sg_list[i]);
      w.total += cur->sg_list[i].length;
    }
    if ((cur->send_flags & IBV_SEND_INLINE) != 0 && w.op != IBV_WR_RDMA_READ &&
        w.op != IBV_WR_BIND_MW && w.op != IBV_WR_LOCAL_INV) {
      if (w.total > q->cap.max_inline_data) {
        bad(EINVAL);
        break;
      }
      w.inl = true;
      for (const ibv_sge& g : w.sges)
        w.inline_data.append(reinterpret_cast<const char*>(g.addr), g.length);
    }
    w.raddr = cur->wr.rdma.remote_addr;
    w.rkey = cur->wr.rdma.rkey;
    w.imm = cur->imm_data;
    if (w.op == IBV_WR_LOCAL_INV) w.rkey = cur->invalidate_rkey;
    if (w.op == IBV_WR_BIND_MW) w.total = 0;
    q->sq.push_back(std::move(w));
    SendWr& in = q->sq.back();
    if (q->st == IBV_QPS_ERR) {
      in.done = true;
      in.status = IBV_WC_WR_FLUSH_ERR;
    } else if (!q->stopped) {
      if (in.op == IBV_WR_BIND_MW) {
        in.done = true;
        in.status = bind_window(q, cur);
        if (in.status != IBV_WC_SUCCESS) q->stopped = true;
      } else {
        start_wr(q, in);
      }
    }
  }
  drain_sq(q);
  return rc;
}

int post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) {
  std::lock_guard lock(g_mu);
  Qp* q = post_target(qp, wr, bad_wr);
  if (q == nullptr) return fail(EINVAL);
  for (ibv_recv_wr* cur = wr; cur != nullptr; cur = cur->next) {
    int err = 0;
    if (q->st == IBV_QPS_RESET)
      err = EINVAL;
    else if (cur->num_sge < 0 || static_cast<uint32_t>(cur->num_sge) > q->cap.max_recv_sge)
      err = EINVAL;
    else if (q->rq.size() >= q->cap.max_recv_wr)
      err = ENOMEM;
    if (err != 0) {
      if (bad_wr != nullptr) *bad_wr = cur;
      return fail(err);
    }
    if (q->st == IBV_QPS_ERR) {
      ibv_wc wc{};
      wc.wr_id = cur->wr_id;
      wc.status = IBV_WC_WR_FLUSH_ERR;
      wc.opcode = IBV_WC_RECV;
      wc.qp_num = q->qp.qp_num;
      add_wc(q->rcq, wc);
      continue;
    }
    RecvWr r;
    r.wr_id = cur->wr_id;
    r.sges.assign(cur->sg_list, cur->sg_list + cur->num_sge);
    q->rq.push_back(std::move(r));
  }
  if (q->id != nullptr && q->id->conn != nullptr && q->id->conn->in == In::Stalled)
    mark_dirty(q->id->conn);
  return 0;
}

int modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Qp* q = lookup(s.qps, qp);
  if (q == nullptr || attr == nullptr) return fail(EINVAL);
  if ((attr_mask & IBV_QP_STATE) == 0) return 0;
  switch (attr->qp_state) {
    case IBV_QPS_ERR:
      enter_error(q, false);
      break;
    case IBV_QPS_RESET:
      q->sq.clear();
      q->rq.clear();
      q->inflight.clear();
      q->stopped = false;
      if (q->id != nullptr && q->id->conn != nullptr) drop_requests(q->id->conn);
      q->st = IBV_QPS_RESET;
      break;
    case IBV_QPS_INIT:
    case IBV_QPS_RTR:
    case IBV_QPS_RTS:
      if (q->st == IBV_QPS_ERR) return fail(EINVAL);
      if (attr->qp_state == IBV_QPS_RTS && q->st != IBV_QPS_RTS) {
        bool linked =
            q->id != nullptr && q->id->conn != nullptr &&
            (q->id->conn->cm == CmState::Established || q->id->conn->cm == CmState::Accepted);
        if (!linked) return fail(EINVAL);
      }
      q->st = attr->qp_state;
      break;
    default:
      return fail(EINVAL);
  }
  qp->state = attr->qp_state;
  return 0;
}

// ---------------------------------------------------------------------------------------------
// rdma_cm.

rdma_event_channel* create_event_channel() {
  std::lock_guard lock(g_mu);
  EvChan* c = new_piped<EvChan>();
  if (c == nullptr) return nullptr;
  c->ch.fd = c->events.rfd;
  sim().evchans[&c->ch] = c;
  return &c->ch;
}

void destroy_event_channel(rdma_event_channel* channel) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  EvChan* c = lookup(s.evchans, channel);
  if (c == nullptr) return;
  for (CmEv* e : c->events.q) delete e;
  for (auto& [k, id] : s.ids)
    if (id->ch == c) id->ch = nullptr;
  close_pipe(c->events);
  forget(s.evchans, channel, c);
}

ibv_context** get_devices(int* num_devices) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  auto** list = new ibv_context*[s.devs.size() + 1];
  std::size_t i = 0;
  for (Dev* d : s.devs)
    if (Ctx* c = process_ctx(d)) list[i++] = &c->ctx;
  list[i] = nullptr;
  if (num_devices != nullptr) *num_devices = static_cast<int>(i);
  return list;
}

void free_devices(ibv_context** list) { delete[] list; }

int create_id(rdma_event_channel* channel, rdma_cm_id** id, void* context, rdma_port_space ps) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  EvChan* c = lookup(s.evchans, channel);
  if (c == nullptr || id == nullptr) return fail_m1(EINVAL);
  if (ps != RDMA_PS_TCP) return fail_m1(EPROTONOSUPPORT);
  Id* x = new Id;
  x->ch = c;
  x->id.channel = channel;
  x->id.context = context;
  x->id.ps = ps;
  x->id.qp_type = IBV_QPT_RC;
  s.ids[&x->id] = x;
  *id = &x->id;
  return 0;
}

int destroy_id(rdma_cm_id* id) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Id* x = lookup(s.ids, id);
  if (x == nullptr) return fail_m1(EINVAL);
  destroy_id_locked(x);
  return 0;
}

void set_src(Id* x, in_addr ip, uint16_t port) {
  x->id.route.addr.src_sin.sin_family = AF_INET;
  x->id.route.addr.src_sin.sin_addr = ip;
  x->id.route.addr.src_sin.sin_port = htons(port);
}

int bind_addr(rdma_cm_id* id, sockaddr* addr) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Id* x = lookup(s.ids, id);
  if (x == nullptr || addr == nullptr || x->bound) return fail_m1(EINVAL);
  if (addr->sa_family != AF_INET) return fail_m1(EAFNOSUPPORT);
  sockaddr_in sin;
  std::memcpy(&sin, addr, sizeof sin);
  Dev* d = dev_by_ip(sin.sin_addr);
  if (d == nullptr) return fail_m1(EADDRNOTAVAIL);
  in_addr ip = d->ip;
  int err = listen_socket(x, ip, ntohs(sin.sin_port));
  if (err != 0) return fail_m1(err);
  x->bound = true;
  x->dev = d;
  x->id.verbs = &process_ctx(d)->ctx;
  x->id.port_num = 1;
  set_src(x, sin.sin_addr, x->port);
  return 0;
}

int listen(rdma_cm_id* id, int backlog) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Id* x = lookup(s.ids, id);
  if (x == nullptr || x->listening || x->conn != nullptr) return fail_m1(EINVAL);
  if (!x->bound) {
    Dev* d = s.devs.empty() ? nullptr : s.devs.front();
    if (d == nullptr) return fail_m1(ENODEV);
    int err = listen_socket(x, d->ip, 0);
    if (err != 0) return fail_m1(err);
    x->bound = true;
    x->dev = d;
    x->id.verbs = &process_ctx(d)->ctx;
    x->id.port_num = 1;
    set_src(x, in_addr{htonl(INADDR_ANY)}, x->port);
  }
  if (::listen(x->lfd, std::max(backlog, 128)) != 0) return -1;
  watch_listener(x);
  return 0;
}

int resolve_addr(rdma_cm_id* id, sockaddr* src_addr, sockaddr* dst_addr, int) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Id* x = lookup(s.ids, id);
  if (x == nullptr || dst_addr == nullptr || x->listening || x->conn != nullptr)
    return fail_m1(EINVAL);
  if (dst_addr->sa_family != AF_INET || (src_addr != nullptr && src_addr->sa_family != AF_INET))
    return fail_m1(EAFNOSUPPORT);
  sockaddr_in dst;
  std::memcpy(&dst, dst_addr, sizeof dst);
  Dev* d = dst.sin_addr.s_addr == htonl(INADDR_ANY) ? nullptr : dev_by_ip(dst.sin_addr);
  if (d == nullptr || !d->port_up) {
    push_cm(x, RDMA_CM_EVENT_ADDR_ERROR, -EHOSTUNREACH, nullptr, 0);
    return 0;
  }
  x->dst = dst;
  x->dev = d;
  x->addr_ok = true;
  x->id.verbs = &process_ctx(d)->ctx;
  x->id.port_num = 1;
  x->id.route.addr.dst_sin = dst;
  if (!x->bound) {
    x->port = static_cast<uint16_t>(32768 + s.rng() % 28000);  // an ephemeral port, for show
    in_addr src = d->ip;
    if (src_addr != nullptr) {
      sockaddr_in sin;
      std::memcpy(&sin, src_addr, sizeof sin);
      if (sin.sin_addr.s_addr != htonl(INADDR_ANY)) src = sin.sin_addr;
    }
    set_src(x, src, x->port);
  }
  push_cm(x, RDMA_CM_EVENT_ADDR_RESOLVED, 0, nullptr, 0);
  return 0;
}

int resolve_route(rdma_cm_id* id, int) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Id* x = lookup(s.ids, id);
  if (x == nullptr || !x->addr_ok) return fail_m1(EINVAL);
  if (!x->dev->port_up) {
    push_cm(x, RDMA_CM_EVENT_ROUTE_ERROR, -EHOSTUNREACH, nullptr, 0);
    return 0;
  }
  x->route_ok = true;
  push_cm(x, RDMA_CM_EVENT_ROUTE_RESOLVED, 0, nullptr, 0);
  return 0;
}

int create_qp(rdma_cm_id* id, ibv_pd* pd, ibv_qp_init_attr* attr) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Id* x = lookup(s.ids, id);
  Pd* p = lookup(s.pds, pd);
  if (x == nullptr || p == nullptr || attr == nullptr || x->qp != nullptr ||
      x->id.verbs == nullptr || x->listening)
    return fail_m1(EINVAL);
  Ctx* vc = lookup(s.ctxs, x->id.verbs);
  Cq* scq = lookup(s.cqs, attr->send_cq);
  Cq* rcq = lookup(s.cqs, attr->recv_cq);
  if (vc == nullptr || p->ctx->dev != vc->dev || scq == nullptr || rcq == nullptr ||
      attr->srq != nullptr)
    return fail_m1(EINVAL);
  if (attr->qp_type != IBV_QPT_RC) return fail_m1(EOPNOTSUPP);
  const ibv_qp_cap& cap = attr->cap;
  if (cap.max_send_wr > s.cfg.max_qp_wr || cap.max_recv_wr > s.cfg.max_qp_wr ||
      cap.max_send_sge > s.cfg.max_sge || cap.max_recv_sge > s.cfg.max_sge ||
      cap.max_inline_data > kMaxInline)
    return fail_m1(EINVAL);
  Qp* q = new Qp;
  q->pd = p;
  q->scq = scq;
  q->rcq = rcq;
  q->id = x;
  q->cap = cap;
  q->cap.max_send_wr = std::max(cap.max_send_wr, 1u);
  q->cap.max_recv_wr = std::max(cap.max_recv_wr, 1u);
  q->cap.max_send_sge = std::max(cap.max_send_sge, 1u);
  q->cap.max_recv_sge = std::max(cap.max_recv_sge, 1u);
  attr->cap = q->cap;
  q->sig_all = attr->sq_sig_all != 0;
  uint32_t qpn = 0;
  while (qpn == 0 || s.qp_by_num.count(qpn) != 0) qpn = static_cast<uint32_t>(s.rng() & 0xffffff);
  q->qp.context = x->id.verbs;
  q->qp.qp_context = attr->qp_context;
  q->qp.pd = pd;
  q->qp.send_cq = attr->send_cq;
  q->qp.recv_cq = attr->recv_cq;
  q->qp.handle = qpn;
  q->qp.qp_num = qpn;
  q->qp.state = IBV_QPS_INIT;
  q->qp.qp_type = IBV_QPT_RC;
  scq->refs++;
  rcq->refs++;
  p->refs++;
  s.qps[&q->qp] = q;
  s.qp_by_num[qpn] = q;
  x->qp = q;
  x->id.qp = &q->qp;
  x->id.pd = pd;
  x->id.send_cq = attr->send_cq;
  x->id.recv_cq = attr->recv_cq;
  x->id.send_cq_channel = attr->send_cq->channel;
  x->id.recv_cq_channel = attr->recv_cq->channel;
  return 0;
}

void destroy_qp(rdma_cm_id* id) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Id* x = lookup(s.ids, id);
  if (x == nullptr || x->qp == nullptr) return;
  destroy_qp_locked(x->qp);
}

int connect(rdma_cm_id* id, rdma_conn_param* param) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Id* x = lookup(s.ids, id);
  if (x == nullptr || !x->route_ok || x->qp == nullptr || x->conn != nullptr || x->passive)
    return fail_m1(EINVAL);
  if (param != nullptr && param->private_data_len > kReqPdataMax) return fail_m1(EINVAL);
  if (!x->dev->port_up) {
    push_cm(x, RDMA_CM_EVENT_UNREACHABLE, -ETIMEDOUT, nullptr, 0);
    return 0;
  }
  int err = 0;
  Conn* c = connect_socket(x, &err);
  if (c == nullptr) {
    if (err == ECONNREFUSED || err == ENOENT)
      push_cm(x, RDMA_CM_EVENT_REJECTED, kRejectNoListener, nullptr, 0);
    else
      push_cm(x, RDMA_CM_EVENT_UNREACHABLE, -ETIMEDOUT, nullptr, 0);
    return 0;
  }
  Hdr h;
  h.type = static_cast<uint8_t>(Ft::CmReq);
  const sockaddr_in& src = x->id.route.addr.src_sin;
  h.addr = static_cast<uint64_t>(ntohl(src.sin_addr.s_addr)) << 16 | x->port;
  h.aux = x->qp->qp.qp_num;
  const void* pd = param != nullptr ? param->private_data : nullptr;
  std::size_t len = param != nullptr && pd != nullptr ? param->private_data_len : 0;
  h.len = static_cast<uint32_t>(len);
  queue_out(c, frame(h, pd, len));
  return 0;
}

int accept(rdma_cm_id* id, rdma_conn_param* param) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Id* x = lookup(s.ids, id);
  if (x == nullptr || x->listening) return fail_m1(EINVAL);
  Conn* c = x->conn;
  if (c == nullptr || !x->passive || x->qp == nullptr) return fail_m1(EINVAL);
  if (param != nullptr && param->private_data_len > kRepPdataMax) return fail_m1(EINVAL);
  if (c->cm == CmState::Failed) return 0;  // CONNECT_ERROR is queued already
  if (c->cm != CmState::ReqDelivered) return fail_m1(EINVAL);
  Hdr h;
  h.type = static_cast<uint8_t>(Ft::CmRep);
  h.aux = x->qp->qp.qp_num;
  const void* pd = param != nullptr ? param->private_data : nullptr;
  std::size_t len = param != nullptr && pd != nullptr ? param->private_data_len : 0;
  h.len = static_cast<uint32_t>(len);
  c->cm = CmState::Accepted;
  if (x->qp->st == IBV_QPS_INIT || x->qp->st == IBV_QPS_RTR) {
    x->qp->st = IBV_QPS_RTS;
    x->qp->qp.state = IBV_QPS_RTS;
  }
  queue_out(c, frame(h, pd, len));
  return 0;
}

int reject(rdma_cm_id* id, const void* private_data, uint8_t private_data_len) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Id* x = lookup(s.ids, id);
  if (x == nullptr || x->conn == nullptr || x->conn->cm != CmState::ReqDelivered)
    return fail_m1(EINVAL);
  if (private_data_len > kRejPdataMax) return fail_m1(EINVAL);
  Hdr h;
  h.type = static_cast<uint8_t>(Ft::CmRej);
  std::size_t len = private_data != nullptr ? private_data_len : 0;
  h.len = static_cast<uint32_t>(len);
  x->conn->cm = CmState::Rejected;
  x->conn->close_after_flush = true;
  queue_out(x->conn, frame(h, private_data, len));
  return 0;
}

int disconnect(rdma_cm_id* id) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Id* x = lookup(s.ids, id);
  if (x == nullptr || x->conn == nullptr) return fail_m1(EINVAL);
  Conn* c = x->conn;
  switch (c->cm) {
    case CmState::Connecting:
    case CmState::Accepted:
    case CmState::Established: {
      c->cm = CmState::Disconnected;
      if (x->qp != nullptr) enter_error(x->qp, false);
      Hdr h;
      h.type = static_cast<uint8_t>(Ft::CmDreq);
      if (c->fd >= 0) queue_out(c, frame(h));
      push_cm(x, RDMA_CM_EVENT_DISCONNECTED, 0, nullptr, 0);
      return 0;
    }
    case CmState::Disconnected:
    case CmState::Failed:
      return 0;
    default:
      return fail_m1(EINVAL);
  }
}

int get_cm_event(rdma_event_channel* channel, rdma_cm_event** event) {
  return take_event(
      channel->fd, [&] { return lookup(sim().evchans, channel); },
      [&](CmEv* e) {
        if (e->ev.event == RDMA_CM_EVENT_ESTABLISHED) {
          // As librdmacm moves the QP to RTS while it processes the reply (app thread).
          if (Id* x = lookup(sim().ids, e->ev.id); x != nullptr && x->qp != nullptr)
            x->qp->qp.state = IBV_QPS_RTS;
        }
        *event = &e->ev;
      });
}

int ack_cm_event(rdma_cm_event* event) {
  if (event == nullptr) return fail_m1(EINVAL);
  // rdma_cm_event is the first member of CmEv, which nothing else derives from.
  delete reinterpret_cast<CmEv*>(event);
  return 0;
}

__be16 get_src_port(rdma_cm_id* id) {
  std::lock_guard lock(g_mu);
  Id* x = lookup(sim().ids, id);
  return x != nullptr ? htons(x->port) : 0;
}

transport::verbs::VerbsApi make_api() {
  transport::verbs::VerbsApi a;
  a.name = "simverbs";
  a.get_device_list = get_device_list;
  a.free_device_list = free_device_list;
  a.get_device_name = get_device_name;
  a.get_device_guid = get_device_guid;
  a.open_device = open_device;
  a.close_device = close_device;
  a.query_device = query_device;
  a.query_port = query_port;
  a.query_gid = query_gid;
  a.get_async_event = get_async_event;
  a.ack_async_event = ack_async_event;
  a.alloc_pd = alloc_pd;
  a.dealloc_pd = dealloc_pd;
  a.reg_mr = reg_mr;
  a.reg_dmabuf_mr = reg_dmabuf_mr;
  a.dereg_mr = dereg_mr;
  a.alloc_mw = alloc_mw;
  a.dealloc_mw = dealloc_mw;
  a.create_comp_channel = create_comp_channel;
  a.destroy_comp_channel = destroy_comp_channel;
  a.create_cq = create_cq;
  a.destroy_cq = destroy_cq;
  a.get_cq_event = get_cq_event;
  a.ack_cq_events = ack_cq_events;
  a.req_notify_cq = req_notify_cq;
  a.poll_cq = poll_cq;
  a.post_send = post_send;
  a.post_recv = post_recv;
  a.modify_qp = modify_qp;
  a.create_event_channel = create_event_channel;
  a.destroy_event_channel = destroy_event_channel;
  a.get_devices = get_devices;
  a.free_devices = free_devices;
  a.create_id = create_id;
  a.destroy_id = destroy_id;
  a.bind_addr = bind_addr;
  a.listen = listen;
  a.resolve_addr = resolve_addr;
  a.resolve_route = resolve_route;
  a.create_qp = create_qp;
  a.destroy_qp = destroy_qp;
  a.connect = connect;
  a.accept = accept;
  a.reject = reject;
  a.disconnect = disconnect;
  a.get_cm_event = get_cm_event;
  a.ack_cm_event = ack_cm_event;
  a.get_src_port = get_src_port;
  return a;
}

}  // namespace

Config current_config_locked() { return g_sim != nullptr ? g_sim->cfg : g_cfg; }

void set_config_locked(const Config& config) {
  g_cfg = config;
  g_cfg_set = true;
  if (g_sim != nullptr) {
    std::vector<DeviceConfig> devices = g_sim->cfg.devices;
    g_sim->cfg = config;
    g_sim->cfg.devices = devices;
  }
}

}  // namespace detail

using namespace detail;

Config parse_config(const std::string& text) {
  Config c;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(pos, end - pos);
    pos = end + 1;
    if (item.empty()) continue;
    std::size_t eq = item.find('=');
    if (eq == std::string::npos) throw std::invalid_argument("FERRY_SIMVERBS: no '=' in " + item);
    std::string key = item.substr(0, eq);
    std::string value = item.substr(eq + 1);
    auto u32 = [&] {
      uint64_t v = num(key, value);
      if (v == 0 || v > 0xffffffffu)
        throw std::invalid_argument("FERRY_SIMVERBS: " + key + " out of range");
      return static_cast<uint32_t>(v);
    };
    if (key == "max_sge") {
      c.max_sge = u32();
    } else if (key == "max_msg_sz") {
      c.max_msg_sz = u32();
    } else if (key == "max_mr_size") {
      c.max_mr_size = num(key, value);
    } else if (key == "max_qp_wr") {
      c.max_qp_wr = u32();
    } else if (key == "max_cqe") {
      c.max_cqe = u32();
    } else if (key == "mw") {
      c.mw = num(key, value) != 0;
    } else if (key == "rate_mbps") {
      c.rate_mbps = num(key, value);
    } else if (key == "dmabuf") {
      c.dmabuf = num(key, value) != 0;
    } else if (key == "peermem") {
      c.peermem = num(key, value) != 0;
    } else if (key == "max_cq_events_batch") {
      // accepted and ignored
    } else if (key == "devices") {
      c.devices.clear();
      std::size_t p = 0;
      while (p < value.size()) {
        std::size_t e = value.find('/', p);
        if (e == std::string::npos) e = value.size();
        std::string dev = value.substr(p, e - p);
        p = e + 1;
        std::size_t colon = dev.find(':');
        in_addr ip;
        if (colon == std::string::npos || colon == 0 ||
            inet_pton(AF_INET, dev.substr(colon + 1).c_str(), &ip) != 1)
          throw std::invalid_argument("FERRY_SIMVERBS: bad device '" + dev + "'");
        c.devices.push_back({dev.substr(0, colon), dev.substr(colon + 1)});
      }
      if (c.devices.empty()) throw std::invalid_argument("FERRY_SIMVERBS: no devices");
    } else {
      throw std::invalid_argument("FERRY_SIMVERBS: unknown key " + key);
    }
  }
  return c;
}

std::string to_string(const Config& c) {
  std::string devices;
  for (const DeviceConfig& d : c.devices) {
    if (!devices.empty()) devices += '/';
    devices += d.name + ":" + d.ipv4;
  }
  return "max_sge=" + std::to_string(c.max_sge) + ",max_msg_sz=" + std::to_string(c.max_msg_sz) +
         ",max_mr_size=" + std::to_string(c.max_mr_size) +
         ",max_qp_wr=" + std::to_string(c.max_qp_wr) + ",max_cqe=" + std::to_string(c.max_cqe) +
         ",mw=" + (c.mw ? "1" : "0") + ",rate_mbps=" + std::to_string(c.rate_mbps) +
         ",dmabuf=" + (c.dmabuf ? "1" : "0") + ",peermem=" + (c.peermem ? "1" : "0") +
         ",devices=" + devices;
}

void configure(const Config& config) {
  std::lock_guard lock(g_mu);
  set_config_locked(config);
}

Config current_config() {
  std::lock_guard lock(g_mu);
  return current_config_locked();
}

const transport::verbs::VerbsApi& api() {
  static const transport::verbs::VerbsApi table = make_api();
  return table;
}

Counters counters() {
  std::lock_guard lock(g_mu);
  return sim().counters;
}

void inject_spurious_event(ibv_cq* cq) {
  std::lock_guard lock(g_mu);
  Cq* c = lookup(sim().cqs, cq);
  if (c != nullptr && c->chan != nullptr) chan_push(c);
}

void set_event_delay(std::chrono::milliseconds delay) {
  std::lock_guard lock(g_mu);
  sim().delay = delay;
}

void drop_next_event(ibv_cq* cq) {
  std::lock_guard lock(g_mu);
  if (Cq* c = lookup(sim().cqs, cq)) c->drop_next = true;
}

bool set_port_state(const std::string& device, uint8_t port, bool up) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Dev* d = nullptr;
  for (Dev* x : s.devs)
    if (x->name == device) d = x;
  if (d == nullptr || port != 1) return false;
  if (d->port_up == up) return true;
  d->port_up = up;
  for (auto& [k, c] : s.ctxs) {
    if (c->dev != d) continue;
    ibv_async_event ev{};
    ev.element.port_num = port;
    ev.event_type = up ? IBV_EVENT_PORT_ACTIVE : IBV_EVENT_PORT_ERR;
    push_async(c, ev);
  }
  if (!up) {
    std::vector<Conn*> broken;
    for (auto& [serial, c] : s.conns)
      if (c->id != nullptr && c->id->dev == d && c->fd >= 0) broken.push_back(c);
    for (Conn* c : broken) conn_failed(c);
  }
  return true;
}

void qp_fatal(ibv_qp* qp) {
  std::lock_guard lock(g_mu);
  Sim& s = sim();
  Qp* q = lookup(s.qps, qp);
  if (q == nullptr) return;
  ibv_async_event ev{};
  ev.element.qp = qp;
  ev.event_type = IBV_EVENT_QP_FATAL;
  if (Ctx* c = lookup(s.ctxs, qp->context)) push_async(c, ev);
  enter_error(q, false);
}

ibv_wc_status inject_access(uint32_t qp_num, uint32_t rkey, uint64_t addr, void* buf,
                            std::size_t len, bool write) {
  std::lock_guard lock(g_mu);
  uint8_t* p = check_remote(rkey, addr, len,
                            write ? IBV_ACCESS_REMOTE_WRITE : IBV_ACCESS_REMOTE_READ, qp_num);
  if (p == nullptr) return IBV_WC_REM_ACCESS_ERR;
  if (len > 0) {
    if (write)
      std::memcpy(p, buf, len);
    else
      std::memcpy(buf, p, len);
  }
  return IBV_WC_SUCCESS;
}

}  // namespace ferry::test::simverbs
