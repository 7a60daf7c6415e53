// The side channel's ordered worker (sidechannel::Outbox): tasks run one at a time, in the
// order pushed, on a thread of its own; finishing runs what is queued and takes nothing more.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>
#include <vector>

#include "sidechannel/outbox.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using sidechannel::Outbox;

TEST(Outbox, RunsTasksInTheOrderPushedOnItsOwnThread) {
  std::vector<int> ran;  // written by the outbox's thread alone
  std::thread::id where;
  {
    Outbox outbox;
    // From several threads, each in its own order.
    std::vector<std::thread> pushers;
    std::vector<std::vector<int>> per_thread(4);
    for (int t = 0; t < 4; ++t)
      pushers.emplace_back([&, t] {
        for (int i = 0; i < 500; ++i)
          outbox.push([&, t, i] {
            where = std::this_thread::get_id();
            per_thread[t].push_back(i);
            ran.push_back(t);
          });
      });
    for (auto& p : pushers) p.join();
    outbox.stop();
    for (const auto& order : per_thread) {
      ASSERT_EQ(order.size(), 500u);
      for (int i = 0; i < 500; ++i) EXPECT_EQ(order[i], i);
    }
  }
  EXPECT_EQ(ran.size(), 2000u);
  EXPECT_NE(where, std::this_thread::get_id());
}

TEST(Outbox, OneTaskAtATime) {
  std::atomic<int> running{0}, most{0};
  Outbox outbox;
  for (int i = 0; i < 200; ++i)
    outbox.push([&] {
      most = std::max(most.load(), ++running);
      std::this_thread::yield();
      --running;
    });
  outbox.stop();
  EXPECT_EQ(most.load(), 1);
}

TEST(Outbox, FinishingRunsWhatIsQueuedAndTakesNothingMore) {
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<int> ran{0};
  Outbox outbox;
  outbox.push([released] { released.wait(); });  // holds the thread while more queue up
  for (int i = 0; i < 10; ++i) outbox.push([&] { ++ran; });
  outbox.finish();
  outbox.push([&] { ran += 100; });  // after finish(): dropped
  release.set_value();
  outbox.stop();
  EXPECT_EQ(ran.load(), 10);
  outbox.stop();  // idempotent
}

TEST(Outbox, TheDestructorRunsWhatIsQueuedThenJoins) {
  std::atomic<int> ran{0};
  {
    Outbox outbox;
    for (int i = 0; i < 10; ++i)
      outbox.push([&] {
        std::this_thread::sleep_for(1ms);
        ++ran;
      });
  }
  EXPECT_EQ(ran.load(), 10);
}

}  // namespace
}  // namespace ferry
