// The request checks of transport/exposure_table.cpp: range arithmetic without overflow,
// token comparison and hex form, and ExposureTable::check's verdicts.
#include "transport/kit/exposure_table.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace ferry::transport::kit {
namespace {

constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();

// A region at an arbitrary address; range_inside only compares numbers, it never dereferences.
Region region_at(std::uint64_t base, std::uint64_t size) {
  Region r;
  r.ptr = reinterpret_cast<std::byte*>(base);
  r.size = size;
  return r;
}

std::uint64_t address_of(const std::byte* p) { return reinterpret_cast<std::uint64_t>(p); }

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// ---------------------------------------------------------------------------------------
// range_inside

TEST(RangeInside, AcceptsRangesInside) {
  const Region r = region_at(0x1000, 0x100);
  EXPECT_TRUE(range_inside(r, 0x1000, 0x100));  // the whole region
  EXPECT_TRUE(range_inside(r, 0x1000, 1));
  EXPECT_TRUE(range_inside(r, 0x1080, 0x10));
  EXPECT_TRUE(range_inside(r, 0x10ff, 1));  // the last byte, ending exactly at the end
  EXPECT_TRUE(range_inside(r, 0x1001, 0xff));
}

TEST(RangeInside, RefusesRangesOneByteOutside) {
  const Region r = region_at(0x1000, 0x100);
  EXPECT_FALSE(range_inside(r, 0x0fff, 1));      // one before the start
  EXPECT_FALSE(range_inside(r, 0x0fff, 0x100));  // starts before, ends inside
  EXPECT_FALSE(range_inside(r, 0x1100, 1));      // one past the end
  EXPECT_FALSE(range_inside(r, 0x1001, 0x100));  // ends one past the end
  EXPECT_FALSE(range_inside(r, 0x1000, 0x101));  // one longer than the region
}

TEST(RangeInside, ZeroLengthRangesUpToTheEnd) {
  const Region r = region_at(0x1000, 0x100);
  EXPECT_TRUE(range_inside(r, 0x1000, 0));
  EXPECT_TRUE(range_inside(r, 0x1100, 0));  // the empty range at the end
  EXPECT_FALSE(range_inside(r, 0x1101, 0));
  EXPECT_FALSE(range_inside(r, 0x0fff, 0));
}

TEST(RangeInside, LengthNearTheTopDoesNotWrap) {
  const Region r = region_at(0x1000, 0x100);
  EXPECT_FALSE(range_inside(r, 0x1000, kMax));
  EXPECT_FALSE(range_inside(r, 0x1010, kMax - 0xf));   // addr + len wraps to 0x1000
  EXPECT_FALSE(range_inside(r, 0x1001, kMax));         // addr + len wraps to 0x1000
  EXPECT_FALSE(range_inside(r, 0x1080, kMax - 0x7f));  // addr + len wraps to exactly 0
}

TEST(RangeInside, AddressNearTheTopDoesNotWrap) {
  const Region r = region_at(0x1000, 0x100);
  EXPECT_FALSE(range_inside(r, kMax, 1));
  EXPECT_FALSE(range_inside(r, kMax, 0x1001));  // addr + len wraps into the region
  EXPECT_FALSE(range_inside(r, kMax - 0x7, 0x1010));
}

TEST(RangeInside, RegionEndingAtTheTopOfTheAddressSpace) {
  // base + size is 2^64, which a naive check would compute as 0.
  const Region r = region_at(kMax - 0xff, 0x100);
  EXPECT_TRUE(range_inside(r, kMax - 0xff, 0x100));
  EXPECT_TRUE(range_inside(r, kMax, 1));
  EXPECT_TRUE(range_inside(r, kMax, 0));
  EXPECT_FALSE(range_inside(r, kMax, 2));
  EXPECT_FALSE(range_inside(r, kMax - 0xff, 0x101));
  EXPECT_FALSE(range_inside(r, 0, 1));
  EXPECT_FALSE(range_inside(r, kMax - 0x100, 1));
}

TEST(RangeInside, RegionCoveringTheWholeAddressSpace) {
  const Region r = region_at(0, kMax);
  EXPECT_TRUE(range_inside(r, 0, kMax));
  EXPECT_TRUE(range_inside(r, kMax - 1, 1));
  EXPECT_FALSE(range_inside(r, 1, kMax));
  EXPECT_FALSE(range_inside(r, kMax, 1));
}

TEST(RangeInside, EmptyRegionHoldsNoBytes) {
  const Region r = region_at(0x1000, 0);
  EXPECT_FALSE(range_inside(r, 0x1000, 1));
  EXPECT_FALSE(range_inside(r, 0x1000, kMax));
}

// ---------------------------------------------------------------------------------------
// Tokens

Token counting_token() {
  Token t{};
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<std::uint8_t>(i * 0x11);
  return t;
}

TEST(Tokens, EqualTokensCompareEqual) {
  const Token a = counting_token();
  Token b = a;
  EXPECT_TRUE(tokens_equal(a, b));
  EXPECT_TRUE(tokens_equal(Token{}, Token{}));
}

TEST(Tokens, EverySingleBitDifferenceIsCaught) {
  const Token a = counting_token();
  for (std::size_t byte = 0; byte < a.size(); ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      Token b = a;
      b[byte] = static_cast<std::uint8_t>(b[byte] ^ (1u << bit));
      EXPECT_FALSE(tokens_equal(a, b)) << "byte " << byte << " bit " << bit;
      EXPECT_FALSE(tokens_equal(b, a)) << "byte " << byte << " bit " << bit;
    }
  }
}

