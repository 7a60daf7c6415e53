// The application's messaging on the connector's NATS connection (Connector::subscribe,
// publish, respond, request; docs/sidechannel.md, "Messaging"), against a real nats-server on
// a free loopback port.
#include <gtest/gtest.h>
#include <uv.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>

#include "sidechannel/subjects.hpp"
#include "tests/support/nats_server.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using test::expect_error;
using test::nats_options;

// What a handler saw: the messages, and the threads it ran on.
class Inbox {
 public:
  MessageHandler handler() {
    return [this](const Message& m) {
      std::lock_guard lock(mu_);
      messages_.push_back(m);
      threads_.push_back(std::this_thread::get_id());
      cv_.notify_all();
    };
  }
  // Waits until `n` messages are in; false after `limit`.
  bool wait_for(std::size_t n, std::chrono::milliseconds limit = 10s) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, limit, [&] { return messages_.size() >= n; });
  }
  std::size_t size() const {
    std::lock_guard lock(mu_);
    return messages_.size();
  }
  std::vector<Message> messages() const {
    std::lock_guard lock(mu_);
    return messages_;
  }
  std::vector<std::thread::id> threads() const {
    std::lock_guard lock(mu_);
    return threads_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Message> messages_;
  std::vector<std::thread::id> threads_;
};

// The answer an asynchronous request got.
struct Answer {
  std::promise<void> done;
  std::atomic<int> calls{0};
  std::optional<Message> reply;
  std::optional<Error> error;
  std::thread::id thread;

  ReplyHandler handler() {
    return [this](const Message* r, const Error* e) {
      thread = std::this_thread::get_id();
      if (r != nullptr) reply = *r;
      if (e != nullptr) error = *e;
      if (++calls == 1) done.set_value();
    };
  }
};

TEST(MessagingSubjects, PatternsAndFerrysNamespace) {
  using sidechannel::pattern_problem;
  using sidechannel::reaches_namespace;
  for (const char* ok : {"a", "a.b", "*", ">", "a.*", "a.>", "*.b.>", "a.*.c"})
    EXPECT_EQ(pattern_problem(ok), std::nullopt) << ok;
  EXPECT_EQ(pattern_problem(""), "is empty");
  EXPECT_EQ(pattern_problem("a.>.b"), "has '>' before its last token");
  EXPECT_EQ(pattern_problem("a.b*"), "has a wildcard inside a token ('b*')");
  EXPECT_EQ(pattern_problem("a..*"), "has an empty token");
  EXPECT_EQ(pattern_problem("*.b c"), "contains whitespace or a control character");
  EXPECT_EQ(pattern_problem(std::string(1025, 'x')), "is longer than 1024 characters");

  for (const char* in : {"ferry.x", "ferry.>", "ferry.*", "*.x", ">", "*.>", "ferry.inbox.a.r1"})
    EXPECT_TRUE(reaches_namespace(in, "ferry")) << in;
  for (const char* out : {"ferry", "*", "ferryx.>", "x.ferry.>", "fer.>", "a.b"})
    EXPECT_FALSE(reaches_namespace(out, "ferry")) << out;
  EXPECT_TRUE(reaches_namespace("team.*.inbox", "team.ferry"));
  EXPECT_TRUE(reaches_namespace("team.>", "team.ferry"));
  EXPECT_FALSE(reaches_namespace("team.other.>", "team.ferry"));
  EXPECT_FALSE(reaches_namespace("team.*", "team.ferry"));  // no token after the prefix
}

class MessagingTest : public ::testing::Test {
 protected:
  test::NatsServer server_;
  Connector a_{nats_options("a", {server_.url()})};
  Connector b_{nats_options("b", {server_.url()})};
};

