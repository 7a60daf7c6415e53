// Regions by verbs (transport/verbs/verbs_region.cpp, verbs_server.cpp), driven directly on the
// simulated fabric (tests/support/simverbs/; no RDMA NIC here): the keys an attachment got at
// ATTACH die when the owner revokes it, and when it ends the region. With memory windows
// (type-2, bound to the peer's queue pair) and without (registrations of the attachment's own).
//
// A peer that has not heard of the revocation yet posts a late RDMA READ and a late RDMA WRITE
// under the dead key (its loop is held at a gate while the owner revokes): the fabric refuses
// both (IBV_WC_REM_ACCESS_ERR on the peer's queue pair), nothing lands in the owner's memory
// (poisoned the moment revoke_attachment() or end_region() returned) nor in the peer's, and
// every key of the attachment is refused, for reading and writing, on every queue pair of the
// owner's.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "tests/support/gate.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/simverbs/simverbs.hpp"
#include "tests/transport/verbs/rig.hpp"
#include "transport/region.hpp"
#include "transport/verbs/verbs_transport.hpp"

namespace ferry::transport::verbs {
namespace {

using namespace std::chrono_literals;
namespace sim = test::simverbs;
using namespace rig;
using Clock = std::chrono::steady_clock;

constexpr auto kWait = 30s;
constexpr std::byte kPoison{0x5A};
constexpr std::byte kUntouched{0xC3};

// ---------------------------------------------------------------------------------------
// A table that records what one side posted and what completed, then calls the simulation.

struct Spy {
  struct Posted {
    std::uint32_t qp = 0;
    std::uint64_t wr_id = 0;
    ibv_wr_opcode opcode = IBV_WR_SEND;
    std::uint32_t rkey = 0;
  };
  struct Completed {
    std::uint32_t qp = 0;
    std::uint64_t wr_id = 0;
    ibv_wc_status status = IBV_WC_SUCCESS;
  };
  std::mutex mu;
  std::vector<std::uint32_t> qps;  ///< QPs created through this table
  std::vector<Posted> posted;      ///< every RDMA READ and WRITE
  std::vector<Completed> completed;
  void clear() {
    std::lock_guard lock(mu);
    qps.clear();
    posted.clear();
    completed.clear();
  }
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
  static int post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
    {
      std::lock_guard lock(spy().mu);
      for (ibv_send_wr* w = wr; w != nullptr; w = w->next)
        if (w->opcode == IBV_WR_RDMA_READ || w->opcode == IBV_WR_RDMA_WRITE)
          spy().posted.push_back({qp->qp_num, w->wr_id, w->opcode, w->wr.rdma.rkey});
    }
    return sim::api().post_send(qp, wr, bad);
  }
  static int poll_cq(ibv_cq* cq, int n, ibv_wc* wc) {
    const int got = sim::api().poll_cq(cq, n, wc);
    std::lock_guard lock(spy().mu);
    for (int i = 0; i < got; ++i)
      spy().completed.push_back({wc[i].qp_num, wc[i].wr_id, wc[i].status});
    return got;
  }
  static const VerbsApi* api() {
    static VerbsApi table = [] {
      VerbsApi t = sim::api();
      t.create_qp = &create_qp;
      t.post_send = &post_send;
      t.poll_cq = &poll_cq;
      return t;
    }();
    return &table;
  }
};

// ---------------------------------------------------------------------------------------
// Observers, a gate, and what a peer holds

/// The attachments the owner heard of, from its loop.
class RegionLog final : public RegionObserver {
 public:
  void on_attached(const Attachment& a) override {
    std::lock_guard lock(mu_);
    attached_.push_back(a.id);
    cv_.notify_all();
  }
  void on_region_transfer(const RegionNotice&) override {}
  void on_detached(std::uint64_t, const std::optional<Error>&) override {}
  std::vector<std::uint64_t> attached(std::size_t n) {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, kWait, [&] { return attached_.size() >= n; });
    return attached_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::uint64_t> attached_;
};

class AttachLog final : public AttachObserver {
 public:
  enum State { attaching, attached, failed, detached };
  void on_attached() override { set(attached); }
  void on_attach_failed(const Error&, bool) override { set(failed); }
  void on_detached(const Error&) override { set(detached); }
  /// Waits for `state` or a later one; false after kWait.
  bool wait(State state) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, kWait, [&] { return state_ >= state; });
  }

 private:
  void set(State s) {
    std::lock_guard lock(mu_);
    state_ = s;
    cv_.notify_all();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  State state_ = attaching;
};

