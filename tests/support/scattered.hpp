#pragma once

// Scatter/gather memory for tests: one allocation cut into pieces of given sizes with guard
// bytes between them, so that the pieces are separate descriptors (never coalesced) and a
// byte written past a piece's end is caught. The pieces hold the pattern of one byte stream.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <ferry/descriptor.hpp>

#include "tests/support/patterns.hpp"

namespace ferry::test {

/// `total` cut into at most `weights.size()` uneven pieces in proportion to `weights` (fewer
/// when `total` is smaller than that); the sizes sum to `total`, none is zero.
inline std::vector<std::size_t> uneven_cut(std::size_t total,
                                           const std::vector<unsigned>& weights) {
  std::vector<std::size_t> out;
  if (total == 0) return out;
  unsigned sum = 0;
  for (unsigned w : weights) sum += w;
  std::size_t given = 0;
  for (std::size_t i = 0; i + 1 < weights.size(); ++i) {
    const std::size_t size = total / sum * weights[i] + (total % sum) * weights[i] / sum;
    if (size == 0) continue;
    out.push_back(size);
    given += size;
  }
  if (given < total) out.push_back(total - given);
  return out;
}

/// "a,b,c" for a list of sizes, and back (the peer program's command lines).
inline std::string cut_text(const std::vector<std::size_t>& cut) {
  std::string out;
  for (std::size_t size : cut) out += (out.empty() ? "" : ",") + std::to_string(size);
  return out;
}
inline std::vector<std::size_t> parse_cut(const std::string& text) {
  std::vector<std::size_t> out;
  std::istringstream in(text);
  std::string part;
  while (std::getline(in, part, ',')) out.push_back(std::stoull(part));
  return out;
}

class Scattered {
 public:
  static constexpr std::size_t kGap = 64;
  static constexpr std::byte kGuard{0xa5};

  /// Pieces of the sizes in `cut`, holding the pattern `seed` (0: zeros).
  Scattered(const std::vector<std::size_t>& cut, std::uint64_t seed) {
    std::size_t bytes = kGap;
    for (std::size_t size : cut) bytes += size + kGap;
    memory_ = std::make_unique_for_overwrite<std::byte[]>(bytes);
    bytes_ = bytes;
    std::memset(memory_.get(), static_cast<int>(kGuard), bytes);
    std::size_t at = kGap;
    for (std::size_t size : cut) {
      pieces_.push_back({memory_.get() + at, size});
      at += size + kGap;
      total_ += size;
    }
    fill(seed);
  }

  std::size_t size() const noexcept { return total_; }
  std::size_t pieces() const noexcept { return pieces_.size(); }
  std::vector<Descriptor> descriptors() const {
    std::vector<Descriptor> out;
    for (const Piece& p : pieces_) out.emplace_back(p.data, p.size);
    return out;
  }
  /// The byte at stream offset `offset`.
  std::byte* at(std::size_t offset) const {
    for (const Piece& p : pieces_) {
      if (offset < p.size) return p.data + offset;
      offset -= p.size;
    }
    return nullptr;
  }

  /// Puts the pattern `seed` (0: zeros) into the pieces; the guards stay.
  void fill(std::uint64_t seed) {
    std::uint64_t offset = 0;
    for (const Piece& p : pieces_) {
      if (seed == 0)
        std::memset(p.data, 0, p.size);
      else
        fill_pattern(p.data, p.size, seed, offset);
      offset += p.size;
    }
  }
  /// Sets every byte of the pieces to `value`.
  void fill_with(std::byte value) {
    for (const Piece& p : pieces_) std::memset(p.data, static_cast<int>(value), p.size);
  }

  /// The stream offset of the first byte that differs from the pattern `seed`, or -1.
  long long mismatch(std::uint64_t seed) const {
    std::uint64_t offset = 0;
    for (const Piece& p : pieces_) {
      if (long long at = first_mismatch(p.data, p.size, seed, offset); at >= 0)
        return static_cast<long long>(offset) + at;
      offset += p.size;
    }
    return -1;
  }
  /// The stream offset of the first byte that is not `value`, or -1.
  long long differs_from(std::byte value) const {
    std::uint64_t offset = 0;
    for (const Piece& p : pieces_) {
      for (std::size_t i = 0; i < p.size; ++i)
        if (p.data[i] != value) return static_cast<long long>(offset + i);
      offset += p.size;
    }
    return -1;
  }
  /// Whether every byte between and around the pieces still holds kGuard.
  bool guards_intact() const {
    std::size_t at = 0;
    for (std::size_t i = 0; i <= pieces_.size(); ++i) {
      for (std::size_t k = 0; k < kGap; ++k)
        if (memory_[at + k] != kGuard) return false;
      if (i < pieces_.size()) at += kGap + pieces_[i].size;
    }
    return at + kGap == bytes_;
  }

 private:
  struct Piece {
    std::byte* data;
    std::size_t size;
  };
  std::unique_ptr<std::byte[]> memory_;
  std::size_t bytes_ = 0;
  std::size_t total_ = 0;
  std::vector<Piece> pieces_;
};

}  // namespace ferry::test
