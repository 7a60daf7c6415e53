#pragma once

// The simulation's per-process state (internal to simverbs). Everything here is guarded by
// the one mutex `g_mu` (simverbs_core.cpp): the application's calls and the NIC thread take it
// around all they do, and the NIC thread moves data between sockets and registered memory in
// bounded steps under it, so that deregistration and invalidation are synchronous.

#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <list>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "tests/support/simverbs/simverbs.hpp"

namespace ferry::test::simverbs::detail {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMaxInline = 256;
constexpr std::size_t kChunk = 1u << 20;       // most bytes one socket call moves
constexpr std::size_t kReadBudget = 8u << 20;  // most bytes one connection reads per wake
constexpr uint8_t kReqPdataMax = 56;           // rdma_connect
constexpr uint8_t kRepPdataMax = 196;          // rdma_accept
constexpr uint8_t kRejPdataMax = 148;          // rdma_reject
constexpr int kRejectConsumer = 28;            // IB_CM_REJ_CONSUMER_DEFINED
constexpr int kRejectNoListener = 8;           // IB_CM_REJ_INVALID_SERVICE_ID

// The wire: a 32-byte header, then for CM frames their private data, for data-carrying frames
// `len` payload bytes and a 4-byte trailer (0, or why the sender gave up midway: the payload's
// rest is then zeros).
enum class Ft : uint8_t {
  CmReq = 1,  // addr: active side's ip<<16|port, aux: its qp_num, payload: private data
  CmRep,      // aux: passive qp_num, payload: private data
  CmRtu,
  CmRej,  // payload: private data
  CmDreq,
  Write,     // rkey, addr, len + payload
  WriteImm,  // + imm
  Send,      // len + payload
  SendImm,   // + imm
  Read,      // rkey, addr, len
  Ack,       // status: 0 or an ibv_wc_status for the requester
  ReadResp,  // status; when 0: len + payload
};

struct Hdr {
  uint8_t type = 0;
  uint8_t status = 0;
  uint16_t pad = 0;
  uint32_t imm = 0;
  uint32_t rkey = 0;
  uint32_t len = 0;
  uint64_t addr = 0;
  uint64_t aux = 0;
};
static_assert(sizeof(Hdr) == 32);

// Events queued for the application, each announced by one byte on a pipe whose read end it
// waits on (a context's async_fd, a completion channel's fd, an event channel's fd).
template <class T>
struct EventPipe {
  int rfd = -1;
  int wfd = -1;
  std::deque<T> q;
};

struct Ctx;
struct Qp;
struct Id;
struct Conn;

struct Dev {
  ibv_device ibdev{};
  std::string name;
  in_addr ip{};
  std::string ip_text;
  bool port_up = true;
  Ctx* pctx = nullptr;  // the process-wide context (rdma_get_devices)
  uint64_t guid = 0;
};

struct Ctx {
  ibv_context ctx{};
  Dev* dev = nullptr;
  EventPipe<ibv_async_event> events;  // behind async_fd
  bool process_wide = false;
};

struct Pd {
  ibv_pd pd{};
  Ctx* ctx = nullptr;
  int refs = 0;
};

struct Mr {
  ibv_mr mr{};
  Pd* pd = nullptr;
  int access = 0;
  /// Where the CPU finds the byte at mr.addr, when that is not mr.addr itself: a mapping of a
  /// dmabuf (reg_dmabuf_mr, or device memory registered through the simulated peermem).
  uint8_t* cpu = nullptr;
  void* map = nullptr;  ///< the mapping to unmap with the region
  std::size_t map_len = 0;
  /// The CPU address of `addr`, which lies in the region.
  uint8_t* at(uint64_t addr) const {
    return cpu != nullptr ? cpu + (addr - reinterpret_cast<uint64_t>(mr.addr))
                          : reinterpret_cast<uint8_t*>(addr);
  }
};

struct Mw {
  ibv_mw mw{};
  Pd* pd = nullptr;
  uint32_t idx = 0;
  uint32_t rkey = 0;
  bool bound = false;
  Mr* mr = nullptr;
  uint64_t addr = 0;
  uint64_t len = 0;
  int access = 0;
  uint32_t qpn = 0;
};

struct Cq;
struct Chan {
  ibv_comp_channel ch{};
  EventPipe<Cq*> events;  // behind ch.fd
  int refs = 0;
};

struct Cq {
  ibv_cq cq{};
  Ctx* ctx = nullptr;
  Chan* chan = nullptr;
  std::deque<ibv_wc> q;
  int cqe = 0;
  bool armed = false;
  bool drop_next = false;
  bool overflowed = false;
  uint64_t gotten = 0;
  uint64_t acked = 0;
  int refs = 0;
};

struct SendWr {
  uint64_t seq = 0;
  uint64_t wr_id = 0;
  ibv_wr_opcode op = IBV_WR_SEND;
  bool signaled = false;
  std::vector<ibv_sge> sges;
  bool inl = false;
  std::string inline_data;
  uint64_t raddr = 0;
  uint32_t rkey = 0;
  uint32_t imm = 0;
  uint64_t total = 0;
  bool done = false;
  bool on_wire = false;
  ibv_wc_status status = IBV_WC_SUCCESS;
};

struct RecvWr {
  uint64_t wr_id = 0;
  std::vector<ibv_sge> sges;
};

struct Qp {
  ibv_qp qp{};
  Pd* pd = nullptr;
  Cq* scq = nullptr;
  Cq* rcq = nullptr;
  Id* id = nullptr;
  ibv_qp_state st = IBV_QPS_INIT;  // the NIC's view
  ibv_qp_cap cap{};
  bool sig_all = false;
  std::deque<SendWr> sq;
  uint64_t next_seq = 1;
  std::deque<uint64_t> inflight;  // seqs of requests awaiting their response, in wire order
  std::deque<RecvWr> rq;
  bool stopped = false;  // a WR failed when started: start no more until the error completes
};

struct Piece {
  uint32_t key = 0;
  uint64_t addr = 0;
  uint64_t len = 0;
};

// One frame waiting to go out on a connection.
struct Out {
  std::string bytes;  // header (and CM private data)
  std::size_t off = 0;
  bool stream = false;  // payload and trailer follow
  bool remote = false;  // pieces are remote ranges (READ response), else local SGEs
  uint32_t qpn = 0;     // responder QP, for windows
  bool use_inline = false;
  std::string inline_data;
  std::vector<Piece> pieces;
  std::size_t pi = 0;
  uint64_t poff = 0;
  uint64_t total = 0;
  uint64_t sent = 0;
  uint32_t trailer = 0;
  std::size_t toff = 0;
  bool request = false;  // a request of the connection's QP, WR `seq`
  uint64_t seq = 0;
  bool started = false;
};

enum class CmState {
  Connecting,    // active, request sent
  ReqWait,       // passive, accepted socket, no request yet
  ReqDelivered,  // passive, CONNECT_REQUEST queued
  Accepted,      // passive, reply sent
  Established,
  Rejected,
  Disconnected,
  Failed,
};

enum class In { Header, Stalled, Cm, Stream, Trailer };
enum class Sink { Discard, Remote, Local };

struct Conn {
  uint64_t serial = 0;
  int fd = -1;
  Id* id = nullptr;
  Id* listener = nullptr;  // passive, before the request
  CmState cm = CmState::Connecting;
  std::list<Out> outs;
  bool close_after_flush = false;
  bool doomed = false;  // closed and owned by no id: reaped by the NIC thread
  uint32_t mask = 0;
  bool dirty = false;
  uint32_t remote_qpn = 0;
  // Inbound.
  In in = In::Header;
  unsigned char hbuf[sizeof(Hdr)] = {};
  std::size_t hoff = 0;
  Hdr h{};
  std::string cm_payload;
  std::size_t cm_off = 0;
  Sink sink = Sink::Discard;
  std::vector<Piece> pieces;
  uint32_t sink_qpn = 0;
  std::size_t pi = 0;
  uint64_t poff = 0;
  uint64_t sdone = 0;
  ibv_wc_status pending = IBV_WC_SUCCESS;  // decided when the header arrived
  ibv_wc_status midway = IBV_WC_SUCCESS;   // found while the payload arrived
  unsigned char tbuf[4] = {};
  std::size_t toff = 0;
};

struct CmEv {
  rdma_cm_event ev{};
  unsigned char pdata[256] = {};
};

struct EvChan {
  rdma_event_channel ch{};
  EventPipe<CmEv*> events;  // behind ch.fd
};

struct Id {
  rdma_cm_id id{};
  EvChan* ch = nullptr;
  Dev* dev = nullptr;
  int lfd = -1;  // bound (and maybe listening) socket
  uint64_t lserial = 0;
  bool listening = false;
  Conn* conn = nullptr;
  Qp* qp = nullptr;
  uint16_t port = 0;
  bool bound = false;
  bool addr_ok = false;
  bool route_ok = false;
  sockaddr_in dst{};
  bool passive = false;
};

struct KeyEnt {
  enum Kind { MrLocal, MrRemote, Window } kind = MrLocal;
  Mr* mr = nullptr;
  Mw* mw = nullptr;
};

struct Sim {
  Config cfg;
  std::vector<Dev*> devs;
  std::unordered_map<const void*, Ctx*> ctxs;
  std::unordered_map<const void*, Pd*> pds;
  std::unordered_map<const void*, Mr*> mrs;
  std::unordered_map<const void*, Mw*> mws;
  std::unordered_map<const void*, Chan*> chans;
  std::unordered_map<const void*, Cq*> cqs;
  std::unordered_map<const void*, Qp*> qps;
  std::unordered_map<uint32_t, Qp*> qp_by_num;
  std::unordered_map<const void*, EvChan*> evchans;
  std::unordered_map<const void*, Id*> ids;
  std::unordered_map<uint32_t, KeyEnt> keys;  // by the key's upper 24 bits
  std::unordered_map<uint64_t, Conn*> conns;  // by serial
  std::unordered_map<uint64_t, Id*> listeners;
  std::unordered_set<int> fds;  // every fd this state owns (closed in a forked child)
  uint64_t next_serial = 1;
  std::mt19937_64 rng;
  // NIC thread.
  int ep = -1;
  int bell = -1;
  bool bell_pending = false;
  bool running = false;
  bool stop = false;
  std::thread nic;
  std::vector<uint64_t> dirty;
  std::vector<std::pair<Clock::time_point, Cq*>> delayed;
  std::chrono::milliseconds delay{0};
  Clock::time_point next_send_ok{};
  bool rate_blocked = false;
  std::vector<char> scratch;
  Counters counters;
};

extern std::mutex g_mu;
/// The state, made on first use (g_mu held).
Sim& sim();
/// The state if one was made (g_mu held).
Sim* sim_if_any();

// simverbs_core.cpp
int track(int fd);
void close_fd(int& fd);
void wake(int wfd);
void push_async(Ctx* ctx, ibv_async_event ev);
void add_wc(Cq* cq, const ibv_wc& wc);
void enter_error(Qp* q, bool retry);
void drain_sq(Qp* q);
SendWr* find_wr(Qp* q, uint64_t seq);
uint8_t* check_remote(uint32_t rkey, uint64_t addr, uint64_t len, int need, uint32_t qpn);
uint8_t* check_local(uint32_t lkey, uint64_t addr, uint64_t len, bool need_write);
void destroy_qp_locked(Qp* q);
void destroy_id_locked(Id* x);
void push_cm(Id* id, rdma_cm_event_type type, int status, const void* pdata, std::size_t len,
             Id* listen = nullptr, uint32_t qpn = 0);

void deliver_due_events();

// simverbs_nic.cpp
void ensure_nic();
void ring();
void mark_dirty(Conn* c);
void drop_requests(Conn* c);
void close_conn(Conn* c);
void conn_failed(Conn* c);
void queue_out(Conn* c, Out out);
Out frame(const Hdr& h, const void* payload = nullptr, std::size_t len = 0);
void stop_nic();
int listen_socket(Id* x, const in_addr& ip, uint16_t port);
Conn* connect_socket(Id* x, int* err);
void watch_listener(Id* x);
void unwatch(int fd);

}  // namespace ferry::test::simverbs::detail
