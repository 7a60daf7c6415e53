// The verbs transport's own machinery, driven directly on the simulated fabric
// (tests/support/simverbs/; no RDMA NIC here): the registration cache (reuse, overlap, split
// above max_mr_size), memory keys that die with their operation (windows and registrations of
// its own), a port going down (exactly the transfers through it fail; the next one
// reconnects), and the completion poller (events coalesced, a lost event recovered, spurious
// and late events harmless, no polling when idle).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
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
#include "transport/wire/frame.hpp"

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
  /// May change each work request posted (of every kind), before the simulation sees it.
  std::function<void(ibv_send_wr&)> rewrite;
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
      std::function<void(ibv_send_wr&)> change;
      {
        std::lock_guard lock(spy().mu);
        change = spy().rewrite;
      }
      if (change) change(*w);
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
  /// Sets (or, with null, clears) the rewrite, under the lock the loops read it with.
  static void set_rewrite(std::function<void(ibv_send_wr&)> change) {
    std::lock_guard lock(spy().mu);
    spy().rewrite = std::move(change);
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
// A transfer that fails after it posted work requests
//
// Its work requests are mostly unsignalled: one that completes without error says nothing, so
// destroying the failed transfer waits until something completes behind them. Each test below
// destroys such a transfer within a bound far below peer_timeout (the wait it fell back on:
// twice, then the connection failed) and moves the next transfer to the same owner.

constexpr auto kLongTimeout = 5s;
constexpr auto kPromptly = 1s;

void long_timeout(Context& c) { c.peer_timeout = kLongTimeout; }

/// How long destroying `t` on `side`'s loop took.
Clock::duration destroy(Side& side, std::unique_ptr<Transfer>& t) {
  return side.call([&] {
    const auto begin = Clock::now();
    t.reset();
    return Clock::now() - begin;
  });
}

long long ms(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

/// An owner's table rewrite: its first CLAIMED gives the last window half its length, so that
/// the claimant has no key for the rest of the range it claimed. Sets `lied` once done.
std::function<void(ibv_send_wr&)> halve_the_last_key(std::atomic<bool>& lied) {
  return [&lied](ibv_send_wr& w) {
    if (lied || w.opcode != IBV_WR_SEND || w.num_sge < 1 || w.sg_list[0].length < wire::kHeaderSize)
      return;
    auto* bytes = reinterpret_cast<std::byte*>(w.sg_list[0].addr);
    const wire::FrameHeader h = wire::decode(bytes);
    if (h.magic != wire::kMagic || h.type != wire::FrameType::claimed || h.len < 24 ||
        wire::kHeaderSize + h.msg_len + h.len > w.sg_list[0].length)
      return;
    std::byte* last = bytes + wire::kHeaderSize + h.msg_len + h.len - 24;
    std::uint64_t len = 0;
    std::memcpy(&len, last + 8, 8);
    len /= 2;
    std::memcpy(last + 8, &len, 8);
    lied = true;
  };
}

TEST_F(Fabric, ATransferWhoseWorkRequestIsRefusedMidwayIsReleasedPromptly) {
  // The third of 16 READs goes under a key the owner never gave: the fabric refuses it
  // (IBV_WC_REM_ACCESS_ERR, both queue pairs in error) after two unsignalled ones completed.
  auto small_wrs = [](VerbsOptions& o) { o.max_wr_bytes = 64 << 10; };
  Side owner("owner", &sim::api());
  Side active("active", Spied<4>::api(), "127.0.0.1", small_wrs, long_timeout);
  constexpr std::size_t kSize = 1u << 20;
  std::vector<std::byte> src(kSize), dst(kSize);
  test::fill_pattern(src.data(), kSize, 6);
  std::atomic<int> data_wrs{0};
  Spied<4>::set_rewrite([&](ibv_send_wr& w) {
    if (w.opcode == IBV_WR_RDMA_READ && ++data_wrs == 3) w.wr.rdma.rkey ^= 0x00ffff00u;
  });
  Log ol, al;
  Offered s = expose(owner, Access::read, src.data(), kSize, ol);
  auto t = start(active, s, dst.data(), kSize, al);
  auto end = al.wait();
  Spied<4>::set_rewrite(nullptr);
  ASSERT_TRUE(end.has_value()) << "the transfer did not end";
  ASSERT_TRUE(end->has_value()) << "a READ under a bad key completed";
  EXPECT_EQ((*end)->code(), ErrorCode::AccessDenied) << (*end)->what();
  EXPECT_NE((*end)->message().find("remote access error"), std::string::npos) << (*end)->what();

  const auto took = destroy(active, t);
  EXPECT_LT(took, kPromptly) << "destroying the failed transfer blocked its loop " << ms(took)
                             << " ms";
  auto owner_end = ol.wait();
  ASSERT_TRUE(owner_end.has_value()) << "the owner's operation did not end";
  EXPECT_TRUE(owner_end->has_value()) << "the owner heard of a success";
  // Its queue pair is in error: the next transfer connects again and moves every byte.
  Log ol2, al2;
  std::fill(dst.begin(), dst.end(), std::byte{0});
  Offered s2 = expose(owner, Access::read, src.data(), kSize, ol2);
  auto t2 = start(active, s2, dst.data(), kSize, al2);
  expect_ok(al2, "the next read");
  expect_ok(ol2, "the owner of the next read");
  EXPECT_EQ(test::first_mismatch(dst.data(), kSize, 6), -1);
  active.call([&] { t2.reset(); });
}

TEST_F(Fabric, ATransferThatFailsBetweenItsWorkRequestsIsReleasedPromptlyOnALiveConnection) {
  // The owner's CLAIMED gives a key for the first half of the range alone: the active side
  // posts the READs of that half (unsignalled), then finds no key for the rest and fails the
  // transfer (ProtocolError) with no work request in error.
  auto small_wrs = [](VerbsOptions& o) { o.max_wr_bytes = 64 << 10; };
  Side owner("owner", Spied<5>::api());
  Side active("active", &sim::api(), "127.0.0.1", small_wrs, long_timeout);
  constexpr std::size_t kSize = 1u << 20;
  std::vector<std::byte> src(kSize), dst(kSize);
  test::fill_pattern(src.data(), kSize, 7);
  std::atomic<bool> lied{false};
  Spied<5>::set_rewrite(halve_the_last_key(lied));
  Log ol, al;
  Offered s = expose(owner, Access::read, src.data(), kSize, ol);
  auto t = start(active, s, dst.data(), kSize, al);
  auto end = al.wait();
  Spied<5>::set_rewrite(nullptr);
  ASSERT_TRUE(lied) << "the owner's answer was not rewritten";
  ASSERT_TRUE(end.has_value()) << "the transfer did not end";
  ASSERT_TRUE(end->has_value()) << "the transfer completed without keys for half its range";
  EXPECT_EQ((*end)->code(), ErrorCode::ProtocolError) << (*end)->what();
  EXPECT_NE((*end)->message().find("gave no key"), std::string::npos) << (*end)->what();
  EXPECT_GT(active.counters().data_wrs, 0u) << "it failed before posting anything";
  // The owner hears that the operation failed (DONE with the error), well before any timeout.
  auto owner_end = ol.wait(kPromptly);
  EXPECT_TRUE(owner_end.has_value()) << "the owner did not hear that the transfer failed";
  if (owner_end.has_value()) {
    ASSERT_TRUE(owner_end->has_value()) << "the owner heard of a success";
    EXPECT_EQ((*owner_end)->code(), ErrorCode::ProtocolError) << (*owner_end)->what();
  }

  const auto took = destroy(active, t);
  EXPECT_LT(took, kPromptly) << "destroying the failed transfer blocked its loop " << ms(took)
                             << " ms";
  // No work request failed: the connection stays up and carries the next transfer.
  const auto before = active.counters().connections;
  Log ol2, al2;
  std::fill(dst.begin(), dst.end(), std::byte{0});
  Offered s2 = expose(owner, Access::read, src.data(), kSize, ol2);
  auto t2 = start(active, s2, dst.data(), kSize, al2);
  expect_ok(al2, "the next read");
  expect_ok(ol2, "the owner of the next read");
  EXPECT_EQ(test::first_mismatch(dst.data(), kSize, 7), -1);
  EXPECT_EQ(active.counters().connections, before) << "the connection did not stay up";
  active.call([&] { t2.reset(); });
}

/// Destroys the transfer's handle in its end callback (on the loop, before what the failure
/// deferred has run), timing that, then records the end in `log`.
class DestroyOnEnd final : public TransferObserver {
 public:
  void on_transfer_complete() override {
    release();
    log.on_transfer_complete();
  }
  void on_transfer_failed(const Error& e) override {
    release();
    log.on_transfer_failed(e);
  }

  std::unique_ptr<Transfer> handle;
  Clock::duration took{};  ///< read after log.wait()
  Log log;

 private:
  void release() {
    const auto begin = Clock::now();
    handle.reset();
    took = Clock::now() - begin;
  }
};

TEST_F(Fabric, ATransferDestroyedAsItsConnectionFailsIsReleasedPromptly) {
  // As above, the owner gives no key for half the range; then the active side's queue pair
  // refuses the DONE that would have retired the READs already posted, and the connection
  // fails. Its READs completed unsignalled before that: no completion, not even a flushed
  // one, will come for them. The handle is destroyed in its failure callback, before the
  // connection is destroyed.
  auto small_wrs = [](VerbsOptions& o) { o.max_wr_bytes = 64 << 10; };
  Side owner("owner", Spied<5>::api());
  Side active("active", Spied<6>::api(), "127.0.0.1", small_wrs, long_timeout);
  constexpr std::size_t kSize = 1u << 20;
  std::vector<std::byte> src(kSize), dst(kSize);
  test::fill_pattern(src.data(), kSize, 8);
  std::atomic<bool> lied{false}, refused{false};
  Spied<5>::set_rewrite(halve_the_last_key(lied));
  Spied<6>::set_rewrite([&](ibv_send_wr& w) {
    if (refused || w.opcode != IBV_WR_SEND || w.num_sge < 1 ||
        w.sg_list[0].length < wire::kHeaderSize)
      return;
    const wire::FrameHeader h = wire::decode(reinterpret_cast<std::byte*>(w.sg_list[0].addr));
    if (h.magic != wire::kMagic || h.type != wire::FrameType::done) return;
    w.num_sge = 1 << 20;  // more than max_send_sge: post_send refuses it (EINVAL)
    refused = true;
  });
  Log ol;
  Offered s = expose(owner, Access::read, src.data(), kSize, ol);
  DestroyOnEnd x;
  active.call([&] {
    TransferSpec spec;
    spec.remote_id = s.exposure.id;
    spec.token = s.exposure.token;
    spec.access = Access::read;
    spec.segments = {Segment{reinterpret_cast<std::uint64_t>(src.data()), dst.data(), kSize}};
    spec.endpoint = s.endpoint;
    spec.peer_name = "owner";
    x.handle = active.transport->start(spec, x);
  });
  auto end = x.log.wait();
  Spied<5>::set_rewrite(nullptr);
  Spied<6>::set_rewrite(nullptr);
  ASSERT_TRUE(lied) << "the owner's answer was not rewritten";
  ASSERT_TRUE(refused) << "no DONE was posted";
  ASSERT_TRUE(end.has_value()) << "the transfer did not end";
  ASSERT_TRUE(end->has_value()) << "the transfer completed without keys for half its range";
  EXPECT_EQ((*end)->code(), ErrorCode::ProtocolError) << (*end)->what();
  EXPECT_LT(x.took, kPromptly) << "destroying the failed transfer blocked its loop " << ms(x.took)
                               << " ms";
  auto owner_end = ol.wait();
  ASSERT_TRUE(owner_end.has_value()) << "the owner's operation did not end";
  EXPECT_TRUE(owner_end->has_value()) << "the owner heard of a success";
  // The next transfer connects again and moves every byte.
  Log ol2, al2;
  std::fill(dst.begin(), dst.end(), std::byte{0});
  Offered s2 = expose(owner, Access::read, src.data(), kSize, ol2);
  auto t2 = start(active, s2, dst.data(), kSize, al2);
  expect_ok(al2, "the next read");
  expect_ok(ol2, "the owner of the next read");
  EXPECT_EQ(test::first_mismatch(dst.data(), kSize, 8), -1);
  active.call([&] { t2.reset(); });
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
