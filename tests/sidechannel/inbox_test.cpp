// What waits at a channel's inbox (sidechannel::Inbox), without NATS: answers reach their
// request once and only at the subject request() gives them; the open requests are capped;
// confirmations end at their deadline, on a restart's new deadline, or when taken; ids are
// fresh, and a random source that fails or repeats itself ends in an error, never a loop.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include <ferry/error.hpp>

#include "sidechannel/inbox.hpp"
#include "sidechannel/nats_channel.hpp"
#include "tests/sidechannel/captured_log.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using sidechannel::Inbox;
using sidechannel::Message;

constexpr const char* kSubject = "ferry.inbox.00000000000000b2";

Message at(const std::string& subject, const std::string& data = {}) {
  Message m;
  m.subject = subject;
  m.data = data;
  return m;
}

struct RandomSourceFor {
  explicit RandomSourceFor(sidechannel::RandomSource source)
      : previous(sidechannel::set_random_source_for_testing(source)) {}
  ~RandomSourceFor() { sidechannel::set_random_source_for_testing(previous); }
  sidechannel::RandomSource previous;
};

class InboxTest : public ::testing::Test {
 protected:
  test::CapturedLog said_;
  Inbox inbox_{kSubject, 16, said_.log()};
};

// --- Requests -----------------------------------------------------------------------------

TEST_F(InboxTest, AnAnswerReachesItsRequestOnceAtTheSubjectRequestGivesIt) {
  std::vector<std::string> got;
  const std::uint64_t id = inbox_.open_request([&](const Message& m) { got.push_back(m.data); });
  const std::string reply = inbox_.request_subject(id);
  EXPECT_TRUE(sidechannel::is_reply_inbox("ferry", reply)) << reply;
  EXPECT_EQ(inbox_.open_requests(), 1u);
  inbox_.deliver(at(reply, "first"));
  inbox_.deliver(at(reply, "second"));
  EXPECT_EQ(got, std::vector<std::string>{"first"});
  EXPECT_EQ(inbox_.open_requests(), 0u);
}

TEST_F(InboxTest, MessagesOfAnyOtherFormReachNobody) {
  int called = 0;
  const std::uint64_t id = inbox_.open_request([&](const Message&) { ++called; });
  const std::string reply = inbox_.request_subject(id);
  const std::string hex = reply.substr(reply.rfind(".r") + 2);
  for (const std::string& foreign : {
           "ferry.inbox.00000000000000a1.r" + hex,  // another channel's inbox
           std::string(kSubject) + ".x" + hex,
           std::string(kSubject) + ".c" + hex,  // a confirmation with the request's id
           std::string(kSubject) + ".r",
           std::string(kSubject) + ".r" + hex + "0",  // another number
           std::string(kSubject) + ".r0" + hex,
           std::string(kSubject) + ".r" + hex + ".x",
           std::string(kSubject) + "x.r" + hex,
           std::string(kSubject),
       })
    inbox_.deliver(at(foreign));
  EXPECT_EQ(called, 0);
  EXPECT_EQ(inbox_.open_requests(), 1u);
}

TEST_F(InboxTest, ADroppedRequestIsNeverAnswered) {
  int called = 0;
  const std::uint64_t id = inbox_.open_request([&](const Message&) { ++called; });
  inbox_.drop_request(id);
  inbox_.drop_request(id);  // unknown by now: ignored
  inbox_.deliver(at(inbox_.request_subject(id)));
  EXPECT_EQ(called, 0);
  EXPECT_EQ(inbox_.open_requests(), 0u);
}

TEST_F(InboxTest, BeyondTheCapTheOldestRequestsAreDroppedAndThatIsSaidOnce) {
  std::vector<int> answered;
  std::vector<std::uint64_t> ids;
  for (int i = 0; i < 20; ++i)
    ids.push_back(inbox_.open_request([&answered, i](const Message&) { answered.push_back(i); }));
  EXPECT_EQ(inbox_.open_requests(), 16u);
  for (std::uint64_t id : ids) inbox_.deliver(at(inbox_.request_subject(id)));
  std::vector<int> newest;
  for (int i = 4; i < 20; ++i) newest.push_back(i);
  EXPECT_EQ(answered, newest);
  EXPECT_EQ(said_.count("more than 16 NATS requests are open; dropping the oldest"), 1u)
      << said_.text();
}

// --- Confirmations ------------------------------------------------------------------------

TEST_F(InboxTest, AConfirmationEndsTheWaitWithoutAnError) {
  std::vector<std::string> heard;
  const auto id = inbox_.await_confirm([&](const std::string& e) { heard.push_back(e); }, "svc", 7,
                                       Inbox::Clock::now() + 1s);
  inbox_.deliver(at(inbox_.confirm_subject(id)));
  inbox_.deliver(at(inbox_.confirm_subject(id)));
  EXPECT_EQ(heard, std::vector<std::string>{""});
  EXPECT_EQ(inbox_.pending_confirmations(), 0u);
  EXPECT_FALSE(inbox_.earliest_deadline());
  // A confirmation subject is not a reply inbox: no one may be answered there.
  EXPECT_FALSE(sidechannel::is_reply_inbox("ferry", inbox_.confirm_subject(id)));
}

TEST_F(InboxTest, WaitsExpireAtTheirDeadlineNamingTheSubject) {
  const auto t0 = Inbox::Clock::now();
  std::vector<std::string> heard;
  auto note = [&](const std::string& e) { heard.push_back(e); };
  inbox_.await_confirm(note, "early", 1, t0 + 1s);
  inbox_.await_confirm(note, "late", 2, t0 + 2s);
  EXPECT_EQ(inbox_.earliest_deadline(), t0 + 1s);
  EXPECT_TRUE(inbox_.take_expired(t0 + 999ms, 300ms).empty());
  auto expired = inbox_.take_expired(t0 + 1s, 300ms);
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].second,
            "the NATS server did not confirm the subscription to 'early' within 300 ms");
  expired[0].first(expired[0].second);
  EXPECT_EQ(heard.size(), 1u);
  EXPECT_EQ(inbox_.pending_confirmations(), 1u);
  EXPECT_EQ(inbox_.earliest_deadline(), t0 + 2s);
}