TEST_F(MessagingTest, PublishReachesASubscriberOfAnotherConnectorOnItsLoopThread) {
  Inbox got;
  Subscription sub = b_.subscribe("app.greet", got.handler());
  EXPECT_TRUE(sub.active());
  EXPECT_EQ(sub.subject(), "app.greet");
  EXPECT_EQ(sub.queue(), "");
  a_.publish("app.greet", "hello", "app.answers");
  ASSERT_TRUE(got.wait_for(1));
  const Message m = got.messages().at(0);
  EXPECT_EQ(m.subject, "app.greet");
  EXPECT_EQ(m.data, "hello");
  EXPECT_EQ(m.reply, "app.answers");
  // On b's loop thread: not this one (the caller), and the same for every message.
  EXPECT_NE(got.threads().at(0), std::this_thread::get_id());
  a_.publish("app.greet", std::string("\0binary\xff", 8));
  ASSERT_TRUE(got.wait_for(2));
  EXPECT_EQ(got.messages().at(1).data, std::string("\0binary\xff", 8));
  EXPECT_EQ(got.threads().at(1), got.threads().at(0));
}

// subscribe() returns once the server has the subscription: a message another connection
// publishes right after it is never missed.
TEST_F(MessagingTest, APublishRightAfterSubscribeReturnsIsSeen) {
  for (int i = 0; i < 20; ++i) {
    Inbox got;
    const std::string subject = "app.fresh." + std::to_string(i);
    Subscription sub = b_.subscribe(subject, got.handler());
    a_.publish(subject, "first");
    ASSERT_TRUE(got.wait_for(1, 5s)) << "round " << i << ": the first message was missed";
  }
}

TEST_F(MessagingTest, WildcardsMatchAndTheConcreteSubjectIsGiven) {
  Inbox one, rest;
  Subscription s1 = b_.subscribe("app.*.status", one.handler());
  Subscription s2 = b_.subscribe("app.>", rest.handler());
  a_.publish("app.decode-3.status", "ready");
  a_.publish("app.decode-3.load.now", "0.5");
  ASSERT_TRUE(rest.wait_for(2));
  ASSERT_TRUE(one.wait_for(1));
  EXPECT_EQ(one.messages().at(0).subject, "app.decode-3.status");
  EXPECT_EQ(rest.messages().at(1).subject, "app.decode-3.load.now");
  a_.publish("app.marker.status", "");
  ASSERT_TRUE(one.wait_for(2));
  EXPECT_EQ(one.size(), 2u);  // "app.decode-3.load.now" is not "app.*.status"
}

TEST_F(MessagingTest, AQueueGroupSplitsMessagesAmongItsMembers) {
  Connector c(nats_options("c", {server_.url()}));
  Inbox m1, m2, all;
  SubscribeOptions group;
  group.queue = "workers";
  Subscription s1 = b_.subscribe("app.work", m1.handler(), group);
  Subscription s2 = c.subscribe("app.work", m2.handler(), group);
  Subscription s3 = c.subscribe("app.work", all.handler());  // no group: gets every one
  EXPECT_EQ(s1.queue(), "workers");
  constexpr int kMessages = 100;
  for (int i = 0; i < kMessages; ++i) a_.publish("app.work", std::to_string(i));
  ASSERT_TRUE(all.wait_for(kMessages));
  ASSERT_TRUE(test::eventually([&] { return m1.size() + m2.size() == kMessages; }))
      << m1.size() << " + " << m2.size();
  EXPECT_GT(m1.size(), 0u);
  EXPECT_GT(m2.size(), 0u);
  // Each went to one member only.
  std::vector<bool> seen(kMessages, false);
  for (const Inbox* member : {&m1, &m2})
    for (const Message& m : member->messages()) {
      const int i = std::stoi(m.data);
      EXPECT_FALSE(seen.at(i)) << "message " << i << " reached both members";
      seen.at(i) = true;
    }
}

