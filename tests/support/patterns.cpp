#include "tests/support/patterns.hpp"

#include <cstring>

#if defined(__SANITIZE_THREAD__)
#define FERRY_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FERRY_TEST_TSAN 1
#endif
#endif

#ifdef FERRY_TEST_TSAN
// ThreadSanitizer's dynamic annotations (its runtime defines them).
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
#endif

namespace ferry::test {

namespace {

// One 64-bit mix per 8 bytes keeps 64 MiB fills fast; the offset enters every word.
inline std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

inline std::byte pattern_byte(std::uint64_t seed, std::uint64_t pos) {
  std::uint64_t word = mix(seed * 0x9e3779b97f4a7c15ULL + (pos >> 3));
  return static_cast<std::byte>(word >> ((pos & 7) * 8));
}

}  // namespace

// Not instrumented by ThreadSanitizer: a test fills its buffers before it hands them to ferry
// (that order is the test's own), and instrumented, 256 MiB took 5.6 s of a TSan test's time.
// The checks below read what ferry wrote: see patterns.hpp for what TSan still sees of them.
__attribute__((no_sanitize("thread"))) void fill_pattern(std::byte* data, std::size_t size,
                                                         std::uint64_t seed, std::uint64_t offset) {
  for (std::size_t i = 0; i < size; ++i) data[i] = pattern_byte(seed, offset + i);
}

namespace {

/// Reads one word in every 4 KiB of `data` where ThreadSanitizer sees it (patterns.hpp).
void sample_for_tsan(const std::byte* data, std::size_t size) {
  const volatile std::byte* at = data;
  for (std::size_t i = 0; i < size; i += 4096) (void)at[i];
}

__attribute__((no_sanitize("thread"))) long long mismatch_in(const std::byte* data,
                                                             std::size_t size, std::uint64_t seed,
                                                             std::uint64_t offset) {
  for (std::size_t i = 0; i < size; ++i)
    if (data[i] != pattern_byte(seed, offset + i)) return static_cast<long long>(i);
  return -1;
}

__attribute__((no_sanitize("thread"))) long long neither_in(const std::byte* data, std::size_t size,
                                                            std::byte a, std::byte b) {
  for (std::size_t i = 0; i < size; ++i)
    if (data[i] != a && data[i] != b) return static_cast<long long>(i);
  return -1;
}

}  // namespace

long long first_mismatch(const std::byte* data, std::size_t size, std::uint64_t seed,
                         std::uint64_t offset) {
  sample_for_tsan(data, size);
  return mismatch_in(data, size, seed, offset);
}

long long first_not(const std::byte* data, std::size_t size, std::byte value) {
  sample_for_tsan(data, size);
  return neither_in(data, size, value, value);
}

long long first_not_either(const std::byte* data, std::size_t size, std::byte a, std::byte b) {
  sample_for_tsan(data, size);
  return neither_in(data, size, a, b);
}

std::unique_ptr<std::byte[]> filled(std::size_t size, std::byte value) {
  auto buf = std::make_unique_for_overwrite<std::byte[]>(size);
  std::memset(buf.get(), static_cast<int>(value), size);
  return buf;
}

std::vector<std::byte> buffer(std::size_t size) { return std::vector<std::byte>(size); }

std::vector<std::byte> patterned(std::size_t size, std::uint64_t seed) {
  std::vector<std::byte> v(size);
  fill_pattern(v.data(), size, seed);
  return v;
}

std::vector<std::byte> peek(const std::byte* data, std::size_t size) {
  std::vector<std::byte> out(size);
#ifdef FERRY_TEST_TSAN
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
#endif
  const volatile std::byte* from = data;
  for (std::size_t i = 0; i < size; ++i) out[i] = from[i];
#ifdef FERRY_TEST_TSAN
  AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
#endif
  return out;
}

}  // namespace ferry::test
