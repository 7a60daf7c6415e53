// The simulated RDMA fabric (tests/support/simverbs), exercised through its function table only,
// as the verbs transport will use it.

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/child_process.hpp"
#include "tests/support/simverbs/simverbs.hpp"

namespace {

using namespace std::chrono_literals;
namespace sv = ferry::test::simverbs;
using Clock = std::chrono::steady_clock;

const ferry::transport::verbs::VerbsApi& V() { return sv::api(); }

void nonblock(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

bool readable(int fd, int ms) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, ms) == 1;
}

sockaddr_in inet(const char* ip, uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, ip, &a.sin_addr);
  return a;
}

struct CmEvent {
  rdma_cm_event_type type{};
  int status = 0;
  std::string pdata;
  rdma_cm_id* id = nullptr;
  rdma_cm_id* listen_id = nullptr;
};

std::optional<CmEvent> next_cm(rdma_event_channel* ch, int ms = 5000) {
  auto until = Clock::now() + std::chrono::milliseconds(ms);
  for (;;) {
    rdma_cm_event* e = nullptr;
    if (V().get_cm_event(ch, &e) == 0) {
      CmEvent r;
      r.type = e->event;
      r.status = e->status;
      r.id = e->id;
      r.listen_id = e->listen_id;
      if (e->param.conn.private_data != nullptr)
        r.pdata.assign(static_cast<const char*>(e->param.conn.private_data),
                       e->param.conn.private_data_len);
      EXPECT_EQ(V().ack_cm_event(e), 0);
      return r;
    }
    if (errno != EAGAIN) return std::nullopt;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
    if (left.count() <= 0) return std::nullopt;
    readable(ch->fd, static_cast<int>(left.count()));
  }
}

CmEvent expect_cm(rdma_event_channel* ch, rdma_cm_event_type type) {
  auto e = next_cm(ch);
  EXPECT_TRUE(e.has_value()) << "no cm event, wanted " << type;
  if (!e) return {};
  EXPECT_EQ(e->type, type);
  return *e;
}

std::vector<ibv_wc> wait_wc(ibv_cq* cq, std::size_t n, int ms = 5000) {
  std::vector<ibv_wc> out;
  auto until = Clock::now() + std::chrono::milliseconds(ms);
  while (out.size() < n && Clock::now() < until) {
    ibv_wc wc[16];
    int k = V().poll_cq(cq, static_cast<int>(std::min<std::size_t>(16, n - out.size())), wc);
    EXPECT_GE(k, 0);
    for (int i = 0; i < k; ++i) out.push_back(wc[i]);
    if (k == 0) std::this_thread::sleep_for(100us);
  }
  return out;
}

ibv_wc one_wc(ibv_cq* cq) {
  auto v = wait_wc(cq, 1);
  EXPECT_EQ(v.size(), 1u);
  return v.empty() ? ibv_wc{} : v[0];
}

bool no_wc(ibv_cq* cq, int ms = 50) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  ibv_wc wc;
  return V().poll_cq(cq, 1, &wc) == 0;
}

// A change of the simulation's configuration for the life of the object.
class ScopedConfig {
 public:
  template <class Change>
  explicit ScopedConfig(Change change) {
    sv::Config c = saved_;
    change(c);
    sv::configure(c);
  }
  ~ScopedConfig() { sv::configure(saved_); }
  ScopedConfig(const ScopedConfig&) = delete;
  ScopedConfig& operator=(const ScopedConfig&) = delete;

 private:
  sv::Config saved_ = sv::current_config();
};

ibv_sge sge(const void* p, std::size_t len, const ibv_mr* mr) {
  return ibv_sge{reinterpret_cast<uint64_t>(p), static_cast<uint32_t>(len), mr->lkey};
}

int post(ibv_qp* qp, ibv_wr_opcode op, uint64_t wr_id, std::vector<ibv_sge> sges,
         uint64_t raddr = 0, uint32_t rkey = 0, unsigned flags = IBV_SEND_SIGNALED,
         uint32_t imm = 0) {
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.opcode = op;
  wr.sg_list = sges.data();
  wr.num_sge = static_cast<int>(sges.size());
  wr.send_flags = flags;
  wr.imm_data = htonl(imm);
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  return V().post_send(qp, &wr, &bad);
}

int post_recv(ibv_qp* qp, uint64_t wr_id, std::vector<ibv_sge> sges) {
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = sges.data();
  wr.num_sge = static_cast<int>(sges.size());
  ibv_recv_wr* bad = nullptr;
  return V().post_recv(qp, &wr, &bad);
}

struct QpOpts {
  int sig_all = 1;
  uint32_t send_wr = 64;
  uint32_t recv_wr = 64;
  uint32_t sge = 4;
};

// One end of a connection: its cm channel and id, a PD, one CQ (send and receive) with a
// non-blocking completion channel.
struct Side {
  rdma_event_channel* ch = nullptr;
  rdma_cm_id* id = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* cc = nullptr;
  ibv_cq* cq = nullptr;
  std::vector<ibv_mr*> mrs;

  ibv_qp* qp() const { return id->qp; }
  ibv_mr* reg(void* p, std::size_t len, int access) {
    ibv_mr* mr = V().reg_mr(pd, p, len, access);
    EXPECT_NE(mr, nullptr);
    if (mr != nullptr) mrs.push_back(mr);
    return mr;
  }
  void make_qp(const QpOpts& o) {
    pd = V().alloc_pd(id->verbs);
    cc = V().create_comp_channel(id->verbs);
    ASSERT_NE(cc, nullptr);
    nonblock(cc->fd);
    cq = V().create_cq(id->verbs, 1024, this, cc, 0);
    ASSERT_NE(cq, nullptr);
    ibv_qp_init_attr a{};
    a.send_cq = cq;
    a.recv_cq = cq;
    a.qp_type = IBV_QPT_RC;
    a.sq_sig_all = o.sig_all;
    a.cap.max_send_wr = o.send_wr;
    a.cap.max_recv_wr = o.recv_wr;
    a.cap.max_send_sge = o.sge;
    a.cap.max_recv_sge = o.sge;
    a.cap.max_inline_data = 64;
    ASSERT_EQ(V().create_qp(id, pd, &a), 0);
  }
  ~Side() {
    if (id != nullptr) {
      if (id->qp != nullptr) V().destroy_qp(id);
      EXPECT_EQ(V().destroy_id(id), 0);
    }
    for (ibv_mr* mr : mrs) EXPECT_EQ(V().dereg_mr(mr), 0);
    if (cq != nullptr) {
      EXPECT_EQ(V().destroy_cq(cq), 0);
    }
    if (cc != nullptr) {
      EXPECT_EQ(V().destroy_comp_channel(cc), 0);
    }
    if (pd != nullptr) {
      EXPECT_EQ(V().dealloc_pd(pd), 0);
    }
    if (ch != nullptr) V().destroy_event_channel(ch);
  }
};

rdma_event_channel* channel() {
  rdma_event_channel* ch = V().create_event_channel();
  EXPECT_NE(ch, nullptr);
  nonblock(ch->fd);
  return ch;
}

// Resolves and connects `client` to ip:port; the caller then handles the other side.
void start_connect(Side& client, const char* ip, uint16_t port, const QpOpts& o,
                   const std::string& req) {
  client.ch = channel();
  ASSERT_EQ(V().create_id(client.ch, &client.id, nullptr, RDMA_PS_TCP), 0);
  sockaddr_in dst = inet(ip, port);
  ASSERT_EQ(V().resolve_addr(client.id, nullptr, reinterpret_cast<sockaddr*>(&dst), 1000), 0);
  expect_cm(client.ch, RDMA_CM_EVENT_ADDR_RESOLVED);
  ASSERT_EQ(V().resolve_route(client.id, 1000), 0);
  expect_cm(client.ch, RDMA_CM_EVENT_ROUTE_RESOLVED);
  client.make_qp(o);
  rdma_conn_param cp{};
  cp.private_data = req.data();
  cp.private_data_len = static_cast<uint8_t>(req.size());
  ASSERT_EQ(V().connect(client.id, &cp), 0);
}

// A listener and a connection to it, both in this process.
struct Pair {
  Side client;
  Side server;
  rdma_event_channel* lch = nullptr;
  rdma_cm_id* listener = nullptr;
  uint16_t port = 0;

  void listen(const char* ip = "127.0.0.1") {
    lch = channel();
    ASSERT_EQ(V().create_id(lch, &listener, nullptr, RDMA_PS_TCP), 0);
    sockaddr_in a = inet(ip, 0);
    ASSERT_EQ(V().bind_addr(listener, reinterpret_cast<sockaddr*>(&a)), 0);
    ASSERT_EQ(V().listen(listener, 8), 0);
    port = ntohs(V().get_src_port(listener));
    ASSERT_NE(port, 0);
  }
  void connect(const QpOpts& o = {}, const char* ip = "127.0.0.1") {
    listen(ip);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    start_connect(client, ip, port, o, "hello");
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    CmEvent e = expect_cm(lch, RDMA_CM_EVENT_CONNECT_REQUEST);
    ASSERT_NE(e.id, nullptr);
    EXPECT_EQ(e.listen_id, listener);
    EXPECT_EQ(e.pdata, "hello");
    server.id = e.id;
    server.make_qp(o);
    std::string rep = "welcome";
    rdma_conn_param cp{};
    cp.private_data = rep.data();
    cp.private_data_len = static_cast<uint8_t>(rep.size());
    ASSERT_EQ(V().accept(server.id, &cp), 0);
    EXPECT_EQ(expect_cm(client.ch, RDMA_CM_EVENT_ESTABLISHED).pdata, "welcome");
    expect_cm(lch, RDMA_CM_EVENT_ESTABLISHED);
  }
  ~Pair() {
    if (listener != nullptr) {
      EXPECT_EQ(V().destroy_id(listener), 0);
    }
    // The server's id was born on the listener's channel: destroy it before the channel.
    if (server.id != nullptr) {
      if (server.id->qp != nullptr) V().destroy_qp(server.id);
      EXPECT_EQ(V().destroy_id(server.id), 0);
      server.id = nullptr;
    }
    if (lch != nullptr) V().destroy_event_channel(lch);
  }
};

