// Admission: the bounds every listener puts on peers that have proven nothing.
#include <gtest/gtest.h>

#include <uv.h>

#include <chrono>
#include <string>
#include <vector>

#include "transport/kit/admission.hpp"

namespace ferry::transport::kit {
namespace {

using namespace std::chrono_literals;

class AdmissionTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(uv_loop_init(&loop_), 0); }
  void TearDown() override {
    admission_.reset();
    uv_run(&loop_, UV_RUN_DEFAULT);
    EXPECT_EQ(uv_loop_close(&loop_), 0);
  }
  Admission& make(ListenerOptions bounds) {
    admission_ = std::make_unique<Admission>(&loop_, bounds,
                                             [this](std::uint64_t id, const std::string& why) {
                                               evicted_.push_back(id);
                                               reasons_.push_back(why);
                                             });
    return *admission_;
  }
  /// Admits and accepts peer `id`; false if the listener was full.
  bool join(std::uint64_t id) {
    if (!admission_->admit()) return false;
    admission_->accepted(id);
    return true;
  }

  uv_loop_t loop_{};
  std::unique_ptr<Admission> admission_;
  std::vector<std::uint64_t> evicted_;
  std::vector<std::string> reasons_;
};

TEST_F(AdmissionTest, RoomIsMadeFromTheSilentFirstThenTheGreetedNeverTheClaimed) {
  ListenerOptions b;
  b.max_unclaimed = 3;
  Admission& a = make(b);
  ASSERT_TRUE(join(1));
  ASSERT_TRUE(join(2));
  ASSERT_TRUE(join(3));
  a.heard(1);    // greeted, the oldest
  a.claimed(3);  // claimed: bound by the total alone
  ASSERT_TRUE(join(4));
  ASSERT_TRUE(join(5));  // unclaimed: 1 (greeted), 2, 4 (silent): 2 goes
  EXPECT_EQ(evicted_, (std::vector<std::uint64_t>{2}));
  ASSERT_TRUE(join(6));  // 1, 4, 5: 4 goes
  a.heard(5);
  a.heard(6);
  ASSERT_TRUE(join(7));  // 1, 5, 6 all greeted: the oldest, 1, goes
  EXPECT_EQ(evicted_, (std::vector<std::uint64_t>{2, 4, 1}));
  EXPECT_NE(reasons_[0].find("said nothing"), std::string::npos) << reasons_[0];
  EXPECT_EQ(a.unclaimed(), 3u);
  EXPECT_EQ(a.connections(), 4u);  // 3, 5, 6, 7
}

TEST_F(AdmissionTest, AFullListenerRefusesAndAClosedPeerMakesRoom) {
  ListenerOptions b;
  b.max_connections = 2;
  Admission& a = make(b);
  ASSERT_TRUE(join(1));
  ASSERT_TRUE(join(2));
  a.claimed(1);
  a.claimed(2);
  EXPECT_FALSE(a.admit());
  EXPECT_TRUE(evicted_.empty()) << "a claimed peer was evicted for room";
  a.closed(2);
  EXPECT_TRUE(join(3));
}

TEST_F(AdmissionTest, AnUnclaimedPeerIsClosedAfterTheTimeoutAndAClaimedOneIsNot) {
  ListenerOptions b;
  b.unclaimed_timeout = 50ms;
  Admission& a = make(b);
  ASSERT_TRUE(join(1));
  ASSERT_TRUE(join(2));
  a.claimed(2);
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (evicted_.empty() && std::chrono::steady_clock::now() < until) uv_run(&loop_, UV_RUN_ONCE);
  EXPECT_EQ(evicted_, (std::vector<std::uint64_t>{1}));
  // With no unclaimed peer left, the sweep stops: the loop has nothing to wait for.
  EXPECT_EQ(uv_run(&loop_, UV_RUN_NOWAIT), 0);
  EXPECT_EQ(a.connections(), 1u);
}

TEST_F(AdmissionTest, TheTotalStaysBelowTheDescriptorLimit) {
  ListenerOptions b;
  b.max_connections = std::size_t{1} << 40;
  Admission& a = make(b);
  EXPECT_LT(a.max_connections(), b.max_connections);
}

}  // namespace
}  // namespace ferry::transport::kit
