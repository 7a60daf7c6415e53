// transport/kit/interval_set.hpp: the bytes of a writable written at least once.
#include "transport/kit/interval_set.hpp"

#include <gtest/gtest.h>

#include <bitset>
#include <cstdint>
#include <limits>
#include <random>

namespace ferry::transport::kit {
namespace {

TEST(IntervalSet, EmptyCoversNothingButTheEmptyRange) {
  IntervalSet s;
  EXPECT_EQ(s.covered(), 0u);
  EXPECT_EQ(s.pieces(), 0u);
  EXPECT_TRUE(s.covers(100, 0));
  EXPECT_FALSE(s.covers(100, 1));
}

TEST(IntervalSet, DisjointRangesStayApart) {
  IntervalSet s;
  s.add(10, 10);
  s.add(30, 10);
  EXPECT_EQ(s.covered(), 20u);
  EXPECT_EQ(s.pieces(), 2u);
  EXPECT_TRUE(s.covers(10, 10));
  EXPECT_TRUE(s.covers(30, 10));
  EXPECT_TRUE(s.covers(35, 5));
  EXPECT_FALSE(s.covers(15, 10));  // across the gap
  EXPECT_FALSE(s.covers(9, 2));
  EXPECT_FALSE(s.covers(39, 2));
  EXPECT_FALSE(s.covers(20, 1));
}

TEST(IntervalSet, OverlappingRangesMergeAndCountOnce) {
  IntervalSet s;
  s.add(10, 10);
  s.add(30, 10);
  s.add(15, 20);  // bridges both
  EXPECT_EQ(s.covered(), 30u);
  EXPECT_EQ(s.pieces(), 1u);
  EXPECT_TRUE(s.covers(10, 30));
}

TEST(IntervalSet, TouchingRangesMerge) {
  IntervalSet s;
  s.add(20, 10);
  s.add(10, 10);  // ends where the first starts
  s.add(30, 5);   // starts where they end
  EXPECT_EQ(s.pieces(), 1u);
  EXPECT_EQ(s.covered(), 25u);
  EXPECT_TRUE(s.covers(10, 25));
}

TEST(IntervalSet, TheSameBytesTwiceCountOnce) {
  IntervalSet s;
  s.add(0, 4096);
  s.add(0, 4096);
  s.add(100, 10);  // inside
  EXPECT_EQ(s.covered(), 4096u);
  EXPECT_EQ(s.pieces(), 1u);
  EXPECT_FALSE(s.covers(0, 8192));
}

TEST(IntervalSet, ARangeSwallowsEveryPieceItCovers) {
  IntervalSet s;
  for (std::uint64_t i = 0; i < 10; ++i) s.add(i * 100, 10);
  EXPECT_EQ(s.pieces(), 10u);
  s.add(50, 500);  // from inside the gap after piece 0 to inside the gap after piece 5
  EXPECT_EQ(s.pieces(), 6u);
  EXPECT_EQ(s.covered(), 10u + 500u + 40u);
  EXPECT_TRUE(s.covers(50, 500));
  EXPECT_FALSE(s.covers(0, 100));
}

TEST(IntervalSet, ZeroLengthAddsNothing) {
  IntervalSet s;
  s.add(10, 0);
  EXPECT_EQ(s.pieces(), 0u);
  s.add(0, 10);
  s.add(20, 10);
  s.add(10, 0);  // in the gap
  EXPECT_EQ(s.pieces(), 2u);
  EXPECT_EQ(s.covered(), 20u);
}

TEST(IntervalSet, AgreesWithABitmapOnRandomRanges) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 50; ++round) {
    IntervalSet s;
    std::bitset<1100> bits;
    for (int i = 0; i < 40; ++i) {
      const std::uint64_t begin = rng() % 1000;
      const std::uint64_t len = rng() % 48;
      s.add(begin, len);
      for (std::uint64_t b = begin; b < begin + len; ++b) bits.set(b);
      ASSERT_EQ(s.covered(), bits.count()) << "round " << round << " add " << i;
    }
    for (int q = 0; q < 100; ++q) {
      const std::uint64_t begin = rng() % 1000;
      const std::uint64_t len = 1 + rng() % 30;
      bool all = true;
      for (std::uint64_t b = begin; b < begin + len; ++b) all = all && bits.test(b);
      EXPECT_EQ(s.covers(begin, len), all) << begin << "+" << len;
    }
  }
}

TEST(IntervalSet, ARangeEndingJustBelowTheTopOfTheAddressSpace) {
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  IntervalSet s;
  s.add(kMax - 16, 16);  // ends at kMax, exclusive
  EXPECT_EQ(s.covered(), 16u);
  EXPECT_TRUE(s.covers(kMax - 16, 16));
}

// A range that ends exactly at 2^64 must not wrap (ExposureTable accepts such a region).
TEST(IntervalSet, ARangeEndingAtTheTopOfTheAddressSpace) {
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  IntervalSet s;
  s.add(kMax - 15, 16);  // the last 16 bytes: begin + len is 2^64
  EXPECT_EQ(s.covered(), 16u);
  EXPECT_EQ(s.pieces(), 1u);
  EXPECT_TRUE(s.covers(kMax - 15, 16));
  s.add(kMax - 31, 16);  // touches it from below
  EXPECT_EQ(s.covered(), 32u);
}

}  // namespace
}  // namespace ferry::transport::kit
