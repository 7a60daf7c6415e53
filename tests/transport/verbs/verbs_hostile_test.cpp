// Hostile peers of the verbs transport, on the simulated fabric (tests/support/simverbs/; no
// RDMA NIC here):
//  - an owner that answers, on its own connection, a claim the client sent to another owner:
//    the answer must not count (answers count only from the connection their request went
//    out on), so the honest owner's transfer goes on as if nothing happened;
//  - a flood of connect requests that carry the public magic and then say nothing: each costs
//    the owner a queue pair and registered buffers, so only the listener's bounds
//    (ListenerOptions) may stay up, and none past unclaimed_timeout; honest peers still get in.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/patterns.hpp"
#include "tests/support/simverbs/simverbs.hpp"
#include "tests/transport/verbs/rig.hpp"
#include "transport/verbs/verbs_conn.hpp"
#include "transport/wire/frame.hpp"

namespace ferry::transport::verbs {
namespace {

using namespace std::chrono_literals;
namespace sim = test::simverbs;
using namespace rig;
using Clock = std::chrono::steady_clock;

class Hostile : public ::testing::Test {
 protected:
  void SetUp() override { sim::configure(sim::Config{}); }
};

// ---------------------------------------------------------------------------------------
// An answer from the wrong connection

/// The CLAIMED frame at the start of a SEND, if that is what `wr` carries.
wire::FrameHeader* claimed_in(ibv_send_wr* wr, wire::FrameHeader& header) {
  if (wr->opcode != IBV_WR_SEND || wr->num_sge < 1 || wr->sg_list[0].length < wire::kHeaderSize)
    return nullptr;
  header = wire::decode(reinterpret_cast<const std::byte*>(wr->sg_list[0].addr));
  if (header.magic != wire::kMagic || header.type != wire::FrameType::claimed) return nullptr;
  return &header;
}

void rewrite(ibv_send_wr* wr, const wire::FrameHeader& header) {
  const wire::HeaderBytes bytes = wire::encode(header);
  std::memcpy(reinterpret_cast<void*>(wr->sg_list[0].addr), bytes.data(), bytes.size());
}

/// What the two owners' tables saw and did.
struct Crossing {
  std::atomic<std::uint64_t> honest_req{0};  ///< the request id the honest owner answers
  std::atomic<bool> release{false};          ///< lets the honest owner's answer go
  std::atomic<bool> forged{false};           ///< the hostile owner sent its forged answer
  static Crossing& get() {
    static Crossing c;
    return c;
  }
};

/// The honest owner: its CLAIMED answer waits (its loop blocked) until released, so that the
/// hostile owner's answer arrives first.
int honest_post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  wire::FrameHeader h;
  if (claimed_in(wr, h) != nullptr) {
    Crossing::get().honest_req = h.req_id;
    const auto until = Clock::now() + 10s;
    while (!Crossing::get().release && Clock::now() < until) std::this_thread::sleep_for(1ms);
  }
  return sim::api().post_send(qp, wr, bad);
}

/// The hostile owner: answers the claim sent to it under the id of the claim the client sent
/// to the honest owner (ids are easy to guess: this one reads it from the honest owner).
int hostile_post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  wire::FrameHeader h;
  if (claimed_in(wr, h) != nullptr && Crossing::get().honest_req != 0) {
    h.req_id = Crossing::get().honest_req;
    rewrite(wr, h);
    Crossing::get().forged = true;
  }
  return sim::api().post_send(qp, wr, bad);
}

/// The simulated device's table with `post_send` in place of its own; the test keeps it
/// until the side that uses it is gone.
std::unique_ptr<VerbsApi> table(int (*post_send)(ibv_qp*, ibv_send_wr*, ibv_send_wr**)) {
  auto t = std::make_unique<VerbsApi>(sim::api());
  t->post_send = post_send;
  return t;
}