TEST(Tokens, HexIsThirtyTwoLowercaseDigits) {
  EXPECT_EQ(token_to_hex(counting_token()), "00112233445566778899aabbccddeeff");
  Token top{};
  top.fill(0xff);
  EXPECT_EQ(token_to_hex(top), "ffffffffffffffffffffffffffffffff");
  EXPECT_EQ(token_to_hex(Token{}), "00000000000000000000000000000000");
}

TEST(Tokens, HexRoundTrip) {
  for (int i = 0; i < 16; ++i) {
    const Token t = random_token();
    const std::string hex = token_to_hex(t);
    ASSERT_EQ(hex.size(), 32u);
    Token back{};
    ASSERT_TRUE(token_from_hex(hex, back)) << hex;
    EXPECT_TRUE(tokens_equal(t, back)) << hex;
  }
  Token parsed{};
  ASSERT_TRUE(token_from_hex("00112233445566778899aabbccddeeff", parsed));
  EXPECT_EQ(parsed, counting_token());
}

TEST(Tokens, RandomTokensDiffer) {
  // 2^-128 odds of a false failure; an all-zero or repeated token means no randomness.
  const Token a = random_token();
  const Token b = random_token();
  EXPECT_FALSE(tokens_equal(a, b));
  EXPECT_FALSE(tokens_equal(a, Token{}));
}

TEST(Tokens, FromHexRejectsWrongLength) {
  const std::string good = "00112233445566778899aabbccddeeff";
  Token out{};
  EXPECT_FALSE(token_from_hex("", out));
  EXPECT_FALSE(token_from_hex(good.substr(0, 31), out));
  EXPECT_FALSE(token_from_hex(good.substr(0, 30), out));
  EXPECT_FALSE(token_from_hex(good + "0", out));
  EXPECT_FALSE(token_from_hex(good + "00", out));
  EXPECT_FALSE(token_from_hex(good + good, out));
}

TEST(Tokens, FromHexRejectsUppercaseAndNonHex) {
  const std::string good = "00112233445566778899aabbccddeeff";
  Token out{};
  EXPECT_FALSE(token_from_hex("00112233445566778899AABBCCDDEEFF", out));
  for (char bad : std::string("AFGgxz -+:\x7f")) {
    for (std::size_t at : {std::size_t{0}, std::size_t{1}, std::size_t{17}, std::size_t{31}}) {
      std::string hex = good;
      hex[at] = bad;
      EXPECT_FALSE(token_from_hex(hex, out)) << "'" << hex << "'";
    }
  }
  std::string with_nul = good;
  with_nul[5] = '\0';
  EXPECT_FALSE(token_from_hex(with_nul, out));
}

// ---------------------------------------------------------------------------------------
// ExposureTable

class NullObserver final : public ExposureObserver {
 public:
  void on_claimed(const Claim&) override {}
  void on_peer_finished(const std::string&, const std::optional<Error>&) override {}
  void on_peer_lost(const Error&) override {}
};

