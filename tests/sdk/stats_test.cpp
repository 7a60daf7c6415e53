// Connector::stats(): the histogram's arithmetic, and what a connector counts for operations
// that complete, fail and are cancelled.
#include <gtest/gtest.h>

#include <ferry/ferry.hpp>

#include <thread>

#include <nlohmann/json.hpp>

#include <chrono>
#include <random>
#include <vector>

#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using test::buffer;
using test::patterned;

constexpr auto kWait = std::chrono::seconds(60);

TEST(LatencyHistogram, EmptyReadsZero) {
  LatencyHistogram h;
  EXPECT_EQ(h.count(), 0u);
  EXPECT_EQ(h.percentile_us(0.5), 0);
  EXPECT_EQ(h.mean_us(), 0);
}

TEST(LatencyHistogram, MinMaxAndMeanAreExact) {
  LatencyHistogram h;
  h.record(3us);
  h.record(1000us);
  h.record(41us);
  EXPECT_EQ(h.count(), 3u);
  EXPECT_DOUBLE_EQ(h.min_us(), 3);
  EXPECT_DOUBLE_EQ(h.max_us(), 1000);
  EXPECT_DOUBLE_EQ(h.mean_us(), (3 + 1000 + 41) / 3.0);
}

// Against the exact percentiles of a sorted sample: within the buckets' 1/8 of a power of two.
TEST(LatencyHistogram, PercentilesWithinTheBucketResolution) {
  std::mt19937_64 rng(7);
  std::lognormal_distribution<double> dist(std::log(50'000.0), 1.5);  // ns, median 50 us
  std::vector<std::int64_t> samples;
  LatencyHistogram h;
  for (int i = 0; i < 20000; ++i) {
    auto ns = static_cast<std::int64_t>(dist(rng));
    samples.push_back(ns);
    h.record(std::chrono::nanoseconds(ns));
  }
  std::sort(samples.begin(), samples.end());
  for (double q : {0.01, 0.5, 0.9, 0.99, 0.999}) {
    const double exact =
        static_cast<double>(
            samples[static_cast<std::size_t>(q * static_cast<double>(samples.size())) - 1]) /
        1e3;
    EXPECT_NEAR(h.percentile_us(q), exact, exact * 0.125) << "q=" << q;
  }
  EXPECT_DOUBLE_EQ(h.percentile_us(1.0), h.max_us());
  EXPECT_DOUBLE_EQ(h.percentile_us(0.0), h.min_us());
}

TEST(LatencyHistogram, HugeAndNegativeDurationsStayInRange) {
  LatencyHistogram h;
  h.record(std::chrono::hours(24 * 365));
  h.record(-5ns);
  EXPECT_EQ(h.count(), 2u);
  EXPECT_DOUBLE_EQ(h.min_us(), 0);
  EXPECT_GT(h.percentile_us(1.0), 3e13);
}

TEST(LatencyHistogram, MergeAddsEverySample) {
  LatencyHistogram a, b;
  for (int i = 1; i <= 100; ++i) a.record(std::chrono::microseconds(i));
  for (int i = 101; i <= 200; ++i) b.record(std::chrono::microseconds(i));
  a.merge(b);
  EXPECT_EQ(a.count(), 200u);
  EXPECT_DOUBLE_EQ(a.max_us(), 200);
  EXPECT_NEAR(a.percentile_us(0.5), 100, 100 * 0.125);
}

const MethodStats* find(const ConnectorStats& s, const std::string& method) {
  for (const auto& m : s.methods)
    if (m.method == method) return &m;
  return nullptr;
}

// `peer` reads `size` patterned bytes from a readable of `owner`; both sides must complete.
// Sets `method` to the method it moved by. Call through ASSERT_NO_FATAL_FAILURE.
void read_once(Connector& owner, Connector& peer, std::size_t size, std::string* method = nullptr) {
  auto src = patterned(size, 1);
  auto dst = buffer(size);
  auto readable = owner.create_readable({Descriptor(src.data(), size)});
  auto read = peer.begin_read(readable.metadata(), {Descriptor(dst.data(), size)});
  ASSERT_TRUE(read.wait_for_completion(kWait));
  ASSERT_TRUE(readable.wait_for_completion(kWait));
  if (method != nullptr) *method = read.method();
}

TEST(ConnectorStats, CountsCompletedOperationsByMethodOnBothSides) {
  Connector owner(test::named("owner"));
  Connector peer(test::named("peer"));
  constexpr std::size_t kSize = 4096 + 17;
  std::string method;  // the best this host offers: cma or tcp
  for (int i = 0; i < 5; ++i) ASSERT_NO_FATAL_FAILURE(read_once(owner, peer, kSize, &method));
  const ConnectorStats p = peer.stats();
  const MethodStats* m = find(p, method);
  ASSERT_NE(m, nullptr) << p.to_text();
  EXPECT_EQ(m->complete.operations, 5u);
  EXPECT_EQ(m->complete.bytes, 5 * kSize);
  EXPECT_EQ(m->latency.count(), 5u);
  EXPECT_GT(m->latency.min_us(), 0);
  EXPECT_EQ(p.active, 5u);
  EXPECT_EQ(p.passive, 0u);
  EXPECT_EQ(p.live, 0u);
  EXPECT_EQ(p.latency.count(), 5u);

  // The owner's side: passive, ended once its peer had read everything.
  const ConnectorStats o = owner.stats();
  ASSERT_NE(find(o, method), nullptr) << o.to_text();
  EXPECT_EQ(find(o, method)->complete.operations, 5u);
  EXPECT_EQ(o.passive, 5u);
  EXPECT_EQ(o.live, 0u);
}

// The passive side's latency includes the wait for its peer: stats report the wait and the
// transfer apart (issue 21: a passive operation's p50 read as slow when its peer came late).
TEST(ConnectorStats, APassiveOperationsWaitForItsPeerIsApartFromItsTransfer) {
  Connector owner(test::named("owner"));
  Connector peer(test::named("peer"));
  constexpr std::size_t kSize = 4096;
  auto src = patterned(kSize, 1);
  auto dst = buffer(kSize);
  auto readable = owner.create_readable({Descriptor(src.data(), kSize)});
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the peer comes late
  auto read = peer.begin_read(readable.metadata(), {Descriptor(dst.data(), kSize)});
  ASSERT_TRUE(read.wait_for_completion(kWait));
  ASSERT_TRUE(readable.wait_for_completion(kWait));

  const ConnectorStats o = owner.stats();
  const MethodStats* m = find(o, read.method());
  ASSERT_NE(m, nullptr) << o.to_text();
  ASSERT_EQ(m->wait.count(), 1u) << o.to_text();
  ASSERT_EQ(m->transfer.count(), 1u);
  EXPECT_GE(m->wait.min_us(), 300000.0);
  EXPECT_LT(m->transfer.max_us(), m->wait.min_us());
  EXPECT_NEAR(m->latency.max_us(), m->wait.max_us() + m->transfer.max_us(), 1.0);
  EXPECT_EQ(o.wait.count(), 1u);
  EXPECT_NE(o.to_text().find("wait p50"), std::string::npos);
  EXPECT_NE(o.to_json().find("\"transfer\""), std::string::npos);

  // The active side waits for nobody: its transfer is its latency, and it has no wait.
  const ConnectorStats p = peer.stats();
  const MethodStats* a = find(p, read.method());
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->wait.count(), 0u);
  EXPECT_EQ(a->transfer.count(), 1u);
  EXPECT_DOUBLE_EQ(a->transfer.max_us(), a->latency.max_us());
}

TEST(ConnectorStats, CountsCancelledAndErroredApartWithoutLatency) {
  Connector owner(test::named("owner"));
  auto mem = buffer(64);
  {
    auto never_claimed = owner.create_readable({Descriptor(mem.data(), mem.size())});
    EXPECT_EQ(owner.stats().live, 1u);
    never_claimed.cancel();
  }
  OperationOptions quick;
  quick.timeout = 20ms;
  auto timed_out = owner.create_writable({Descriptor(mem.data(), mem.size())}, quick);
  EXPECT_THROW(timed_out.wait_for_completion(), Error);
  const ConnectorStats s = owner.stats();
  const MethodStats* none = find(s, "none");
  ASSERT_NE(none, nullptr) << s.to_text();
  EXPECT_EQ(none->cancelled.operations, 1u);
  EXPECT_EQ(none->errored.operations, 1u);
  EXPECT_EQ(none->errored.bytes, 64u);
  EXPECT_EQ(none->complete.operations, 0u);
  EXPECT_EQ(none->latency.count(), 0u);
  EXPECT_EQ(s.latency.count(), 0u);
  EXPECT_EQ(s.passive, 2u);
  EXPECT_EQ(s.live, 0u);
}

TEST(ConnectorStats, TextAndJsonCarryTheSameNumbers) {
  Connector owner(test::named("owner"));
  Connector peer(test::named("peer"));
  auto src = patterned(1000, 3);
  auto dst = buffer(1000);
  auto writable = owner.create_writable({Descriptor(dst.data(), dst.size())});
  auto write = peer.begin_write({Descriptor(src.data(), src.size())}, writable.metadata());
  ASSERT_TRUE(write.wait_for_completion(kWait));
  const ConnectorStats s = peer.stats();
  const auto j = nlohmann::json::parse(s.to_json());
  ASSERT_EQ(j.at("methods").size(), 1u);
  EXPECT_EQ(j["methods"][0]["method"], write.method());
  EXPECT_EQ(j["methods"][0]["complete"]["operations"], 1);
  EXPECT_EQ(j["methods"][0]["complete"]["bytes"], 1000);
  EXPECT_EQ(j["latency"]["count"], 1);
  EXPECT_EQ(j["active"], 1);
  const std::string text = s.to_text();
  EXPECT_NE(text.find(write.method()), std::string::npos) << text;
  EXPECT_NE(text.find("1000 B"), std::string::npos) << text;
}

TEST(LatencyHistogram, CountAtMostIsCumulativeAndAgreesWithTheSamples) {
  LatencyHistogram h;
  for (auto d : {5us, 50us, 500us, 5000us, 50000us}) h.record(d);
  EXPECT_EQ(h.count_at_most(1us), 0u);
  EXPECT_EQ(h.count_at_most(10us), 1u);
  EXPECT_EQ(h.count_at_most(100us), 2u);
  EXPECT_EQ(h.count_at_most(1ms), 3u);
  EXPECT_EQ(h.count_at_most(10ms), 4u);
  EXPECT_EQ(h.count_at_most(1s), 5u);
  EXPECT_NEAR(h.sum_seconds(), 0.055555, 1e-9);
  // Monotonic over a fine sweep.
  std::uint64_t last = 0;
  for (std::int64_t ns = 1; ns < 100'000'000; ns = ns * 11 / 10 + 1) {
    const std::uint64_t n = h.count_at_most(std::chrono::nanoseconds(ns));
    EXPECT_GE(n, last) << ns;
    last = n;
  }
}

// Kind, role and direction: a read and a write between two connectors, seen from both.
TEST(ConnectorStats, SplitsByKindRoleAndDirectionAndNamesThePeer) {
  Connector owner(test::named("owner"));
  Connector peer(test::named("peer"));
  std::string method;
  ASSERT_NO_FATAL_FAILURE(read_once(owner, peer, 3000, &method));
  auto into = buffer(700);
  auto from = patterned(700, 2);
  auto writable = owner.create_writable({Descriptor(into.data(), into.size())});
  auto write = peer.begin_write({Descriptor(from.data(), from.size())}, writable.metadata());
  ASSERT_TRUE(write.wait_for_completion(kWait));
  ASSERT_TRUE(writable.wait_for_completion(kWait));

  // The peer read 3000 bytes in and wrote 700 out; the owner the other way round.
  const ConnectorStats p = peer.stats();
  EXPECT_EQ(p.bytes_in, 3000u) << p.to_text();
  EXPECT_EQ(p.bytes_out, 700u);
  const ConnectorStats o = owner.stats();
  EXPECT_EQ(o.bytes_in, 700u) << o.to_text();
  EXPECT_EQ(o.bytes_out, 3000u);
  const MethodStats* m = find(p, method);
  ASSERT_NE(m, nullptr);
  ASSERT_EQ(m->counts.size(), 2u);
  for (const OperationCount& c : m->counts) {
    EXPECT_FALSE(c.passive);
    EXPECT_EQ(c.outcome, OperationStatus::complete);
    EXPECT_EQ(c.operations, 1u);
    EXPECT_EQ(c.bytes, c.kind == OperationKind::read ? 3000u : 700u);
  }
  const MethodStats* om = find(o, method);
  ASSERT_NE(om, nullptr);
  for (const OperationCount& c : om->counts) EXPECT_TRUE(c.passive);
  // Each knows the other as its peer, with the bytes each way.
  ASSERT_EQ(p.peers.size(), 1u);
  EXPECT_EQ(p.peers[0].name, "owner");
  EXPECT_EQ(p.peers[0].id, owner.identity().id);
  EXPECT_EQ(p.peers[0].operations, 2u);
  EXPECT_EQ(p.peers[0].bytes_in, 3000u);
  EXPECT_EQ(p.peers[0].bytes_out, 700u);
  ASSERT_EQ(o.peers.size(), 1u);
  EXPECT_EQ(o.peers[0].id, peer.identity().id);
  EXPECT_EQ(o.peers[0].bytes_in, 700u);
  // The connection each holds, counted for its method; 0 for the methods unused.
  std::uint64_t held = 0;
  for (const auto& [name, n] : p.connections) {
    if (name == method)
      held = n;
    else
      EXPECT_EQ(n, 0u) << name;
  }
  EXPECT_GE(held, 1u) << p.to_text();
  const auto j = nlohmann::json::parse(p.to_json());
  EXPECT_EQ(j["bytes_in"], 3000);
  EXPECT_EQ(j["peers"][0]["id"], owner.identity().id);
  EXPECT_EQ(j["connections"][method], held);
}

TEST(ConnectorStats, CountsErrorsByCode) {
  Connector owner(test::named("owner"));
  auto mem = buffer(64);
  {
    auto never_claimed = owner.create_readable({Descriptor(mem.data(), mem.size())});
    never_claimed.cancel();
  }
  OperationOptions quick;
  quick.timeout = 20ms;
  for (int i = 0; i < 2; ++i) {
    auto timed_out = owner.create_writable({Descriptor(mem.data(), mem.size())}, quick);
    EXPECT_THROW(timed_out.wait_for_completion(), Error);
  }
  const ConnectorStats s = owner.stats();
  ASSERT_EQ(s.errors.size(), 2u) << s.to_text();
  EXPECT_EQ(s.errors[0].code, ErrorCode::Timeout);  // ordered by code
  std::uint64_t timeouts = 0;
  std::uint64_t cancels = 0;
  for (const ErrorCount& e : s.errors) {
    if (e.code == ErrorCode::Timeout) timeouts = e.operations;
    if (e.code == ErrorCode::Cancelled) cancels = e.operations;
  }
  EXPECT_EQ(timeouts, 2u);
  EXPECT_EQ(cancels, 1u);
  const MethodStats* none = find(s, "none");
  ASSERT_NE(none, nullptr);
  EXPECT_EQ(none->errors.size(), 2u);
  EXPECT_NE(s.to_text().find("Timeout 2"), std::string::npos) << s.to_text();
  EXPECT_EQ(nlohmann::json::parse(s.to_json())["errors"]["Timeout"], 2);
  // Split by outcome too: the writables errored, the readable was cancelled.
  for (const OperationCount& c : none->counts)
    EXPECT_EQ(c.outcome, c.kind == OperationKind::write ? OperationStatus::errored
                                                        : OperationStatus::cancelled);
}

// A method refused at set-up falls back to the next: counted for the refusing method.
TEST(ConnectorStats, CountsSetUpFallbacks) {
  Connector owner(test::named("owner"));
  Connector reader(test::named("reader"));
  auto src = patterned(512, 4);
  auto dst = buffer(512);
  auto readable = owner.create_readable({Descriptor(src.data(), src.size())});
  RdmaMetadata m = readable.metadata();
  // An endpoint of the best method that nothing listens at: its set-up fails, the next works.
  ASSERT_GE(m.endpoints.size(), 2u) << "needs two methods (cma and tcp)";
  if (m.endpoints[0].method != "tcp") {
    m.endpoints[0].address = "@ferry-nobody-" + owner.identity().id;
  } else {
    GTEST_SKIP() << "tcp is the best method here: nothing to fall back to";
  }
  auto read = reader.begin_read(m, {Descriptor(dst.data(), dst.size())});
  ASSERT_TRUE(read.wait_for_completion(kWait));
  const ConnectorStats s = reader.stats();
  const MethodStats* refused = find(s, m.endpoints[0].method);
  ASSERT_NE(refused, nullptr) << s.to_text();
  EXPECT_EQ(refused->fallbacks, 1u);
}

// Regions served and attachments made count while they live, and not after (the loop counts
// when they are made and when they end).
TEST(ConnectorStats, CountsRegionsAndAttachmentsWhileTheyLive) {
  Connector owner(test::named("owner"));
  Connector peer(test::named("peer"));
  auto pool = buffer(4 * 4096);
  RegionOptions o;
  o.block_size = 4096;
  {
    auto region = owner.create_region({Descriptor(pool.data(), pool.size())}, o);
    auto att = peer.attach(region.metadata());
    att.wait_attached();
    auto dst = buffer(4096);
    auto r = att.read_blocks({1}, {Descriptor(dst.data(), dst.size())});
    ASSERT_TRUE(r.wait_for_completion(kWait));
    EXPECT_EQ(owner.stats().regions, 1u);
    EXPECT_EQ(peer.stats().attachments, 1u);
    EXPECT_EQ(nlohmann::json::parse(peer.stats().to_json())["attachments"], 1);
  }
  // Ended: the next count (an operation's end) sees none.
  ASSERT_NO_FATAL_FAILURE(read_once(owner, peer, 64));
  EXPECT_TRUE(test::eventually([&] { return owner.stats().regions == 0; }, 10s));
  EXPECT_TRUE(test::eventually([&] { return peer.stats().attachments == 0; }, 10s));
}

}  // namespace
}  // namespace ferry