TEST_F(MessagingTest, ASyncRequestGetsTheResponderAnswer) {
  Subscription echo =
      b_.subscribe("app.echo", [this](const Message& m) { b_.respond(m, "echo:" + m.data); });
  const Message reply = a_.request("app.echo", "17", 5s);
  EXPECT_EQ(reply.data, "echo:17");
  EXPECT_TRUE(reply.reply.empty());
  // Many in turn, each its own answer.
  for (int i = 0; i < 50; ++i)
    EXPECT_EQ(a_.request("app.echo", std::to_string(i), 5s).data, "echo:" + std::to_string(i));
}

TEST_F(MessagingTest, AnAsyncRequestCallsItsHandlerOnceOnTheLoopThread) {
  std::thread::id responder_thread;
  Subscription echo = b_.subscribe("app.blocks", [&](const Message& m) {
    responder_thread = std::this_thread::get_id();
    b_.respond(m, "blocks for " + m.data + ": 4 9 2");
  });
  Answer answer;
  a_.request("app.blocks", "request-17", 5s, answer.handler());
  ASSERT_EQ(answer.done.get_future().wait_for(10s), std::future_status::ready);
  ASSERT_TRUE(answer.reply);
  EXPECT_FALSE(answer.error);
  EXPECT_EQ(answer.reply->data, "blocks for request-17: 4 9 2");
  EXPECT_NE(answer.thread, std::this_thread::get_id());
  EXPECT_NE(answer.thread, responder_thread);  // a's loop, not b's
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(answer.calls.load(), 1);
}

TEST_F(MessagingTest, ARequestNobodyAnswersTimesOutNamingItsSubject) {
  Inbox silent;
  Subscription sub = b_.subscribe("app.silent", silent.handler());
  const auto start = std::chrono::steady_clock::now();
  expect_error([&] { (void)a_.request("app.silent", "?", 300ms); }, ErrorCode::Timeout,
               "no reply to the request at 'app.silent' within 300 ms");
  // libuv's timers count from the loop's clock, cached at the start of its turn: a fraction of
  // a millisecond before this thread's `start` (seen: 299.73 ms).
  EXPECT_GE(std::chrono::steady_clock::now() - start, 295ms);
  EXPECT_EQ(silent.size(), 1u);  // it was delivered, just not answered
  Answer answer;
  a_.request("app.silent", "?", 100ms, answer.handler());
  ASSERT_EQ(answer.done.get_future().wait_for(10s), std::future_status::ready);
  ASSERT_TRUE(answer.error);
  EXPECT_EQ(answer.error->code(), ErrorCode::Timeout);
  EXPECT_TRUE(answer.error->retryable());
  EXPECT_FALSE(answer.reply);
}

TEST_F(MessagingTest, ARequestToASubjectNobodySubscribesSaysNoResponders) {
  const auto start = std::chrono::steady_clock::now();
  expect_error([&] { (void)a_.request("app.nobody", "?", 5s); }, ErrorCode::PeerLost,
               "no responders at 'app.nobody'");
  // Told by the server at once, not by the deadline.
  EXPECT_LT(std::chrono::steady_clock::now() - start, 4s);
}

TEST_F(MessagingTest, UnsubscribeStopsDelivery) {
  Inbox got, marker;
  Subscription sub = b_.subscribe("app.stream", got.handler());
  Subscription mark = b_.subscribe("app.marker", marker.handler());
  a_.publish("app.stream", "1");
  ASSERT_TRUE(got.wait_for(1));
  sub.unsubscribe();
  EXPECT_FALSE(sub.active());
  EXPECT_FALSE(sub.error());
  sub.unsubscribe();  // idempotent
  for (int i = 0; i < 10; ++i) a_.publish("app.stream", "late");
  // The server handles a's messages in order: once the marker is in, the rest were routed.
  a_.publish("app.marker", "");
  ASSERT_TRUE(marker.wait_for(1));
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(got.size(), 1u);
}

