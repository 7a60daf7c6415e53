// LinkPool: links kept for reuse by address, within a bound on idle ones.
#include <gtest/gtest.h>

#include <uv.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "transport/kit/link_pool.hpp"

namespace ferry::transport::kit {
namespace {

struct FakeLink {
  explicit FakeLink(int* closed) : closed_(closed) {}
  bool usable() const { return ok; }
  bool idle() const { return users == 0; }
  void close() { ++*closed_; }
  std::chrono::steady_clock::time_point idle_since{};
  bool ok = true;
  int users = 0;

 private:
  int* closed_;
};

class LinkPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(uv_loop_init(&loop_), 0);
    pool_ = std::make_unique<LinkPool<FakeLink>>(
        &loop_, [this](std::function<void()> f) { deferred_.push_back(std::move(f)); });
  }
  void TearDown() override {
    pool_.reset();
    uv_run(&loop_, UV_RUN_DEFAULT);
    EXPECT_EQ(uv_loop_close(&loop_), 0);
  }
  FakeLink* add(const std::string& address) {
    return pool_->add(address, std::make_unique<FakeLink>(&closed_));
  }
  void run_deferred() {
    auto now = std::move(deferred_);
    deferred_.clear();
    for (auto& f : now) f();
  }

  uv_loop_t loop_{};
  int closed_ = 0;
  std::vector<std::function<void()>> deferred_;
  std::unique_ptr<LinkPool<FakeLink>> pool_;
};

TEST_F(LinkPoolTest, IdleLinksBeyondTheBoundCloseLeastRecentlyUsedFirst) {
  constexpr int kLinks = static_cast<int>(LinkPool<FakeLink>::kMaxIdle) + 10;
  for (int i = 0; i < kLinks; ++i) pool_->released(add("peer:" + std::to_string(i)));
  EXPECT_EQ(closed_, 10);
  run_deferred();
  EXPECT_EQ(pool_->size(), LinkPool<FakeLink>::kMaxIdle);
  EXPECT_EQ(pool_->find("peer:0"), nullptr) << "the least recently used was kept";
  EXPECT_NE(pool_->find("peer:" + std::to_string(kLinks - 1)), nullptr);
}

TEST_F(LinkPoolTest, ALinkInUseIsNeverClosedForRoom) {
  FakeLink* busy = add("busy");
  busy->users = 1;
  pool_->released(busy);  // not idle: nothing happens
  for (int i = 0; i < static_cast<int>(LinkPool<FakeLink>::kMaxIdle) + 5; ++i)
    pool_->released(add("peer:" + std::to_string(i)));
  EXPECT_EQ(pool_->find("busy"), busy);
}

TEST_F(LinkPoolTest, AnUnusableLinkLeavesTheIndexAndGoesOnceIdle) {
  FakeLink* broken = add("a");
  broken->users = 1;
  broken->ok = false;
  EXPECT_EQ(pool_->find("a"), nullptr);
  EXPECT_EQ(closed_, 0) << "closed under the transfers it carries";
  EXPECT_EQ(pool_->size(), 1u);
  FakeLink* fresh = add("a");
  EXPECT_EQ(pool_->find("a"), fresh);
  broken->users = 0;
  pool_->released(broken);
  EXPECT_EQ(closed_, 1);
  run_deferred();
  EXPECT_EQ(pool_->size(), 1u);
}

}  // namespace
}  // namespace ferry::transport::kit
