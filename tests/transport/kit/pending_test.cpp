// PendingRequests: an answer counts only from the connection its request went out on.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "transport/kit/pending.hpp"

namespace ferry::transport::kit {
namespace {

TEST(PendingRequests, IdsAreFreshAndAnswersCountOnlyFromTheirConnection) {
  PendingRequests<std::string> pending;
  const std::uint64_t a = pending.add(1, "to one");
  const std::uint64_t b = pending.add(2, "to two");
  EXPECT_NE(a, b);
  EXPECT_EQ(pending.find(a, 2), nullptr) << "connection 2 answered what was asked of 1";
  EXPECT_FALSE(pending.take(a, 2).has_value());
  ASSERT_NE(pending.find(a, 1), nullptr);
  EXPECT_EQ(*pending.find(a, 1), "to one");
  EXPECT_EQ(pending.take(a, 1), std::optional<std::string>("to one"));
  EXPECT_FALSE(pending.take(a, 1).has_value()) << "answered twice";
  EXPECT_EQ(pending.size(), 1u);
  // An id is never handed out again, even once answered.
  EXPECT_GT(pending.add(1, "again"), b);
}

TEST(PendingRequests, CountsPerConnectionAndForgetsAConnectionsRequestsWithIt) {
  std::map<std::uint64_t, int> count;
  PendingRequests<int> pending([&](std::uint64_t conn, int delta) { count[conn] += delta; });
  const std::uint64_t a = pending.add(1, 10);
  pending.add(1, 11);
  const std::uint64_t c = pending.add(2, 20);
  EXPECT_EQ(count[1], 2);
  EXPECT_EQ(count[2], 1);
  pending.forget(a);
  EXPECT_EQ(count[1], 1);
  pending.forget_if([](int v) { return v == 11; });
  EXPECT_EQ(count[1], 0);
  pending.drop_connection(2);  // gone with its watchdog: not counted
  EXPECT_EQ(count[2], 1);
  EXPECT_EQ(pending.find(c, 2), nullptr);
  EXPECT_TRUE(pending.empty());
}

}  // namespace
}  // namespace ferry::transport::kit
