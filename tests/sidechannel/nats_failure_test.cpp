// The side channel when NATS misbehaves: a server restarted mid-run, a cluster node that
// dies, credentials that are wrong.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>

#include "tests/support/nats_server.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using test::at;
using test::eventually;
using test::nats_options;

// One read of `size` patterned bytes by subject, from `owner` to `reader`, verified.
void pair_once(Connector& owner, Connector& reader, const std::string& subject, std::uint64_t seed,
               std::chrono::milliseconds timeout = 20s) {
  constexpr std::size_t kSize = 256u << 10;
  auto src = test::patterned(kSize, seed);
  auto dst = test::buffer(kSize);
  auto readable = owner.create_readable({Descriptor(src.data(), kSize)}, at(subject, timeout));
  auto read = reader.begin_read(Subject(subject), {Descriptor(dst.data(), kSize)}, at("", timeout));
  ASSERT_TRUE(read.wait_for_completion(timeout + 5s)) << subject;
  ASSERT_TRUE(readable.wait_for_completion(timeout + 5s)) << subject;
  EXPECT_EQ(test::first_mismatch(dst.data(), kSize, seed), -1) << subject;
}

// Records the side channel's events; the connector calls it on its loop thread.
struct EventLog {
  std::mutex mu;
  std::vector<SideChannelEvent> events;
  std::function<void(SideChannelEvent, const std::string&)> callback() {
    return [this](SideChannelEvent e, const std::string&) {
      std::lock_guard lock(mu);
      events.push_back(e);
    };
  }
  int count(SideChannelEvent e) {
    std::lock_guard lock(mu);
    return static_cast<int>(std::count(events.begin(), events.end(), e));
  }
};

TEST(NatsRestart, ConnectorsReconnectAndLaterOperationsComplete) {
  test::NatsServer server;
  EventLog owner_log, reader_log;
  ConnectorOptions oo = nats_options("owner", {server.url()});
  oo.nats.on_event = owner_log.callback();
  ConnectorOptions ro = nats_options("reader", {server.url()});
  ro.nats.on_event = reader_log.callback();
  Connector owner(oo);
  Connector reader(ro);
  pair_once(owner, reader, "restart.before", 1);

  server.kill();
  ASSERT_TRUE(eventually([&] { return reader_log.count(SideChannelEvent::disconnected) > 0; }, 5s));

  // Caught in the outage: a pairing started while NATS is down. Its request waits in the
  // reconnect buffer or is asked again; it completes after the restart, or fails by its
  // deadline; it never hangs.
  constexpr std::size_t kSize = 4096;
  auto src = test::patterned(kSize, 2);
  auto dst = test::buffer(kSize);
  auto readable = owner.create_readable({Descriptor(src.data(), kSize)}, at("restart.during", 15s));
  auto read =
      reader.begin_read(Subject("restart.during"), {Descriptor(dst.data(), kSize)}, at("", 15s));

  std::this_thread::sleep_for(300ms);
  server.start();
  ASSERT_TRUE(eventually(
      [&] {
        return owner_log.count(SideChannelEvent::reconnected) > 0 &&
               reader_log.count(SideChannelEvent::reconnected) > 0;
      },
      10s));

  try {
    ASSERT_TRUE(read.wait_for_completion(20s));
    EXPECT_EQ(test::first_mismatch(dst.data(), kSize, 2), -1);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
  }
  EXPECT_TRUE(is_final(read.status()));

  // Started after the reconnect: complete.
  pair_once(owner, reader, "restart.after", 3);
}