// A loop waits at a test::Gate (at most kWait): meanwhile its side hears nothing.
using test::Gate;

/// A peer's attachment and its transfers, destroyed on the peer's loop.
struct Held {
  Side& side;
  std::unique_ptr<RemoteRegion> region;
  std::vector<std::unique_ptr<Transfer>> transfers;
  explicit Held(Side& s) : side(s) {}
  ~Held() {
    side.call([this] {
      transfers.clear();
      region.reset();
    });
  }
  /// Loop thread: a transfer of the whole region (at `base`) to or from `local`.
  void start_here(Access access, std::uint64_t base, std::byte* local, std::size_t size, Log& log) {
    TransferSpec spec;
    spec.access = access;
    spec.segments = {Segment{base, local, size}};
    spec.region_tag = "verbs_region_test";
    transfers.push_back(region->start(std::move(spec), log));
  }
};

std::size_t posted(Spy& spy) {
  std::lock_guard lock(spy.mu);
  return spy.posted.size();
}

/// Polls `done` every 100 us for at most kWait: for what the simulated NIC reports on its own
/// thread, with no event for the test to wait on.
template <class F>
bool within_wait(F done) {
  const auto until = Clock::now() + kWait;
  while (!done()) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(100us);
  }
  return true;
}

// ---------------------------------------------------------------------------------------

class RegionKeys : public ::testing::TestWithParam<std::tuple<bool, bool>> {
 protected:
  void SetUp() override {
    sim::configure(sim::Config{});
    Spied<0>::spy().clear();
    Spied<1>::spy().clear();
    Spied<2>::spy().clear();
  }
  void TearDown() override { sim::configure(sim::Config{}); }
};

/// Checks, from `spy` of one peer, the RDMA `opcode` work requests it posted after the first
/// `from` of them: at least one, each under one of `keys`, the first completed with
/// IBV_WC_REM_ACCESS_ERR on its queue pair (which then goes to error: the rest flush).
void expect_refused_by_the_fabric(Spy& spy, std::size_t from, ibv_wr_opcode opcode,
                                  const std::vector<Window>& keys, const char* what) {
  std::vector<Spy::Posted> late;
  {
    std::lock_guard lock(spy.mu);
    late.assign(spy.posted.begin() + static_cast<std::ptrdiff_t>(from), spy.posted.end());
  }
  ASSERT_FALSE(late.empty()) << what << ": nothing was posted";
  for (const Spy::Posted& p : late) {
    EXPECT_EQ(p.opcode, opcode) << what;
    EXPECT_TRUE(
        std::any_of(keys.begin(), keys.end(), [&](const Window& w) { return w.rkey == p.rkey; }))
        << what << ": posted under key " << p.rkey << ", not one the attachment got";
  }
  // The first late work request fails at the owner; the QP goes to error, the rest flush.
  const Spy::Posted& first = late.front();
  std::optional<ibv_wc_status> status;
  EXPECT_TRUE(within_wait([&] {
    std::lock_guard lock(spy.mu);
    for (const Spy::Completed& c : spy.completed)
      if (c.qp == first.qp && c.wr_id == first.wr_id) status = c.status;
    return status.has_value();
  })) << what
      << ": its completion never came";
  if (status) {
    EXPECT_EQ(*status, IBV_WC_REM_ACCESS_ERR)
        << what << ": " << wc_status_text(*status) << ", not a remote access error";
  }
}

