#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ferry::test {

/// Fills `size` bytes at `data` with a pattern determined by `seed` and the byte's offset,
/// so that a misplaced or missing byte is caught by verify().
void fill_pattern(std::byte* data, std::size_t size, std::uint64_t seed, std::uint64_t offset = 0);
/// Index of the first byte that differs from the pattern, or -1 when all match.
long long first_mismatch(const std::byte* data, std::size_t size, std::uint64_t seed,
                         std::uint64_t offset = 0);
/// Index of the first of `size` bytes at `data` that is not `value`, or -1.
long long first_not(const std::byte* data, std::size_t size, std::byte value);
/// Index of the first of `size` bytes at `data` that is neither `a` nor `b`, or -1.
long long first_not_either(const std::byte* data, std::size_t size, std::byte a, std::byte b);
// Under ThreadSanitizer, both read every byte uninstrumented (instrumented, a 256 MiB check
// took 5.5 s) and one 8-byte word in every 4 KiB instrumented: a copy by another thread that
// ferry's completion does not order before the check still shows as a race, since ferry copies
// whole chunks of 4 KiB and more.

/// A copy of `size` bytes at `data` that a transfer may be writing at this very moment, on
/// another thread (a cma copy job): for tests that watch a transfer's progress. The copy may
/// be stale or torn, which such a test tolerates; ThreadSanitizer is told to ignore these
/// reads, and only these.
std::vector<std::byte> peek(const std::byte* data, std::size_t size);

/// `size` bytes of `value` on the heap, filled by one memset (under ThreadSanitizer,
/// `std::make_unique<std::byte[]>(n)` zeroes byte by byte, instrumented: 256 MiB took 10 s).
std::unique_ptr<std::byte[]> filled(std::size_t size, std::byte value);

/// A zero-initialized buffer.
std::vector<std::byte> buffer(std::size_t size);
std::vector<std::byte> patterned(std::size_t size, std::uint64_t seed);

}  // namespace ferry::test
