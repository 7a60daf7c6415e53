#pragma once

// The KV cache shape and its deterministic content, shared by the prefill worker (which
// computes it) and the decode worker (which verifies every byte it received).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace disagg {

/// How a KV cache is laid out: for each layer, blocks of `tokens_per_block` tokens of
/// `bytes_per_token` bytes. A request of `tokens` tokens needs ceil(tokens / tokens_per_block)
/// blocks in every layer.
struct Shape {
  std::uint32_t layers = 8;
  std::uint32_t tokens_per_block = 16;
  std::uint32_t bytes_per_token = 4096;

  std::size_t block_bytes() const noexcept {
    return std::size_t{tokens_per_block} * bytes_per_token;
  }
  std::uint32_t blocks_for(std::uint32_t tokens) const noexcept {
    return (tokens + tokens_per_block - 1) / tokens_per_block;
  }
};

/// A stable 64-bit digest of the prompt: the "model" below depends on nothing else.
inline std::uint64_t prompt_digest(std::string_view prompt) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a
  for (unsigned char c : prompt) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

inline std::uint64_t mix(std::uint64_t x) noexcept {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

/// Fills one block's worth of KV for `layer` and the block's index in the request: a stand-in
/// for attention keys and values, cheap to compute and to check, different for every prompt,
/// layer, token and byte. `bytes` is a multiple of 8.
inline void fill_block(std::byte* out, std::size_t bytes, std::uint64_t digest, std::uint32_t layer,
                       std::uint32_t block) noexcept {
  const std::uint64_t base =
      mix(digest ^ (std::uint64_t{layer} << 40) ^ (std::uint64_t{block} << 8));
  for (std::size_t w = 0; w < bytes / 8; ++w) {
    std::uint64_t v = mix(base + w);
    std::memcpy(out + w * 8, &v, 8);
  }
}

/// Whether a block holds exactly what fill_block would write.
inline bool check_block(const std::byte* in, std::size_t bytes, std::uint64_t digest,
                        std::uint32_t layer, std::uint32_t block) noexcept {
  const std::uint64_t base =
      mix(digest ^ (std::uint64_t{layer} << 40) ^ (std::uint64_t{block} << 8));
  for (std::size_t w = 0; w < bytes / 8; ++w) {
    std::uint64_t v;
    std::memcpy(&v, in + w * 8, 8);
    if (v != mix(base + w)) return false;
  }
  return true;
}

}  // namespace disagg