TEST_P(RegionKeys, ALateReadAndWriteUnderTheKeysOfAnEndedAttachmentAreRefusedByTheFabric) {
  const auto [windows, whole_region] = GetParam();
  auto tune = [windows = windows](VerbsOptions& o) { o.memory_windows = windows; };
  constexpr std::size_t kSize = 256u << 10;
  std::vector<std::byte> memory = test::patterned(kSize, 5);  // the owner's region
  std::vector<std::byte> src = test::patterned(kSize, 6);
  std::vector<std::byte> read_back = test::buffer(kSize);
  std::unique_ptr<std::byte[]> late_into = test::filled(kSize, kUntouched);
  RegionLog rlog;
  AttachLog alog_r, alog_w;
  Log live_read, live_write, late_read, late_write;
  Gate gate_r{kWait}, gate_w{kWait};
  Side owner("owner", Spied<0>::api(), "127.0.0.1", tune);
  Side reader("reader", Spied<1>::api(), "127.0.0.1", tune);
  Side writer("writer", Spied<2>::api(), "127.0.0.1", tune);
  EXPECT_EQ(owner.call([&] { return owner.transport->uses_memory_windows(); }), windows);

  RegionExposure region;
  region.id = 0x7200;
  region.token = random_token();
  region.access = Access::read_write;
  region.regions = {Region{memory.data(), kSize, MemoryKind::host}};
  std::shared_ptr<const Registration> registration;
  AttachSpec spec;
  spec.region = region.id;
  spec.token = region.token;
  spec.access = Access::read_write;
  spec.peer_name = "owner";
  owner.call([&] {
    registration = owner.transport->register_exposed(region.regions[0]);
    spec.endpoint = owner.transport->endpoints().at(0);
    spec.endpoint.info = owner.transport->serve_region(region, rlog);
  });
  const std::uint64_t base = reinterpret_cast<std::uint64_t>(memory.data());

  // The reader attaches, then the writer; each learns the keys of its attachment.
  Held r(reader), w(writer);
  r.region = reader.call([&] { return reader.transport->attach(spec, alog_r); });
  ASSERT_TRUE(alog_r.wait(AttachLog::attached));
  w.region = writer.call([&] { return writer.transport->attach(spec, alog_w); });
  ASSERT_TRUE(alog_w.wait(AttachLog::attached));
  const std::vector<std::uint64_t> ids = rlog.attached(2);
  ASSERT_EQ(ids.size(), 2u);
  auto keys_of = [](Side& side, Held& h) {
    return side.call([&] { return dynamic_cast<VerbsRemoteRegion&>(*h.region).windows; });
  };
  const std::vector<Window> keys_r = keys_of(reader, r);
  const std::vector<Window> keys_w = keys_of(writer, w);
  ASSERT_FALSE(keys_r.empty());
  ASSERT_FALSE(keys_w.empty());

  // While they live, the keys work: a read and a write, and a probe of each key through one of
  // the owner's queue pairs.
  reader.call([&] { r.start_here(Access::read, base, read_back.data(), kSize, live_read); });
  expect_ok(live_read, "the read while attached");
  EXPECT_EQ(test::first_mismatch(read_back.data(), kSize, 5), -1);
  writer.call([&] { w.start_here(Access::write, base, src.data(), kSize, live_write); });
  expect_ok(live_write, "the write while attached");
  EXPECT_EQ(owner.call([&] { return test::first_mismatch(memory.data(), kSize, 6); }), -1);
  std::vector<std::uint32_t> owner_qps;
  {
    std::lock_guard lock(Spied<0>::spy().mu);
    owner_qps = Spied<0>::spy().qps;
  }
  ASSERT_EQ(owner_qps.size(), 2u) << "one connection per peer";
  for (const Window& k : keys_r) {
    bool live = false;
    for (std::uint32_t qp : owner_qps) {
      std::byte probe[16];
      live = live ||
             sim::inject_access(qp, k.rkey, k.addr, probe, sizeof probe, false) == IBV_WC_SUCCESS;
    }
    EXPECT_TRUE(live) << "key " << k.rkey << " did not work while attached";
  }
  const std::size_t posted_r = posted(Spied<1>::spy());
  const std::size_t posted_w = posted(Spied<2>::spy());

  // Each peer's loop waits at its gate, a transfer queued behind it: when the gate opens, it
  // starts before the peer reads the owner's notice, under the keys it holds.
  reader.loop.post([&] {
    gate_r.wait();
    r.start_here(Access::read, base, late_into.get(), kSize, late_read);
  });
  writer.loop.post([&] {
    gate_w.wait();
    w.start_here(Access::write, base, src.data(), kSize, late_write);
  });
  struct OpenOnExit {  // a test that fails from here on does not leave a loop at its gate
    Gate& a;
    Gate& b;
    ~OpenOnExit() {
      a.open();
      b.open();
    }
  } open_on_exit{gate_r, gate_w};
  ASSERT_TRUE(gate_r.wait_entered());
  ASSERT_TRUE(gate_w.wait_entered());
  owner.call([&] {
    const Error reason(ErrorCode::Cancelled, "revoked by the test");
    if (whole_region) {
      owner.transport->end_region(region.id, reason);
    } else {
      for (std::uint64_t id : ids) owner.transport->revoke_attachment(id, reason);
    }
    std::memset(memory.data(), static_cast<int>(kPoison), kSize);
  });
  gate_r.open();
  gate_w.open();

  for (Log* log : {&late_read, &late_write}) {
    auto end = log->wait();
    ASSERT_TRUE(end.has_value()) << "a late transfer did not end";
    EXPECT_TRUE(end->has_value()) << "a late transfer completed";
  }
  expect_refused_by_the_fabric(Spied<1>::spy(), posted_r, IBV_WR_RDMA_READ, keys_r,
                               "the late read");
  expect_refused_by_the_fabric(Spied<2>::spy(), posted_w, IBV_WR_RDMA_WRITE, keys_w,
                               "the late write");
  EXPECT_TRUE(alog_r.wait(AttachLog::detached));
  EXPECT_TRUE(alog_w.wait(AttachLog::detached));
  EXPECT_EQ(owner.call([&] { return test::first_not(memory.data(), kSize, kPoison); }), -1)
      << "a late write reached the owner's memory";
  EXPECT_EQ(reader.call([&] { return test::first_not(late_into.get(), kSize, kUntouched); }), -1)
      << "a late read brought bytes of the owner's memory";

  // Every key of both attachments is dead for reading and writing, on every queue pair of the
  // owner's, and the memory unchanged by the attempts.
  for (const std::vector<Window>* keys : {&keys_r, &keys_w})
    for (const Window& k : *keys)
      for (std::uint32_t qp : owner_qps) {
        std::byte junk[16];
        std::memset(junk, 0xee, sizeof junk);
        EXPECT_EQ(sim::inject_access(qp, k.rkey, k.addr, junk, sizeof junk, true),
                  IBV_WC_REM_ACCESS_ERR)
            << "key " << k.rkey << " still writes";
        EXPECT_EQ(sim::inject_access(qp, k.rkey, k.addr, junk, sizeof junk, false),
                  IBV_WC_REM_ACCESS_ERR)
            << "key " << k.rkey << " still reads";
      }
  EXPECT_EQ(owner.call([&] { return test::first_not(memory.data(), kSize, kPoison); }), -1);
  owner.call([&] { registration.reset(); });
}

INSTANTIATE_TEST_SUITE_P(Kinds, RegionKeys,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<bool, bool>>& p) {
                           return std::string(std::get<0>(p.param) ? "MemoryWindows"
                                                                   : "OwnRegistrations") +
                                  (std::get<1>(p.param) ? "_RegionEnded" : "_Revoked");
                         });

}  // namespace
}  // namespace ferry::transport::verbs
