// The verbs transport's own machinery, driven directly on the simulated fabric
// (tests/support/simverbs/; no RDMA NIC here): the registration cache (reuse, overlap, split
// above max_mr_size), memory keys that die with their operation (windows and registrations of
// its own), a port going down (exactly the transfers through it fail; the next one
// reconnects), and the completion poller (events coalesced, a lost event recovered, spurious
// and late events harmless, no polling when idle).
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "loop/event_loop.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/simverbs/simverbs.hpp"
#include "tests/transport/verbs/rig.hpp"
#include "transport/kit/exposure_table.hpp"
#include "transport/verbs/verbs_transport.hpp"

namespace ferry::transport::verbs {
namespace {

using namespace std::chrono_literals;
namespace sim = test::simverbs;
using namespace rig;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------------------
// A table that records what the transport did, then calls the simulation.

struct Spy {
  std::mutex mu;
  std::vector<std::uint32_t> qps;  ///< QPs created through this table
  std::vector<ibv_cq*> cqs;        ///< CQs created through this table
  struct Access {
    std::uint32_t rkey = 0;
    std::uint64_t addr = 0;
    std::uint32_t len = 0;
  };
  std::vector<Access> accesses;  ///< every RDMA READ/WRITE posted
  /// Called on each RDMA READ/WRITE posted, before the simulation sees it.
  std::function<void(const Access&)> on_access;
};

template <int N>
struct Spied {
  static Spy& spy() {
    static Spy s;
    return s;
  }
  static int create_qp(rdma_cm_id* id, ibv_pd* pd, ibv_qp_init_attr* attr) {
    const int rc = sim::api().create_qp(id, pd, attr);
    if (rc == 0) {
      std::lock_guard lock(spy().mu);
      spy().qps.push_back(id->qp->qp_num);
    }
    return rc;
  }
  static ibv_cq* create_cq(ibv_context* ctx, int cqe, void* c, ibv_comp_channel* ch, int v) {
    ibv_cq* cq = sim::api().create_cq(ctx, cqe, c, ch, v);
    std::lock_guard lock(spy().mu);
    if (cq != nullptr) spy().cqs.push_back(cq);
    return cq;
  }
  static int post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
    for (ibv_send_wr* w = wr; w != nullptr; w = w->next) {
      if (w->opcode != IBV_WR_RDMA_READ && w->opcode != IBV_WR_RDMA_WRITE) continue;
      std::uint32_t len = 0;
      for (int i = 0; i < w->num_sge; ++i) len += w->sg_list[i].length;
      Spy::Access a{w->wr.rdma.rkey, w->wr.rdma.remote_addr, len};
      std::function<void(const Spy::Access&)> hook;
      {
        std::lock_guard lock(spy().mu);
        spy().accesses.push_back(a);
        hook = spy().on_access;
      }
      if (hook) hook(a);
    }
    return sim::api().post_send(qp, wr, bad);
  }
  static const VerbsApi* api() {
    static VerbsApi table = [] {
      VerbsApi t = sim::api();
      t.create_qp = &create_qp;
      t.create_cq = &create_cq;
      t.post_send = &post_send;
      return t;
    }();
    return &table;
  }
};

class Fabric : public ::testing::Test {
 protected:
  void SetUp() override {
    sim::Config c;  // the defaults: sim0 127.0.0.1, sim1 127.0.0.2, max_mr_size 64 MiB
    sim::configure(c);
  }
  void TearDown() override {
    sim::configure(sim::Config{});
    sim::set_event_delay(0ms);
    sim::set_port_state("sim0", 1, true);
  }
};

// ---------------------------------------------------------------------------------------
// The registration cache

TEST_F(Fabric, RegistrationsAreReusedMergedAndSplitAboveMaxMrSize) {
  Side side("reg", &sim::api());
  constexpr std::size_t kBig = 150u << 20;  // 3 pieces of at most 64 MiB
  std::unique_ptr<std::byte[]> big(new std::byte[kBig]);
  std::byte* p = big.get();
  side.call([&] {
    VerbsTransport& t = *side.transport;
    const std::uint64_t devices = 2;
    auto a = t.register_memory({p, 1 << 20, MemoryKind::host});
    EXPECT_EQ(t.counters().registrations, devices) << "one region per device";
    auto inner = t.register_memory({p + 4096, 4096, MemoryKind::host});
    EXPECT_EQ(inner.get(), a.get()) << "a range inside a registered one reuses it";
    EXPECT_EQ(t.counters().registrations, devices);
    auto overlap = t.register_memory({p + (512 << 10), 1 << 20, MemoryKind::host});
    EXPECT_TRUE(overlap->covers(reinterpret_cast<std::uint64_t>(p), 1536 << 10))
        << "an overlapping range is registered as the union";
    EXPECT_EQ(t.counters().registrations, 2 * devices);
    auto whole = t.register_memory({p, kBig, MemoryKind::host});
    EXPECT_EQ(t.counters().registrations, 2 * devices + 3 * devices)
        << "150 MiB above a max_mr_size of 64 MiB: three regions per device";
    EXPECT_TRUE(whole->covers(reinterpret_cast<std::uint64_t>(p), kBig));
  });
}

// ---------------------------------------------------------------------------------------
// Keys die with their operation

class Keys : public Fabric, public ::testing::WithParamInterface<bool> {};

TEST_P(Keys, WorkWhileTheOperationLivesAndFailAfterItEnds) {
  const bool windows = GetParam();
  auto tune = [windows](VerbsOptions& o) { o.memory_windows = windows; };
  Spied<1>::spy().qps.clear();
  Spied<2>::spy().accesses.clear();
  Side owner("owner", Spied<1>::api(), "127.0.0.1", tune);
  Side active("active", Spied<2>::api(), "127.0.0.1", tune);
  EXPECT_EQ(owner.call([&] { return owner.transport->uses_memory_windows(); }), windows);

  constexpr std::size_t kSize = 256 << 10;
  std::vector<std::byte> src(kSize), dst(kSize);
  test::fill_pattern(src.data(), kSize, 5);
  Log olog, alog;
  Offered s = expose(owner, Access::read, src.data(), kSize, olog);

  // While the claim holds, the key the active side uses reaches the memory through the
  // owner's queue pair.
  std::atomic<int> live_probe{-1};
  Spied<2>::spy().on_access = [&](const Spy::Access& a) {
    if (live_probe.load() != -1) return;
    std::uint32_t qp = 0;
    {
      std::lock_guard lock(Spied<1>::spy().mu);
      qp = Spied<1>::spy().qps.empty() ? 0 : Spied<1>::spy().qps.back();
    }
    std::byte probe[16];
    live_probe = sim::inject_access(qp, a.rkey, a.addr, probe, sizeof probe, false);
  };
  auto t = start(active, s, dst.data(), kSize, alog);
  expect_ok(alog, "the read");
  expect_ok(olog, "the owner");
  Spied<2>::spy().on_access = nullptr;
  EXPECT_EQ(live_probe.load(), IBV_WC_SUCCESS) << "the key did not work during the operation";
  EXPECT_EQ(test::first_mismatch(dst.data(), kSize, 5), -1);

  // After: every key it used is dead, for reading and writing, and the memory unchanged.
  std::vector<Spy::Access> used;
  std::uint32_t qp = 0;
  {
    std::lock_guard lock(Spied<2>::spy().mu);
    used = Spied<2>::spy().accesses;
  }
  {
    std::lock_guard lock(Spied<1>::spy().mu);
    qp = Spied<1>::spy().qps.back();
  }
  ASSERT_FALSE(used.empty());
  for (const Spy::Access& a : used) {
    std::byte junk[16];
    std::memset(junk, 0xee, sizeof junk);
    EXPECT_EQ(sim::inject_access(qp, a.rkey, a.addr, junk, sizeof junk, true),
              IBV_WC_REM_ACCESS_ERR);
    EXPECT_EQ(sim::inject_access(qp, a.rkey, a.addr, junk, sizeof junk, false),
              IBV_WC_REM_ACCESS_ERR);
  }
  EXPECT_EQ(test::first_mismatch(src.data(), kSize, 5), -1) << "a late access changed memory";
  active.call([&] { t.reset(); });
}

INSTANTIATE_TEST_SUITE_P(Kinds, Keys, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "MemoryWindows" : "OwnRegistrations";
                         });