constexpr std::uint64_t kConnA = 7;
constexpr std::uint64_t kConnB = 8;

class ExposureTableTest : public ::testing::Test {
 protected:
  // One readable and one writable, each over a single 4 KiB region of `memory_`.
  void SetUp() override {
    readable_.id = 0x1111;
    readable_.token = random_token();
    readable_.access = Access::read;
    readable_.regions.push_back({memory_.data(), 4096});
    table_.add(readable_, observer_);

    writable_.id = 0x2222;
    writable_.token = random_token();
    writable_.access = Access::write;
    writable_.regions.push_back({memory_.data() + 4096, 4096});
    table_.add(writable_, observer_);
  }

  std::uint64_t base(std::size_t offset) const { return address_of(memory_.data()) + offset; }

  std::vector<std::byte> memory_ = std::vector<std::byte>(16 * 4096);
  NullObserver observer_;
  ExposureTable table_;
  Exposure readable_;
  Exposure writable_;
};

TEST_F(ExposureTableTest, ValidRequestIsServedAtTheRightAddress) {
  auto v = table_.check(readable_.id, readable_.token, Access::read, base(100), 50, kConnA);
  ASSERT_TRUE(v.ok()) << v.message;
  EXPECT_EQ(v.entry, table_.find(readable_.id));
  EXPECT_EQ(v.ptr, memory_.data() + 100);

  auto w = table_.check(writable_.id, writable_.token, Access::write, base(4096), 4096, kConnA);
  ASSERT_TRUE(w.ok()) << w.message;
  EXPECT_EQ(w.ptr, memory_.data() + 4096);
}

TEST_F(ExposureTableTest, UnknownIdAndWrongTokenGetTheSameAnswer) {
  Token wrong = readable_.token;
  wrong[15] = static_cast<std::uint8_t>(wrong[15] ^ 1);
  auto bad_token = table_.check(readable_.id, wrong, Access::read, base(0), 1, kConnA);
  auto bad_id = table_.check(0x9999, readable_.token, Access::read, base(0), 1, kConnA);
  // Another operation's valid token is a wrong token here too.
  auto other_token = table_.check(readable_.id, writable_.token, Access::read, base(0), 1, kConnA);
  for (const auto* v : {&bad_token, &bad_id, &other_token}) {
    EXPECT_FALSE(v->ok());
    EXPECT_EQ(v->code, ErrorCode::AccessDenied);
    EXPECT_EQ(v->message, transport::kit::ExposureTable::kNoLiveOperation);
    EXPECT_EQ(v->ptr, nullptr);
  }
  EXPECT_EQ(bad_token.message, bad_id.message);
}

TEST_F(ExposureTableTest, WrongAccessKindIsDenied) {
  auto write_readable =
      table_.check(readable_.id, readable_.token, Access::write, base(0), 1, kConnA);
  EXPECT_FALSE(write_readable.ok());
  EXPECT_EQ(write_readable.code, ErrorCode::AccessDenied);
  EXPECT_TRUE(contains(write_readable.message, "readable; it cannot be written"))
      << write_readable.message;

  auto read_writable =
      table_.check(writable_.id, writable_.token, Access::read, base(4096), 1, kConnA);
  EXPECT_FALSE(read_writable.ok());
  EXPECT_EQ(read_writable.code, ErrorCode::AccessDenied);
  EXPECT_TRUE(contains(read_writable.message, "writable; it cannot be read"))
      << read_writable.message;
}

TEST_F(ExposureTableTest, ClaimBindsOnce) {
  ExposureTable::Entry* entry = table_.find(readable_.id);
  ASSERT_NE(entry, nullptr);
  EXPECT_EQ(entry->bound_to, 0u);
  EXPECT_TRUE(ExposureTable::claim(*entry, kConnA, "peer-a"));
  EXPECT_FALSE(ExposureTable::claim(*entry, kConnB, "peer-b"));
  EXPECT_FALSE(ExposureTable::claim(*entry, kConnA, "peer-a again"));
  EXPECT_EQ(entry->bound_to, kConnA);
  EXPECT_EQ(entry->peer, "peer-a");
}