// When unsubscribe() returns on a foreign thread, the handler is not running and never runs
// again, though messages keep coming.
TEST_F(MessagingTest, NoHandlerRunsAfterUnsubscribeReturnsOnAForeignThread) {
  for (int round = 0; round < 5; ++round) {
    std::atomic<bool> running{false};
    std::atomic<int> calls{0};
    std::promise<void> first;
    Subscription sub = b_.subscribe("app.busy", [&](const Message&) {
      running = true;
      if (++calls == 1) first.set_value();
      std::this_thread::sleep_for(20ms);  // a slow handler (against the rules, to widen the race)
      running = false;
    });
    std::atomic<bool> stop{false};
    std::thread publisher([&] {
      while (!stop) {
        a_.publish("app.busy", "x");
        std::this_thread::sleep_for(1ms);
      }
    });
    ASSERT_EQ(first.get_future().wait_for(10s), std::future_status::ready);
    ASSERT_TRUE(test::eventually([&] { return running.load(); }));
    sub.unsubscribe();
    EXPECT_FALSE(running.load()) << "round " << round << ": a handler call outlived unsubscribe";
    const int after = calls.load();
    std::this_thread::sleep_for(60ms);
    EXPECT_EQ(calls.load(), after) << "round " << round << ": the handler ran after unsubscribe";
    stop = true;
    publisher.join();
  }
}

TEST_F(MessagingTest, AHandlerMayUnsubscribeItself) {
  std::atomic<int> calls{0};
  Subscription sub;
  std::promise<void> ready;
  auto ready_future = ready.get_future();
  sub = b_.subscribe("app.once", [&](const Message&) {
    ready_future.wait();
    ++calls;
    sub.unsubscribe();
  });
  ready.set_value();
  for (int i = 0; i < 5; ++i) a_.publish("app.once", "x");
  ASSERT_TRUE(test::eventually([&] { return calls.load() >= 1; }));
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(calls.load(), 1);
  EXPECT_FALSE(sub.active());
}

TEST_F(MessagingTest, ClosingTheConnectorEndsSubscriptionsAndPendingRequests) {
  Inbox silent;
  Subscription listening = b_.subscribe("app.silent", silent.handler());
  auto doomed = std::make_unique<Connector>(nats_options("doomed", {server_.url()}));
  Inbox got;
  Subscription sub = doomed->subscribe("app.doomed", got.handler());
  Answer pending;
  doomed->request("app.silent", "?", 30s, pending.handler());
  std::promise<std::optional<Error>> blocked;
  std::thread waiter([&] {
    try {
      (void)doomed->request("app.silent", "?", 30s);
      blocked.set_value(std::nullopt);
    } catch (const Error& e) {
      blocked.set_value(e);
    }
  });
  ASSERT_TRUE(silent.wait_for(2));  // both requests are out
  const auto start = std::chrono::steady_clock::now();
  doomed.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  auto thrown_future = blocked.get_future();
  if (thrown_future.wait_for(10s) != std::future_status::ready) {
    waiter.detach();  // it waits for ever: the failure is this test's, not the next one's
    FAIL() << "a blocking request outlived the connector";
  }
  waiter.join();

  ASSERT_EQ(pending.done.get_future().wait_for(0s), std::future_status::ready);
  EXPECT_EQ(pending.calls.load(), 1);
  ASSERT_TRUE(pending.error);
  EXPECT_EQ(pending.error->code(), ErrorCode::Cancelled);
  EXPECT_NE(pending.error->message().find("closed"), std::string::npos);
  std::optional<Error> thrown = thrown_future.get();
  ASSERT_TRUE(thrown);
  EXPECT_EQ(thrown->code(), ErrorCode::Cancelled);

  // The handle outlives the connector: ended, says why, and unsubscribes without harm.
  EXPECT_FALSE(sub.active());
  ASSERT_TRUE(sub.error());
  EXPECT_EQ(sub.error()->code(), ErrorCode::Cancelled);
  sub.unsubscribe();
  b_.publish("app.doomed", "nobody hears");
  EXPECT_EQ(got.size(), 0u);
}

