// transport/kit/registration_cache.hpp: reuse, merging, invalidation, idle trimming, and a
// method that refuses. The cache only compares addresses; none is dereferenced.
#include "transport/kit/registration_cache.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include <ferry/error.hpp>

namespace ferry::transport::kit {
namespace {

Region at(std::uint64_t base, std::uint64_t size, MemoryKind kind = MemoryKind::host) {
  return Region{reinterpret_cast<std::byte*>(base), size, kind};
}

/// A method that records what it was asked to register and hands out a handle per call,
/// counting the handles still alive.
struct Method {
  std::vector<Region> asked;
  std::shared_ptr<int> live = std::make_shared<int>(0);
  bool refuse = false;

  RegistrationCache::RegisterFn fn() {
    return [this](const Region& r) -> std::shared_ptr<void> {
      asked.push_back(r);
      if (refuse) throw Error(ErrorCode::Unsupported, "the method refuses");
      ++*live;
      return std::shared_ptr<void>(new int(0), [live = live](void* p) {
        --*live;
        delete static_cast<int*>(p);
      });
    };
  }
};

TEST(RegistrationCache, ARangeInsideACachedOneReusesIt) {
  Method m;
  RegistrationCache cache(m.fn());
  auto whole = cache.acquire(at(0x10000, 0x4000));
  auto inner = cache.acquire(at(0x11000, 0x100));
  auto same = cache.acquire(at(0x10000, 0x4000));
  auto last_byte = cache.acquire(at(0x13fff, 1));
  EXPECT_EQ(inner, whole);
  EXPECT_EQ(same, whole);
  EXPECT_EQ(last_byte, whole);
  EXPECT_EQ(cache.registrations(), 1u);
  EXPECT_EQ(m.asked.size(), 1u);
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(whole->base, 0x10000u);
  EXPECT_EQ(whole->size, 0x4000u);
  EXPECT_EQ(cache.find(0x12000, 0x10), whole);
  EXPECT_EQ(cache.find(0x13fff, 2), nullptr);  // runs one byte past its end
}

TEST(RegistrationCache, OverlappingRangesMergeIntoOneThatReplacesThem) {
  Method m;
  RegistrationCache cache(m.fn());
  auto a = cache.acquire(at(0x10000, 0x1000));
  auto b = cache.acquire(at(0x20000, 0x1000));
  ASSERT_EQ(cache.size(), 2u);
  // Overlaps the end of a and the start of b: one registration spans all three.
  auto merged = cache.acquire(at(0x10800, 0x10000));
  EXPECT_EQ(merged->base, 0x10000u);
  EXPECT_EQ(merged->size, 0x11000u);
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(cache.registrations(), 3u);
  ASSERT_EQ(m.asked.size(), 3u);
  EXPECT_EQ(reinterpret_cast<std::uint64_t>(m.asked[2].ptr), 0x10000u);
  EXPECT_EQ(m.asked[2].size, 0x11000u);
  // The index answers with the merged one from now on...
  EXPECT_EQ(cache.find(0x10000, 0x10), merged);
  EXPECT_EQ(cache.find(0x20000, 0x10), merged);
  EXPECT_EQ(cache.acquire(at(0x10000, 0x1000)), merged);
  // ...while the holders of the old ones keep theirs, intact, until they let go.
  EXPECT_EQ(a->base, 0x10000u);
  EXPECT_EQ(a->size, 0x1000u);
  EXPECT_EQ(b->base, 0x20000u);
  EXPECT_EQ(*m.live, 3);
  a.reset();
  b.reset();
  EXPECT_EQ(*m.live, 1);
}

TEST(RegistrationCache, TouchingRangesMerge) {
  Method m;
  RegistrationCache cache(m.fn());
  auto left = cache.acquire(at(0x10000, 0x1000));
  auto right = cache.acquire(at(0x12000, 0x1000));
  // Ends where `right` starts and starts where `left` ends.
  auto middle = cache.acquire(at(0x11000, 0x1000));
  EXPECT_EQ(middle->base, 0x10000u);
  EXPECT_EQ(middle->size, 0x3000u);
  EXPECT_EQ(cache.size(), 1u);
}

TEST(RegistrationCache, DisjointRangesStayApart) {
  Method m;
  RegistrationCache cache(m.fn());
  auto a = cache.acquire(at(0x10000, 0x1000));
  auto b = cache.acquire(at(0x11001, 0x1000));  // a one-byte gap
  EXPECT_NE(a, b);
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(a->size, 0x1000u);
  EXPECT_EQ(cache.find(0x10fff, 3), nullptr);  // across the gap
}

TEST(RegistrationCache, InvalidateForgetsOverlappingRegistrationsButNotTheirHolders) {
  Method m;
  RegistrationCache cache(m.fn());
  auto a = cache.acquire(at(0x10000, 0x1000));
  auto b = cache.acquire(at(0x20000, 0x1000));
  cache.invalidate(at(0x10fff, 1));  // the last byte of a
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(cache.find(0x10000, 1), nullptr);
  EXPECT_EQ(cache.find(0x20000, 1), b);
  EXPECT_EQ(a->base, 0x10000u);  // still held
  EXPECT_EQ(*m.live, 2);
  // The memory was freed and maybe reused: the next acquire registers anew.
  auto again = cache.acquire(at(0x10000, 0x1000));
  EXPECT_NE(again, a);
  EXPECT_EQ(cache.registrations(), 3u);
  a.reset();
  EXPECT_EQ(*m.live, 2);
  // A range that only touches a registration leaves it alone.
  cache.invalidate(at(0x21000, 0x1000));
  EXPECT_EQ(cache.find(0x20000, 1), b);
}

TEST(RegistrationCache, IdleRegistrationsBeyondMaxIdleAreTrimmedLeastRecentlyUsedFirst) {
  Method m;
  RegistrationCache cache(m.fn(), 1);
  cache.acquire(at(0x10000, 0x100));  // dropped at once by the caller: idle
  cache.acquire(at(0x20000, 0x100));
  cache.acquire(at(0x10000, 0x10));  // uses the first again: the second is now the oldest
  EXPECT_EQ(cache.size(), 2u);
  cache.acquire(at(0x30000, 0x100));
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_NE(cache.find(0x10000, 1), nullptr);
  EXPECT_EQ(cache.find(0x20000, 1), nullptr) << "the least recently used should have gone";
  EXPECT_NE(cache.find(0x30000, 1), nullptr);
  EXPECT_EQ(*m.live, 2);  // the method released the trimmed one
}

TEST(RegistrationCache, RegistrationsInUseAreNeverTrimmed) {
  Method m;
  RegistrationCache cache(m.fn(), 1);
  std::vector<std::shared_ptr<const Registration>> held;
  for (std::uint64_t i = 0; i < 5; ++i) held.push_back(cache.acquire(at(0x10000 * (i + 1), 0x100)));
  EXPECT_EQ(cache.size(), 5u);
  EXPECT_EQ(*m.live, 5);
  held.clear();
  // Idle now; trimmed on the next acquire, down to max_idle (and the one just acquired).
  auto fresh = cache.acquire(at(0x900000, 0x100));
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(*m.live, 2);
  EXPECT_NE(cache.find(0x50000, 1), nullptr) << "the most recently used idle one stays";
}

// Held by a large operation, a large index is not scanned at every registration; its idle
// entries still go, once it has grown by half.
TEST(RegistrationCache, ALargeIndexIsTrimmedAsItGrows) {
  Method m;
  RegistrationCache cache(m.fn(), 2);
  std::vector<std::shared_ptr<const Registration>> held;
  for (std::uint64_t i = 0; i < 1000; ++i)
    held.push_back(cache.acquire(at(0x10000 * (i + 1), 0x100)));
  EXPECT_EQ(cache.size(), 1000u);
  held.clear();  // all idle now
  std::vector<std::shared_ptr<const Registration>> fresh;
  std::uint64_t i = 0;
  for (; i < 1000 && cache.size() > 2 + fresh.size(); ++i)
    fresh.push_back(cache.acquire(at(0x100000000 + 0x10000 * i, 0x100)));
  EXPECT_LE(i, 501u) << "the idle registrations were not trimmed within half the index's growth";
  EXPECT_EQ(cache.size(), 2 + fresh.size());
  EXPECT_EQ(*m.live, static_cast<int>(2 + fresh.size()));
}

TEST(RegistrationCache, ARefusedRegistrationLeavesTheIndexUnchanged) {
  Method m;
  RegistrationCache cache(m.fn());
  auto a = cache.acquire(at(0x10000, 0x1000));
  auto b = cache.acquire(at(0x12000, 0x1000));
  m.refuse = true;
  try {
    cache.acquire(at(0x10800, 0x2000));  // would merge a and b
    ADD_FAILURE() << "the refusal did not reach the caller";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported);
  }
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(cache.registrations(), 2u);
  EXPECT_EQ(cache.find(0x10000, 0x1000), a);
  EXPECT_EQ(cache.find(0x12000, 0x1000), b);
  m.refuse = false;
  auto merged = cache.acquire(at(0x10800, 0x2000));
  EXPECT_EQ(merged->base, 0x10000u);
  EXPECT_EQ(merged->size, 0x3000u);
}

TEST(RegistrationCache, EmptyNullAndWrappingRangesAreInvalidArguments) {
  Method m;
  RegistrationCache cache(m.fn());
  for (const Region& r : {at(0x10000, 0), at(0, 0x10), at(~std::uint64_t{0} - 0xf, 0x20)}) {
    try {
      cache.acquire(r);
      ADD_FAILURE() << "accepted a range of " << r.size << " bytes at " << r.ptr;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
    }
  }
  EXPECT_TRUE(m.asked.empty());
}

TEST(RegistrationCache, AMethodThatNeedsNoHandleStillCaches) {
  RegistrationCache cache(nullptr);
  auto a = cache.acquire(at(0x10000, 0x1000));
  EXPECT_EQ(a->handle, nullptr);
  EXPECT_EQ(cache.acquire(at(0x10100, 0x10)), a);
  EXPECT_EQ(cache.registrations(), 1u);
}

TEST(RegistrationCache, ARangeOfAnotherMemoryKindIsNotReused) {
  Method m;
  RegistrationCache cache(m.fn());
  auto host = cache.acquire(at(0x10000, 0x1000, MemoryKind::host));
  auto cuda = cache.acquire(at(0x10100, 0x10, MemoryKind::cuda));
  EXPECT_NE(cuda, host);
  EXPECT_EQ(cuda->kind, MemoryKind::cuda);
}

}  // namespace
}  // namespace ferry::transport::kit
