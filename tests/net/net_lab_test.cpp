// The network lab (label `net`): ferry between "hosts" made of network namespaces, joined by
// a switch, each with its own nats-server in one cluster (tests/net/lab.hpp), workers
// (ferry_net_worker) in each. Links shaped with tc; partitions, power loss, a killed
// nats-server, a flapping link, and the side channel and data path cut apart.
//
// Asserted throughout: every operation ends (completes, or fails with the documented code and
// a message naming the peer) within peer_timeout + slack; the bytes of every completed
// transfer are verified at the destination; the surviving workers' descriptors and resident
// memory return to their baseline; pairing by subject keeps working through the cluster when
// a worker's server dies. Needs root, iproute2 (ip, tc) and nats-server; the shaped cases also
// need sch_netem. Without them a test skips, saying why (ctest reports it as skipped).
#include <gtest/gtest.h>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/net/lab.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using netlab::json;
using netlab::Lab;
using netlab::Net;
using netlab::Worker;
using netlab::WorkerOptions;
using Clock = std::chrono::steady_clock;

const int kPeerTimeoutMs = WorkerOptions{}.peer_timeout_ms;
// Workers of the cases without a fault: a peer slowed down by a sanitizer on a loaded machine
// must not read as lost (with 1 s, a 256 MiB write under ThreadSanitizer on 2 cores at a load
// of 8 once ended PeerLost on a clean link).
WorkerOptions steady() {
  WorkerOptions o;
  o.peer_timeout_ms = 5000;
  return o;
}
// Room for the watchdog's granularity, a loaded 2-core machine and the pipe to the worker.
constexpr int kSlackMs = 3000;
constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;
// A data link slowed down so that a transfer is still running when a fault comes: 80 Mbit/s,
// 10 MB/s, a 32 MiB transfer takes about 3.4 s.
const std::vector<std::string> kSlowLink{"tbf",   "rate",    "80mbit", "burst",
                                         "256kb", "latency", "200ms"};

long long now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
      .count();
}

enum class Way { read, write };  // a reader reading a readable; a writer writing a writable

const char* way_name(Way w) { return w == Way::read ? "read" : "write"; }
void PrintTo(Way w, std::ostream* os) { *os << way_name(w); }

/// One transfer's two operations: `owner` serves the passive one, `active` acts on it.
struct Pairing {
  Worker& owner;
  Worker& active;
  Way way;
  std::size_t size;
  std::string slot;
  std::uint64_t seed;
  std::string meta;  // the passive operation's metadata (JSON)
};

std::string subject_of(const Pairing& p) {
  return "lab.op." + std::to_string(::getpid()) + "." + p.slot;
}

int counter = 0;

/// The owner's half of a transfer: exposes a passive operation at a subject of its own.
Pairing expose(Worker& owner, Worker& active, Way way, std::size_t size, int owner_timeout_ms = 0) {
  ++counter;
  Pairing p{owner,
            active,
            way,
            size,
            "t" + std::to_string(counter),
            static_cast<std::uint64_t>(counter) * 7919,
            {}};
  json exposed = owner.cmd("expose " + p.slot + (way == Way::read ? " readable " : " writable ") +
                           std::to_string(size) + " " + std::to_string(p.seed) + " " +
                           subject_of(p) + " " + std::to_string(owner_timeout_ms));
  EXPECT_TRUE(exposed.contains("meta")) << exposed.dump();
  p.meta = exposed.value("meta", std::string("{}"));
  return p;
}

/// The active half: begins by the owner's subject or, with `explicit_meta`, by the metadata
/// the owner printed (carried by the test, not NATS).
void begin(const Pairing& p, bool explicit_meta = false, int active_timeout_ms = 0) {
  const std::string how = explicit_meta ? "meta " + p.meta : "subject " + subject_of(p);
  json begun = p.active.cmd("begin " + p.slot + (p.way == Way::read ? " read " : " write ") +
                            std::to_string(p.size) + " " + std::to_string(p.seed) + " " +
                            std::to_string(active_timeout_ms) + " " + how);
  EXPECT_TRUE(begun.value("started", false)) << begun.dump();
}

/// Both halves.
Pairing start(Worker& owner, Worker& active, Way way, std::size_t size, bool explicit_meta = false,
              int owner_timeout_ms = 0, int active_timeout_ms = 0) {
  Pairing p = expose(owner, active, way, size, owner_timeout_ms);
  begin(p, explicit_meta, active_timeout_ms);
  return p;
}

