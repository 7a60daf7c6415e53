// The NATS side channel on its own (sidechannel::NatsChannel), against a private nats-server:
// answers go only to ferry's reply inboxes; what it keeps for requests and subscription
// confirmations cannot grow without bound; a failing random source does not hang it; what it
// has to say goes to the connector's log, never to stderr.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>

#include "loop/event_loop.hpp"
#include "sidechannel/inbox.hpp"
#include "sidechannel/nats_channel.hpp"
#include "tests/sidechannel/captured_log.hpp"
#include "tests/support/nats_server.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using sidechannel::Message;
using sidechannel::NatsChannel;

constexpr const char* kOwnerId = "00000000000000a1";
constexpr const char* kAskerId = "00000000000000b2";

// Runs `fn` on the loop, failing the whole test program if it does not return within `limit`
// (a loop stuck for good would otherwise hang it until ctest's timeout).
template <class F>
auto bounded_call(loop::EventLoop& loop, F fn, std::chrono::seconds limit = 10s) {
  auto result = std::async(std::launch::async, [&] { return loop.call(fn); });
  if (result.wait_for(limit) != std::future_status::ready) {
    std::fprintf(stderr, "FAILED: the loop did not come back within %llds\n",
                 static_cast<long long>(limit.count()));
    std::fflush(stderr);
    std::_Exit(1);
  }
  return result.get();
}

class NatsChannelTest : public ::testing::Test {
 protected:
  explicit NatsChannelTest(test::NatsServer::Options server = {}) : server_(std::move(server)) {}

  void TearDown() override {
    loop_.call([&] { channels_.clear(); });
  }

  NatsOptions options() {
    NatsOptions o;
    o.servers = {server_.url()};
    o.use_environment = false;
    o.reconnect_wait = 100ms;
    return o;
  }

  NatsChannel& open(const std::string& id, NatsOptions o) {
    return *loop_.call([&] {
      channels_.push_back(std::make_unique<NatsChannel>(loop_, o, id));
      return channels_.back().get();
    });
  }
  NatsChannel& open(const std::string& id) { return open(id, options()); }

  // Subscribes on the loop and waits for the confirmation; returns its error text.
  std::string subscribe(NatsChannel& ch, const std::string& subject,
                        sidechannel::MessageHandler handler) {
    auto done = std::make_shared<std::promise<std::string>>();
    auto confirmed = done->get_future();
    loop_.call([&] {
      ch.subscribe(subject, {}, std::move(handler),
                   [done](const std::string& error) { done->set_value(error); });
    });
    if (confirmed.wait_for(5s) != std::future_status::ready) return "no confirmation";
    return confirmed.get();
  }

  // One request on the loop; its answer's data, or "" when none comes within 5 s.
  std::string ask(NatsChannel& ch, const std::string& subject) {
    auto answer = std::make_shared<std::promise<std::string>>();
    auto got = answer->get_future();
    loop_.call([&] {
      ch.request(subject, "?", [answer](const Message& m) {
        answer->set_value(m.no_responders ? "no responders" : m.data);
      });
    });
    if (got.wait_for(5s) != std::future_status::ready) return {};
    return got.get();
  }

  test::NatsServer server_;
  test::CapturedLog said_;  // the connector's log, as the channels get it from the loop
  loop::EventLoop loop_{nullptr, said_.log()};
  std::vector<std::unique_ptr<NatsChannel>> channels_;  // destroyed on the loop
};

// --- Answers go to ferry's reply inboxes only --------------------------------------------

TEST(ReplyInbox, OnlyTheFormRequestBuildsIsAReplyInbox) {
  using sidechannel::is_reply_inbox;
  EXPECT_TRUE(is_reply_inbox("ferry", "ferry.inbox.00000000000000b2.r1"));
  EXPECT_TRUE(is_reply_inbox("ferry", "ferry.inbox.0123456789abcdef.rffffffffffffffff"));
  EXPECT_TRUE(is_reply_inbox("my.ns", "my.ns.inbox.0123456789abcdef.r9"));
  for (const char* foreign : {
           "",
           "evil.collect",
           "_INBOX.abc",
           "ferry.notify.00000000000000b2",     // another connector's notices
           "ferry.inbox.00000000000000b2.c1",   // a subscription confirmation
           "ferry.inbox.00000000000000b2.r",    // no number
           "ferry.inbox.00000000000000b2.r01",  // not as request() writes it
           "ferry.inbox.00000000000000b2.r1.x",
           "ferry.inbox.00000000000000b2.r10000000000000000",  // 17 digits
           "ferry.inbox.00000000000000B2.r1",                  // upper case
           "ferry.inbox.b2.r1",                                // not a connector id
           "ferry.inbox.00000000000000b2x.r1",
           "ferry.inbox.*.r1",
           "ferry.inbox.00000000000000b2.r*",
           "ferry.inbox.00000000000000b2.>",
           "ferryx.inbox.00000000000000b2.r1",
           "other.inbox.00000000000000b2.r1",
           "x.ferry.inbox.00000000000000b2.r1",
       })
    EXPECT_FALSE(is_reply_inbox("ferry", foreign)) << foreign;
  EXPECT_FALSE(is_reply_inbox("my.ns", "ferry.inbox.0123456789abcdef.r9"));
}

