#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry::test {

/// Fills `size` bytes at `data` with a pattern determined by `seed` and the byte's offset,
/// so that a misplaced or missing byte is caught by verify().
void fill_pattern(std::byte* data, std::size_t size, std::uint64_t seed, std::uint64_t offset = 0);
/// Index of the first byte that differs from the pattern, or -1 when all match.
long long first_mismatch(const std::byte* data, std::size_t size, std::uint64_t seed,
                         std::uint64_t offset = 0);

/// A copy of `size` bytes at `data` that a transfer may be writing at this very moment, on
/// another thread (a cma copy job): for tests that watch a transfer's progress. The copy may
/// be stale or torn, which such a test tolerates; ThreadSanitizer is told to ignore these
/// reads, and only these.
std::vector<std::byte> peek(const std::byte* data, std::size_t size);

/// A zero-initialized buffer.
std::vector<std::byte> buffer(std::size_t size);
std::vector<std::byte> patterned(std::size_t size, std::uint64_t seed);

}  // namespace ferry::test
