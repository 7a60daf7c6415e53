// Pairing by subject against forged, late and unlucky NATS peers: a plain cnats client plays
// the other side.
#include <gtest/gtest.h>

#include <nats/nats.h>
#include <uv.h>

#include <chrono>
#include <future>
#include <thread>

#include <ferry/ferry.hpp>
#include <nlohmann/json.hpp>

#include "tests/support/nats_server.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/raw_peer.hpp"
#include "tests/support/util.hpp"
#include "transport/token.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using json = nlohmann::json;
using test::at;
using test::ended_with;
using test::nats_options;

// A plain NATS client of the test's own.
class RawNats {
 public:
  explicit RawNats(const std::string& url) {
    EXPECT_EQ(natsConnection_ConnectTo(&nc_, url.c_str()), NATS_OK);
  }
  ~RawNats() {
    for (auto* sub : subs_) natsSubscription_Destroy(sub);
    natsConnection_Destroy(nc_);
  }
  // The metadata a passive operation serves at `subject`, asked with a reply subject of the
  // form ferry's own requests use (owners answer nowhere else), or with `reply` when given.
  std::string ask(const std::string& subject, int timeout_ms = 5000, std::string reply = {}) {
    if (reply.empty()) reply = "ferry.inbox.00000000000000ee.r" + std::to_string(++asked_);
    natsSubscription* inbox = nullptr;
    natsMsg* answer = nullptr;
    natsStatus s = natsConnection_SubscribeSync(&inbox, nc_, reply.c_str());
    if (s == NATS_OK)
      s = natsConnection_PublishRequestString(nc_, subject.c_str(), reply.c_str(), "{}");
    if (s == NATS_OK) s = natsSubscription_NextMsg(&answer, inbox, timeout_ms);
    natsSubscription_Destroy(inbox);
    last_status_ = s;
    if (timeout_ms >= 5000) {
      EXPECT_EQ(s, NATS_OK);
    }
    natsMsg* reply_msg = answer;
    if (reply_msg == nullptr) return {};
    std::string data(natsMsg_GetData(reply_msg),
                     static_cast<std::size_t>(natsMsg_GetDataLength(reply_msg)));
    natsMsg_Destroy(reply_msg);
    return data;
  }
  void publish(const std::string& subject, const std::string& data) {
    natsConnection_PublishString(nc_, subject.c_str(), data.c_str());
    natsConnection_FlushTimeout(nc_, 2000);
  }
  // Answers every request at `subject` with `answer(request)`, after `delay`.
  void answer(const std::string& subject, std::function<std::string()> answer,
              std::chrono::milliseconds delay = 0ms) {
    auto* ctx = new Ctx{this, std::move(answer), delay};
    natsSubscription* sub = nullptr;
    natsConnection_Subscribe(
        &sub, nc_, subject.c_str(),
        [](natsConnection* nc, natsSubscription*, natsMsg* msg, void* closure) {
          auto* c = static_cast<Ctx*>(closure);
          std::this_thread::sleep_for(c->delay);
          if (const char* reply = natsMsg_GetReply(msg))
            natsConnection_PublishString(nc, reply, c->answer().c_str());
          natsMsg_Destroy(msg);
        },
        ctx);
    natsSubscription_SetOnCompleteCB(
        sub, [](void* c) { delete static_cast<Ctx*>(c); }, ctx);
    natsConnection_Flush(nc_);
    subs_.push_back(sub);
  }
  // Counts messages at `subject`.
  std::shared_ptr<std::atomic<int>> count(const std::string& subject) {
    auto n = std::make_shared<std::atomic<int>>(0);
    auto* holder = new std::shared_ptr<std::atomic<int>>(n);
    natsSubscription* sub = nullptr;
    natsConnection_Subscribe(
        &sub, nc_, subject.c_str(),
        [](natsConnection*, natsSubscription*, natsMsg* msg, void* closure) {
          ++**static_cast<std::shared_ptr<std::atomic<int>>*>(closure);
          natsMsg_Destroy(msg);
        },
        holder);
    natsSubscription_SetOnCompleteCB(
        sub, [](void* c) { delete static_cast<std::shared_ptr<std::atomic<int>>*>(c); }, holder);
    natsConnection_Flush(nc_);
    subs_.push_back(sub);
    return n;
  }

  natsStatus last_status() const noexcept { return last_status_; }