TEST_F(Hostile, AnAnswerFromAnotherOwnersConnectionDoesNotCount) {
  constexpr std::size_t kSize = 1 << 20;
  auto src = test::patterned(kSize, 5);
  auto src2 = test::patterned(kSize, 6);
  auto honest_mem = test::buffer(kSize);
  auto hostile_mem = test::buffer(kSize);
  Log honest_log, hostile_log, t1_log, t2_log;
  const auto honest_api = table(&honest_post_send);
  const auto hostile_api = table(&hostile_post_send);
  Side client("client", &sim::api());
  Side honest("honest", honest_api.get());
  Side hostile("hostile", hostile_api.get());
  const Offered at_honest = expose(honest, Access::write, honest_mem.data(), kSize, honest_log);
  const Offered at_hostile = expose(hostile, Access::write, hostile_mem.data(), kSize, hostile_log);

  // The client writes into the honest owner; that owner's answer is held back.
  auto t1 = start(client, at_honest, src.data(), kSize, t1_log);
  const auto until = Clock::now() + 20s;
  while (Crossing::get().honest_req == 0 && Clock::now() < until) std::this_thread::sleep_for(1ms);
  ASSERT_NE(Crossing::get().honest_req.load(), 0u) << "the honest owner never answered";
  // Meanwhile the client also writes into the hostile owner, whose answer carries the id of
  // the claim that went to the honest one.
  auto t2 = start(client, at_hostile, src2.data(), kSize, t2_log);
  while (!Crossing::get().forged && Clock::now() < until) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(Crossing::get().forged) << "the hostile owner never answered";
  // Let the client read the forged answer before the real one arrives.
  std::this_thread::sleep_for(300ms);
  Crossing::get().release = true;

  // The honest transfer ends as if nothing had happened: its bytes in the honest owner's
  // memory, none in the hostile owner's.
  expect_ok(t1_log, "the write into the honest owner");
  EXPECT_EQ(test::first_mismatch(honest_mem.data(), kSize, 5), -1);
  EXPECT_TRUE(std::all_of(hostile_mem.begin(), hostile_mem.end(), [](std::byte b) {
    return b == std::byte{0};
  })) << "the hostile owner's memory got bytes";
  client.call([&] {
    t1.reset();
    t2.reset();
  });
}

// ---------------------------------------------------------------------------------------
// A flood of connect requests

/// A raw rdma_cm client that connects with ferry's private data and then says nothing.
class RawClients {
 public:
  explicit RawClients(const VerbsApi& api) : api_(api), ch_(api.create_event_channel()) {}
  ~RawClients() {
    for (auto& [id, c] : conns_) {
      if (id->qp != nullptr) api_.destroy_qp(id);
      api_.destroy_id(id);
    }
    for (auto& [ctx, r] : resources_) {
      api_.destroy_cq(r.cq);
      api_.dealloc_pd(r.pd);
    }
    api_.destroy_event_channel(ch_);
  }

  /// Connects one more; true once it is established (false: refused or failed).
  bool connect(const std::string& address) {
    sockaddr_in dst{};
    dst.sin_family = AF_INET;
    const auto colon = address.rfind(':');
    inet_pton(AF_INET, address.substr(0, colon).c_str(), &dst.sin_addr);
    dst.sin_port = htons(static_cast<std::uint16_t>(std::stoi(address.substr(colon + 1))));
    rdma_cm_id* id = nullptr;
    if (api_.create_id(ch_, &id, nullptr, RDMA_PS_TCP) != 0) return false;
    conns_[id] = State::resolving;
    if (api_.resolve_addr(id, nullptr, reinterpret_cast<sockaddr*>(&dst), 2000) != 0 ||
        !wait_for(id, State::addr_resolved) || api_.resolve_route(id, 2000) != 0 ||
        !wait_for(id, State::route_resolved))
      return false;
    Resources& r = resources_for(id->verbs);
    ibv_qp_init_attr attr{};
    attr.send_cq = r.cq;
    attr.recv_cq = r.cq;
    attr.qp_type = IBV_QPT_RC;
    attr.cap.max_send_wr = 4;
    attr.cap.max_recv_wr = 4;
    attr.cap.max_send_sge = 1;
    attr.cap.max_recv_sge = 1;
    if (api_.create_qp(id, r.pd, &attr) != 0) return false;
    CmPrivate priv;
    priv.id = 0xbad0000 + conns_.size();
    rdma_conn_param param{};
    param.private_data = &priv;
    param.private_data_len = sizeof priv;
    param.responder_resources = 1;
    param.initiator_depth = 1;
    if (api_.connect(id, &param) != 0) return false;
    return wait_for(id, State::up);
  }

