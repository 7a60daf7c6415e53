// The side channel's limit on answers per served subscription (sidechannel::AnswerLimit): a
// token bucket per key, with time given by the test.
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "sidechannel/answer_limit.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using sidechannel::AnswerLimit;
using Clock = AnswerLimit::Clock;

int admitted(AnswerLimit& limit, const std::string& subject, int asked, Clock::time_point now) {
  int n = 0;
  for (int i = 0; i < asked; ++i) n += limit.admit(subject, now) ? 1 : 0;
  return n;
}

TEST(AnswerLimit, AnswersABurstThenAtTheRate) {
  AnswerLimit limit(8, 4);
  const auto t0 = Clock::now();
  EXPECT_EQ(admitted(limit, "s", 1000, t0), 8);
  EXPECT_EQ(admitted(limit, "s", 1000, t0 + 500ms), 2);
  EXPECT_EQ(admitted(limit, "s", 1000, t0 + 1500ms), 4);
  // Refills up to the burst, no further.
  EXPECT_EQ(admitted(limit, "s", 1000, t0 + 60s), 8);
}

TEST(AnswerLimit, EachKeyHasItsOwnBucket) {
  AnswerLimit limit(2, 1);
  const auto t0 = Clock::now();
  EXPECT_EQ(admitted(limit, "a", 10, t0), 2);
  EXPECT_EQ(admitted(limit, "b", 10, t0), 2);
  EXPECT_EQ(limit.subjects(), 2u);
}

TEST(AnswerLimit, ZeroPerSecondIsNoLimit) {
  AnswerLimit limit(1, 0);
  EXPECT_EQ(admitted(limit, "s", 1000, Clock::now()), 1000);
}

TEST(AnswerLimit, RefusalsAreNotedOnceEveryTenSeconds) {
  AnswerLimit limit(1, 1);
  const auto t0 = Clock::now();
  EXPECT_FALSE(limit.note_due(t0).has_value());  // nothing refused yet
  admitted(limit, "s", 5, t0);
  EXPECT_EQ(limit.note_due(t0), 4u);
  admitted(limit, "s", 3, t0);
  EXPECT_FALSE(limit.note_due(t0 + 9s).has_value());
  EXPECT_EQ(limit.note_due(t0 + 10s), 3u);
}

TEST(AnswerLimit, FullBucketsAreForgottenOnceThereAreMany) {
  AnswerLimit limit(4, 4);
  const auto t0 = Clock::now();
  for (std::size_t i = 0; i < AnswerLimit::kPruneAbove; ++i)
    ASSERT_TRUE(limit.admit("op." + std::to_string(i), t0));
  EXPECT_EQ(limit.subjects(), AnswerLimit::kPruneAbove);
  // A second later all have refilled: the next new subject makes room.
  EXPECT_TRUE(limit.admit("next", t0 + 1s));
  EXPECT_EQ(limit.subjects(), 1u);
  // A bucket still draining is kept.
  EXPECT_EQ(admitted(limit, "next", 10, t0 + 1s), 3);
  EXPECT_FALSE(limit.admit("next", t0 + 1s));
}

}  // namespace
}  // namespace ferry