TEST(NatsCluster, WorkersOnDifferentNodesPairAndSurviveANodeFailure) {
  // Three nodes, full mesh of routes on loopback.
  std::uint16_t cluster_ports[3] = {test::free_port(), test::free_port(), test::free_port()};
  auto routes_for = [&](int self) {
    std::string routes;
    for (int i = 0; i < 3; ++i)
      if (i != self)
        routes += (routes.empty() ? "" : ",") + std::string("nats://127.0.0.1:") +
                  std::to_string(cluster_ports[i]);
    return routes;
  };
  std::vector<std::unique_ptr<test::NatsServer>> nodes;
  for (int i = 0; i < 3; ++i) {
    test::NatsServer::Options o;
    o.args = {"--cluster_name", "ferry-test",
              "--cluster",      "nats://127.0.0.1:" + std::to_string(cluster_ports[i]),
              "--routes",       routes_for(i)};
    nodes.push_back(std::make_unique<test::NatsServer>(o));
  }
  EventLog owner_log;
  // The owner prefers node 0 and knows node 1; the reader uses node 2.
  ConnectorOptions oo = nats_options("owner", {nodes[0]->url(), nodes[1]->url()});
  oo.nats.on_event = owner_log.callback();
  Connector owner(oo);
  Connector reader(nats_options("reader", {nodes[2]->url()}));

  // Interest crosses the routes within moments; the reader asks until it does.
  pair_once(owner, reader, "cluster.first", 11);

  nodes[0]->kill();
  ASSERT_TRUE(eventually([&] { return owner_log.count(SideChannelEvent::reconnected) > 0; }, 10s))
      << "the owner did not fail over to node 1";
  pair_once(owner, reader, "cluster.after-failover", 12);
  pair_once(reader, owner, "cluster.reverse", 13);
}

class NatsAuthTest : public ::testing::Test {
 protected:
  static void expect_refused(ConnectorOptions o, const std::string& point) {
    try {
      Connector c(o);
      ADD_FAILURE() << "connected with bad credentials";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::AccessDenied) << e.what();
      EXPECT_NE(std::string(e.what()).find(point), std::string::npos) << e.what();
    }
  }
};

TEST_F(NatsAuthTest, UserAndPassword) {
  test::NatsServer server(
      test::NatsServer::Options{0, {"--user", "ferry", "--pass", "s3cret"}, {}});
  ConnectorOptions good = nats_options("owner", {server.url()});
  good.nats.user = "ferry";
  good.nats.password = "s3cret";
  ConnectorOptions good2 = good;
  good2.name = "reader";
  Connector owner(good);
  Connector reader(good2);
  pair_once(owner, reader, "auth.user", 21);

  ConnectorOptions wrong = good;
  wrong.nats.password = "guess";
  expect_refused(wrong, "refused the credentials");
  ConnectorOptions none = nats_options("anonymous", {server.url()});
  expect_refused(none, "refused the credentials");
}

TEST_F(NatsAuthTest, Token) {
  test::NatsServer server(test::NatsServer::Options{0, {"--auth", "t0ken"}, {}});
  ConnectorOptions good = nats_options("owner", {server.url()});
  good.nats.token = "t0ken";
  ConnectorOptions good2 = good;
  good2.name = "reader";
  Connector owner(good);
  Connector reader(good2);
  pair_once(owner, reader, "auth.token", 22);

  ConnectorOptions wrong = good;
  wrong.nats.token = "not-it";
  expect_refused(wrong, "refused the credentials");
}

TEST(NatsConnect, AServersEntryMayBeACommaSeparatedListAsTheEnvironmentIs) {
  test::NatsServer server;
  ConnectorOptions o = test::named("listed");
  o.nats.use_environment = false;
  o.nats.connect_timeout = 2s;
  // The first is tried first and cannot be reached; the second can.
  o.nats.servers = {"nats://127.0.0.1:" + std::to_string(test::free_port()) + ", " + server.url() +
                    " ,"};
  Connector c(o);
  EXPECT_TRUE(c.has_side_channel());
}

TEST(NatsConnect, TheEnvironmentConfiguresTheSideChannel) {
  test::NatsServer server(test::NatsServer::Options{0, {"--user", "env", "--pass", "pw"}, {}});
  ::setenv("FERRY_NATS_URL", (" " + server.url() + " ,").c_str(), 1);
  ::setenv("FERRY_NATS_USER", "env", 1);
  ::setenv("FERRY_NATS_PASSWORD", "pw", 1);
  {
    Connector from_env(test::named("from-env"));
    EXPECT_TRUE(from_env.has_side_channel());
    ConnectorOptions ignoring = test::named("ignoring");
    ignoring.nats.use_environment = false;
    Connector plain(ignoring);
    EXPECT_FALSE(plain.has_side_channel());
  }
  ::unsetenv("FERRY_NATS_URL");
  ::unsetenv("FERRY_NATS_USER");
  ::unsetenv("FERRY_NATS_PASSWORD");
}

}  // namespace
}  // namespace ferry