TEST_F(MessagingTest, FerrysOwnNamespaceIsRefused) {
  Inbox got;
  const std::string why = "ferry's own namespace 'ferry.'";
  expect_error([&] { a_.publish("ferry.notify.0123456789abcdef", "{}"); },
               ErrorCode::InvalidArgument, why);
  expect_error([&] { a_.publish("app.x", "{}", "ferry.notify.0123456789abcdef"); },
               ErrorCode::InvalidArgument, why);
  expect_error([&] { (void)a_.request("ferry.inbox.x", "", 1s); }, ErrorCode::InvalidArgument, why);
  for (const char* pattern : {"ferry.>", "ferry.inbox.*", "*.notify.>", ">", "*.>"})
    expect_error([&] { (void)a_.subscribe(pattern, got.handler()); }, ErrorCode::InvalidArgument,
                 "reaches into " + why);
  // Near it, but outside: allowed.
  Subscription s1 = a_.subscribe("ferryx.>", got.handler());
  Subscription s2 = a_.subscribe("*", got.handler());
  Subscription s3 = a_.subscribe("ferry", got.handler());
  a_.publish("ferry", "");

  // A request whose reply subject points into the namespace (but is no request inbox) is not
  // answered there: a peer cannot make this connector publish a control message.
  Message forged{"app.ask", "ferry.notify.0123456789abcdef", ""};
  expect_error([&] { a_.respond(forged, "{}"); }, ErrorCode::InvalidArgument,
               "is not a request inbox");
}

TEST(MessagingPrefix, AnotherPrefixMovesTheNamespace) {
  test::NatsServer server;
  auto options = nats_options("team", {server.url()});
  options.nats.prefix = "team.ferry";
  Connector c(options);
  Inbox got;
  expect_error([&] { c.publish("team.ferry.notify.x", ""); }, ErrorCode::InvalidArgument,
               "ferry's own namespace 'team.ferry.'");
  expect_error([&] { (void)c.subscribe("team.*.inbox.>", got.handler()); },
               ErrorCode::InvalidArgument, "team.ferry.");
  Subscription ok = c.subscribe("team.other.>", got.handler());
  c.publish("ferry.notify.x", "not ours any more");
  c.publish("team.other.x", "");
  ASSERT_TRUE(got.wait_for(1));
}

TEST_F(MessagingTest, BadArgumentsAreRefusedAtTheCall) {
  Inbox got;
  for (const char* bad : {"", "a..b", "a.*", "a.>", "a b", "a.b*"})
    expect_error([&] { a_.publish(bad, ""); }, ErrorCode::InvalidArgument, "subject");
  for (const char* bad : {"", "a..b", "a.>.b", "a.b*", "a b", "*x"})
    expect_error([&] { (void)a_.subscribe(bad, got.handler()); }, ErrorCode::InvalidArgument,
                 "subject");
  SubscribeOptions spaced;
  spaced.queue = "my group";
  expect_error([&] { (void)a_.subscribe("app.x", got.handler(), spaced); },
               ErrorCode::InvalidArgument, "queue group 'my group'");
  expect_error([&] { (void)a_.subscribe("app.x", nullptr); }, ErrorCode::InvalidArgument,
               "handler is empty");
  expect_error([&] { a_.request("app.x", "", 0ms, [](const Message*, const Error*) {}); },
               ErrorCode::InvalidArgument, "timeout must be positive");
  expect_error([&] { a_.request("app.x", "", 1s, nullptr); }, ErrorCode::InvalidArgument,
               "reply handler is empty");
  expect_error(
      [&] {
        a_.respond(Message{"app.x", "", ""}, "answer");
      },
      ErrorCode::InvalidArgument, "asks for no reply");

  Connector plain(test::named("plain"));
  expect_error([&] { plain.publish("app.x", ""); }, ErrorCode::InvalidState, "FERRY_NATS_URL");
  expect_error([&] { (void)plain.subscribe("app.x", got.handler()); }, ErrorCode::InvalidState,
               "FERRY_NATS_URL");
  expect_error([&] { (void)plain.request("app.x", "", 1s); }, ErrorCode::InvalidState,
               "side channel");

  Connector moved(std::move(plain));
  expect_error([&] { plain.publish("app.x", ""); }, ErrorCode::InvalidState, "moved from");
}