json wait(Worker& w, const std::string& slot, int ms) {
  return w.cmd("wait " + slot + " " + std::to_string(ms), std::chrono::milliseconds(ms + 10000));
}

/// Waits for both sides and expects both complete by `method`, the destination's bytes
/// verified; then frees both.
void expect_complete(const Pairing& p, const std::string& method = "tcp", int limit_ms = 60000) {
  json a = wait(p.active, p.slot, limit_ms);
  json o = wait(p.owner, p.slot, limit_ms);
  const std::string what = std::string(way_name(p.way)) + " of " + std::to_string(p.size) +
                           " bytes, " + p.active.name() + " <- " + p.owner.name();
  EXPECT_EQ(a.value("status", ""), "complete") << what << ": active " << a.dump();
  EXPECT_EQ(o.value("status", ""), "complete") << what << ": owner " << o.dump();
  EXPECT_EQ(a.value("method", ""), method) << what << ": " << a.dump();
  // The destination checks the bytes: the reader's memory, or the writable's.
  const json& dest = p.way == Way::read ? a : o;
  EXPECT_EQ(dest.value("verify", ""), "ok") << what << ": " << dest.dump();
  p.active.cmd("drop " + p.slot);
  p.owner.cmd("drop " + p.slot);
}

/// Polls the owner until it has seen the claim (its operation in_progress): mid-transfer.
bool await_claimed(const Pairing& p, std::chrono::milliseconds limit = 20s) {
  const auto until = Clock::now() + limit;
  while (Clock::now() < until) {
    if (p.owner.cmd("status " + p.slot).value("status", "") == "in_progress") return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

/// Expects `w`'s operation `slot` to end within `limit_ms` of `since_ms` (steady_clock ms):
/// complete and verified where `may_complete`, else errored with `code` and a message naming
/// `peer`. Returns the outcome.
json expect_ends(Worker& w, const std::string& slot, long long since_ms, int limit_ms,
                 const std::string& code, const std::string& peer, bool may_complete = false) {
  json r = wait(w, slot, limit_ms + 2000);
  const std::string status = r.value("status", "");
  EXPECT_TRUE(status == "errored" || (may_complete && status == "complete"))
      << w.name() << ": " << r.dump();
  if (status == "complete") {
    EXPECT_EQ(r.value("verify", "").rfind("mismatch", 0), std::string::npos) << r.dump();
  } else if (status == "errored") {
    EXPECT_EQ(r.value("code", ""), code) << w.name() << ": " << r.dump();
    if (!peer.empty()) {
      EXPECT_NE(r.value("message", "").find(peer), std::string::npos)
          << w.name() << ": the error should name " << peer << ": " << r.dump();
    }
  }
  const long long ended = r.value("ended_ms", 0LL);
  std::cout << "[ lab      ] " << w.name() << " " << status << " " << r.value("code", "") << " "
            << (ended > 0 ? ended - since_ms : -1)
            << " ms after the fault: " << r.value("message", "") << std::endl;
  if (ended > 0) {
    EXPECT_LE(ended - since_ms, limit_ms)
        << w.name() << " ended " << ended - since_ms << " ms after the fault: " << r.dump();
  }
  return r;
}

struct Usage {
  long long fds = 0;
  long long rss_kb = 0;
};

Usage usage(Worker& w) {
  json s = w.cmd("stats");
  return {s.value("fds", 0LL), s.value("rss_kb", 0LL)};
}

/// Expects `w`'s descriptors and resident memory back at `base` (memory within 16 MiB: the
/// allocator's and the loop's own), waiting a little for connections being closed.
void expect_baseline(Worker& w, const Usage& base) {
  Usage now;
  const auto until = Clock::now() + 5s;
  do {
    now = usage(w);
    if (now.fds <= base.fds && now.rss_kb <= base.rss_kb + 16 * 1024) break;
    std::this_thread::sleep_for(100ms);
  } while (Clock::now() < until);
  EXPECT_LE(now.fds, base.fds) << w.name() << ": descriptors " << base.fds << " -> " << now.fds;
  EXPECT_LE(now.rss_kb, base.rss_kb + 16 * 1024)
      << w.name() << ": resident KiB " << base.rss_kb << " -> " << now.rss_kb;
  EXPECT_EQ(w.cmd("stats").value("live", -1), 0) << w.name() << ": operations still live";
}

class NetLab : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string why = netlab::missing_prerequisite(); !why.empty()) GTEST_SKIP() << why;
    lab_ = std::make_unique<Lab>(3, mtu_);
  }
  void TearDown() override {
    lab_.reset();
    const std::string mine = "ferrylab-" + std::to_string(::getpid()) + "-";
    for (const std::string& ns : netlab::lab_namespaces())
      EXPECT_NE(ns.rfind(mine, 0), 0u) << "left behind: " << ns;
  }

  /// Warms `w` up (a transfer each way with each of `peers`, so that every connection it
  /// keeps exists) and returns its usage then.
  Usage warm_baseline(Worker& w, const std::vector<Worker*>& peers) {
    for (Worker* peer : peers)
      for (Way way : {Way::read, Way::write}) {
        expect_complete(start(*peer, w, way, MiB));
        expect_complete(start(w, *peer, way, MiB));
      }
    return usage(w);
  }

  int mtu_ = 1500;
  std::unique_ptr<Lab> lab_;
};

