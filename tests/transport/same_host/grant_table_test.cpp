// transport/same_host/grant_table.hpp: the owner's permission for one peer's copies, which keeps
// cancel()'s promise across processes.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "transport/same_host/grant_table.hpp"
#include "transport/same_host/system.hpp"

namespace ferry::transport::same_host {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// A second mapping of the owner's table, as a peer process has it.
GrantView view_of(const GrantTable& table) {
  return GrantView(fetch_fd(open_pidfd(::getpid()), ::getpid(), table.fd()), table.bytes());
}

TEST(GrantTable, APeerCopiesOnlyUnderALiveGrantOfItsGeneration) {
  GrantTable table(4);
  GrantView peer = view_of(table);
  auto g = table.open();
  ASSERT_TRUE(g.has_value());
  EXPECT_TRUE(peer.holds(*g));
  ASSERT_TRUE(peer.acquire(*g));
  EXPECT_EQ(table.in_flight(*g), 1u);
  peer.release(*g);
  EXPECT_EQ(table.in_flight(*g), 0u);
  Grant stale = *g;
  stale.generation += 1;
  EXPECT_FALSE(peer.acquire(stale)) << "a grant of another generation was taken";
  EXPECT_TRUE(table.close(*g, Clock::now() + 1s, {}));
  EXPECT_FALSE(peer.acquire(*g)) << "a copy started under an ended grant";
}

TEST(GrantTable, CloseWaitsForTheCopyUnderWayAndNoLonger) {
  GrantTable table(4);
  GrantView peer = view_of(table);
  auto g = table.open();
  ASSERT_TRUE(g.has_value());
  ASSERT_TRUE(peer.acquire(*g));
  std::atomic<bool> released{false};
  std::thread copier([&] {
    std::this_thread::sleep_for(150ms);
    released = true;
    peer.release(*g);
  });
  const auto at = Clock::now();
  EXPECT_TRUE(table.close(*g, Clock::now() + 10s, {}));
  EXPECT_TRUE(released.load()) << "close() returned while a copy was under way";
  EXPECT_LT(Clock::now() - at, 5s) << "close() did not wake when the copy ended";
  copier.join();
}

TEST(GrantTable, ACopyThatOutlivesTheDeadlineQuarantinesItsSlot) {
  GrantTable table(1);
  GrantView peer = view_of(table);
  auto g = table.open();
  ASSERT_TRUE(g.has_value());
  ASSERT_TRUE(peer.acquire(*g));
  EXPECT_FALSE(table.close(*g, Clock::now() + 50ms, {}));
  EXPECT_EQ(table.quarantined(), 1u);
  EXPECT_FALSE(table.open().has_value()) << "a quarantined slot was handed out again";
  peer.release(*g);
}

TEST(GrantTable, APeerThatExitedIsNotWaitedFor) {
  GrantTable table(2);
  GrantView peer = view_of(table);
  auto g = table.open();
  ASSERT_TRUE(g.has_value());
  ASSERT_TRUE(peer.acquire(*g));  // and never released: the peer "died"
  const auto at = Clock::now();
  EXPECT_TRUE(table.close(*g, Clock::now() + 10s, [] { return true; }));
  EXPECT_LT(Clock::now() - at, 1s);
  EXPECT_EQ(table.quarantined(), 0u);
}

TEST(GrantTable, SlotsAreReusedWithAFreshGenerationAndRunOut) {
  GrantTable table(2);
  auto a = table.open();
  auto b = table.open();
  ASSERT_TRUE(a && b);
  EXPECT_FALSE(table.open().has_value());
  ASSERT_TRUE(table.close(*a, Clock::now(), {}));
  auto c = table.open();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->slot, a->slot);
  EXPECT_NE(c->generation, a->generation);
  GrantView peer = view_of(table);
  EXPECT_FALSE(peer.acquire(*a)) << "the old generation took the reused slot";
  EXPECT_TRUE(peer.acquire(*c));
  peer.release(*c);
}

TEST(GrantTable, ALateReleaseOfAnOldGrantLeavesTheSlotsNextGrantAlone) {
  GrantTable table(1);
  GrantView peer = view_of(table);
  auto old = table.open();
  ASSERT_TRUE(old.has_value());
  ASSERT_TRUE(peer.acquire(*old));
  // The owner stopped waiting (a stopped peer), and the slot went to the next grant.
  ASSERT_TRUE(table.close(*old, Clock::now() + 1s, [] { return true; }));
  auto next = table.open();
  ASSERT_TRUE(next.has_value());
  ASSERT_EQ(next->slot, old->slot);
  ASSERT_TRUE(peer.acquire(*next));
  peer.release(*old);  // the stopped peer resumes and gives back what it held
  EXPECT_EQ(table.in_flight(*next), 1u) << "an old release took the new grant's copy away";
  peer.release(*next);
  EXPECT_EQ(table.in_flight(*next), 0u);
}

TEST(GrantView, ASlotOutsideTheTableIsNotHeld) {
  GrantTable table(2);
  GrantView peer = view_of(table);
  EXPECT_FALSE(peer.holds(Grant{2, 1}));
  EXPECT_FALSE(peer.holds(Grant{0, 0}));
  EXPECT_TRUE(peer.holds(Grant{1, 7}));
}

}  // namespace
}  // namespace ferry::transport::same_host