TEST_F(ExposureTableTest, ClaimedOperationIsDeniedToOtherConnections) {
  ExposureTable::Entry* entry = table_.find(readable_.id);
  ASSERT_NE(entry, nullptr);
  ASSERT_TRUE(ExposureTable::claim(*entry, kConnA, "peer-a"));

  auto other = table_.check(readable_.id, readable_.token, Access::read, base(0), 1, kConnB);
  EXPECT_FALSE(other.ok());
  EXPECT_EQ(other.code, ErrorCode::AccessDenied);
  EXPECT_TRUE(contains(other.message, "claimed by another peer (peer-a)")) << other.message;
  // A notice (len 0) from another connection is refused as well.
  auto notice = table_.check(readable_.id, readable_.token, Access::read, 0, 0, kConnB);
  EXPECT_FALSE(notice.ok());
  EXPECT_EQ(notice.code, ErrorCode::AccessDenied);

  auto owner = table_.check(readable_.id, readable_.token, Access::read, base(0), 1, kConnA);
  EXPECT_TRUE(owner.ok()) << owner.message;
}

TEST_F(ExposureTableTest, NoticeChecksNoRange) {
  auto v = table_.check(readable_.id, readable_.token, Access::read, 0, 0, kConnA);
  ASSERT_TRUE(v.ok()) << v.message;
  EXPECT_EQ(v.entry, table_.find(readable_.id));
  EXPECT_EQ(v.ptr, nullptr);
}

TEST_F(ExposureTableTest, RangeOutsideIsDeniedWithItsAddress) {
  struct Case {
    std::uint64_t addr;
    std::uint64_t len;
  };
  const Case cases[] = {
      {base(4096), 1},                 // one past the end (the start of the writable's memory)
      {base(4095), 2},                 // the last byte and one more
      {base(0) - 1, 1},                // one before the start
      {base(0), 4097},                 // one longer than the region
      {base(1), kMax},                 // addr + len wraps
      {kMax - 3, 8},                   // addr near the top, addr + len wraps to 4
      {kMax, kMax},           {0, 1},  // below every region
      {base(100), kMax - 99},          // addr + len wraps to base
  };
  for (const Case& c : cases) {
    auto v = table_.check(readable_.id, readable_.token, Access::read, c.addr, c.len, kConnA);
    EXPECT_FALSE(v.ok()) << std::hex << c.addr << " + " << c.len;
    EXPECT_EQ(v.code, ErrorCode::AccessDenied);
    EXPECT_TRUE(contains(v.message, "is outside the operation's memory")) << v.message;
    char hex[32];
    std::snprintf(hex, sizeof hex, "0x%llx", static_cast<unsigned long long>(c.addr));
    EXPECT_TRUE(contains(v.message, hex)) << v.message;
    EXPECT_TRUE(contains(v.message, std::to_string(c.len) + " bytes")) << v.message;
  }
}

TEST_F(ExposureTableTest, RangeInTheSecondOfSeveralUnsortedRegions) {
  // Regions given out of address order, with gaps between them.
  Exposure e;
  e.id = 0x3333;
  e.token = random_token();
  e.access = Access::read;
  e.regions.push_back({memory_.data() + 12 * 4096, 1024});  // highest
  e.regions.push_back({memory_.data() + 8 * 4096, 1024});   // middle
  e.regions.push_back({memory_.data() + 10 * 4096, 1024});  // between
  table_.add(e, observer_);

  auto middle = table_.check(e.id, e.token, Access::read, base(8 * 4096 + 100), 50, kConnA);
  ASSERT_TRUE(middle.ok()) << middle.message;
  EXPECT_EQ(middle.ptr, memory_.data() + 8 * 4096 + 100);

  auto between = table_.check(e.id, e.token, Access::read, base(10 * 4096), 1024, kConnA);
  ASSERT_TRUE(between.ok()) << between.message;
  EXPECT_EQ(between.ptr, memory_.data() + 10 * 4096);

  auto highest_end = table_.check(e.id, e.token, Access::read, base(12 * 4096 + 1023), 1, kConnA);
  ASSERT_TRUE(highest_end.ok()) << highest_end.message;
  EXPECT_EQ(highest_end.ptr, memory_.data() + 12 * 4096 + 1023);

  // The gaps, and a range that starts in one region and runs into the gap after it.
  for (std::uint64_t addr :
       {base(8 * 4096 + 1024), base(9 * 4096), base(12 * 4096 + 1024), base(8 * 4096 - 1)}) {
    auto v = table_.check(e.id, e.token, Access::read, addr, 1, kConnA);
    EXPECT_FALSE(v.ok()) << std::hex << addr;
    EXPECT_EQ(v.code, ErrorCode::AccessDenied);
  }
  auto spill = table_.check(e.id, e.token, Access::read, base(10 * 4096 + 1000), 100, kConnA);
  EXPECT_FALSE(spill.ok());
}