// ---------------------------------------------------------------------------------------------
// Clean links: every size, both pairings, by subject through the cluster and by explicit
// metadata, at MTU 1500 and 9000.

class CleanLink : public NetLab, public ::testing::WithParamInterface<int> {
 protected:
  void SetUp() override {
    mtu_ = GetParam();
    NetLab::SetUp();
  }
};

TEST_P(CleanLink, EverySizeBothPairingsAcrossHosts) {
  Worker a(*lab_, 0, "alpha", steady());
  Worker b(*lab_, 1, "bravo", steady());
  Worker c(*lab_, 2, "charlie", steady());
  for (std::size_t size : {std::size_t{1}, 4 * KiB, MiB + 7, 64 * MiB, 256 * MiB}) {
    SCOPED_TRACE("size " + std::to_string(size));
    // A reads B's readable; C writes A's writable: three hosts, three servers.
    expect_complete(start(b, a, Way::read, size));
    expect_complete(start(a, c, Way::write, size));
  }
  // By explicit metadata (no NATS between the two after the test carried it).
  expect_complete(start(c, b, Way::read, 4 * MiB + 1, true));
  expect_complete(start(b, c, Way::write, 4 * MiB + 1, true));
}

INSTANTIATE_TEST_SUITE_P(Mtu, CleanLink, ::testing::Values(1500, 9000),
                         [](const auto& p) { return "mtu" + std::to_string(p.param); });

// ---------------------------------------------------------------------------------------------
// Shaped links: host 1's links (NATS and data, both directions) through tc. The netem cases
// skip where sch_netem is missing; the rate-limited case (tbf) runs wherever tc does. Sizes stay
// small on lossy and slow links: TCP under 1 % loss and 20 ms RTT moves well under 1 MB/s.

struct Shape {
  const char* name;
  std::vector<std::string> qdisc;
  std::vector<std::size_t> sizes;
};

void PrintTo(const Shape& s, std::ostream* os) { *os << s.name; }

class ShapedLink : public NetLab, public ::testing::WithParamInterface<Shape> {};