TEST_F(NatsChannelTest, RespondAnswersRequestsAndNothingElse) {
  NatsChannel& owner = open(kOwnerId);
  NatsChannel& asker = open(kAskerId);
  std::atomic<int> served{0};
  ASSERT_EQ(subscribe(owner, "svc",
                      [&](const Message& m) {
                        ++served;
                        owner.respond(m, "the metadata");
                      }),
            "");
  EXPECT_EQ(ask(asker, "svc"), "the metadata");

  // Requests naming a reply subject of their choosing: the asker listens there.
  const std::vector<std::string> foreign = {
      "evil.collect",
      "ferry.notify." + std::string(kAskerId),
      "ferry.inbox." + std::string(kAskerId) + ".c1",
      "ferry.inbox." + std::string(kAskerId) + ".r1.x",
      "other.inbox." + std::string(kAskerId) + ".r1",
  };
  std::atomic<int> leaked{0};
  for (const auto& subject : foreign)
    ASSERT_EQ(subscribe(asker, subject, [&](const Message&) { ++leaked; }), "") << subject;
  ::testing::internal::CaptureStderr();
  loop_.call([&] {
    for (const auto& subject : foreign) asker.publish("svc", "?", subject);
    asker.publish("svc", "no reply subject at all");
  });
  // The server keeps one connection's messages in order: once the owner has answered a
  // proper request sent after them, it has handled those too.
  EXPECT_EQ(ask(asker, "svc"), "the metadata");
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(served.load(), 2 + static_cast<int>(foreign.size()) + 1);
  EXPECT_EQ(leaked.load(), 0);
  // Noted once in the connector's log, not once per request.
  EXPECT_EQ(said_.count("is not a ferry reply inbox"), 1u) << said_.text();
  EXPECT_EQ(said_.count("'evil.collect'"), 1u) << said_.text();
}

// --- The random source failing ----------------------------------------------------------

// As loop::random_u64 fails when the kernel refuses getrandom().
std::uint64_t failing_random() {
  throw Error(ErrorCode::Internal, "getrandom: Function not implemented");
}

struct RandomSourceFor {
  explicit RandomSourceFor(sidechannel::RandomSource source)
      : previous(sidechannel::set_random_source_for_testing(source)) {}
  ~RandomSourceFor() { sidechannel::set_random_source_for_testing(previous); }
  sidechannel::RandomSource previous;
};

TEST_F(NatsChannelTest, AFailingRandomSourceFailsTheCallAtOnceAndLeavesNothingBehind) {
  NatsChannel& owner = open(kOwnerId);
  NatsChannel& asker = open(kAskerId);
  ASSERT_EQ(subscribe(owner, "svc", [&](const Message& m) { owner.respond(m, "yes"); }), "");
  std::atomic<int> told{0}, delivered{0};
  {
    RandomSourceFor failing(&failing_random);
    // Both draw ids: a subscription's confirmation, and a request. Each fails at once
    // (bounded_call: nothing spins) with the source's error, and leaves nothing waiting.
    bounded_call(loop_, [&] {
      test::expect_error(
          [&] {
            owner.subscribe(
                "other", {}, [&](const Message&) { ++delivered; },
                [&](const std::string&) { ++told; });
          },
          ErrorCode::Internal, "getrandom");
      test::expect_error([&] { asker.request("svc", "?", [&](const Message&) { ++told; }); },
                         ErrorCode::Internal, "getrandom");
      EXPECT_EQ(owner.pending_confirmations(), 0u);
      EXPECT_EQ(asker.open_requests(), 0u);
    });
  }
  // Nothing was subscribed or asked: a message to the refused subject finds no handler, and
  // the refused request was never sent (the owner would have answered it).
  loop_.call([&] { asker.publish("other", "anyone?"); });
  EXPECT_EQ(ask(asker, "svc"), "yes");  // the source works again, and so does the channel
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(told.load(), 0);
  EXPECT_EQ(delivered.load(), 0);
}

// --- Open requests are capped ------------------------------------------------------------