TEST_F(InboxTest, ARestartMovesEveryDeadlineAndNamesWhatToSendAgain) {
  const auto t0 = Inbox::Clock::now();
  const auto a = inbox_.await_confirm([](const std::string&) {}, "a", 1, t0 + 1s);
  const auto b = inbox_.await_confirm([](const std::string&) {}, "b", 2, t0 + 2s);
  auto again = inbox_.restart_confirms(t0 + 5s);
  EXPECT_EQ(std::set<std::string>(again.begin(), again.end()),
            (std::set<std::string>{inbox_.confirm_subject(a), inbox_.confirm_subject(b)}));
  EXPECT_EQ(inbox_.earliest_deadline(), t0 + 5s);
  EXPECT_TRUE(inbox_.take_expired(t0 + 4s, 1000ms).empty());
}

TEST_F(InboxTest, AWaitIsTakenByItsIdBySubscriptionOrAllAtOnce) {
  const auto later = Inbox::Clock::now() + 1h;
  std::vector<std::string> heard;
  auto note = [&](const std::string& e) { heard.push_back(e); };
  const auto one = inbox_.await_confirm(note, "one", 1, later);
  inbox_.await_confirm(note, "two", 2, later);
  inbox_.await_confirm(note, "three", 3, later);
  ASSERT_TRUE(inbox_.take_confirm(one));
  EXPECT_FALSE(inbox_.take_confirm(one));
  ASSERT_TRUE(inbox_.take_confirm_of(2));
  EXPECT_FALSE(inbox_.take_confirm_of(2));
  EXPECT_EQ(inbox_.pending_confirmations(), 1u);
  auto all = inbox_.take_all_confirms();
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(inbox_.pending_confirmations(), 0u);
  EXPECT_TRUE(heard.empty());  // taking a wait tells nobody; the taker does
}

TEST_F(InboxTest, ClearForgetsEverythingAndTellsNobody) {
  int called = 0;
  inbox_.open_request([&](const Message&) { ++called; });
  inbox_.await_confirm([&](const std::string&) { ++called; }, "svc", 1, Inbox::Clock::now());
  inbox_.clear();
  EXPECT_EQ(inbox_.open_requests(), 0u);
  EXPECT_EQ(inbox_.pending_confirmations(), 0u);
  EXPECT_TRUE(inbox_.take_expired(Inbox::Clock::now() + 1s, 1ms).empty());
  EXPECT_EQ(called, 0);
}

// --- Ids ----------------------------------------------------------------------------------

TEST(InboxIds, AreNonZeroAndDistinct) {
  Inbox inbox(kSubject, 100000, {});
  std::set<std::uint64_t> ids;
  for (int i = 0; i < 1000; ++i) ids.insert(inbox.open_request([](const Message&) {}));
  EXPECT_EQ(ids.size(), 1000u);
  EXPECT_EQ(ids.count(0), 0u);
}

std::uint64_t zero_then_seven() {
  static int calls = 0;
  return ++calls == 1 ? 0 : 7;
}
std::uint64_t always_42() { return 42; }
std::uint64_t failing() { throw Error(ErrorCode::Internal, "getrandom: Function not implemented"); }

TEST(InboxIds, ComeFromTheRandomSourceSkippingZero) {
  RandomSourceFor source(&zero_then_seven);
  Inbox inbox(kSubject, 16, {});
  EXPECT_EQ(inbox.open_request([](const Message&) {}), 7u);
  EXPECT_EQ(inbox.request_subject(7), std::string(kSubject) + ".r7");
}

TEST(InboxIds, ASourceThatRepeatsItselfEndsInAnErrorNotALoop) {
  RandomSourceFor source(&always_42);
  Inbox inbox(kSubject, 16, {});
  EXPECT_EQ(inbox.open_request([](const Message&) {}), 42u);
  test::expect_error([&] { inbox.open_request([](const Message&) {}); }, ErrorCode::Internal,
                     "the random source repeats itself");
  EXPECT_EQ(inbox.open_requests(), 1u);
  EXPECT_EQ(inbox.await_confirm([](const std::string&) {}, "svc", 1, Inbox::Clock::now()), 42u);
  test::expect_error(
      [&] { inbox.await_confirm([](const std::string&) {}, "svc", 2, Inbox::Clock::now()); },
      ErrorCode::Internal, "the random source repeats itself");
  EXPECT_EQ(inbox.pending_confirmations(), 1u);
}

TEST(InboxIds, AFailingSourceFailsTheCallAndChangesNothing) {
  Inbox inbox(kSubject, 2, {});
  int called = 0;
  inbox.open_request([&](const Message&) { ++called; });
  inbox.open_request([&](const Message&) { ++called; });
  RandomSourceFor source(&failing);
  // At the cap: a request that could not be opened must not have dropped the oldest.
  test::expect_error([&] { inbox.open_request([](const Message&) {}); }, ErrorCode::Internal,
                     "getrandom");
  EXPECT_EQ(inbox.open_requests(), 2u);
  test::expect_error(
      [&] { inbox.await_confirm([&](const std::string&) { ++called; }, "svc", 1, {}); },
      ErrorCode::Internal, "getrandom");
  EXPECT_EQ(inbox.pending_confirmations(), 0u);
  EXPECT_EQ(called, 0);
}

}  // namespace
}  // namespace ferry