TEST_P(ShapedLink, TransfersCompleteVerified) {
  const Shape& shape = GetParam();
  if (shape.qdisc.front() == "netem")
    if (std::string why = lab_->netem_missing(); !why.empty()) GTEST_SKIP() << why;
  Worker a(*lab_, 0, "alpha", steady());
  Worker b(*lab_, 1, "bravo", steady());
  lab_->shape(1, Net::both, shape.qdisc);
  for (std::size_t size : shape.sizes) {
    SCOPED_TRACE("size " + std::to_string(size));
    expect_complete(start(b, a, Way::read, size));
    expect_complete(start(b, a, Way::write, size));
    expect_complete(start(a, b, Way::read, size));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Tc, ShapedLink,
    ::testing::Values(
        Shape{"delay_1ms", {"netem", "delay", "1ms"}, {1, 64 * KiB, 16 * MiB, 64 * MiB}},
        Shape{"delay_10ms_jitter_2ms", {"netem", "delay", "10ms", "2ms"}, {1, 64 * KiB, 4 * MiB}},
        Shape{"loss_0_1pct", {"netem", "loss", "0.1%"}, {1, 64 * KiB, 4 * MiB}},
        Shape{"loss_1pct_delay_1ms", {"netem", "delay", "1ms", "loss", "1%"}, {1, 64 * KiB, MiB}},
        Shape{"reorder_25pct_delay_5ms",
              {"netem", "delay", "5ms", "reorder", "25%", "50%"},
              {1, 64 * KiB, 4 * MiB}},
        Shape{"rate_100mbit",
              {"tbf", "rate", "100mbit", "burst", "256kb", "latency", "200ms"},
              {1, 64 * KiB, 16 * MiB}}),
    [](const auto& p) { return std::string(p.param.name); });

// ---------------------------------------------------------------------------------------------
// cma: two processes in one namespace use it; across namespaces (one kernel, one PID namespace,
// but each network namespace has its own abstract Unix sockets) the peer's cma socket cannot be
// reached.

TEST_F(NetLab, CmaBetweenTwoProcessesOfOneHost) {
  WorkerOptions o = steady();
  o.transports = "tcp,cma";
  Worker a(*lab_, 0, "alpha", o);
  Worker a2(*lab_, 0, "alpha2", o);
  const json methods = a.ready()["methods"];
  if (std::find(methods.begin(), methods.end(), "cma") == methods.end())
    GTEST_SKIP() << "cma is not offered here: " << a.ready().dump();
  for (std::size_t size : {std::size_t{1}, MiB + 3, 64 * MiB}) {
    SCOPED_TRACE("size " + std::to_string(size));
    expect_complete(start(a2, a, Way::read, size), "cma");
    expect_complete(start(a2, a, Way::write, size), "cma");
  }
}

TEST_F(NetLab, CmaAcrossNamespacesFallsBackToTcp) {
  WorkerOptions o = steady();
  o.transports = "tcp,cma";
  Worker a(*lab_, 0, "alpha", o);
  Worker b(*lab_, 1, "bravo", o);
  const json methods = a.ready()["methods"];
  if (std::find(methods.begin(), methods.end(), "cma") == methods.end())
    GTEST_SKIP() << "cma is not offered here: " << a.ready().dump();
  for (int round = 0; round < 2; ++round)
    for (Way way : {Way::read, Way::write}) expect_complete(start(b, a, way, MiB + 5), "tcp");
  std::cout << "[ lab      ] alpha's stats: " << a.cmd("stats")["ferry"].dump() << std::endl;
}

TEST_F(NetLab, CmaOnlyAcrossNamespacesFailsNamingThePeer) {
  WorkerOptions o;
  o.transports = "cma";
  Worker a(*lab_, 0, "alpha", o);
  Worker b(*lab_, 1, "bravo", o);
  const json methods = a.ready()["methods"];
  if (std::find(methods.begin(), methods.end(), "cma") == methods.end())
    GTEST_SKIP() << "cma is not offered here: " << a.ready().dump();
  for (Way way : {Way::read, Way::write}) {
    Pairing p = start(b, a, way, MiB, false, 5000);
    const long long t0 = now_ms();
    json r = expect_ends(a, p.slot, t0, kSlackMs, "NoCommonMethod", "bravo");
    // What cma does across network namespaces (docs/testing.md): the owner's endpoint is an
    // abstract Unix socket, which exists only in the owner's network namespace. Its metadata
    // names that namespace, so the active side passes cma over at once, saying why, and tries
    // no connect (before: a refused connect, ECONNREFUSED, and PeerLost).
    EXPECT_NE(r.value("message", "").find("another network namespace"), std::string::npos)
        << r.dump();
    // The owner, never claimed, is told over NATS how its peer ended, naming it.
    expect_ends(b, p.slot, t0, kSlackMs, "NoCommonMethod", "alpha");
    a.cmd("drop " + p.slot);
    b.cmd("drop " + p.slot);
  }
}

// ---------------------------------------------------------------------------------------------
// Faults.

class Fault : public NetLab, public ::testing::WithParamInterface<Way> {};

std::string way_param(const ::testing::TestParamInfo<Way>& p) {
  return p.param == Way::read ? "Read" : "Write";
}

// Host 1 is cut off (both links down at the switch) while a 32 MiB transfer with host 0 runs;
// both sides end PeerLost within peer_timeout + slack; healed, nothing more lands in the failed
// operation's destination, the two pair again and transfer, and both workers are back at their
// baseline.
TEST_P(Fault, PartitionMidTransferThenHeal) {
  Worker a(*lab_, 0, "alpha");
  Worker b(*lab_, 1, "bravo");
  Worker c(*lab_, 2, "charlie");
  const Usage base = warm_baseline(a, {&b, &c});
  const Usage base_b = usage(b);
  lab_->shape(1, Net::data, kSlowLink);
  Pairing p = start(b, a, GetParam(), 32 * MiB);
  ASSERT_TRUE(await_claimed(p)) << "the owner never saw the claim";
  lab_->set_link(1, Net::both, false);
  const long long t0 = now_ms();
  expect_ends(a, p.slot, t0, kPeerTimeoutMs + kSlackMs, "PeerLost", "bravo");
  expect_ends(b, p.slot, t0, kPeerTimeoutMs + kSlackMs, "PeerLost", "alpha");
  // Healed with the failed operations still held: whatever the two kernels retransmit once
  // the link is back, no byte lands in the destination after its operation failed.
  Worker& dest = GetParam() == Way::read ? a : b;
  const std::string before = dest.cmd("hash " + p.slot).value("hash", "");
  lab_->set_link(1, Net::both, true);
  lab_->shape(1, Net::data, {});
  lab_->await_cluster();
  std::this_thread::sleep_for(1500ms);
  EXPECT_EQ(dest.cmd("hash " + p.slot).value("hash", ""), before)
      << dest.name() << ": the destination changed after its operation failed";
  a.cmd("drop " + p.slot);
  b.cmd("drop " + p.slot);
  for (Way way : {Way::read, Way::write}) expect_complete(start(b, a, way, 8 * MiB));
  expect_complete(start(c, a, Way::read, 8 * MiB));
  expect_baseline(a, base);
  expect_baseline(b, base_b);
}

// A partition between two hosts only: host 1's links drop the IPv4 packets from and to host
// 0's addresses (as a firewall's drop rule between the two would; played by the userspace wire,
// since this kernel has no drop action), while host 2 still reaches both. Under a 32 MiB
// transfer between hosts 0 and 1, both sides end PeerLost naming each other; meanwhile host 2
// pairs with both, both ways, by subject (its server routes to both, though the route between
// the other two is cut); healed, hosts 0 and 1 pair again and transfer, back at their baseline.
TEST_P(Fault, PartitionBetweenTwoHostsOnly) {
  if (std::string why = Lab::wire_missing(); !why.empty()) GTEST_SKIP() << why;
  lab_->wire_command(1, Net::both, "reset");  // host 1's links become wires first
  lab_->await_cluster();
  Worker a(*lab_, 0, "alpha");
  Worker b(*lab_, 1, "bravo");
  Worker c(*lab_, 2, "charlie");
  const Usage base = warm_baseline(a, {&b, &c});
  const Usage base_b = usage(b);
  lab_->wire_command(1, Net::data, "rate 80mbit");  // so that the transfer is still running
  Pairing p = start(b, a, GetParam(), 32 * MiB);
  ASSERT_TRUE(await_claimed(p)) << "the owner never saw the claim";
  lab_->wire_command(1, Net::both, "block " + lab_->nats_ip(0) + " block " + lab_->data_ip(0));
  const long long t0 = now_ms();
  expect_ends(a, p.slot, t0, kPeerTimeoutMs + kSlackMs, "PeerLost", "bravo");
  expect_ends(b, p.slot, t0, kPeerTimeoutMs + kSlackMs, "PeerLost", "alpha");
  a.cmd("drop " + p.slot);
  b.cmd("drop " + p.slot);
  lab_->wire_command(1, Net::data, "rate 0bit");
  for (Way way : {Way::read, Way::write}) {
    expect_complete(start(c, a, way, 4 * MiB));
    expect_complete(start(c, b, way, 4 * MiB));
  }
  lab_->wire_command(1, Net::both, "unblock " + lab_->nats_ip(0) + " unblock " + lab_->data_ip(0));
  // Healed: the route between the servers of hosts 0 and 1 resumes at TCP's next
  // retransmission (whose backoff grew while its packets were dropped); the two pair again.
  bool paired = false;
  for (const auto until = Clock::now() + 30s; !paired && Clock::now() < until;) {
    Pairing q = start(b, a, Way::read, MiB);
    paired = wait(a, q.slot, 5000).value("status", "") == "complete";
    a.cmd("drop " + q.slot);
    b.cmd("drop " + q.slot);
  }
  ASSERT_TRUE(paired) << "hosts 0 and 1 did not pair again within 30 s of the heal";
  for (Way way : {Way::read, Way::write}) expect_complete(start(b, a, way, 8 * MiB));
  expect_baseline(a, base);
  expect_baseline(b, base_b);
}

// Host 1 is cut off under a 32 MiB transfer and both sides cancel at once (the handles
// destroyed): cancel() returns within peer_timeout on both (a few ms here), without waiting for
// the unreachable peer; healed, the hosts transfer, back at their baseline.
TEST_P(Fault, CancelDuringPartitionReturnsPromptly) {
  Worker a(*lab_, 0, "alpha");
  Worker b(*lab_, 1, "bravo");
  const Usage base = warm_baseline(a, {&b});
  const Usage base_b = usage(b);
  lab_->shape(1, Net::data, kSlowLink);
  Pairing p = start(b, a, GetParam(), 32 * MiB);
  ASSERT_TRUE(await_claimed(p)) << "the owner never saw the claim";
  lab_->set_link(1, Net::both, false);
  for (Worker* w : {&a, &b}) {
    const auto t0 = Clock::now();
    json s = w->cmd("status " + p.slot);
    EXPECT_EQ(s.value("status", ""), "in_progress") << w->name() << ": " << s.dump();
    w->cmd("drop " + p.slot);
    const auto took =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
    std::cout << "[ lab      ] " << w->name() << " cancelled in " << took << " ms" << std::endl;
    EXPECT_LT(took, kPeerTimeoutMs) << w->name() << ": cancel() waited for the lost peer";
  }
  lab_->set_link(1, Net::both, true);
  lab_->shape(1, Net::data, {});
  lab_->await_cluster();
  for (Way way : {Way::read, Way::write}) expect_complete(start(b, a, way, 4 * MiB));
  expect_baseline(a, base);
  expect_baseline(b, base_b);
}

// Host 1 loses power mid-transfer: its links go dark, then every process in it (workers and
// nats-server) is SIGKILLed, so no FIN or RST ever leaves it. Host 0's side ends PeerLost
// naming the peer; host 0 goes on with host 2, through the rest of the cluster, and with a new
// worker on host 1 once its power is back.
TEST_P(Fault, PowerLossOfTheOtherHost) {
  Worker a(*lab_, 0, "alpha");
  Worker b(*lab_, 1, "bravo");
  Worker c(*lab_, 2, "charlie");
  const Usage base = warm_baseline(a, {&b, &c});
  lab_->shape(1, Net::data, kSlowLink);
  // Host 0 is the reader of host 1's readable, or the owner of the writable host 1 writes.
  Pairing p = GetParam() == Way::read ? start(b, a, Way::read, 32 * MiB)
                                      : start(a, b, Way::write, 32 * MiB);
  ASSERT_TRUE(await_claimed(p)) << "the owner never saw the claim";
  lab_->set_link(1, Net::both, false);
  b.kill(SIGKILL);
  lab_->kill_nats(1);
  const long long t0 = now_ms();
  expect_ends(a, p.slot, t0, kPeerTimeoutMs + kSlackMs, "PeerLost", "bravo");
  a.cmd("drop " + p.slot);
  for (Way way : {Way::read, Way::write}) {
    expect_complete(start(c, a, way, 8 * MiB));
    expect_complete(start(a, c, way, 8 * MiB));
  }
  expect_baseline(a, base);
  // Power back: host 1's server rejoins, a new worker there (same address, a new listener)
  // pairs with host 0 both ways.
  lab_->set_link(1, Net::both, true);
  lab_->shape(1, Net::data, {});
  lab_->start_nats(1);
  lab_->await_cluster();
  Worker b2(*lab_, 1, "bravo2");
  for (Way way : {Way::read, Way::write}) {
    expect_complete(start(b2, a, way, 4 * MiB));
    expect_complete(start(a, b2, way, 4 * MiB));
  }
}

// Host 0's nats-server is killed mid-transfer. Its worker was given every server's URL: it
// reconnects to another, the transfer (on the data path) completes, an operation it exposed
// before the failover is paired after it, and pairing by subject with hosts 1 and 2 goes on
// through the cluster.
TEST_F(NetLab, NatsServerKilledClusterFailoverHolds) {
  Worker a(*lab_, 0, "alpha");
  Worker b(*lab_, 1, "bravo");
  Worker c(*lab_, 2, "charlie");
  const Usage base = warm_baseline(a, {&b, &c});
  // Exposed before the failover, paired after it: alpha's subscription to its subject must
  // follow it to its new server.
  Pairing early = expose(a, c, Way::write, 4 * MiB);
  lab_->shape(1, Net::data, kSlowLink);
  Pairing p = start(b, a, Way::read, 32 * MiB);
  ASSERT_TRUE(await_claimed(p));
  lab_->kill_nats(0);
  // Connected again, to another server (the state may read connected to the dead one for a
  // moment, until the closed socket is noticed).
  const auto killed = Clock::now();
  json s;
  do {
    s = a.cmd("stats");
    if (s.value("side_channel", "") == "connected" &&
        s.value("detail", "").find(lab_->nats_ip(0)) == std::string::npos)
      break;
    std::this_thread::sleep_for(20ms);
  } while (Clock::now() - killed < 10s);
  EXPECT_EQ(s.value("side_channel", ""), "connected") << s.dump();
  EXPECT_EQ(s.value("detail", "").find(lab_->nats_ip(0)), std::string::npos)
      << "still on the dead server: " << s.dump();
  std::cout << "[ lab      ] alpha reconnected to " << s.value("detail", "") << " in "
            << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - killed).count()
            << " ms" << std::endl;
  expect_complete(p);
  begin(early);
  expect_complete(early);
  lab_->shape(1, Net::data, {});
  for (Way way : {Way::read, Way::write}) {
    expect_complete(start(b, a, way, 4 * MiB));
    expect_complete(start(a, c, way, 4 * MiB));
  }
  expect_baseline(a, base);
  // The server comes back and rejoins the cluster; workers that start there pair through it.
  lab_->start_nats(0);
  lab_->await_cluster();
  Worker a2(*lab_, 0, "alpha2");
  expect_complete(start(c, a2, Way::read, MiB));
  expect_complete(start(a2, b, Way::write, MiB));
}