TEST_F(NatsChannelTest, OpenRequestsAreCappedOldestFirst) {
  NatsChannel& ch = open(kAskerId);
  // A subscriber that never answers holds the subject, so the server sends no "no
  // responders": every request stays open.
  ASSERT_EQ(subscribe(ch, "silent", [](const Message&) {}), "");
  constexpr std::size_t kExtra = 100;
  std::vector<std::uint64_t> ids;
  loop_.call([&] {
    for (std::size_t i = 0; i < NatsChannel::kMaxOpenRequests + kExtra; ++i)
      ids.push_back(ch.request("silent", "", [](const Message&) {}));
  });
  EXPECT_EQ(loop_.call([&] { return ch.open_requests(); }), NatsChannel::kMaxOpenRequests);
  // Said once, in the connector's log.
  EXPECT_EQ(said_.count("NATS requests are open; dropping the oldest"), 1u) << said_.text();
  EXPECT_EQ(std::set<std::uint64_t>(ids.begin(), ids.end()).size(), ids.size());
  // The newest are the ones kept: cancelling one of them shrinks the table, cancelling one of
  // the dropped does not.
  loop_.call([&] {
    ch.cancel_request(ids.front());
    EXPECT_EQ(ch.open_requests(), NatsChannel::kMaxOpenRequests);
    ch.cancel_request(ids.back());
    EXPECT_EQ(ch.open_requests(), NatsChannel::kMaxOpenRequests - 1);
  });
  // And requests still work.
  NatsChannel& owner = open(kOwnerId);
  ASSERT_EQ(subscribe(owner, "svc", [&](const Message& m) { owner.respond(m, "yes"); }), "");
  EXPECT_EQ(ask(ch, "svc"), "yes");
}

// --- Subscription confirmations end ------------------------------------------------------

// A server on which ferry's connections may not publish to their inboxes: no confirmation
// ever comes back.
test::NatsServer::Options refusing_confirmations() {
  test::NatsServer::Options o;
  o.config =
      "authorization {\n"
      "  users = [ { user: ferry, password: pw,\n"
      "              permissions: { publish: { deny: [\"ferry.inbox.>\"] } } } ]\n"
      "}\n";
  return o;
}

class NatsConfirmTest : public NatsChannelTest {
 protected:
  NatsConfirmTest() : NatsChannelTest(refusing_confirmations()) {}
  NatsOptions options() {
    NatsOptions o = NatsChannelTest::options();
    o.user = "ferry";
    o.password = "pw";
    o.request_timeout = 300ms;
    return o;
  }
};

TEST_F(NatsConfirmTest, AConfirmationThatNeverComesIsAnErrorAtItsDeadline) {
  NatsChannel& ch = open(kOwnerId, options());
  auto start = std::chrono::steady_clock::now();
  std::string error = subscribe(ch, "svc", [](const Message&) {});
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_NE(error.find("the NATS server did not confirm the subscription to 'svc' within 300 ms"),
            std::string::npos)
      << error;
  EXPECT_GE(took, 250ms);
  EXPECT_EQ(loop_.call([&] { return ch.pending_confirmations(); }), 0u);
}

TEST_F(NatsConfirmTest, UnsubscribingEndsTheWaitForTheConfirmation) {
  NatsChannel& ch = open(kOwnerId, options());
  auto done = std::make_shared<std::promise<std::string>>();
  auto heard = done->get_future();
  bool called_inside = false;
  loop_.call([&] {
    auto id = ch.subscribe(
        "svc", {}, [](const Message&) {},
        [done](const std::string& error) { done->set_value(error); });
    ch.unsubscribe(id);
    // Told after this callback, not from inside unsubscribe().
    called_inside = heard.wait_for(0s) == std::future_status::ready;
    EXPECT_EQ(ch.pending_confirmations(), 0u);
  });
  EXPECT_FALSE(called_inside);
  ASSERT_EQ(heard.wait_for(100ms), std::future_status::ready);
  EXPECT_NE(heard.get().find("unsubscribed before"), std::string::npos);
}

TEST_F(NatsChannelTest, AConfirmationWaitsOutAnOutageAndComesAfterTheReconnect) {
  std::atomic<int> drops{0}, returns{0};
  NatsOptions o = options();
  o.request_timeout = 200ms;
  o.on_event = [&](SideChannelEvent e, const std::string&) {
    if (e == SideChannelEvent::disconnected) ++drops;
    if (e == SideChannelEvent::reconnected) ++returns;
  };
  NatsChannel& ch = open(kOwnerId, o);
  server_.kill();
  ASSERT_TRUE(test::eventually([&] { return drops > 0; }, 5s));

  auto done = std::make_shared<std::promise<std::string>>();
  auto heard = done->get_future();
  loop_.call([&] {
    ch.subscribe(
        "svc", {}, [&](const Message& m) { ch.respond(m, "back"); },
        [done](const std::string& error) { done->set_value(error); });
  });
  // Several deadlines long: while the connection is down, the deadline waits.
  EXPECT_EQ(heard.wait_for(700ms), std::future_status::timeout);
  EXPECT_EQ(loop_.call([&] { return ch.pending_confirmations(); }), 1u);
  server_.start();
  ASSERT_TRUE(test::eventually([&] { return returns > 0; }, 10s));
  ASSERT_EQ(heard.wait_for(5s), std::future_status::ready);
  EXPECT_EQ(heard.get(), "");
  EXPECT_EQ(loop_.call([&] { return ch.pending_confirmations(); }), 0u);
  NatsChannel& asker = open(kAskerId);
  EXPECT_EQ(ask(asker, "svc"), "back");
}

}  // namespace
}  // namespace ferry