 private:
  struct Ctx {
    RawNats* self;
    std::function<std::string()> answer;
    std::chrono::milliseconds delay;
  };
  natsConnection* nc_ = nullptr;
  natsStatus last_status_ = NATS_OK;
  int asked_ = 0;
  std::vector<natsSubscription*> subs_;
};

class NatsHostileTest : public ::testing::Test {
 protected:
  test::NatsServer server_;
  RawNats raw_{server_.url()};
};

TEST_F(NatsHostileTest, AForgedOwnerIdCannotInjectProtocolOrKillTheSideChannel) {
  Connector owner(nats_options("owner", {server_.url()}));
  Connector reader(nats_options("reader", {server_.url()}));
  auto src = test::patterned(4096, 1);
  auto readable = owner.create_readable({Descriptor(src.data(), src.size())}, at("real"));
  json forged = json::parse(readable.metadata().to_json());
  forged["owner"]["id"] = "x\r\nPUB injected.by.victim 0\r\n\r\nSUB y";
  raw_.answer("forged", [&] { return forged.dump(); });
  auto injected = raw_.count("injected.by.victim");

  auto dst = test::buffer(4096);
  auto read = reader.begin_read(Subject("forged"), {Descriptor(dst.data(), dst.size())});
  EXPECT_EQ(ended_with(read), ErrorCode::InvalidMetadata);
  EXPECT_EQ(read.error()->field(), "owner.id");
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(injected->load(), 0);
  // The reader's side channel still works.
  auto again = reader.begin_read(Subject("real"), {Descriptor(dst.data(), dst.size())});
  ASSERT_TRUE(again.wait_for_completion(20s));
  EXPECT_EQ(test::first_mismatch(dst.data(), dst.size(), 1), -1);
}

TEST_F(NatsHostileTest, AForgedCompleteNoticeDoesNotCompleteAnUntouchedOperation) {
  Connector owner(nats_options("owner", {server_.url()}));
  auto dst = test::buffer(4096);
  auto writable = owner.create_writable({Descriptor(dst.data(), dst.size())}, at("victim"));
  auto meta = RdmaMetadata::from_json(raw_.ask("victim"));
  json notice = {{"version", 1},     {"key", meta.notification_key},  {"token", meta.token},
                 {"from", "forger"}, {"from_id", "00000000000000ff"}, {"status", "complete"}};
  raw_.publish("ferry.notify." + meta.owner.id, notice.dump());
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(writable.status(), OperationStatus::initialized);
  // A failure notice from a token holder while nobody has claimed it does end it.
  notice["status"] = "errored";
  notice["code"] = "Cancelled";
  notice["message"] = "gave up";
  raw_.publish("ferry.notify." + meta.owner.id, notice.dump());
  EXPECT_EQ(ended_with(writable, 5s), ErrorCode::Cancelled);
  EXPECT_NE(writable.error()->message().find("peer 'forger'"), std::string::npos);
}

TEST_F(NatsHostileTest, NoticesFromAnyoneButTheClaimantAreIgnored) {
  Connector owner(nats_options("owner", {server_.url()}));
  ConnectorOptions slow = nats_options("reader", {server_.url()});
  slow.tcp.chunk_size = 4096;
  slow.tcp.window = 4096;
  Connector reader(slow);
  constexpr std::size_t kBig = 64u << 20;
  auto src = test::patterned(kBig, 2);
  auto dst = test::buffer(kBig);
  auto readable = owner.create_readable({Descriptor(src.data(), kBig)}, at("claimed"));
  auto read = reader.begin_read(Subject("claimed"), {Descriptor(dst.data(), kBig)});
  ASSERT_TRUE(test::eventually([&] { return readable.status() == OperationStatus::in_progress; }));
  auto meta = RdmaMetadata::from_json(raw_.ask("claimed"));
  json notice = {{"version", 1},
                 {"key", meta.notification_key},
                 {"token", meta.token},
                 {"from", "intruder"},
                 {"from_id", "00000000000000ff"},
                 {"status", "errored"},
                 {"code", "Cancelled"},
                 {"message", "hijack"}};
  raw_.publish("ferry.notify." + meta.owner.id, notice.dump());
  ASSERT_TRUE(read.wait_for_completion(60s));
  ASSERT_TRUE(readable.wait_for_completion(60s));
  EXPECT_EQ(test::first_mismatch(dst.data(), kBig, 2), -1);
}