// The server a worker is connected to (on another host) is cut off silently: its NATS link
// goes dark, no FIN or RST. The worker has every server's URL; it should notice and fail over
// to another server, and pair by subject through it, within a bounded time (10 s here;
// FERRY_NET_FAILOVER_LIMIT_S=N waits longer, to measure).
//
// NatsOptions::ping_interval and max_pings_out bound the time to notice (about 15 s by
// default; 1 s and 2 here, about 3 s). Before they were set, cnats' defaults (a PING every 2
// minutes, stale after 2 unanswered) left the worker on the dead server for 360 s, every
// pairing by subject ending Timeout meanwhile.
TEST_F(NetLab, NatsServerSilentlyCutOffFailsOver) {
  WorkerOptions o;
  o.nats_host = 1;  // alpha, on host 0, talks to host 1's server first
  o.nats_ping_ms = 1000;
  Worker a(*lab_, 0, "alpha", o);
  Worker c(*lab_, 2, "charlie");
  expect_complete(start(c, a, Way::read, MiB));
  EXPECT_NE(a.cmd("stats").value("detail", "").find(lab_->nats_ip(1)), std::string::npos);
  const char* limit_env = std::getenv("FERRY_NET_FAILOVER_LIMIT_S");
  const std::chrono::seconds failover_limit(limit_env != nullptr ? std::atoi(limit_env) : 10);
  lab_->set_link(1, Net::nats, false);
  const auto cut = Clock::now();
  json s;
  do {
    s = a.cmd("stats");
    if (s.value("side_channel", "") == "connected" &&
        s.value("detail", "").find(lab_->nats_ip(1)) == std::string::npos)
      break;
    std::this_thread::sleep_for(100ms);
  } while (Clock::now() - cut < failover_limit);
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - cut);
  std::cout << "[ lab      ] alpha " << took.count()
            << " ms after the cut: " << s.value("side_channel", "") << " " << s.value("detail", "")
            << std::endl;
  EXPECT_EQ(s.value("detail", "").find(lab_->nats_ip(1)), std::string::npos)
      << "still on the cut-off server " << took.count()
      << " ms after the cut: " << s.value("side_channel", "") << " " << s.value("detail", "");
  expect_complete(start(c, a, Way::read, MiB));
  expect_complete(start(a, c, Way::write, MiB));
}

