// A worker that starts before NATS: the connector is made at once and connects in the
// background (NatsOptions::connect_deadline); explicit metadata works meanwhile, operations by
// subject wait for the connection within their deadlines, and a side channel that gives up is
// closed with the servers named.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <mutex>
#include <optional>
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

// Events as the connector's loop reports them.
struct EventLog {
  std::mutex mu;
  std::vector<std::pair<SideChannelEvent, std::string>> events;
  std::function<void(SideChannelEvent, const std::string&)> callback() {
    return [this](SideChannelEvent e, const std::string& detail) {
      std::lock_guard lock(mu);
      events.emplace_back(e, detail);
    };
  }
  std::optional<std::string> heard(SideChannelEvent e) {
    std::lock_guard lock(mu);
    for (auto& [event, detail] : events)
      if (event == e) return detail;
    return std::nullopt;
  }
};

// Options for a server that is not there (yet): `port` on loopback.
ConnectorOptions waiting_for(std::string name, std::uint16_t port) {
  ConnectorOptions o =
      test::nats_options(std::move(name), {"nats://127.0.0.1:" + std::to_string(port)});
  o.nats.connect_timeout = 500ms;
  o.nats.reconnect_wait = 50ms;
  return o;
}

// One read of patterned bytes by explicit metadata, verified.
void read_by_metadata(Connector& owner, Connector& reader) {
  constexpr std::size_t kSize = 64u << 10;
  auto src = test::patterned(kSize, 5);
  auto dst = test::buffer(kSize);
  auto readable = owner.create_readable({Descriptor(src.data(), kSize)});
  auto read = reader.begin_read(readable.metadata(), {Descriptor(dst.data(), kSize)});
  ASSERT_TRUE(read.wait_for_completion(10s));
  ASSERT_TRUE(readable.wait_for_completion(10s));
  EXPECT_EQ(test::first_mismatch(dst.data(), kSize, 5), -1);
}

TEST(NatsBackground, AConnectorMadeWhileNoServerListensTransfersByExplicitMetadataAtOnce) {
  const std::uint16_t port = test::free_port();
  const auto start = std::chrono::steady_clock::now();
  Connector owner(waiting_for("early-owner", port));
  Connector reader(waiting_for("early-reader", port));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  EXPECT_TRUE(owner.has_side_channel());
  SideChannelStatus now = owner.side_channel_state();
  EXPECT_EQ(now.state, SideChannelState::connecting) << now.detail;
  EXPECT_NE(now.detail.find("nats://127.0.0.1:" + std::to_string(port)), std::string::npos)
      << now.detail;
  read_by_metadata(owner, reader);
  EXPECT_EQ(owner.side_channel_state().state, SideChannelState::connecting);
}

TEST(NatsBackground, ASubjectPairMadeBeforeTheServerStartsCompletesOnceItStarts) {
  const std::uint16_t port = test::free_port();
  EventLog owner_events;
  ConnectorOptions oo = waiting_for("owner", port);
  oo.nats.on_event = owner_events.callback();
  Connector owner(oo);
  Connector reader(waiting_for("reader", port));
  constexpr std::size_t kSize = 128u << 10;
  auto src = test::patterned(kSize, 9);
  auto dst = test::buffer(kSize);
  auto readable = owner.create_readable({Descriptor(src.data(), kSize)}, at("early.kv", 20s));
  auto read = reader.begin_read(Subject("early.kv"), {Descriptor(dst.data(), kSize)}, at("", 20s));
  // Both wait: neither fails while the server is not there.
  std::this_thread::sleep_for(600ms);
  EXPECT_EQ(read.status(), OperationStatus::in_progress);
  EXPECT_EQ(readable.status(), OperationStatus::initialized);
  EXPECT_FALSE(owner_events.heard(SideChannelEvent::connected));

  test::NatsServer server(test::NatsServer::Options{port, {}, {}});
  ASSERT_TRUE(read.wait_for_completion(15s));
  ASSERT_TRUE(readable.wait_for_completion(15s));
  EXPECT_EQ(test::first_mismatch(dst.data(), kSize, 9), -1);
  ASSERT_TRUE(eventually([&] { return owner_events.heard(SideChannelEvent::connected); }, 5s));
  EXPECT_EQ(*owner_events.heard(SideChannelEvent::connected), server.url());
  SideChannelStatus now = owner.side_channel_state();
  EXPECT_EQ(now.state, SideChannelState::connected) << now.detail;
  EXPECT_EQ(now.detail, server.url());
}

TEST(NatsBackground, OnEventHearsConnectedAlsoWhenTheConstructorConnects) {
  test::NatsServer server;
  EventLog events;
  ConnectorOptions o = test::nats_options("at-once", {server.url()});
  o.nats.on_event = events.callback();
  Connector c(o);
  EXPECT_EQ(c.side_channel_state().state, SideChannelState::connected);
  ASSERT_TRUE(eventually([&] { return events.heard(SideChannelEvent::connected); }, 5s));
  EXPECT_EQ(*events.heard(SideChannelEvent::connected), server.url());
}

TEST(NatsBackground, ASubjectOpWhoseDeadlinePassesFirstEndsTimeoutSayingNatsIsNotConnected) {
  Connector reader(waiting_for("impatient", test::free_port()));
  auto dst = test::buffer(4096);
  auto read = reader.begin_read(Subject("never.there"), {Descriptor(dst.data(), dst.size())},
                                at("", 300ms));
  try {
    EXPECT_TRUE(read.wait_for_completion(10s));
    ADD_FAILURE() << "completed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
    const std::string text = e.what();
    EXPECT_NE(text.find("'never.there'"), std::string::npos) << text;
    EXPECT_NE(text.find("NATS is not connected (connecting"), std::string::npos) << text;
  }
}