// The claimant's connector id is no secret (HELLO carries it, reply subjects show it): only
// the secret the owner handed to the claim, over the claim's own connection, ends it.
TEST_F(NatsHostileTest, OnlyTheClaimsSecretEndsAClaimedTransfer) {
  Connector owner(nats_options("owner", {server_.url()}));
  auto dst = test::buffer(4096);
  auto writable = owner.create_writable({Descriptor(dst.data(), dst.size())}, at("claimed-raw"));
  auto meta = RdmaMetadata::from_json(raw_.ask("claimed-raw"));
  const test::Target t = test::target_of(meta);
  test::RawClient claimant(t.address);
  ASSERT_TRUE(claimant.greet("claimant", 0xabc)) << claimant.error();
  std::vector<std::byte> bytes(16, std::byte{7});
  ASSERT_TRUE(claimant.send_frame(
      test::request(transport::wire::FrameType::write, t, 1, t.base, 16), {}, bytes));
  ASSERT_TRUE(test::is_ok(claimant.read_frame(), 1)) << claimant.error();
  auto secret = claimant.claim_secret(t.op_id);
  ASSERT_TRUE(secret.has_value()) << "the owner handed the claimant no secret";
  ASSERT_TRUE(test::eventually([&] { return writable.status() == OperationStatus::in_progress; }));

  json notice = {
      {"version", 1},        {"key", meta.notification_key},  {"token", meta.token},
      {"from", "intruder"},  {"from_id", "0000000000000abc"},  // the claimant's id, as HELLO said
      {"status", "errored"}, {"code", "Cancelled"},           {"message", "hijack"}};
  raw_.publish("ferry.notify." + meta.owner.id, notice.dump());
  notice["claim"] = std::string(32, '0');
  raw_.publish("ferry.notify." + meta.owner.id, notice.dump());
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(writable.status(), OperationStatus::in_progress);

  notice["claim"] = transport::token_to_hex(*secret);
  notice["from"] = "claimant";
  raw_.publish("ferry.notify." + meta.owner.id, notice.dump());
  EXPECT_EQ(ended_with(writable, 5s), ErrorCode::Cancelled);
  EXPECT_NE(writable.error()->message().find("peer 'claimant'"), std::string::npos);
}

// Metadata (a credential) is published only to reply subjects in ferry's inbox namespace.
TEST_F(NatsHostileTest, MetadataIsAnsweredOnlyToFerrysInboxes) {
  Connector owner(nats_options("owner", {server_.url()}));
  auto src = test::patterned(64, 3);
  auto readable = owner.create_readable({Descriptor(src.data(), src.size())}, at("guarded"));
  for (const char* foreign : {"_INBOX.elsewhere.r1", "evil.collect",
                              "ferry.notify.00000000000000ee", "ferry.inbox.00000000000000ee.c1"}) {
    EXPECT_EQ(raw_.ask("guarded", 300, foreign), "") << foreign;
    EXPECT_EQ(raw_.last_status(), NATS_TIMEOUT) << foreign;
  }
  EXPECT_FALSE(raw_.ask("guarded").empty());
}

TEST_F(NatsHostileTest, MalformedNoticesAreDroppedQuietly) {
  Connector owner(nats_options("owner", {server_.url()}));
  auto dst = test::buffer(64);
  auto writable = owner.create_writable({Descriptor(dst.data(), dst.size())}, at("quiet"));
  const std::string to = "ferry.notify." + writable.metadata().owner.id;
  ::testing::internal::CaptureStderr();
  for (const char* junk : {"", "{", "[]", R"({"version":"1"})", R"({"version":1,"key":5})",
                           R"({"version":1,"key":"0","token":"0","status":"errored"})"})
    raw_.publish(to, junk);
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(writable.status(), OperationStatus::initialized);
}

