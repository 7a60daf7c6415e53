#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace ferry::transport {

/// 128 random bits; a passive operation's access token, or a claim's secret.
using Token = std::array<std::uint8_t, 16>;

/// Where memory lives, as a bit in a set of kinds a method moves.
enum class MemoryKind : std::uint8_t { host = 1, cuda = 2 };
constexpr std::uint8_t bit(MemoryKind k) noexcept { return static_cast<std::uint8_t>(k); }

/// A range of this process's memory exposed to a peer, or registered with a method.
struct Region {
  std::byte* ptr = nullptr;
  std::uint64_t size = 0;
  MemoryKind kind = MemoryKind::host;
  int cuda_device = -1;  ///< the CUDA device ordinal of cuda memory; -1 for host memory
};

}  // namespace ferry::transport
