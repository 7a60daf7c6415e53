// The well-known stats subject (NatsOptions::answer_stats, docs/operations.md): every
// connector with a side channel answers a request at "<prefix>.stats" with who it is and its
// stats, so that one request gathers the whole cluster. A plain cnats client asks, as
// ferry-top does.
#include <gtest/gtest.h>

#include <nats/nats.h>

#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>
#include <nlohmann/json.hpp>

#include "tests/support/nats_server.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using test::nats_options;

// Publishes one request at `subject` with reply subject `reply` and gathers what comes back
// there for `window`.
std::vector<nlohmann::json> gather(const std::string& url, const std::string& subject,
                                   const std::string& reply,
                                   std::chrono::milliseconds window = 1500ms) {
  struct Box {
    std::mutex mu;
    std::vector<std::string> answers;
  } box;
  natsConnection* nc = nullptr;
  natsSubscription* sub = nullptr;
  EXPECT_EQ(natsConnection_ConnectTo(&nc, url.c_str()), NATS_OK);
  if (nc == nullptr) return {};
  EXPECT_EQ(natsConnection_Subscribe(
                &sub, nc, reply.c_str(),
                [](natsConnection*, natsSubscription*, natsMsg* msg, void* closure) {
                  auto* b = static_cast<Box*>(closure);
                  // The server's "no responders" (nobody subscribed yet) is no answer.
                  if (!natsMsg_IsNoResponders(msg)) {
                    std::lock_guard lock(b->mu);
                    b->answers.emplace_back(natsMsg_GetData(msg),
                                            static_cast<std::size_t>(natsMsg_GetDataLength(msg)));
                  }
                  natsMsg_Destroy(msg);
                },
                &box),
            NATS_OK);
  natsConnection_Flush(nc);
  EXPECT_EQ(natsConnection_PublishRequestString(nc, subject.c_str(), reply.c_str(), "{}"), NATS_OK);
  natsConnection_Flush(nc);
  std::this_thread::sleep_for(window);
  natsSubscription_Unsubscribe(sub);
  natsSubscription_Destroy(sub);
  natsConnection_Destroy(nc);
  std::vector<nlohmann::json> out;
  for (const std::string& a : box.answers) out.push_back(nlohmann::json::parse(a));
  return out;
}

constexpr char kReply[] = "ferry.inbox.0123456789abcdef.r1";

const nlohmann::json* by_name(const std::vector<nlohmann::json>& answers, const std::string& name) {
  for (const auto& a : answers)
    if (a.value("name", "") == name) return &a;
  return nullptr;
}

class StatsSubject : public ::testing::Test {
 protected:
  test::NatsServer server_;
};

TEST_F(StatsSubject, EveryConnectorAnswersWithWhoItIsAndItsStats) {
  Connector a(nats_options("worker-a", {server_.url()}));
  Connector b(nats_options("worker-b", {server_.url()}));
  ConnectorOptions quiet_options = nats_options("quiet", {server_.url()});
  quiet_options.nats.answer_stats = false;
  Connector quiet(quiet_options);
  // A transfer between a and b, so that their stats say something.
  auto src = test::patterned(5000, 1);
  auto dst = test::buffer(5000);
  auto readable = a.create_readable({Descriptor(src.data(), src.size())});
  auto read = b.begin_read(readable.metadata(), {Descriptor(dst.data(), dst.size())});
  ASSERT_TRUE(read.wait_for_completion(30s));
  ASSERT_TRUE(readable.wait_for_completion(30s));

  std::vector<nlohmann::json> answers;
  // The connectors subscribe in the background: ask until both have (quiet never answers).
  test::eventually(
      [&] {
        answers = gather(server_.url(), "ferry.stats", kReply, 500ms);
        return answers.size() >= 2;
      },
      10s);
  ASSERT_EQ(answers.size(), 2u) << "quiet must not answer";
  const nlohmann::json* wa = by_name(answers, "worker-a");
  const nlohmann::json* wb = by_name(answers, "worker-b");
  ASSERT_NE(wa, nullptr);
  ASSERT_NE(wb, nullptr);
  EXPECT_EQ((*wa)["version"], 1);
  EXPECT_EQ((*wa)["id"], a.identity().id);
  EXPECT_EQ((*wa)["host"], a.identity().host);
  EXPECT_EQ((*wa)["pid"], a.identity().pid);
  EXPECT_GE((*wa)["uptime_s"].get<double>(), 0.0);
  EXPECT_FALSE((*wa)["methods"].empty());
  EXPECT_EQ((*wa)["nats"]["state"], "connected");
  EXPECT_EQ((*wa)["stats"]["bytes_out"], 5000);
  EXPECT_EQ((*wb)["stats"]["bytes_in"], 5000);
  EXPECT_EQ((*wb)["stats"]["peers"][0]["id"], a.identity().id);
  EXPECT_EQ((*wb)["stats"]["connections"][read.method()].get<int>() >= 1, true) << *wb;
}

// The answer goes only to a request inbox: a request naming another subject as its reply (a
// reflection attempt) is dropped, as at every subject ferry serves.
TEST_F(StatsSubject, AReplySubjectThatIsNoRequestInboxGetsNothing) {
  Connector a(nats_options("worker-a", {server_.url()}));
  ASSERT_TRUE(test::eventually(
      [&] { return gather(server_.url(), "ferry.stats", kReply, 300ms).size() == 1; }, 10s));
  EXPECT_TRUE(gather(server_.url(), "ferry.stats", "someone.else", 800ms).empty());
}

TEST_F(StatsSubject, TheEnvironmentTurnsItOff) {
  // The servers are given here; the environment is read for the rest (FERRY_NATS_* unset
  // otherwise in this test's process).
  auto reading_environment = [&](const char* name) {
    ConnectorOptions o = nats_options(name, {server_.url()});
    o.nats.use_environment = true;
    return o;
  };
  ::setenv("FERRY_NATS_STATS", "0", 1);
  Connector off(reading_environment("off"));
  ::unsetenv("FERRY_NATS_STATS");
  Connector on(reading_environment("on"));
  std::vector<nlohmann::json> answers;
  ASSERT_TRUE(test::eventually(
      [&] {
        answers = gather(server_.url(), "ferry.stats", kReply, 300ms);
        return !answers.empty();
      },
      10s));
  // "off" was made first: had it subscribed, it would answer by now. Another round hears
  // only "on".
  answers = gather(server_.url(), "ferry.stats", kReply, 800ms);
  ASSERT_EQ(answers.size(), 1u);
  EXPECT_EQ(answers[0]["name"], "on");
}

}  // namespace
}  // namespace ferry