TEST_F(NatsHostileTest, ALateAnswerStillPairs) {
  // Every answer takes 1.2 s; the reader asks again after 1 s but must take whichever
  // answer arrives.
  Connector owner(nats_options("owner", {server_.url()}));
  ConnectorOptions impatient = nats_options("reader", {server_.url()});
  impatient.nats.request_timeout = 1000ms;
  Connector reader(impatient);
  auto src = test::patterned(4096, 3);
  auto readable = owner.create_readable({Descriptor(src.data(), src.size())}, at("direct"));
  const std::string meta = readable.metadata().to_json();
  raw_.answer(
      "relayed", [meta] { return meta; }, 1200ms);
  auto dst = test::buffer(4096);
  auto read =
      reader.begin_read(Subject("relayed"), {Descriptor(dst.data(), dst.size())}, at("", 10s));
  ASSERT_TRUE(read.wait_for_completion(15s));
  EXPECT_EQ(test::first_mismatch(dst.data(), dst.size(), 3), -1);
}

TEST_F(NatsHostileTest, SubjectsInFerrysOwnNamespaceAreRefused) {
  Connector owner(nats_options("owner", {server_.url()}));
  auto buf = test::buffer(64);
  try {
    (void)owner.create_readable({Descriptor(buf.data(), buf.size())},
                                at("ferry.notify." + owner.identity().id));
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("ferry's own namespace"), std::string::npos);
  }
}

TEST_F(NatsHostileTest, ClosingAConnectorThatPublishedIsQuickAndLosesNoNotice) {
  // The reader gets metadata whose endpoint is a listener that never answers, so its
  // transfer cannot start; destroying the reader cancels it, and the cancel notice must
  // still reach the owner, without the destructor stalling.
  test::RawListener silent;
  Connector owner(nats_options("owner", {server_.url()}));
  auto src = test::patterned(4096, 4);
  auto readable = owner.create_readable({Descriptor(src.data(), src.size())}, at("served"));
  json detour = json::parse(readable.metadata().to_json());
  detour["endpoints"] = json::array({{{"method", "tcp"}, {"address", silent.address()}}});
  raw_.answer("detour", [&] { return detour.dump(); });
  {
    auto reader = std::make_unique<Connector>(nats_options("reader", {server_.url()}));
    auto dst = test::buffer(4096);
    auto read = reader->begin_read(Subject("detour"), {Descriptor(dst.data(), dst.size())});
    ASSERT_TRUE(test::eventually([&] { return read.method() == "tcp"; }, 5s));
    auto start = std::chrono::steady_clock::now();
    reader.reset();
    EXPECT_LT(std::chrono::steady_clock::now() - start, 400ms);
    EXPECT_EQ(read.status(), OperationStatus::cancelled);
  }
  EXPECT_EQ(ended_with(readable, 5s), ErrorCode::Cancelled);
  EXPECT_NE(readable.error()->message().find("connector was closed"), std::string::npos)
      << readable.error()->message();
}

TEST_F(NatsHostileTest, ConcurrentCreatesDuringAnOutageWaitInParallel) {
  ConnectorOptions o = nats_options("owner", {server_.url()});
  o.nats.request_timeout = 500ms;
  Connector owner(o);
  server_.kill();
  std::this_thread::sleep_for(200ms);
  std::vector<std::vector<std::byte>> bufs(5, test::buffer(64));
  auto start = std::chrono::steady_clock::now();
  std::vector<std::future<WritableOperation>> creates;
  for (int i = 0; i < 5; ++i)
    creates.push_back(std::async(std::launch::async, [&, i] {
      return owner.create_writable({Descriptor(bufs[static_cast<std::size_t>(i)].data(), 64)},
                                   at("outage." + std::to_string(i)));
    }));
  for (auto& c : creates) c.get();
  // Each waits at most request_timeout for its confirmation, side by side.
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1500ms);
}

TEST(NatsEmbedded, DestroyingRightAfterCreatingOnTheLoopThreadDoesNotStall) {
  test::NatsServer server;
  uv_loop_t loop;
  ASSERT_EQ(uv_loop_init(&loop), 0);
  {
    ConnectorOptions o = nats_options("embedded", {server.url()});
    o.loop = &loop;
    o.nats.request_timeout = 5000ms;
    auto buf = test::buffer(64);
    auto start = std::chrono::steady_clock::now();
    {
      Connector c(o);
      auto readable = c.create_readable({Descriptor(buf.data(), buf.size())}, at("quick"));
    }
    uv_run(&loop, UV_RUN_DEFAULT);  // until the side channel has closed
    EXPECT_LT(std::chrono::steady_clock::now() - start, 2000ms);
  }
  EXPECT_EQ(uv_loop_close(&loop), 0);
}

}  // namespace
}  // namespace ferry