// Host 1's data link goes down and up (0.2 s down, 0.3 s up, 8 times) under a 16 MiB
// transfer: the transfer ends, complete with its bytes verified or PeerLost naming the peer,
// never later than peer_timeout + slack after the last flap; afterwards the hosts transfer.
TEST_F(NetLab, LinkFlappingUnderATransfer) {
  Worker a(*lab_, 0, "alpha");
  Worker b(*lab_, 1, "bravo");
  const Usage base = warm_baseline(a, {&b});
  const Usage base_b = usage(b);
  lab_->shape(1, Net::data, kSlowLink);
  Pairing r = start(b, a, Way::read, 16 * MiB);
  Pairing w = start(b, a, Way::write, 16 * MiB);
  ASSERT_TRUE(await_claimed(r));
  for (int i = 0; i < 8; ++i) {
    lab_->set_link(1, Net::data, false);
    std::this_thread::sleep_for(200ms);
    lab_->set_link(1, Net::data, true);
    std::this_thread::sleep_for(300ms);
  }
  const long long t0 = now_ms();
  for (const Pairing* p : {&r, &w}) {
    json act = expect_ends(a, p->slot, t0, 60000, "PeerLost", "bravo", true);
    json own = expect_ends(b, p->slot, t0, 60000, "PeerLost", "alpha", true);
    std::cout << "after flapping, " << way_name(p->way) << ": active " << act.dump() << "; owner "
              << own.dump() << "\n";
    // A completed destination holds every byte (never a retry into corrupt memory).
    const json& dest = p->way == Way::read ? act : own;
    if (dest.value("status", "") == "complete") {
      EXPECT_EQ(dest.value("verify", ""), "ok") << dest.dump();
    }
    a.cmd("drop " + p->slot);
    b.cmd("drop " + p->slot);
  }
  lab_->shape(1, Net::data, {});
  for (Way way : {Way::read, Way::write}) expect_complete(start(b, a, way, 4 * MiB));
  expect_baseline(a, base);
  expect_baseline(b, base_b);
}