TEST_F(MessagingTest, ABlockingRequestOnTheLoopThreadIsRefused) {
  std::promise<std::optional<Error>> seen;
  Subscription sub = b_.subscribe("app.trigger", [&](const Message&) {
    try {
      (void)b_.request("app.x", "", 1s);
      seen.set_value(std::nullopt);
    } catch (const Error& e) {
      seen.set_value(e);
    }
  });
  a_.publish("app.trigger", "");
  auto error = seen.get_future().get();
  ASSERT_TRUE(error);
  EXPECT_EQ(error->code(), ErrorCode::WrongThread);
}

// Called from many threads at once: every request gets its own answer, every message arrives.
TEST_F(MessagingTest, CallsFromForeignThreads) {
  Subscription echo = b_.subscribe("app.echo", [this](const Message& m) { b_.respond(m, m.data); });
  Inbox got;
  Subscription sink = b_.subscribe("app.sink", got.handler());
  constexpr int kThreads = 4, kEach = 25;
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        const std::string mine = std::to_string(t) + "/" + std::to_string(i);
        a_.publish("app.sink", mine);
        if (a_.request("app.echo", mine, 10s).data != mine) ++wrong;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  ASSERT_TRUE(got.wait_for(kThreads * kEach));
  // One thread's messages arrive in its order.
  std::vector<int> next(kThreads, 0);
  for (const Message& m : got.messages()) {
    const int t = std::stoi(m.data.substr(0, m.data.find('/')));
    EXPECT_EQ(m.data, std::to_string(t) + "/" + std::to_string(next[t]));
    ++next[t];
  }
}

// cnats renews subscriptions after a reconnect: a subscription made before the server went
// away hears messages published after it is back, and so does a queue group.
TEST(MessagingRestart, SubscriptionsOutliveAServerRestart) {
  test::NatsServer server;
  Connector a(nats_options("a", {server.url()}));
  Connector b(nats_options("b", {server.url()}));
  Inbox got;
  SubscribeOptions group;
  group.queue = "workers";
  Subscription sub = b.subscribe("app.after", got.handler(), group);
  Subscription echo = b.subscribe("app.echo", [&](const Message& m) { b.respond(m, m.data); });
  server.kill();
  server.start();
  // Until both have reconnected, a publish may be lost (a is buffering, b not yet subscribed
  // again): publish until one arrives.
  ASSERT_TRUE(test::eventually(
      [&] {
        a.publish("app.after", "again");
        return got.wait_for(1, 50ms);
      },
      20s));
  EXPECT_TRUE(sub.active());
  EXPECT_EQ(a.request("app.echo", "still here", 5s).data, "still here");
}

TEST(MessagingPayload, DataBeyondTheServersMaxPayloadIsRefusedNamingBothSizes) {
  test::NatsServer server{test::NatsServer::Options{0, {}, "max_payload: 2048\n"}};
  Connector a(nats_options("a", {server.url()}));
  const std::string big(4096, 'x');
  const std::string sizes = "holds 4096 bytes, more than the NATS server's max_payload of 2048";
  expect_error([&] { a.publish("app.big", big); }, ErrorCode::SideChannel, sizes);
  expect_error([&] { (void)a.request("app.big", big, 1s); }, ErrorCode::SideChannel, sizes);
  expect_error(
      [&] {
        a.respond(Message{"app.x", "_INBOX.abc", ""}, big);
      },
      ErrorCode::SideChannel, sizes);
  // At the limit it goes.
  Inbox got;
  Subscription sub = a.subscribe("app.big", got.handler());
  a.publish("app.big", std::string(2048, 'y'));
  ASSERT_TRUE(got.wait_for(1));
  EXPECT_EQ(got.messages().at(0).data.size(), 2048u);
}