constexpr int kAll = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;

std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>((i * 131 + seed) >> 3);
  return v;
}

uint64_t fnv(const unsigned char* p, std::size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// ---------------------------------------------------------------------------------------------

TEST(SimverbsConfig, ParsesAndPrints) {
  sv::Config c = sv::parse_config(
      "max_sge=2,max_msg_sz=65536,max_mr_size=1048576,max_qp_wr=32,mw=0,rate_mbps=80,"
      "devices=a:10.0.0.1/b:10.0.0.2/c:10.0.0.3");
  EXPECT_EQ(c.max_sge, 2u);
  EXPECT_EQ(c.max_msg_sz, 65536u);
  EXPECT_EQ(c.max_mr_size, 1048576u);
  EXPECT_EQ(c.max_qp_wr, 32u);
  EXPECT_FALSE(c.mw);
  EXPECT_EQ(c.rate_mbps, 80u);
  ASSERT_EQ(c.devices.size(), 3u);
  EXPECT_EQ(c.devices[2].name, "c");
  EXPECT_EQ(c.devices[2].ipv4, "10.0.0.3");
  sv::Config again = sv::parse_config(sv::to_string(c));
  EXPECT_EQ(sv::to_string(again), sv::to_string(c));
  EXPECT_THROW(sv::parse_config("max_sge=x"), std::invalid_argument);
  EXPECT_THROW(sv::parse_config("bogus=1"), std::invalid_argument);
  sv::Config d;
  EXPECT_EQ(d.max_sge, 4u);
  EXPECT_EQ(d.max_msg_sz, 1u << 20);
  EXPECT_EQ(d.max_mr_size, 64u << 20);
  EXPECT_TRUE(d.mw);
}

TEST(SimverbsDevices, QueryLikeHardware) {
  int n = 0;
  ibv_device** list = V().get_device_list(&n);
  ASSERT_EQ(n, 2);
  EXPECT_EQ(list[2], nullptr);
  EXPECT_STREQ(V().get_device_name(list[0]), "sim0");
  EXPECT_STREQ(V().get_device_name(list[1]), "sim1");
  EXPECT_NE(V().get_device_guid(list[0]), 0u);
  EXPECT_NE(V().get_device_guid(list[0]), V().get_device_guid(list[1]));

  ibv_context* ctx = V().open_device(list[1]);
  ASSERT_NE(ctx, nullptr);
  EXPECT_EQ(ctx->device, list[1]);
  EXPECT_GE(ctx->async_fd, 0);
  ibv_device_attr da{};
  ASSERT_EQ(V().query_device(ctx, &da), 0);
  EXPECT_EQ(da.max_sge, 4);
  EXPECT_EQ(da.max_mr_size, 64u << 20);
  EXPECT_EQ(da.max_qp_wr, 256);
  EXPECT_EQ(da.max_cqe, 65536);
  EXPECT_EQ(da.phys_port_cnt, 1);
  EXPECT_NE(da.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B, 0u);
  EXPECT_GT(da.max_mw, 0);
  ibv_port_attr pa{};
  ASSERT_EQ(V().query_port(ctx, 1, &pa), 0);
  EXPECT_EQ(pa.state, IBV_PORT_ACTIVE);
  EXPECT_EQ(pa.active_mtu, IBV_MTU_4096);
  EXPECT_EQ(pa.link_layer, IBV_LINK_LAYER_ETHERNET);
  EXPECT_EQ(pa.max_msg_sz, 1u << 20);
  EXPECT_EQ(V().query_port(ctx, 2, &pa), EINVAL);
  ibv_gid gid{};
  ASSERT_EQ(V().query_gid(ctx, 1, 0, &gid), 0);
  const unsigned char want[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 2};
  EXPECT_EQ(std::memcmp(gid.raw, want, 16), 0);
  EXPECT_EQ(V().query_gid(ctx, 1, 1, &gid), -1);
  EXPECT_EQ(V().close_device(ctx), 0);

  int m = 0;
  ibv_context** cms = V().get_devices(&m);
  ASSERT_EQ(m, 2);
  EXPECT_EQ(cms[0]->device, list[0]);
  EXPECT_EQ(cms[1]->device, list[1]);
  ibv_context** again = V().get_devices(nullptr);
  EXPECT_EQ(again[0], cms[0]);  // one per device, for the process
  V().free_devices(again);
  V().free_devices(cms);
  V().free_device_list(list);
}

// GPUDirect: a dmabuf region answers at its iova from the fd's bytes at its offset; reg_mr
// refuses memory the CPU cannot read (as pinning would), unless the simulated peermem is on.
TEST(SimverbsMemory, DmabufRegionsServeTheFdsBytes) {
  ibv_context** ctxs = V().get_devices(nullptr);
  ibv_pd* pd = V().alloc_pd(ctxs[0]);
  V().free_devices(ctxs);
  ASSERT_NE(pd, nullptr);
  ASSERT_NE(V().reg_dmabuf_mr, nullptr);
  const int fd = ::memfd_create("simverbs-dmabuf", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  std::vector<unsigned char> bytes = pattern(3 * 4096, 5);
  ASSERT_EQ(::pwrite(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  constexpr uint64_t kIova = 0x7f0000100000ull;
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
  ibv_mr* mr = V().reg_dmabuf_mr(pd, 4096 + 100, 1000, kIova, fd, access);
  ::close(fd);  // the region keeps the bytes
  ASSERT_NE(mr, nullptr);
  EXPECT_EQ(reinterpret_cast<uint64_t>(mr->addr), kIova);
  unsigned char out[16] = {};
  EXPECT_EQ(sv::inject_access(0, mr->rkey, kIova + 10, out, 16, false), IBV_WC_SUCCESS);
  EXPECT_EQ(std::memcmp(out, bytes.data() + 4096 + 110, 16), 0);
  EXPECT_EQ(sv::inject_access(0, mr->rkey, kIova + 990, out, 16, false), IBV_WC_REM_ACCESS_ERR);
  ASSERT_EQ(V().dereg_mr(mr), 0);

  sv::Config c = sv::current_config();
  c.dmabuf = false;
  sv::configure(c);
  const int fd2 = ::memfd_create("simverbs-dmabuf", MFD_CLOEXEC);
  ASSERT_EQ(::ftruncate(fd2, 4096), 0);
  errno = 0;
  EXPECT_EQ(V().reg_dmabuf_mr(pd, 0, 4096, kIova, fd2, access), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  ::close(fd2);
  c.dmabuf = true;
  sv::configure(c);

  void* none = ::mmap(nullptr, 8192, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(none, MAP_FAILED);
  const auto refused = sv::counters().refused_mrs;
  errno = 0;
  EXPECT_EQ(V().reg_mr(pd, static_cast<char*>(none) + 10, 5000, IBV_ACCESS_LOCAL_WRITE), nullptr);
  EXPECT_EQ(errno, EFAULT);
  EXPECT_EQ(sv::counters().refused_mrs, refused + 1);
  ::munmap(none, 8192);
  EXPECT_EQ(V().dealloc_pd(pd), 0);
}

TEST(SimverbsMemory, RegisterCheckAndKeysDieAtDereg) {
  ibv_context** ctxs = V().get_devices(nullptr);
  ibv_pd* pd = V().alloc_pd(ctxs[0]);
  V().free_devices(ctxs);
  ASSERT_NE(pd, nullptr);
  std::vector<unsigned char> buf = pattern(8192, 1);
  ibv_mr* mr =
      V().reg_mr(pd, buf.data(), buf.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
  ASSERT_NE(mr, nullptr);
  EXPECT_EQ(mr->addr, buf.data());
  EXPECT_EQ(mr->length, buf.size());
  EXPECT_EQ(mr->pd, pd);
  EXPECT_NE(mr->lkey, mr->rkey);
  errno = 0;
  EXPECT_EQ(V().reg_mr(pd, buf.data(), (64u << 20) + 1, IBV_ACCESS_LOCAL_WRITE), nullptr);
  EXPECT_EQ(errno, EINVAL);
  errno = 0;
  EXPECT_EQ(V().reg_mr(pd, buf.data(), buf.size(), IBV_ACCESS_REMOTE_WRITE), nullptr);
  EXPECT_EQ(errno, EINVAL);

  auto addr = reinterpret_cast<uint64_t>(buf.data());
  unsigned char out[16] = {};
  EXPECT_EQ(sv::inject_access(0, mr->rkey, addr + 100, out, 16, false), IBV_WC_SUCCESS);
  EXPECT_EQ(std::memcmp(out, buf.data() + 100, 16), 0);
  EXPECT_EQ(sv::inject_access(0, mr->lkey, addr, out, 16, false), IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(sv::inject_access(0, mr->rkey, addr + 8190, out, 16, false), IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(sv::inject_access(0, mr->rkey, addr - 1, out, 1, false), IBV_WC_REM_ACCESS_ERR);
  unsigned char junk[16];
  std::memset(junk, 0xee, sizeof junk);
  std::vector<unsigned char> before = buf;
  EXPECT_EQ(sv::inject_access(0, mr->rkey, addr, junk, 16, true), IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(buf, before);  // no REMOTE_WRITE: nothing written

  EXPECT_EQ(V().dealloc_pd(pd), EBUSY);
  uint32_t old = mr->rkey;
  ASSERT_EQ(V().dereg_mr(mr), 0);
  EXPECT_EQ(sv::inject_access(0, old, addr, out, 16, false), IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(V().dealloc_pd(pd), 0);
}

TEST(SimverbsCm, ConnectAcceptDisconnectInProcess) {
  Pair p;
  p.connect();
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_EQ(p.client.qp()->state, IBV_QPS_RTS);
  EXPECT_EQ(p.server.qp()->state, IBV_QPS_RTS);
  EXPECT_NE(p.client.qp()->qp_num, p.server.qp()->qp_num);
  EXPECT_EQ(p.client.id->verbs->device, p.server.id->verbs->device);
  EXPECT_STREQ(V().get_device_name(p.client.id->verbs->device), "sim0");
  EXPECT_EQ(p.server.id->channel, p.lch);
  EXPECT_EQ(ntohs(p.server.id->route.addr.src_sin.sin_port), p.port);
  EXPECT_EQ(p.client.qp()->send_cq, p.client.cq);
  EXPECT_EQ(p.client.qp()->pd, p.client.pd);

  ASSERT_EQ(post_recv(p.server.qp(), 7, {}), 0);
  ASSERT_EQ(V().disconnect(p.client.id), 0);
  expect_cm(p.client.ch, RDMA_CM_EVENT_DISCONNECTED);
  expect_cm(p.lch, RDMA_CM_EVENT_DISCONNECTED);
  ibv_wc wc = one_wc(p.server.cq);  // the server's QP went to error: its receive flushed
  EXPECT_EQ(wc.wr_id, 7u);
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(V().disconnect(p.server.id), 0);
  EXPECT_FALSE(next_cm(p.lch, 50).has_value());
}

TEST(SimverbsCm, RejectCarriesPrivateData) {
  Pair p;
  p.listen();
  ASSERT_FALSE(HasFatalFailure());
  start_connect(p.client, "127.0.0.1", p.port, {}, "let me in");
  ASSERT_FALSE(HasFatalFailure());
  CmEvent e = expect_cm(p.lch, RDMA_CM_EVENT_CONNECT_REQUEST);
  EXPECT_EQ(e.pdata, "let me in");
  ASSERT_EQ(V().reject(e.id, "no", 2), 0);
  CmEvent r = expect_cm(p.client.ch, RDMA_CM_EVENT_REJECTED);
  EXPECT_EQ(r.status, 28);
  EXPECT_EQ(r.pdata, "no");
  EXPECT_EQ(V().destroy_id(e.id), 0);
}

TEST(SimverbsCm, NoListenerRejectsAndAddressesAreChecked) {
  Pair p;
  p.listen("127.0.0.2");
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_STREQ(V().get_device_name(p.listener->verbs->device), "sim1");
  rdma_cm_id* other = nullptr;
  ASSERT_EQ(V().create_id(p.lch, &other, nullptr, RDMA_PS_TCP), 0);
  sockaddr_in same = inet("127.0.0.2", p.port);
  EXPECT_EQ(V().bind_addr(other, reinterpret_cast<sockaddr*>(&same)), -1);
  EXPECT_EQ(errno, EADDRINUSE);
  sockaddr_in nowhere = inet("10.9.8.7", 0);
  EXPECT_EQ(V().bind_addr(other, reinterpret_cast<sockaddr*>(&nowhere)), -1);
  EXPECT_EQ(errno, EADDRNOTAVAIL);
  EXPECT_EQ(V().resolve_addr(other, nullptr, reinterpret_cast<sockaddr*>(&nowhere), 100), 0);
  expect_cm(p.lch, RDMA_CM_EVENT_ADDR_ERROR);
  EXPECT_EQ(V().destroy_id(other), 0);

  // Nobody listens on sim0 at that port.
  start_connect(p.client, "127.0.0.1", p.port, {}, "anyone?");
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_STREQ(V().get_device_name(p.client.id->verbs->device), "sim0");
  CmEvent r = expect_cm(p.client.ch, RDMA_CM_EVENT_REJECTED);
  EXPECT_EQ(r.status, 8);
  EXPECT_FALSE(next_cm(p.lch, 50).has_value());
}

TEST(SimverbsCm, RejectOrDisconnectThenDestroyStillReachThePeer) {
  {
    Pair p;
    p.listen();
    ASSERT_FALSE(HasFatalFailure());
    start_connect(p.client, "127.0.0.1", p.port, {}, "a");
    ASSERT_FALSE(HasFatalFailure());
    CmEvent e = expect_cm(p.lch, RDMA_CM_EVENT_CONNECT_REQUEST);
    ASSERT_EQ(V().reject(e.id, "busy", 4), 0);
    ASSERT_EQ(V().destroy_id(e.id), 0);
    CmEvent r = expect_cm(p.client.ch, RDMA_CM_EVENT_REJECTED);
    EXPECT_EQ(r.status, 28);
    EXPECT_EQ(r.pdata, "busy");
  }
  Pair p;
  p.connect();
  ASSERT_FALSE(HasFatalFailure());
  std::vector<unsigned char> local(64, 1);
  ibv_mr* lmr = p.server.reg(local.data(), local.size(), IBV_ACCESS_LOCAL_WRITE);
  // On the wire (the client has no receive posted) when the client disconnects and goes.
  ASSERT_EQ(post(p.server.qp(), IBV_WR_SEND, 1, {sge(local.data(), 8, lmr)}), 0);
  EXPECT_TRUE(no_wc(p.server.cq));
  ASSERT_EQ(V().disconnect(p.client.id), 0);
  V().destroy_qp(p.client.id);
  ASSERT_EQ(V().destroy_id(p.client.id), 0);
  p.client.id = nullptr;
  expect_cm(p.lch, RDMA_CM_EVENT_DISCONNECTED);
  ibv_wc wc = one_wc(p.server.cq);
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);  // a disconnect, not a dead peer
}

TEST(SimverbsData, WriteReadSendImmediateMultiSge) {
  Pair p;
  p.connect();
  ASSERT_FALSE(HasFatalFailure());
  std::vector<unsigned char> target(65536, 0);
  std::vector<unsigned char> local = pattern(65536, 5);
  ibv_mr* tmr = p.server.reg(target.data(), target.size(), kAll);
  ibv_mr* lmr = p.client.reg(local.data(), local.size(), IBV_ACCESS_LOCAL_WRITE);
  auto taddr = reinterpret_cast<uint64_t>(target.data());
  ibv_qp* qp = p.client.qp();

  // WRITE gathering three pieces.
  ASSERT_EQ(
      post(qp, IBV_WR_RDMA_WRITE, 1,
           {sge(&local[0], 100, lmr), sge(&local[1000], 200, lmr), sge(&local[5000], 3000, lmr)},
           taddr + 10, tmr->rkey),
      0);
  ibv_wc wc = one_wc(p.client.cq);
  EXPECT_EQ(wc.wr_id, 1u);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.opcode, IBV_WC_RDMA_WRITE);
  EXPECT_EQ(wc.qp_num, qp->qp_num);
  EXPECT_EQ(std::memcmp(&target[10], &local[0], 100), 0);
  EXPECT_EQ(std::memcmp(&target[110], &local[1000], 200), 0);
  EXPECT_EQ(std::memcmp(&target[310], &local[5000], 3000), 0);
  EXPECT_EQ(target[9], 0);
  EXPECT_EQ(target[3310], 0);

  // READ scattering into two pieces.
  std::vector<unsigned char> remote = pattern(65536, 9);
  std::memcpy(target.data(), remote.data(), remote.size());
  std::vector<unsigned char> sink(65536, 0);
  ibv_mr* smr = p.client.reg(sink.data(), sink.size(), IBV_ACCESS_LOCAL_WRITE);
  ASSERT_EQ(post(qp, IBV_WR_RDMA_READ, 2, {sge(&sink[0], 40000, smr), sge(&sink[50000], 5000, smr)},
                 taddr + 1000, tmr->rkey),
            0);
  wc = one_wc(p.client.cq);
  EXPECT_EQ(wc.wr_id, 2u);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.opcode, IBV_WC_RDMA_READ);
  EXPECT_EQ(wc.byte_len, 45000u);
  EXPECT_EQ(std::memcmp(&sink[0], &remote[1000], 40000), 0);
  EXPECT_EQ(std::memcmp(&sink[50000], &remote[41000], 5000), 0);
  EXPECT_EQ(sink[40000], 0);

  // SEND into a two-piece receive.
  std::vector<unsigned char> inbox(4096, 0);
  ibv_mr* imr = p.server.reg(inbox.data(), inbox.size(), IBV_ACCESS_LOCAL_WRITE);
  ASSERT_EQ(post_recv(p.server.qp(), 30, {sge(&inbox[0], 10, imr), sge(&inbox[100], 1000, imr)}),
            0);
  ASSERT_EQ(post(qp, IBV_WR_SEND, 3, {sge(&local[7], 5, lmr), sge(&local[200], 500, lmr)}), 0);
  wc = one_wc(p.server.cq);
  EXPECT_EQ(wc.wr_id, 30u);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.opcode, IBV_WC_RECV);
  EXPECT_EQ(wc.byte_len, 505u);
  EXPECT_EQ(wc.qp_num, p.server.qp()->qp_num);
  EXPECT_EQ(wc.wc_flags & IBV_WC_WITH_IMM, 0u);
  EXPECT_EQ(std::memcmp(&inbox[0], &local[7], 5), 0);
  EXPECT_EQ(std::memcmp(&inbox[5], &local[200], 5), 0);
  EXPECT_EQ(std::memcmp(&inbox[100], &local[205], 495), 0);
  wc = one_wc(p.client.cq);
  EXPECT_EQ(wc.wr_id, 3u);
  EXPECT_EQ(wc.opcode, IBV_WC_SEND);

  // WRITE_WITH_IMM: data in memory, a receive consumed with the immediate.
  ASSERT_EQ(post_recv(p.server.qp(), 31, {}), 0);
  ASSERT_EQ(post(qp, IBV_WR_RDMA_WRITE_WITH_IMM, 4, {sge(&local[300], 777, lmr)}, taddr + 20000,
                 tmr->rkey, IBV_SEND_SIGNALED, 0xabcd1234),
            0);
  wc = one_wc(p.server.cq);
  EXPECT_EQ(wc.wr_id, 31u);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.opcode, IBV_WC_RECV_RDMA_WITH_IMM);
  EXPECT_EQ(wc.byte_len, 777u);
  EXPECT_NE(wc.wc_flags & IBV_WC_WITH_IMM, 0u);
  EXPECT_EQ(ntohl(wc.imm_data), 0xabcd1234u);
  EXPECT_EQ(std::memcmp(&target[20000], &local[300], 777), 0);
  EXPECT_EQ(one_wc(p.client.cq).opcode, IBV_WC_RDMA_WRITE);

  // SEND_WITH_IMM, inline: the buffer may change right after the post.
  char msg[16] = "inline!";
  ASSERT_EQ(post_recv(p.server.qp(), 32, {sge(&inbox[0], 100, imr)}), 0);
  ibv_sge isge{reinterpret_cast<uint64_t>(msg), 8, 0};
  ASSERT_EQ(
      post(qp, IBV_WR_SEND_WITH_IMM, 5, {isge}, 0, 0, IBV_SEND_SIGNALED | IBV_SEND_INLINE, 77), 0);
  std::memset(msg, 'x', sizeof msg);
  wc = one_wc(p.server.cq);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.byte_len, 8u);
  EXPECT_EQ(ntohl(wc.imm_data), 77u);
  EXPECT_STREQ(reinterpret_cast<char*>(inbox.data()), "inline!");
  EXPECT_EQ(one_wc(p.client.cq).wr_id, 5u);
}

TEST(SimverbsData, RcOrderingAndReceiverNotReady) {
  Pair p;
  p.connect();
  ASSERT_FALSE(HasFatalFailure());
  const std::size_t big = 1u << 20;
  std::vector<unsigned char> target(big, 0);
  std::vector<unsigned char> local = pattern(big, 3);
  ibv_mr* tmr = p.server.reg(target.data(), big, kAll);
  ibv_mr* lmr = p.client.reg(local.data(), big, IBV_ACCESS_LOCAL_WRITE);
  char word[8] = "go";
  ibv_mr* wmr = p.server.reg(word, sizeof word, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* qp = p.client.qp();

  // A SEND with no receive posted is held, not lost, and holds what follows it.
  ASSERT_EQ(post(qp, IBV_WR_SEND, 1, {sge(local.data(), 4, lmr)}), 0);
  ASSERT_EQ(post(qp, IBV_WR_RDMA_WRITE, 2, {sge(local.data(), big, lmr)},
                 reinterpret_cast<uint64_t>(target.data()), tmr->rkey),
            0);
  EXPECT_TRUE(no_wc(p.client.cq, 100));
  EXPECT_EQ(target[big - 1], 0);
  ASSERT_EQ(post_recv(p.server.qp(), 9, {sge(word, sizeof word, wmr)}), 0);
  auto wcs = wait_wc(p.client.cq, 2);
  ASSERT_EQ(wcs.size(), 2u);
  EXPECT_EQ(wcs[0].wr_id, 1u);
  EXPECT_EQ(wcs[1].wr_id, 2u);
  EXPECT_EQ(wcs[1].status, IBV_WC_SUCCESS);
  EXPECT_EQ(one_wc(p.server.cq).wr_id, 9u);

  // A SEND posted after WRITEs reaches the responder after their data.
  std::memset(target.data(), 0, big);
  ASSERT_EQ(post_recv(p.server.qp(), 10, {sge(word, sizeof word, wmr)}), 0);
  for (uint64_t i = 0; i < 4; ++i) {
    std::size_t q = big / 4;
    ASSERT_EQ(post(qp, IBV_WR_RDMA_WRITE, 20 + i, {sge(&local[i * q], q, lmr)},
                   reinterpret_cast<uint64_t>(&target[i * q]), tmr->rkey, 0),
              0);
  }
  ASSERT_EQ(post(qp, IBV_WR_SEND, 30, {sge(local.data(), 4, lmr)}), 0);
  ibv_wc wc = one_wc(p.server.cq);
  EXPECT_EQ(wc.wr_id, 10u);
  EXPECT_EQ(target, local);  // all of it, when the receive completes
  wcs = wait_wc(p.client.cq, 5);
  ASSERT_EQ(wcs.size(), 5u);  // sq_sig_all=1: all of them, in order
  EXPECT_EQ(wcs[0].wr_id, 20u);
  EXPECT_EQ(wcs[4].wr_id, 30u);
}

TEST(SimverbsData, RemoteAccessErrorLeavesMemoryAndBreaksBothQps) {
  Pair p;
  p.connect();
  ASSERT_FALSE(HasFatalFailure());
  std::vector<unsigned char> target = pattern(8192, 4);
  const std::vector<unsigned char> before = target;
  ibv_mr* tmr = p.server.reg(target.data(), target.size(),
                             IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);  // no REMOTE_WRITE
  std::vector<unsigned char> local(8192, 0x11);
  ibv_mr* lmr = p.client.reg(local.data(), local.size(), IBV_ACCESS_LOCAL_WRITE);
  auto taddr = reinterpret_cast<uint64_t>(target.data());
  ASSERT_EQ(post_recv(p.server.qp(), 50, {}), 0);

  ASSERT_EQ(
      post(p.client.qp(), IBV_WR_RDMA_WRITE, 1, {sge(local.data(), 100, lmr)}, taddr, tmr->rkey),
      0);
  ibv_wc wc = one_wc(p.client.cq);
  EXPECT_EQ(wc.wr_id, 1u);
  EXPECT_EQ(wc.status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(target, before);
  wc = one_wc(p.server.cq);  // the responder's QP went to error too
  EXPECT_EQ(wc.wr_id, 50u);
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
  ASSERT_EQ(
      post(p.client.qp(), IBV_WR_RDMA_READ, 2, {sge(local.data(), 100, lmr)}, taddr, tmr->rkey, 0),
      0);
  wc = one_wc(p.client.cq);  // unsignaled, but flushed WRs always complete
  EXPECT_EQ(wc.wr_id, 2u);
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
}

TEST(SimverbsData, BadKeyAndOutOfBoundsReads) {
  for (int variant = 0; variant < 2; ++variant) {
    Pair p;
    p.connect({.sig_all = 0});
    ASSERT_FALSE(HasFatalFailure());
    std::vector<unsigned char> target = pattern(4096, 8);
    ibv_mr* tmr = p.server.reg(target.data(), target.size(), kAll);
    std::vector<unsigned char> local(8192, 0);
    ibv_mr* lmr = p.client.reg(local.data(), local.size(), IBV_ACCESS_LOCAL_WRITE);
    auto taddr = reinterpret_cast<uint64_t>(target.data());
    uint32_t rkey = variant == 0 ? tmr->rkey ^ 0x100 : tmr->rkey;
    std::size_t len = variant == 0 ? 16 : 4097;
    // Unsignaled: an error completes anyway.
    ASSERT_EQ(
        post(p.client.qp(), IBV_WR_RDMA_READ, 7, {sge(local.data(), len, lmr)}, taddr, rkey, 0), 0);
    ibv_wc wc = one_wc(p.client.cq);
    EXPECT_EQ(wc.wr_id, 7u);
    EXPECT_EQ(wc.status, IBV_WC_REM_ACCESS_ERR) << "variant " << variant;
    EXPECT_EQ(local[0], 0);
  }
}

TEST(SimverbsData, PostValidationAndLocalErrors) {
  Pair p;
  p.connect({.sig_all = 1, .send_wr = 4, .recv_wr = 4, .sge = 2});
  ASSERT_FALSE(HasFatalFailure());
  std::vector<unsigned char> target(2u << 20, 0);
  ibv_mr* tmr = p.server.reg(target.data(), target.size(), kAll);
  std::vector<unsigned char> local(2u << 20, 1);
  ibv_mr* lmr = p.client.reg(local.data(), local.size(), IBV_ACCESS_LOCAL_WRITE);
  auto taddr = reinterpret_cast<uint64_t>(target.data());
  ibv_qp* qp = p.client.qp();

  std::vector<ibv_sge> three(3, sge(local.data(), 1, lmr));
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.sg_list = three.data();
  wr.num_sge = 3;
  wr.wr.rdma = {taddr, tmr->rkey};
  ibv_send_wr* bad = nullptr;
  EXPECT_EQ(V().post_send(qp, &wr, &bad), EINVAL);
  EXPECT_EQ(bad, &wr);

  // Receiver not ready holds the SENDs: the send queue (4) fills.
  for (uint64_t i = 0; i < 4; ++i)
    ASSERT_EQ(post(qp, IBV_WR_SEND, i, {sge(local.data(), 1, lmr)}), 0);
  EXPECT_EQ(post(qp, IBV_WR_SEND, 4, {sge(local.data(), 1, lmr)}), ENOMEM);
  for (uint64_t i = 0; i < 4; ++i)
    ASSERT_EQ(post_recv(p.server.qp(), 100 + i, {sge(&target[i], 1, tmr)}), 0);
  for (ibv_cq* cq : {p.client.cq, p.server.cq}) {
    auto wcs = wait_wc(cq, 4);
    ASSERT_EQ(wcs.size(), 4u);
    for (const ibv_wc& c : wcs) EXPECT_EQ(c.status, IBV_WC_SUCCESS);
  }
  EXPECT_EQ(target[3], 1);

  // Over max_msg_sz: a completion error.
  ASSERT_EQ(
      post(qp, IBV_WR_RDMA_WRITE, 8, {sge(local.data(), (1u << 20) + 1, lmr)}, taddr, tmr->rkey),
      0);
  ibv_wc wc = one_wc(p.client.cq);
  EXPECT_EQ(wc.status, IBV_WC_LOC_LEN_ERR);
  EXPECT_EQ(target[100], 0);

  // A READ into memory that is not locally writable, on a fresh connection.
  Pair p2;
  p2.connect();
  ASSERT_FALSE(HasFatalFailure());
  ibv_mr* romr2 = p2.client.reg(local.data(), 4096, 0);  // not locally writable
  ibv_mr* tmr2 = p2.server.reg(target.data(), 4096, kAll);
  ASSERT_EQ(
      post(p2.client.qp(), IBV_WR_RDMA_READ, 9, {sge(local.data(), 64, romr2)}, taddr, tmr2->rkey),
      0);
  wc = one_wc(p2.client.cq);
  EXPECT_EQ(wc.status, IBV_WC_LOC_PROT_ERR);

  // Caps above the device's limits.
  Pair p3;
  p3.listen();
  ASSERT_FALSE(HasFatalFailure());
  p3.client.ch = channel();
  ASSERT_EQ(V().create_id(p3.client.ch, &p3.client.id, nullptr, RDMA_PS_TCP), 0);
  sockaddr_in dst = inet("127.0.0.1", p3.port);
  ASSERT_EQ(V().resolve_addr(p3.client.id, nullptr, reinterpret_cast<sockaddr*>(&dst), 100), 0);
  p3.client.pd = V().alloc_pd(p3.client.id->verbs);
  p3.client.cq = V().create_cq(p3.client.id->verbs, 16, nullptr, nullptr, 0);
  ibv_qp_init_attr a{};
  a.send_cq = a.recv_cq = p3.client.cq;
  a.qp_type = IBV_QPT_RC;
  a.cap = {1, 1, 5, 1, 0};
  EXPECT_EQ(V().create_qp(p3.client.id, p3.client.pd, &a), -1);
  EXPECT_EQ(errno, EINVAL);
  a.cap = {257, 1, 1, 1, 0};
  EXPECT_EQ(V().create_qp(p3.client.id, p3.client.pd, &a), -1);
  a.cap = {256, 256, 4, 4, 0};
  EXPECT_EQ(V().create_qp(p3.client.id, p3.client.pd, &a), 0);
}

TEST(SimverbsData, SendLongerThanReceiveBuffer) {
  Pair p;
  p.connect();
  ASSERT_FALSE(HasFatalFailure());
  std::vector<unsigned char> local(1000, 2);
  std::vector<unsigned char> inbox(100, 0);
  ibv_mr* lmr = p.client.reg(local.data(), local.size(), IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* imr = p.server.reg(inbox.data(), inbox.size(), IBV_ACCESS_LOCAL_WRITE);
  ASSERT_EQ(post_recv(p.server.qp(), 1, {sge(inbox.data(), 100, imr)}), 0);
  ASSERT_EQ(post(p.client.qp(), IBV_WR_SEND, 2, {sge(local.data(), 1000, lmr)}), 0);
  ibv_wc wc = one_wc(p.server.cq);
  EXPECT_EQ(wc.status, IBV_WC_LOC_LEN_ERR);
  wc = one_wc(p.client.cq);
  EXPECT_EQ(wc.status, IBV_WC_REM_INV_REQ_ERR);
}

TEST(SimverbsQp, SelectiveSignalling) {
  Pair p;
  p.connect({.sig_all = 0});
  ASSERT_FALSE(HasFatalFailure());
  std::vector<unsigned char> target(4096, 0);
  std::vector<unsigned char> local = pattern(4096, 2);
  ibv_mr* tmr = p.server.reg(target.data(), target.size(), kAll);
  ibv_mr* lmr = p.client.reg(local.data(), local.size(), IBV_ACCESS_LOCAL_WRITE);
  auto taddr = reinterpret_cast<uint64_t>(target.data());
  for (uint64_t i = 0; i < 3; ++i)
    ASSERT_EQ(post(p.client.qp(), IBV_WR_RDMA_WRITE, i, {sge(&local[i * 1000], 1000, lmr)},
                   taddr + i * 1000, tmr->rkey, 0),
              0);
  ASSERT_EQ(post(p.client.qp(), IBV_WR_RDMA_WRITE, 3, {sge(&local[3000], 1000, lmr)}, taddr + 3000,
                 tmr->rkey, IBV_SEND_SIGNALED),
            0);
  ibv_wc wc = one_wc(p.client.cq);
  EXPECT_EQ(wc.wr_id, 3u);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_TRUE(no_wc(p.client.cq));
  EXPECT_EQ(std::memcmp(target.data(), local.data(), 4000), 0);
}

TEST(SimverbsQp, ModifyToErrorFlushesEverything) {
  Pair p;
  p.connect({.sig_all = 0});
  ASSERT_FALSE(HasFatalFailure());
  std::vector<unsigned char> local(64, 1);
  ibv_mr* lmr = p.client.reg(local.data(), local.size(), IBV_ACCESS_LOCAL_WRITE);
  for (uint64_t i = 0; i < 3; ++i) ASSERT_EQ(post_recv(p.client.qp(), 10 + i, {}), 0);
  // Held by the server (no receive there): outstanding when the QP goes to error.
  ASSERT_EQ(post(p.client.qp(), IBV_WR_SEND, 20, {sge(local.data(), 8, lmr)}, 0, 0, 0), 0);
  EXPECT_TRUE(no_wc(p.client.cq));
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  ASSERT_EQ(V().modify_qp(p.client.qp(), &attr, IBV_QP_STATE), 0);
  EXPECT_EQ(p.client.qp()->state, IBV_QPS_ERR);
  auto wcs = wait_wc(p.client.cq, 4);
  ASSERT_EQ(wcs.size(), 4u);
  std::vector<uint64_t> ids;
  for (const ibv_wc& wc : wcs) {
    EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
    ids.push_back(wc.wr_id);
  }
  std::sort(ids.begin(), ids.end());
  EXPECT_EQ(ids, (std::vector<uint64_t>{10, 11, 12, 20}));
  // Later posts complete flushed, signalled or not.
  ASSERT_EQ(post(p.client.qp(), IBV_WR_SEND, 21, {sge(local.data(), 8, lmr)}, 0, 0, 0), 0);
  ASSERT_EQ(post_recv(p.client.qp(), 22, {}), 0);
  wcs = wait_wc(p.client.cq, 2);
  ASSERT_EQ(wcs.size(), 2u);
  EXPECT_EQ(wcs[0].wr_id, 21u);
  EXPECT_EQ(wcs[0].status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(wcs[1].wr_id, 22u);
  EXPECT_TRUE(no_wc(p.client.cq));
}

TEST(SimverbsCq, OneShotArmingAndInjectedEvents) {
  Pair p;
  p.connect();
  ASSERT_FALSE(HasFatalFailure());
  std::vector<unsigned char> target(4096, 0);
  std::vector<unsigned char> local(4096, 3);
  ibv_mr* tmr = p.server.reg(target.data(), target.size(), kAll);
  ibv_mr* lmr = p.client.reg(local.data(), local.size(), IBV_ACCESS_LOCAL_WRITE);
  auto write = [&](uint64_t id) {
    ASSERT_EQ(post(p.client.qp(), IBV_WR_RDMA_WRITE, id, {sge(local.data(), 64, lmr)},
                   reinterpret_cast<uint64_t>(target.data()), tmr->rkey),
              0);
    EXPECT_EQ(one_wc(p.client.cq).wr_id, id);
  };
  ibv_cq* cq = nullptr;
  void* ctx = nullptr;
  ibv_comp_channel* cc = p.client.cc;

  // No arm, no event.
  write(1);
  EXPECT_FALSE(readable(cc->fd, 30));
  EXPECT_EQ(V().get_cq_event(cc, &cq, &ctx), -1);
  EXPECT_EQ(errno, EAGAIN);
  // One arm, one event, however many completions.
  ASSERT_EQ(V().req_notify_cq(p.client.cq, 0), 0);
  write(2);
  write(3);
  ASSERT_TRUE(readable(cc->fd, 2000));
  ASSERT_EQ(V().get_cq_event(cc, &cq, &ctx), 0);
  EXPECT_EQ(cq, p.client.cq);
  EXPECT_EQ(ctx, &p.client);
  EXPECT_EQ(V().get_cq_event(cc, &cq, &ctx), -1);
  EXPECT_EQ(errno, EAGAIN);
  V().ack_cq_events(p.client.cq, 1);
  // A completion that is already there when arming raises nothing.
  write(4);
  ASSERT_EQ(V().req_notify_cq(p.client.cq, 0), 0);
  EXPECT_FALSE(readable(cc->fd, 30));

  // Dropped: the arm is spent, the event lost.
  V().req_notify_cq(p.client.cq, 0);  // (armed already: once is enough)
  sv::drop_next_event(p.client.cq);
  write(5);
  EXPECT_FALSE(readable(cc->fd, 50));
  ASSERT_EQ(V().req_notify_cq(p.client.cq, 0), 0);
  write(6);
  ASSERT_TRUE(readable(cc->fd, 2000));
  ASSERT_EQ(V().get_cq_event(cc, &cq, &ctx), 0);
  V().ack_cq_events(cq, 1);

  // Spurious: an event with no completion, on an unarmed CQ.
  sv::inject_spurious_event(p.client.cq);
  ASSERT_TRUE(readable(cc->fd, 0));
  ASSERT_EQ(V().get_cq_event(cc, &cq, &ctx), 0);
  ibv_wc wc;
  EXPECT_EQ(V().poll_cq(cq, 1, &wc), 0);
  V().ack_cq_events(cq, 1);

  // Delayed.
  sv::set_event_delay(150ms);
  ASSERT_EQ(V().req_notify_cq(p.client.cq, 0), 0);
  auto t0 = Clock::now();
  write(7);
  EXPECT_FALSE(readable(cc->fd, 50));
  ASSERT_TRUE(readable(cc->fd, 3000));
  EXPECT_GE(Clock::now() - t0, 140ms);
  sv::set_event_delay(0ms);
  ASSERT_EQ(V().get_cq_event(cc, &cq, &ctx), 0);
  V().ack_cq_events(cq, 1);

  // Counters: an idle waiter costs nothing.
  sv::Counters before = sv::counters();
  EXPECT_FALSE(readable(cc->fd, 50));
  sv::Counters after = sv::counters();
  EXPECT_EQ(after.poll_cq, before.poll_cq);
  EXPECT_EQ(after.get_cq_event, before.get_cq_event);
  EXPECT_EQ(after.req_notify_cq, before.req_notify_cq);
  V().poll_cq(p.client.cq, 1, &wc);
  V().req_notify_cq(p.client.cq, 0);
  V().get_cq_event(cc, &cq, &ctx);
  after = sv::counters();
  EXPECT_EQ(after.poll_cq, before.poll_cq + 1);
  EXPECT_EQ(after.req_notify_cq, before.req_notify_cq + 1);
  EXPECT_EQ(after.get_cq_event, before.get_cq_event + 1);

  // destroy_cq refuses while an event is gotten and not acked.
  ibv_comp_channel* cc2 = V().create_comp_channel(p.client.id->verbs);
  ibv_cq* cq2 = V().create_cq(p.client.id->verbs, 4, nullptr, cc2, 0);
  ASSERT_NE(cq2, nullptr);
  sv::inject_spurious_event(cq2);
  ASSERT_EQ(V().get_cq_event(cc2, &cq, &ctx), 0);
  EXPECT_EQ(V().destroy_comp_channel(cc2), EBUSY);
  EXPECT_EQ(V().destroy_cq(cq2), EBUSY);
  uint64_t acked = sv::counters().cq_events_acked;
  V().ack_cq_events(cq2, 1);
  EXPECT_EQ(sv::counters().cq_events_acked, acked + 1);
  EXPECT_EQ(V().destroy_cq(cq2), 0);
  EXPECT_EQ(V().destroy_comp_channel(cc2), 0);
}

TEST(SimverbsMw, BindInvalidateAndQpBinding) {
  Pair p;
  p.connect();
  ASSERT_FALSE(HasFatalFailure());
  Pair other;  // a second connection to the same server process
  other.connect();
  ASSERT_FALSE(HasFatalFailure());
  std::vector<unsigned char> target = pattern(16384, 6);
  ibv_mr* tmr =
      p.server.reg(target.data(), target.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
  auto taddr = reinterpret_cast<uint64_t>(target.data());
  errno = 0;
  EXPECT_EQ(V().alloc_mw(p.server.pd, IBV_MW_TYPE_1), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  ibv_mw* mw = V().alloc_mw(p.server.pd, IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  EXPECT_EQ(mw->type, IBV_MW_TYPE_2);
  EXPECT_EQ(mw->pd, p.server.pd);
  uint32_t first = mw->rkey;
  unsigned char buf[64];
  // Unbound: nothing passes.
  EXPECT_EQ(sv::inject_access(p.server.qp()->qp_num, first, taddr + 4096, buf, 8, false),
            IBV_WC_REM_ACCESS_ERR);

  auto bind = [&](uint64_t id, uint32_t rkey, uint64_t addr, uint64_t len, unsigned access) {
    ibv_send_wr wr{};
    wr.wr_id = id;
    wr.opcode = IBV_WR_BIND_MW;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.bind_mw.mw = mw;
    wr.bind_mw.rkey = rkey;
    wr.bind_mw.bind_info = {tmr, addr, len, access};
    ibv_send_wr* bad = nullptr;
    EXPECT_EQ(V().post_send(p.server.qp(), &wr, &bad), 0);
    return one_wc(p.server.cq);
  };
  uint32_t rkey = ibv_inc_rkey(first);
  ibv_wc wc = bind(1, rkey, taddr + 4096, 8192, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.opcode, IBV_WC_BIND_MW);
  EXPECT_EQ(mw->rkey, rkey);

  // Through the QP it was bound on: inside the window only.
  std::vector<unsigned char> local(16384, 0);
  ibv_mr* lmr = p.client.reg(local.data(), local.size(), IBV_ACCESS_LOCAL_WRITE);
  ASSERT_EQ(
      post(p.client.qp(), IBV_WR_RDMA_READ, 2, {sge(local.data(), 8192, lmr)}, taddr + 4096, rkey),
      0);
  wc = one_wc(p.client.cq);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(std::memcmp(local.data(), &target[4096], 8192), 0);
  EXPECT_EQ(sv::inject_access(p.server.qp()->qp_num, rkey, taddr + 4095, buf, 8, false),
            IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(sv::inject_access(p.server.qp()->qp_num, first, taddr + 4096, buf, 8, false),
            IBV_WC_REM_ACCESS_ERR);  // the old key
  // Not through another QP, even of the same process and PD's context.
  std::vector<unsigned char> local2(64, 0);
  ibv_mr* lmr2 = other.client.reg(local2.data(), local2.size(), IBV_ACCESS_LOCAL_WRITE);
  ASSERT_EQ(post(other.client.qp(), IBV_WR_RDMA_READ, 3, {sge(local2.data(), 64, lmr2)},
                 taddr + 4096, rkey),
            0);
  EXPECT_EQ(one_wc(other.client.cq).status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(local2[0], 0);
  // A bound window cannot be bound again before it is invalidated.
  EXPECT_EQ(bind(4, ibv_inc_rkey(rkey), taddr, 64, IBV_ACCESS_REMOTE_READ).status,
            IBV_WC_MW_BIND_ERR);
  EXPECT_EQ(V().dealloc_mw(mw), 0);
}

TEST(SimverbsMw, InvalidateAndDeallocAreImmediate) {
  Pair p;
  p.connect();
  ASSERT_FALSE(HasFatalFailure());
  std::vector<unsigned char> target = pattern(8192, 7);
  ibv_mr* tmr =
      p.server.reg(target.data(), target.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
  auto taddr = reinterpret_cast<uint64_t>(target.data());
  ibv_mw* mw = V().alloc_mw(p.server.pd, IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  uint32_t qpn = p.server.qp()->qp_num;
  auto bind = [&](uint32_t rkey) {
    ibv_send_wr wr{};
    wr.wr_id = rkey;
    wr.opcode = IBV_WR_BIND_MW;
    wr.bind_mw.mw = mw;
    wr.bind_mw.rkey = rkey;
    wr.bind_mw.bind_info = {tmr, taddr, 8192, IBV_ACCESS_REMOTE_WRITE};
    ibv_send_wr* bad = nullptr;
    EXPECT_EQ(V().post_send(p.server.qp(), &wr, &bad), 0);
    EXPECT_EQ(one_wc(p.server.cq).status, IBV_WC_SUCCESS);
  };
  uint32_t k1 = ibv_inc_rkey(mw->rkey);
  bind(k1);
  unsigned char data[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  EXPECT_EQ(sv::inject_access(qpn, k1, taddr, data, 8, true), IBV_WC_SUCCESS);
  EXPECT_EQ(std::memcmp(target.data(), data, 8), 0);
  unsigned char out[8];
  EXPECT_EQ(sv::inject_access(qpn, k1, taddr, out, 8, false), IBV_WC_REM_ACCESS_ERR);  // write only

  ibv_send_wr inv{};
  inv.wr_id = 99;
  inv.opcode = IBV_WR_LOCAL_INV;
  inv.send_flags = IBV_SEND_SIGNALED;
  inv.invalidate_rkey = k1;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(V().post_send(p.server.qp(), &inv, &bad), 0);
  ibv_wc wc = one_wc(p.server.cq);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.opcode, IBV_WC_LOCAL_INV);
  std::vector<unsigned char> snapshot = target;
  unsigned char junk[8] = {9, 9, 9, 9, 9, 9, 9, 9};
  EXPECT_EQ(sv::inject_access(qpn, k1, taddr, junk, 8, true), IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(target, snapshot);

  uint32_t k2 = ibv_inc_rkey(k1);
  bind(k2);
  EXPECT_EQ(sv::inject_access(qpn, k2, taddr, data, 8, true), IBV_WC_SUCCESS);
  ASSERT_EQ(V().dealloc_mw(mw), 0);
  EXPECT_EQ(sv::inject_access(qpn, k2, taddr, junk, 8, true), IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(target, snapshot);

  // Without windows in the configuration.
  ScopedConfig no_windows([](sv::Config& c) { c.mw = false; });
  errno = 0;
  EXPECT_EQ(V().alloc_mw(p.server.pd, IBV_MW_TYPE_2), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  ibv_device_attr da{};
  V().query_device(p.server.id->verbs, &da);
  EXPECT_EQ(da.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B, 0u);
}

TEST(SimverbsFaults, PortDownBreaksConnectionsAndComesBack) {
  Pair p;
  p.connect();
  ASSERT_FALSE(HasFatalFailure());
  ibv_context* ctx = p.client.id->verbs;
  nonblock(ctx->async_fd);
  ibv_async_event ev{};
  EXPECT_EQ(V().get_async_event(ctx, &ev), -1);
  EXPECT_EQ(errno, EAGAIN);
  std::vector<unsigned char> local(64, 1);
  ibv_mr* lmr = p.client.reg(local.data(), local.size(), IBV_ACCESS_LOCAL_WRITE);
  // On the wire (held by the server, no receive there) when the port goes down.
  ASSERT_EQ(post(p.client.qp(), IBV_WR_SEND, 1, {sge(local.data(), 8, lmr)}), 0);
  ASSERT_EQ(post_recv(p.client.qp(), 2, {}), 0);
  EXPECT_TRUE(no_wc(p.client.cq));

  ASSERT_TRUE(sv::set_port_state("sim0", 1, false));
  ASSERT_TRUE(readable(ctx->async_fd, 1000));
  ASSERT_EQ(V().get_async_event(ctx, &ev), 0);
  EXPECT_EQ(ev.event_type, IBV_EVENT_PORT_ERR);
  EXPECT_EQ(ev.element.port_num, 1);
  uint64_t acked = sv::counters().async_events_acked;
  V().ack_async_event(&ev);
  EXPECT_EQ(sv::counters().async_events_acked, acked + 1);
  ibv_port_attr pa{};
  V().query_port(ctx, 1, &pa);
  EXPECT_EQ(pa.state, IBV_PORT_DOWN);
  auto wcs = wait_wc(p.client.cq, 2);
  ASSERT_EQ(wcs.size(), 2u);
  EXPECT_EQ(wcs[0].wr_id, 1u);
  EXPECT_EQ(wcs[0].status, IBV_WC_RETRY_EXC_ERR);
  EXPECT_EQ(wcs[1].wr_id, 2u);
  EXPECT_EQ(wcs[1].status, IBV_WC_WR_FLUSH_ERR);
  expect_cm(p.client.ch, RDMA_CM_EVENT_DISCONNECTED);
  expect_cm(p.lch, RDMA_CM_EVENT_DISCONNECTED);

  // New connections through it fail.
  Side late;
  late.ch = channel();
  ASSERT_EQ(V().create_id(late.ch, &late.id, nullptr, RDMA_PS_TCP), 0);
  sockaddr_in dst = inet("127.0.0.1", p.port);
  ASSERT_EQ(V().resolve_addr(late.id, nullptr, reinterpret_cast<sockaddr*>(&dst), 100), 0);
  expect_cm(late.ch, RDMA_CM_EVENT_ADDR_ERROR);

  ASSERT_TRUE(sv::set_port_state("sim0", 1, true));
  ASSERT_TRUE(readable(ctx->async_fd, 1000));
  ASSERT_EQ(V().get_async_event(ctx, &ev), 0);
  EXPECT_EQ(ev.event_type, IBV_EVENT_PORT_ACTIVE);
  V().ack_async_event(&ev);
  ASSERT_EQ(V().resolve_addr(late.id, nullptr, reinterpret_cast<sockaddr*>(&dst), 100), 0);
  expect_cm(late.ch, RDMA_CM_EVENT_ADDR_RESOLVED);
  EXPECT_FALSE(sv::set_port_state("sim9", 1, false));
}

TEST(SimverbsFaults, QpFatal) {
  Pair p;
  p.connect();
  ASSERT_FALSE(HasFatalFailure());
  ibv_context* ctx = p.server.id->verbs;
  nonblock(ctx->async_fd);
  ASSERT_EQ(post_recv(p.server.qp(), 5, {}), 0);
  sv::qp_fatal(p.server.qp());
  ibv_async_event ev{};
  ASSERT_TRUE(readable(ctx->async_fd, 1000));
  ASSERT_EQ(V().get_async_event(ctx, &ev), 0);
  EXPECT_EQ(ev.event_type, IBV_EVENT_QP_FATAL);
  EXPECT_EQ(ev.element.qp, p.server.qp());
  V().ack_async_event(&ev);
  ibv_wc wc = one_wc(p.server.cq);
  EXPECT_EQ(wc.wr_id, 5u);
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
}

TEST(SimverbsData, LargeTransferIsFast) {
  Pair p;
  p.connect({.sig_all = 1, .send_wr = 64, .recv_wr = 4, .sge = 1});
  ASSERT_FALSE(HasFatalFailure());
  const std::size_t region = 64u << 20;
  const std::size_t total = 256u << 20;
  const std::size_t msg = 1u << 20;
  std::vector<unsigned char> target(region, 0);
  std::vector<unsigned char> local = pattern(region, 11);
  ibv_mr* tmr = p.server.reg(target.data(), region, kAll);
  ibv_mr* lmr = p.client.reg(local.data(), region, IBV_ACCESS_LOCAL_WRITE);
  auto taddr = reinterpret_cast<uint64_t>(target.data());
  auto t0 = Clock::now();
  std::size_t posted = 0;
  std::size_t done = 0;
  while (done < total / msg) {
    while (posted < total / msg && posted - done < 32) {
      std::size_t off = (posted * msg) % region;
      ASSERT_EQ(post(p.client.qp(), IBV_WR_RDMA_WRITE, posted, {sge(&local[off], msg, lmr)},
                     taddr + off, tmr->rkey),
                0);
      ++posted;
    }
    ibv_wc wc[16];
    int n = V().poll_cq(p.client.cq, 16, wc);
    for (int i = 0; i < n; ++i) ASSERT_EQ(wc[i].status, IBV_WC_SUCCESS);
    done += static_cast<std::size_t>(n);
    if (n == 0) std::this_thread::sleep_for(50us);
    ASSERT_LT(Clock::now() - t0, 60s);
  }
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("256 MiB in %.2f s: %.0f MB/s\n", secs, static_cast<double>(total) / secs / 1e6);
  EXPECT_TRUE(target == local);
  EXPECT_LT(secs, 20.0);
}

TEST(SimverbsData, RateCapSlowsTheSender) {
  ScopedConfig slow([](sv::Config& c) { c.rate_mbps = 80; });  // 10 MB/s
  Pair p;
  p.connect();
  ASSERT_FALSE(HasFatalFailure());
  const std::size_t n = 1u << 20;
  std::vector<unsigned char> target(n, 0);
  std::vector<unsigned char> local = pattern(n, 1);
  ibv_mr* tmr = p.server.reg(target.data(), n, kAll);
  ibv_mr* lmr = p.client.reg(local.data(), n, IBV_ACCESS_LOCAL_WRITE);
  auto t0 = Clock::now();
  ASSERT_EQ(post(p.client.qp(), IBV_WR_RDMA_WRITE, 1, {sge(local.data(), n, lmr)},
                 reinterpret_cast<uint64_t>(target.data()), tmr->rkey),
            0);
  EXPECT_TRUE(no_wc(p.client.cq, 30));  // still on its way
  EXPECT_EQ(one_wc(p.client.cq).status, IBV_WC_SUCCESS);
  EXPECT_GE(Clock::now() - t0, 80ms);
  EXPECT_EQ(target, local);
}

TEST(SimverbsMemory, DeregDuringAWriteStopsItThere) {
  // 10 MB/s: 1 MiB takes about 100 ms.
  ScopedConfig slow([](sv::Config& c) { c.rate_mbps = 80; });
  Pair p;
  p.connect();
  ASSERT_FALSE(HasFatalFailure());
  const std::size_t n = 1u << 20;
  std::vector<unsigned char> target(n, 0);
  std::vector<unsigned char> local = pattern(n, 2);
  ibv_mr* tmr = V().reg_mr(p.server.pd, target.data(), n, kAll);
  ASSERT_NE(tmr, nullptr);
  ibv_mr* lmr = p.client.reg(local.data(), n, IBV_ACCESS_LOCAL_WRITE);
  ASSERT_EQ(post(p.client.qp(), IBV_WR_RDMA_WRITE, 1, {sge(local.data(), n, lmr)},
                 reinterpret_cast<uint64_t>(target.data()), tmr->rkey),
            0);
  EXPECT_TRUE(no_wc(p.client.cq, 30));
  ASSERT_EQ(V().dereg_mr(tmr), 0);
  const std::vector<unsigned char> at_dereg = target;  // nothing writes it any more
  ibv_wc wc = one_wc(p.client.cq);
  EXPECT_EQ(wc.status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(target, at_dereg);
  EXPECT_NE(at_dereg, local);        // it was stopped midway...
  EXPECT_EQ(at_dereg[0], local[0]);  // ...after it had begun

  // A READ whose source is deregistered midway: the rest comes as zeros, the requester gets
  // a remote access error, and the responder's QP fails as well.
  Pair q;
  q.connect();
  ASSERT_FALSE(HasFatalFailure());
  std::vector<unsigned char> source = pattern(n, 3);
  std::vector<unsigned char> sink(n, 0xff);
  ibv_mr* smr = V().reg_mr(q.server.pd, source.data(), n, kAll);
  ASSERT_NE(smr, nullptr);
  ibv_mr* kmr = q.client.reg(sink.data(), n, IBV_ACCESS_LOCAL_WRITE);
  ASSERT_EQ(post_recv(q.server.qp(), 9, {}), 0);
  ASSERT_EQ(post(q.client.qp(), IBV_WR_RDMA_READ, 2, {sge(sink.data(), n, kmr)},
                 reinterpret_cast<uint64_t>(source.data()), smr->rkey),
            0);
  EXPECT_TRUE(no_wc(q.client.cq, 30));
  ASSERT_EQ(V().dereg_mr(smr), 0);
  wc = one_wc(q.client.cq);
  EXPECT_EQ(wc.status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(sink[0], source[0]);
  EXPECT_EQ(sink[n - 1], 0);
  wc = one_wc(q.server.cq);
  EXPECT_EQ(wc.wr_id, 9u);
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
}

TEST(SimverbsFork, ChildDoesNotKeepTheParentsConnectionsOpen) {
  Pair p;
  p.connect();
  ASSERT_FALSE(HasFatalFailure());
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::sleep(5);  // holds whatever fork gave it, without using the simulation
    _exit(0);
  }
  V().destroy_qp(p.server.id);
  ASSERT_EQ(V().destroy_id(p.server.id), 0);
  p.server.id = nullptr;
  // The server's end of the socket is closed here, and the child closed its copies.
  auto e = next_cm(p.client.ch, 2000);
  ::kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->type, RDMA_CM_EVENT_DISCONNECTED);
}

// ---------------------------------------------------------------------------------------------
// Across processes: this binary, run again, serves memory.

std::string self_exe() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
}

constexpr std::size_t kServed = 1u << 20;

// Waits until `pid` is stopped by a signal (kill() does not wait for it).
bool stopped(pid_t pid) {
  auto until = Clock::now() + 5s;
  while (Clock::now() < until) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string all((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    std::size_t paren = all.rfind(')');
    if (paren != std::string::npos && paren + 2 < all.size() && all[paren + 2] == 'T') return true;
    std::this_thread::sleep_for(1ms);
  }
  return false;
}

// SimverbsChild.Serve run as a child process, with a client connected to it.
struct ServedChild {
  ferry::test::ChildProcess process{
      {self_exe(), "--gtest_filter=SimverbsChild.Serve"},
      {"FERRY_SIMVERBS_CHILD=1", "FERRY_SIMVERBS=" + sv::to_string(sv::current_config())}};
  Side client;
  uint64_t raddr = 0;  // the served memory
  uint32_t rkey = 0;

  // The child's next line from the simulation ("SIM ..."), without its prefix.
  std::string next() {
    for (;;) {
      std::string l = process.read_line(10s);
      if (l.rfind("SIM ", 0) == 0) return l.substr(4);
    }
  }

  // Connects `client` (private data `req`) and learns where the served memory is.
  void connect(const std::string& req) {
    std::istringstream port_line(next());
    std::string word;
    unsigned port = 0;
    port_line >> word >> port;
    ASSERT_EQ(word, "port");
    start_connect(client, "127.0.0.2", static_cast<uint16_t>(port), {}, req);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    expect_cm(client.ch, RDMA_CM_EVENT_ESTABLISHED);
    std::istringstream mr_line(next());
    mr_line >> word >> raddr >> rkey;
    ASSERT_EQ(word, "mr");
  }

  // The child's checksum of the served memory.
  std::string sum() {
    process.send_line("sum");
    return next();
  }
};

TEST(SimverbsChild, Serve) {
  if (std::getenv("FERRY_SIMVERBS_CHILD") == nullptr)
    GTEST_SKIP() << "the served side of SimverbsCrossProcess; runs only as its child (not a "
                    "ctest entry)";
  auto say = [](const std::string& s) {
    std::printf("SIM %s\n", s.c_str());
    std::fflush(stdout);
  };
  Pair p;
  p.listen("127.0.0.2");
  ASSERT_FALSE(HasFatalFailure());
  say("port " + std::to_string(p.port));
  CmEvent e = expect_cm(p.lch, RDMA_CM_EVENT_CONNECT_REQUEST);
  ASSERT_NE(e.id, nullptr);
  p.server.id = e.id;
  p.server.make_qp({});
  std::vector<unsigned char> served = pattern(kServed, 42);
  ibv_mr* mr = p.server.reg(served.data(), served.size(), kAll);
  ASSERT_EQ(V().accept(p.server.id, nullptr), 0);
  expect_cm(p.lch, RDMA_CM_EVENT_ESTABLISHED);
  say("mr " + std::to_string(reinterpret_cast<uint64_t>(served.data())) + " " +
      std::to_string(mr->rkey));
  std::string line;
  while (std::getline(std::cin, line) && line != "exit") {
    if (line != "sum") continue;
    // Read through the simulation, as the NIC thread wrote (no race with its last write).
    std::vector<unsigned char> copy(kServed);
    ASSERT_EQ(sv::inject_access(0, mr->rkey, reinterpret_cast<uint64_t>(served.data()), copy.data(),
                                copy.size(), false),
              IBV_WC_SUCCESS);
    say("sum " + std::to_string(fnv(copy.data(), copy.size())));
  }
}

TEST(SimverbsCrossProcess, ServedMemoryAndRealPeerDeath) {
  ServedChild child;
  child.connect("child?");
  ASSERT_FALSE(HasFatalFailure());
  Side& client = child.client;
  const uint64_t raddr = child.raddr;
  const uint32_t rkey = child.rkey;

  // READ what it serves, in four pieces.
  std::vector<unsigned char> local(kServed, 0);
  ibv_mr* lmr = client.reg(local.data(), local.size(), IBV_ACCESS_LOCAL_WRITE);
  std::size_t q = kServed / 4;
  ASSERT_EQ(post(client.qp(), IBV_WR_RDMA_READ, 1,
                 {sge(&local[0], q, lmr), sge(&local[q], q, lmr), sge(&local[2 * q], q, lmr),
                  sge(&local[3 * q], q, lmr)},
                 raddr, rkey),
            0);
  ibv_wc wc = one_wc(client.cq);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_TRUE(local == pattern(kServed, 42));
  // WRITE into it; the child checks.
  std::vector<unsigned char> ones(65536, 0x5a);
  ibv_mr* omr = client.reg(ones.data(), ones.size(), IBV_ACCESS_LOCAL_WRITE);
  ASSERT_EQ(post(client.qp(), IBV_WR_RDMA_WRITE, 2, {sge(ones.data(), ones.size(), omr)},
                 raddr + 4096, rkey),
            0);
  EXPECT_EQ(one_wc(client.cq).status, IBV_WC_SUCCESS);
  std::vector<unsigned char> expect = pattern(kServed, 42);
  std::memset(&expect[4096], 0x5a, 65536);
  EXPECT_EQ(child.sum(), "sum " + std::to_string(fnv(expect.data(), expect.size())));
  // A bad key: the child's memory is unchanged (checked below) and the QP fails.
  // (Done last on this connection: it breaks it. Peer death first.)

  // The child stops answering, then dies.
  child.process.kill(SIGSTOP);
  ASSERT_TRUE(stopped(child.process.pid()));
  ASSERT_EQ(post(client.qp(), IBV_WR_RDMA_READ, 3, {sge(local.data(), 4096, lmr)}, raddr, rkey), 0);
  ASSERT_EQ(post_recv(client.qp(), 4, {}), 0);
  EXPECT_TRUE(no_wc(client.cq, 100));
  child.process.kill(SIGKILL);
  auto wcs = wait_wc(client.cq, 2);
  ASSERT_EQ(wcs.size(), 2u);
  EXPECT_EQ(wcs[0].wr_id, 3u);
  EXPECT_EQ(wcs[0].status, IBV_WC_RETRY_EXC_ERR);
  EXPECT_EQ(wcs[1].wr_id, 4u);
  EXPECT_EQ(wcs[1].status, IBV_WC_WR_FLUSH_ERR);
  expect_cm(client.ch, RDMA_CM_EVENT_DISCONNECTED);
  ASSERT_EQ(post(client.qp(), IBV_WR_RDMA_WRITE, 5, {sge(ones.data(), 8, omr)}, raddr, rkey, 0), 0);
  wc = one_wc(client.cq);
  EXPECT_EQ(wc.wr_id, 5u);
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
  child.process.wait();
}

TEST(SimverbsCrossProcess, RemoteAccessErrorAcrossProcesses) {
  ServedChild child;
  child.connect("x");
  ASSERT_FALSE(HasFatalFailure());
  Side& client = child.client;
  std::vector<unsigned char> junk(4096, 0xee);
  ibv_mr* jmr = client.reg(junk.data(), junk.size(), IBV_ACCESS_LOCAL_WRITE);
  // Straddles the end of the served region.
  ASSERT_EQ(post(client.qp(), IBV_WR_RDMA_WRITE, 1, {sge(junk.data(), 4096, jmr)},
                 child.raddr + kServed - 100, child.rkey),
            0);
  EXPECT_EQ(one_wc(client.cq).status, IBV_WC_REM_ACCESS_ERR);
  std::vector<unsigned char> expect = pattern(kServed, 42);
  EXPECT_EQ(child.sum(), "sum " + std::to_string(fnv(expect.data(), expect.size())));
  child.process.send_line("exit");
  EXPECT_EQ(child.process.wait(), 0);
}

}  // namespace