// A cut well under peer_timeout (host 1's data link down for 0.3 s, peer_timeout 3 s) under a
// transfer each way is ridden out: TCP retransmits once the link is back (its backoff from the
// 200 ms minimum leaves at most about 1.4 s of silence), and both transfers complete with their
// bytes verified.
TEST_F(NetLab, BriefCutIsRiddenOut) {
  WorkerOptions o;
  o.peer_timeout_ms = 3000;
  Worker a(*lab_, 0, "alpha", o);
  Worker b(*lab_, 1, "bravo", o);
  lab_->shape(1, Net::data, kSlowLink);
  Pairing r = start(b, a, Way::read, 16 * MiB);
  Pairing w = start(b, a, Way::write, 16 * MiB);
  ASSERT_TRUE(await_claimed(r));
  ASSERT_TRUE(await_claimed(w));
  lab_->set_link(1, Net::data, false);
  std::this_thread::sleep_for(300ms);
  lab_->set_link(1, Net::data, true);
  expect_complete(r);
  expect_complete(w);
}

// The side channel reaches host 1 but its data path does not (its data link down, its NATS
// link up): pairing by subject finds the metadata, and the active side then fails PeerLost
// naming the owner within peer_timeout + slack; the owner, never claimed, hears of it over
// NATS and ends PeerLost naming the reader or writer. Healed, they transfer.
TEST_P(Fault, NatsUpDataPathDown) {
  Worker a(*lab_, 0, "alpha");
  Worker b(*lab_, 1, "bravo");
  const Usage base = warm_baseline(a, {&b});
  const Usage base_b = usage(b);
  lab_->set_link(1, Net::data, false);
  Pairing p = start(b, a, GetParam(), 4 * MiB, false, 6000);
  const long long t0 = now_ms();
  expect_ends(a, p.slot, t0, kPeerTimeoutMs + kSlackMs, "PeerLost", "bravo");
  // The owner is told over NATS how its peer ended (before its own deadline).
  expect_ends(b, p.slot, t0, kPeerTimeoutMs + kSlackMs, "PeerLost", "alpha");
  a.cmd("drop " + p.slot);
  b.cmd("drop " + p.slot);
  lab_->set_link(1, Net::data, true);
  for (Way way : {Way::read, Way::write}) expect_complete(start(b, a, way, 4 * MiB));
  expect_baseline(a, base);
  expect_baseline(b, base_b);
}