TEST_F(ExposureTableTest, RangeAcrossTwoTouchingRegionsIsServed) {
  // Touching descriptors grant one contiguous span; a gap is never bridged.
  Exposure e;
  e.id = 0x4444;
  e.token = random_token();
  e.access = Access::write;
  e.regions.push_back({memory_.data() + 9 * 4096, 4096});
  e.regions.push_back({memory_.data() + 8 * 4096, 4096});
  table_.add(e, observer_);

  auto first = table_.check(e.id, e.token, Access::write, base(8 * 4096), 4096, kConnA);
  ASSERT_TRUE(first.ok()) << first.message;
  auto second = table_.check(e.id, e.token, Access::write, base(9 * 4096), 4096, kConnA);
  ASSERT_TRUE(second.ok()) << second.message;
  EXPECT_EQ(second.ptr, memory_.data() + 9 * 4096);
  auto across = table_.check(e.id, e.token, Access::write, base(9 * 4096 - 8), 16, kConnA);
  ASSERT_TRUE(across.ok()) << across.message;
  EXPECT_EQ(across.ptr, memory_.data() + 9 * 4096 - 8);
  auto past = table_.check(e.id, e.token, Access::write, base(10 * 4096 - 8), 16, kConnA);
  EXPECT_FALSE(past.ok());
  EXPECT_EQ(past.code, ErrorCode::AccessDenied);
}

TEST_F(ExposureTableTest, RangeInsideAnEnclosingRegionBeyondANestedOne) {
  // docs/protocol.md, check 4: the range must lie inside *one of* the descriptors. A
  // descriptor nested inside another (the same buffer exposed twice, or a header view of
  // it) must not hide the bytes of the enclosing one that lie past it.
  Exposure e;
  e.id = 0x5555;
  e.token = random_token();
  e.access = Access::read;
  e.regions.push_back({memory_.data() + 8 * 4096, 4 * 4096});  // encloses the next one
  e.regions.push_back({memory_.data() + 9 * 4096, 16});
  table_.add(e, observer_);

  auto inside_nested = table_.check(e.id, e.token, Access::read, base(9 * 4096), 16, kConnA);
  EXPECT_TRUE(inside_nested.ok()) << inside_nested.message;
  auto past_nested = table_.check(e.id, e.token, Access::read, base(10 * 4096), 4096, kConnA);
  EXPECT_TRUE(past_nested.ok()) << past_nested.message;
  if (past_nested.ok()) {
    EXPECT_EQ(past_nested.ptr, memory_.data() + 10 * 4096);
  }
}

TEST_F(ExposureTableTest, RemovedExposureIsUnknown) {
  EXPECT_TRUE(table_.remove(readable_.id));
  EXPECT_FALSE(table_.remove(readable_.id));
  EXPECT_EQ(table_.find(readable_.id), nullptr);
  auto v = table_.check(readable_.id, readable_.token, Access::read, base(0), 1, kConnA);
  EXPECT_FALSE(v.ok());
  EXPECT_EQ(v.code, ErrorCode::AccessDenied);
  EXPECT_EQ(v.message, transport::kit::ExposureTable::kNoLiveOperation);
  EXPECT_EQ(table_.size(), 1u);
}

TEST_F(ExposureTableTest, AddingATakenIdThrowsInternal) {
  try {
    table_.add(readable_, observer_);
    FAIL() << "add() accepted a duplicate id";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Internal);
    EXPECT_TRUE(contains(e.message(), "already in use")) << e.message();
  }
  EXPECT_EQ(table_.size(), 2u);
}

}  // namespace
}  // namespace ferry::transport::kit