// ---------------------------------------------------------------------------------------
// A port going down

TEST_F(Fabric, APortDownErrorsExactlyTheTransfersThroughItAndTheNextOneReconnects) {
  sim::Config slow;
  slow.rate_mbps = 800;  // 32 MiB take about a third of a second each way
  sim::configure(slow);
  Side a("owner-a", &sim::api(), "127.0.0.1");  // on sim0
  Side b("owner-b", &sim::api(), "127.0.0.2");  // on sim1
  Side active("active", &sim::api());
  constexpr std::size_t kSize = 32u << 20;
  std::vector<std::byte> src_a(kSize), src_b(kSize), dst_a(kSize), dst_b(kSize);
  test::fill_pattern(src_a.data(), kSize, 1);
  test::fill_pattern(src_b.data(), kSize, 2);
  Log la, lb, ta, tb;
  Offered sa = expose(a, Access::read, src_a.data(), kSize, la);
  Offered sb = expose(b, Access::read, src_b.data(), kSize, lb);
  auto xa = start(active, sa, dst_a.data(), kSize, ta);
  auto xb = start(active, sb, dst_b.data(), kSize, tb);
  const auto deadline = Clock::now() + 20s;
  while (test::first_mismatch(test::peek(dst_a.data(), 4096).data(), 4096, 1) >= 0 &&
         Clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  ASSERT_FALSE(ta.ended()) << "the transfer through sim0 ended before the port went down";
  ASSERT_TRUE(sim::set_port_state("sim0", 1, false));

  auto end_a = ta.wait();
  ASSERT_TRUE(end_a.has_value());
  ASSERT_TRUE(end_a->has_value()) << "the transfer through the dead port completed";
  EXPECT_EQ((*end_a)->code(), ErrorCode::PeerLost) << (*end_a)->what();
  EXPECT_NE((*end_a)->message().find("sim0"), std::string::npos) << (*end_a)->what();
  expect_ok(tb, "the transfer through sim1");
  EXPECT_EQ(test::first_mismatch(dst_b.data(), kSize, 2), -1);
  auto owner_a = la.wait();
  ASSERT_TRUE(owner_a.has_value());
  EXPECT_TRUE(owner_a->has_value()) << "owner A was not told its peer is gone";
  expect_ok(lb, "owner B");

  // The port comes back: a new transfer to A builds a new connection.
  sim::configure(sim::Config{});
  ASSERT_TRUE(sim::set_port_state("sim0", 1, true));
  const auto before = active.counters().connections;
  Log la2, ta2;
  std::fill(dst_a.begin(), dst_a.end(), std::byte{0});
  Offered sa2 = expose(a, Access::read, src_a.data(), kSize, la2);
  auto xa2 = start(active, sa2, dst_a.data(), kSize, ta2);
  expect_ok(ta2, "the transfer after the port came back");
  expect_ok(la2, "owner A, after the port came back");
  EXPECT_EQ(test::first_mismatch(dst_a.data(), kSize, 1), -1);
  EXPECT_EQ(active.counters().connections, before + 1);
  active.call([&] {
    xa.reset();
    xb.reset();
    xa2.reset();
  });
}

// ---------------------------------------------------------------------------------------
// The completion poller

TEST_F(Fabric, LateEventsAreCoalescedIntoFewWakeups) {
  Side owner("owner", &sim::api());
  Side active("active", &sim::api(), "127.0.0.1", [](VerbsOptions& o) {
    o.max_wr_bytes = 16 << 10;
    o.signal_every = 1;  // a completion per work request
  });
  sim::set_event_delay(20ms);  // completions pile up before the loop hears of them
  constexpr std::size_t kSize = 8u << 20;
  std::vector<std::byte> src(kSize), dst(kSize);
  test::fill_pattern(src.data(), kSize, 3);
  Log ol, al;
  Offered s = expose(owner, Access::read, src.data(), kSize, ol);
  auto t = start(active, s, dst.data(), kSize, al);
  expect_ok(al, "the read");
  expect_ok(ol, "the owner");
  EXPECT_EQ(test::first_mismatch(dst.data(), kSize, 3), -1);
  const auto c = active.counters();
  EXPECT_GE(c.completions, 512u) << "one completion per 16 KiB work request";
  EXPECT_LT(c.comp_wakeups * 4, c.completions)
      << c.comp_wakeups << " wakeups for " << c.completions << " completions";
  active.call([&] { t.reset(); });
}

TEST_F(Fabric, ALostEventIsRecoveredAndSpuriousOnesAreHarmless) {
  Spied<3>::spy().cqs.clear();
  Side owner("owner", &sim::api());
  Side active("active", Spied<3>::api());
  std::vector<ibv_cq*> cqs;
  {
    std::lock_guard lock(Spied<3>::spy().mu);
    cqs = Spied<3>::spy().cqs;
  }
  ASSERT_FALSE(cqs.empty());
  for (ibv_cq* cq : cqs) sim::drop_next_event(cq);  // the next wakeup of each is lost
  constexpr std::size_t kSize = 1u << 20;
  std::vector<std::byte> src(kSize), dst(kSize);
  test::fill_pattern(src.data(), kSize, 4);
  Log ol, al;
  Offered s = expose(owner, Access::read, src.data(), kSize, ol);
  auto t = start(active, s, dst.data(), kSize, al);
  expect_ok(al, "the read despite a lost wakeup");
  expect_ok(ol, "the owner");
  EXPECT_EQ(test::first_mismatch(dst.data(), kSize, 4), -1);
  EXPECT_GE(active.counters().watchdog_found, 1u) << "who found the completions, then?";

  const auto before = active.counters();
  for (ibv_cq* cq : cqs) sim::inject_spurious_event(cq);
  const auto deadline = Clock::now() + 5s;
  while (active.counters().comp_wakeups == before.comp_wakeups && Clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  const auto after = active.counters();
  EXPECT_GT(after.empty_wakeups, before.empty_wakeups);
  EXPECT_EQ(after.completions, before.completions);

  // Spurious events did not disarm anything: the next transfer completes by events.
  Log ol2, al2;
  Offered s2 = expose(owner, Access::read, src.data(), kSize, ol2);
  auto t2 = start(active, s2, dst.data(), kSize, al2);
  expect_ok(al2, "the read after spurious events");
  expect_ok(ol2, "the owner, after spurious events");
  active.call([&] {
    t.reset();
    t2.reset();
  });
}

TEST_F(Fabric, NothingPollsWhenIdle) {
  Side owner("owner", &sim::api());
  Side active("active", &sim::api());
  constexpr std::size_t kSize = 1u << 20;
  std::vector<std::byte> src(kSize), dst(kSize);
  Log ol, al;
  Offered s = expose(owner, Access::read, src.data(), kSize, ol);
  auto t = start(active, s, dst.data(), kSize, al);
  expect_ok(al, "the read");
  expect_ok(ol, "the owner");
  std::this_thread::sleep_for(100ms);  // what was under way settles
  const auto before = sim::counters();
  const auto owner_before = owner.counters();
  std::this_thread::sleep_for(500ms);
  const auto after = sim::counters();
  EXPECT_EQ(after.poll_cq, before.poll_cq) << "the completion queues were polled while idle";
  EXPECT_EQ(after.req_notify_cq, before.req_notify_cq);
  EXPECT_EQ(owner.counters().watchdog_polls, owner_before.watchdog_polls);
  active.call([&] { t.reset(); });
}

}  // namespace
}  // namespace ferry::transport::verbs