// The data path reaches host 1 but the side channel does not (its NATS link down: its server
// cut from the cluster): pairing by explicit metadata still completes both sides; pairing by
// subject ends Timeout naming the subject. Healed, pairing by subject works again.
TEST_P(Fault, DataPathUpNatsDown) {
  Worker a(*lab_, 0, "alpha");
  Worker b(*lab_, 1, "bravo");
  const Usage base = warm_baseline(a, {&b});
  const Usage base_b = usage(b);
  lab_->set_link(1, Net::nats, false);
  expect_complete(start(b, a, GetParam(), 4 * MiB, true));
  Pairing p = start(b, a, GetParam(), 4 * MiB, false, 3000, 3000);
  const long long t0 = now_ms();
  json r = expect_ends(a, p.slot, t0, 3000 + kSlackMs, "Timeout", "lab.op.");
  expect_ends(b, p.slot, t0, 3000 + kSlackMs, "Timeout", "");
  a.cmd("drop " + p.slot);
  b.cmd("drop " + p.slot);
  lab_->set_link(1, Net::nats, true);
  lab_->await_cluster();
  for (Way way : {Way::read, Way::write}) expect_complete(start(b, a, way, 4 * MiB));
  expect_baseline(a, base);
  expect_baseline(b, base_b);
}

INSTANTIATE_TEST_SUITE_P(BothPairings, Fault, ::testing::Values(Way::read, Way::write), way_param);

}  // namespace
}  // namespace ferry
