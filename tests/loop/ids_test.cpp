// The loop layer's helpers: ids, hex, random bytes, UTF-8 checks, the owning libuv handle.
#include <gtest/gtest.h>

#include <uv.h>

#include <set>

#include "loop/ids.hpp"
#include "loop/uv_handle.hpp"

namespace ferry::loop {
namespace {

TEST(Ids, Hex16RoundTripsAndRefusesAnythingElse) {
  EXPECT_EQ(hex16(0xdeadbeef), "00000000deadbeef");
  std::uint64_t v = 0;
  EXPECT_TRUE(parse_hex16("00000000deadbeef", v));
  EXPECT_EQ(v, 0xdeadbeefu);
  EXPECT_FALSE(parse_hex16("deadbeef", v));
  EXPECT_FALSE(parse_hex16("00000000deadbeeg", v));
  EXPECT_FALSE(parse_hex16("00000000deadbeef0", v));
}

TEST(Ids, HexOfBytesHasOneSpelling) {
  std::uint8_t in[3] = {0x00, 0xab, 0xff};
  EXPECT_EQ(to_hex(in), "00abff");
  std::uint8_t out[3] = {};
  EXPECT_TRUE(from_hex("00abff", out));
  EXPECT_EQ(out[1], 0xab);
  EXPECT_FALSE(from_hex("00ABFF", out)) << "uppercase would give a token two spellings";
  EXPECT_FALSE(from_hex("00abf", out));
  EXPECT_FALSE(from_hex("00abfz", out));
}

TEST(Ids, RandomValuesDiffer) {
  std::set<std::uint64_t> seen;
  for (int i = 0; i < 64; ++i) seen.insert(random_u64());
  EXPECT_EQ(seen.size(), 64u);
}

TEST(Utf8, ValidTextPassesUnchanged) {
  EXPECT_TRUE(valid_utf8("plain"));
  EXPECT_TRUE(valid_utf8("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"));
  EXPECT_EQ(sanitized_utf8("caf\xc3\xa9"), "caf\xc3\xa9");
}

TEST(Utf8, BadBytesBecomeReplacementCharacters) {
  for (std::string bad : {std::string("a\xff"), std::string("\xc0\xaf"),  // overlong '/'
                          std::string("\xed\xa0\x80"),                    // surrogate
                          std::string("\xf4\x90\x80\x80"),                // above U+10FFFF
                          std::string("\xe2\x82"),                        // truncated
                          std::string("a\0b", 3)}) {
    EXPECT_FALSE(valid_utf8(bad)) << bad;
    std::string clean = sanitized_utf8(bad);
    EXPECT_TRUE(valid_utf8(clean));
    EXPECT_NE(clean.find("\xef\xbf\xbd"), std::string::npos);
  }
  EXPECT_EQ(sanitized_utf8("a\xff"
                           "b"),
            "a\xef\xbf\xbd"
            "b");
}

TEST(UvHandle, ClosesItselfAndNeverCallsBackAfterReset) {
  uv_loop_t uv;
  ASSERT_EQ(uv_loop_init(&uv), 0);
  int fired = 0;
  {
    Timer t = Timer::timer(&uv, &fired);
    uv_timer_start(
        t.get(), [](uv_timer_t* h) { ++*static_cast<int*>(h->data); }, 0, 0);
    Timer moved = std::move(t);
    EXPECT_FALSE(t);
    EXPECT_TRUE(moved);
    // Destroyed before the loop ever runs: the timer must not fire, and the loop must end
    // with nothing open.
  }
  uv_run(&uv, UV_RUN_DEFAULT);
  EXPECT_EQ(fired, 0);
  EXPECT_EQ(uv_loop_close(&uv), 0);
}

TEST(UvHandle, PollOfABadFdThrowsAndLeaksNothing) {
  uv_loop_t uv;
  ASSERT_EQ(uv_loop_init(&uv), 0);
  EXPECT_THROW(Poll::poll(&uv, -1, nullptr), Error);
  uv_run(&uv, UV_RUN_DEFAULT);
  EXPECT_EQ(uv_loop_close(&uv), 0);
}

}  // namespace
}  // namespace ferry::loop
