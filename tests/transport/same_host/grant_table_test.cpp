// transport/same_host/grant_table.hpp: the owner's permission for one peer's copies, which keeps
// cancel()'s promise across processes.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mman.h>
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

// ---------------------------------------------------------------------------------------
// What a peer maps: never more than the owner's sealed memfd holds (a malicious owner would
// otherwise fault its reader's copies with SIGBUS).

/// A memfd of `bytes`, sealed with `seals` (0: none), as a peer would fetch it.
int memfd_of(std::size_t bytes, int seals) {
  const int fd = ::memfd_create("ferry-test-table", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(bytes)), 0);
  if (seals != 0) {
    EXPECT_EQ(::fcntl(fd, F_ADD_SEALS, seals), 0);
  }
  return fd;
}

ErrorCode refusal(int fd, std::size_t bytes) {
  try {
    GrantView view(fd, bytes);
  } catch (const Error& e) {
    return e.code();
  }
  return ErrorCode::Internal;  // mapped: not what these cases expect
}

TEST(GrantView, ATableItsOwnerCouldShrinkIsNotMapped) {
  EXPECT_EQ(refusal(memfd_of(4096, 0), 4096), ErrorCode::ProtocolError) << "unsealed";
  EXPECT_EQ(refusal(memfd_of(4096, F_SEAL_GROW), 4096), ErrorCode::ProtocolError)
      << "sealed against growing only";
}

TEST(GrantView, ATableSmallerOrLargerThanItsMetadataSaysIsNotMapped) {
  constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW;
  EXPECT_EQ(refusal(memfd_of(4096, kSeals), 8192), ErrorCode::ProtocolError) << "overstated";
  EXPECT_EQ(refusal(memfd_of(8192, kSeals), 4096), ErrorCode::ProtocolError) << "understated";
  EXPECT_EQ(refusal(memfd_of(4096, kSeals), 4095), ErrorCode::ProtocolError) << "part of a slot";
  EXPECT_EQ(refusal(memfd_of(4096, kSeals), 0), ErrorCode::ProtocolError) << "empty";
  EXPECT_EQ(refusal(memfd_of(4096, kSeals), std::size_t{1} << 40), ErrorCode::ProtocolError)
      << "a terabyte";
  // A plain file cannot be sealed at all.
  char name[] = "/tmp/ferry-grant-XXXXXX";
  const int file = ::mkstemp(name);
  ASSERT_GE(file, 0);
  ::unlink(name);
  ASSERT_EQ(::ftruncate(file, 4096), 0);
  EXPECT_EQ(refusal(file, 4096), ErrorCode::ProtocolError) << "a file that is no memfd";
  // And the real thing is mapped.
  GrantView ok(memfd_of(4096, kSeals), 4096);
  EXPECT_TRUE(ok.holds(Grant{511, 1}));
  EXPECT_FALSE(ok.holds(Grant{512, 1}));
}

TEST(GrantTable, ItsMemfdCanNeitherShrinkNorGrow) {
  GrantTable table(4);
  EXPECT_NE(::ftruncate(table.fd(), 8), 0) << "the owner's table shrank";
  EXPECT_NE(::ftruncate(table.fd(), static_cast<off_t>(table.bytes() * 2)), 0)
      << "the owner's table grew";
  EXPECT_NE(::fcntl(table.fd(), F_ADD_SEALS, F_SEAL_WRITE), 0) << "the seals can be changed";
}

// ---------------------------------------------------------------------------------------
// Slots come back: none leaks to a peer that scribbles or stalls.

/// The slot's word, written as a peer that breaks the protocol would.
void scribble(const GrantTable& table, std::uint32_t slot, std::uint64_t value) {
  void* p = ::mmap(nullptr, table.bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, table.fd(), 0);
  ASSERT_NE(p, MAP_FAILED);
  std::atomic_ref<std::uint64_t>(static_cast<std::uint64_t*>(p)[slot]).store(value);
  ::munmap(p, table.bytes());
}

TEST(GrantTable, ASlotWhoseGenerationAPeerOverwroteIsReusedAfterClose) {
  GrantTable table(1);
  for (int round = 0; round < 3; ++round) {
    auto g = table.open();
    ASSERT_TRUE(g.has_value()) << "round " << round << ": the slot leaked";
    scribble(table, g->slot, (std::uint64_t{g->generation} + 7) << 32 | 3);
    EXPECT_TRUE(table.close(*g, Clock::now() + 10s, {}));
  }
  EXPECT_EQ(table.held(), 0u);
}

TEST(GrantTable, AQuarantinedSlotComesBackOnceItsCopyIsGivenBack) {
  GrantTable table(1);
  GrantView peer = view_of(table);
  auto g = table.open();
  ASSERT_TRUE(g.has_value());
  ASSERT_TRUE(peer.acquire(*g));
  EXPECT_FALSE(table.close(*g, Clock::now(), {}));
  EXPECT_EQ(table.held(), 1u);
  EXPECT_FALSE(table.open().has_value()) << "handed out while its copy was under way";
  peer.release(*g);
  auto next = table.open();
  ASSERT_TRUE(next.has_value()) << "the slot stayed quarantined after its copy ended";
  EXPECT_EQ(next->slot, g->slot);
  EXPECT_NE(next->generation, g->generation);
  EXPECT_EQ(table.held(), 0u);
}

TEST(GrantTable, AQuarantinedSlotComesBackOnceItsPeerCopiesNothing) {
  GrantTable table(1);
  GrantView peer = view_of(table);
  auto g = table.open();
  ASSERT_TRUE(g.has_value());
  ASSERT_TRUE(peer.acquire(*g));  // and never released
  bool gone = false;
  EXPECT_FALSE(table.close(*g, Clock::now(), [&] { return gone; }));
  EXPECT_FALSE(table.open().has_value());
  gone = true;  // its process exited, say
  auto next = table.open();
  ASSERT_TRUE(next.has_value()) << "the slot of a peer that copies nothing stayed quarantined";
  EXPECT_FALSE(peer.acquire(*g)) << "the old generation took the reused slot";
}

}  // namespace
}  // namespace ferry::transport::same_host