// Embedded mode: every handler and reply runs on the thread that runs the caller's loop, and
// calls from another thread are carried to it.
TEST(MessagingEmbedded, CallbacksRunOnTheCallersLoopThread) {
  test::NatsServer server;
  Connector responder(nats_options("responder", {server.url()}));
  Subscription echo = responder.subscribe(
      "emb.ask", [&](const Message& m) { responder.respond(m, "pong:" + m.data); });

  uv_loop_t loop;
  ASSERT_EQ(uv_loop_init(&loop), 0);
  auto options = nats_options("embedded", {server.url()});
  options.loop = &loop;
  auto worker = std::make_unique<Connector>(options);
  const auto loop_thread = std::this_thread::get_id();
  std::vector<std::thread::id> threads;  // loop thread only
  std::vector<std::string> notes;
  std::optional<std::string> reply;
  // On the loop thread subscribe does not wait; this connector's own publish after it still
  // comes after the subscription.
  std::optional<std::string> foreign_reply;
  std::atomic<bool> foreign_done{false};
  std::thread foreign;
  Subscription notes_sub = worker->subscribe("emb.note", [&](const Message& m) {
    threads.push_back(std::this_thread::get_id());
    notes.push_back(m.data);
    if (notes.size() != 1) return;
    worker->request("emb.ask", "1", 5s, [&](const Message* r, const Error* e) {
      threads.push_back(std::this_thread::get_id());
      reply = r != nullptr ? r->data : std::string("error: ") + e->what();
    });
    // The loop runs now: a foreign thread's calls are carried to it, and wait for it.
    foreign = std::thread([&] {
      worker->publish("emb.note", "from a foreign thread");
      try {
        foreign_reply = worker->request("emb.ask", "2", 5s).data;
      } catch (const Error& e) {
        foreign_reply = std::string("error: ") + e.what();
      }
      foreign_done = true;
    });
  });
  worker->publish("emb.note", "from the loop thread");

  // Runs the loop until everything arrived, or 10 s.
  struct Until {
    std::function<bool()> done;
  } until{[&] { return reply.has_value() && notes.size() == 2 && foreign_done.load(); }};
  uv_idle_t check;
  uv_idle_init(&loop, &check);
  check.data = &until;
  uv_idle_start(&check, [](uv_idle_t* h) {
    if (static_cast<Until*>(h->data)->done()) uv_stop(h->loop);
  });
  uv_timer_t deadline;
  uv_timer_init(&loop, &deadline);
  uv_timer_start(
      &deadline, [](uv_timer_t* t) { uv_stop(t->loop); }, 10000, 0);
  uv_run(&loop, UV_RUN_DEFAULT);
  // The foreign thread waits for the loop: keep it turning until that thread is done.
  for (int i = 0; i < 10000 && !foreign_done.load(); ++i) {
    uv_run(&loop, UV_RUN_NOWAIT);
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_TRUE(foreign.joinable());
  foreign.join();

  EXPECT_EQ(reply, "pong:1");
  EXPECT_EQ(foreign_reply, "pong:2");
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_EQ(notes.at(0), "from the loop thread");
  EXPECT_EQ(notes.at(1), "from a foreign thread");
  ASSERT_EQ(threads.size(), 3u);
  for (auto id : threads) EXPECT_EQ(id, loop_thread);

  notes_sub.unsubscribe();
  worker.reset();  // on the loop's thread
  uv_close(reinterpret_cast<uv_handle_t*>(&deadline), nullptr);
  uv_close(reinterpret_cast<uv_handle_t*>(&check), nullptr);
  uv_run(&loop, UV_RUN_DEFAULT);
  EXPECT_EQ(uv_loop_close(&loop), 0);
}

}  // namespace
}  // namespace ferry