  /// Reads the events that arrive within `for_how_long`.
  void drain(std::chrono::milliseconds for_how_long) {
    const auto until = Clock::now() + for_how_long;
    while (Clock::now() < until) next_event(10ms);
  }
  std::size_t up() const {
    std::size_t n = 0;
    for (const auto& [id, s] : conns_) n += s == State::up ? 1 : 0;
    return n;
  }

 private:
  enum class State { resolving, addr_resolved, route_resolved, up, ended };
  struct Resources {
    ibv_pd* pd = nullptr;
    ibv_cq* cq = nullptr;
  };

  Resources& resources_for(ibv_context* ctx) {
    Resources& r = resources_[ctx];
    if (r.pd == nullptr) {
      r.pd = api_.alloc_pd(ctx);
      r.cq = api_.create_cq(ctx, 4096, nullptr, nullptr, 0);
    }
    return r;
  }

  bool wait_for(rdma_cm_id* id, State want) {
    const auto until = Clock::now() + 10s;
    while (Clock::now() < until) {
      if (conns_[id] == want) return true;
      if (conns_[id] == State::ended) return false;
      next_event(100ms);
    }
    return false;
  }

  void next_event(std::chrono::milliseconds timeout) {
    pollfd p{ch_->fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(timeout.count())) <= 0) return;
    rdma_cm_event* ev = nullptr;
    if (api_.get_cm_event(ch_, &ev) != 0) return;
    State next = State::ended;
    switch (ev->event) {
      case RDMA_CM_EVENT_ADDR_RESOLVED:
        next = State::addr_resolved;
        break;
      case RDMA_CM_EVENT_ROUTE_RESOLVED:
        next = State::route_resolved;
        break;
      case RDMA_CM_EVENT_ESTABLISHED:
        next = State::up;
        break;
      default:
        break;  // rejected, unreachable, disconnected, errors: over
    }
    if (auto it = conns_.find(ev->id); it != conns_.end()) it->second = next;
    api_.ack_cm_event(ev);
  }

  const VerbsApi& api_;
  rdma_event_channel* ch_;
  std::map<rdma_cm_id*, State> conns_;
  std::map<ibv_context*, Resources> resources_;
};

TEST_F(Hostile, ConnectRequestsThatClaimNothingStayWithinTheListenersBounds) {
  constexpr std::size_t kMaxUnclaimed = 16;
  constexpr auto kUnclaimedTimeout = 1500ms;
  Log owner_log, reader_log;
  Side owner("owner", &sim::api(), "127.0.0.1", {}, [&](Context& c) {
    c.listener.max_unclaimed = kMaxUnclaimed;
    c.listener.unclaimed_timeout = kUnclaimedTimeout;
  });
  Side reader("reader", &sim::api());
  auto mem = test::patterned(1 << 20, 8);
  auto back = test::buffer(1 << 20);
  const Offered offered = expose(owner, Access::read, mem.data(), mem.size(), owner_log);

  RawClients flood(sim::api());
  int established = 0;
  for (int i = 0; i < 300; ++i) established += flood.connect(offered.endpoint.address) ? 1 : 0;
  flood.drain(300ms);
  EXPECT_GT(established, 0) << "the flood never got in: nothing was tested";
  EXPECT_LE(flood.up(), kMaxUnclaimed)
      << "of 300 connect requests, " << established << " were accepted";

  // An honest peer gets in, in the middle of the flood.
  auto read = start(reader, offered, back.data(), back.size(), reader_log);
  expect_ok(reader_log, "an honest read during the flood");
  EXPECT_EQ(test::first_mismatch(back.data(), back.size(), 8), -1);
  reader.call([&] { read.reset(); });

  // And none of the silent ones outlives unclaimed_timeout.
  flood.drain(kUnclaimedTimeout + 1500ms);
  EXPECT_EQ(flood.up(), 0u);
}

}  // namespace
}  // namespace ferry::transport::verbs