TEST(NatsBackground, RetriesExhaustedCloseTheSideChannelAndSubjectCallsFailNamingTheServers) {
  const std::uint16_t port = test::free_port();
  const std::string url = "nats://127.0.0.1:" + std::to_string(port);
  EventLog events;
  ConnectorOptions o = waiting_for("giving-up", port);
  o.nats.connect_deadline = 300ms;
  o.nats.on_event = events.callback();
  Connector c(o);
  ASSERT_TRUE(
      eventually([&] { return c.side_channel_state().state == SideChannelState::closed; }, 10s))
      << c.side_channel_state().detail;
  const std::string detail = c.side_channel_state().detail;
  EXPECT_NE(detail.find("gave up connecting to NATS at " + url + " after 300 ms"),
            std::string::npos)
      << detail;
  EXPECT_TRUE(eventually([&] { return events.heard(SideChannelEvent::closed); }, 5s));
  EXPECT_TRUE(c.has_side_channel());  // configured with servers, as before

  auto buf = test::buffer(4096);
  test::expect_error(
      [&] { auto r = c.begin_read(Subject("late.kv"), {Descriptor(buf.data(), buf.size())}); },
      ErrorCode::SideChannel,
      "the NATS side channel is closed: gave up connecting to NATS at " + url);
  test::expect_error(
      [&] { auto r = c.create_readable({Descriptor(buf.data(), buf.size())}, at("late.kv", 1s)); },
      ErrorCode::SideChannel, url);
  test::expect_error([&] { c.publish("app.hello", "x"); }, ErrorCode::SideChannel, url);

  // What does not need NATS still works.
  Connector peer(test::named("peer"));
  read_by_metadata(c, peer);
}

TEST(NatsBackground, MaxReconnectAlsoBoundsConnectingInTheBackground) {
  ConnectorOptions o = waiting_for("few-rounds", test::free_port());
  o.nats.max_reconnect = 2;
  Connector c(o);
  ASSERT_TRUE(
      eventually([&] { return c.side_channel_state().state == SideChannelState::closed; }, 10s))
      << c.side_channel_state().detail;
  EXPECT_NE(c.side_channel_state().detail.find("max_reconnect"), std::string::npos)
      << c.side_channel_state().detail;
}

TEST(NatsBackground, MessagingWhileConnectingIsDeliveredOnceTheServerIsThere) {
  const std::uint16_t port = test::free_port();
  Connector c(waiting_for("early-messenger", port));
  std::promise<std::string> got;
  auto heard = got.get_future();
  // Off the loop thread: returns at once while connecting, the subscription in place.
  const auto start = std::chrono::steady_clock::now();
  Subscription sub = c.subscribe("app.ready", [&](const Message& m) { got.set_value(m.data); });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 500ms);
  EXPECT_TRUE(sub.active());
  c.publish("app.ready", "decode-3");  // kept in cnats' reconnect buffer
  std::this_thread::sleep_for(200ms);
  test::NatsServer server(test::NatsServer::Options{port, {}, {}});
  ASSERT_EQ(heard.wait_for(10s), std::future_status::ready);
  EXPECT_EQ(heard.get(), "decode-3");
}

TEST(NatsBackground, ARequestMadeWhileConnectingIsAnsweredWithinItsTimeout) {
  const std::uint16_t port = test::free_port();
  // One connector, so that the responder's subscription reaches the server first (cnats sends
  // the subscriptions, then what it buffered); a responder on a connection that is not up yet
  // would leave the request "no responders" (PeerLost).
  Connector c(waiting_for("early-asker", port));
  Subscription sub =
      c.subscribe("app.blocks", [&](const Message& m) { c.respond(m, "17: 3 blocks"); });
  std::promise<std::string> got;
  auto answer = got.get_future();
  c.request("app.blocks", "17", 10s, [&](const Message* reply, const Error* error) {
    got.set_value(reply != nullptr ? reply->data : std::string("error: ") + error->what());
  });
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(answer.wait_for(0s), std::future_status::timeout);  // waits; no error at once
  test::NatsServer server(test::NatsServer::Options{port, {}, {}});
  ASSERT_EQ(answer.wait_for(10s), std::future_status::ready);
  EXPECT_EQ(answer.get(), "17: 3 blocks");
}

TEST(NatsBackground, FerryNatsUrlAtADeadServerDoesNotAbortTheReadmeSnippet) {
  ::setenv("FERRY_NATS_URL", ("nats://127.0.0.1:" + std::to_string(test::free_port())).c_str(), 1);
  {
    // README.md, "Ten lines".
    Connector prefill, decode;
    std::vector<std::byte> kv(1 << 20), blocks(1 << 20);
    auto readable = prefill.create_readable({Descriptor(kv.data(), kv.size())});
    std::string meta = readable.metadata().to_json();
    auto read = decode.begin_read(RdmaMetadata::from_json(meta),
                                  {Descriptor(blocks.data(), blocks.size())});
    EXPECT_TRUE(read.wait_for_completion(10s));
    EXPECT_TRUE(readable.wait_for_completion(10s));
    EXPECT_EQ(prefill.side_channel_state().state, SideChannelState::connecting);
  }
  ::unsetenv("FERRY_NATS_URL");
}

}  // namespace
}  // namespace ferry
