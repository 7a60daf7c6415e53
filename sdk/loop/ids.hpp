#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace ferry::loop {

/// Fills `out` from the kernel's random source. Throws Error(Internal) if the kernel refuses
/// (after a bounded number of tries), never loops forever.
void random_bytes(std::span<std::uint8_t> out);

/// 64 random bits.
std::uint64_t random_u64();

/// "00000000deadbeef": 16 lowercase hex digits.
std::string hex16(std::uint64_t value);
/// Parses exactly 16 lowercase or uppercase hex digits; false on anything else.
bool parse_hex16(std::string_view text, std::uint64_t& out) noexcept;

/// Whether `text` is non-empty and all lowercase hex digits (ids and tokens have one spelling).
bool is_lower_hex(std::string_view text) noexcept;

/// Lowercase hex of `bytes`, and back; from_hex fails (false) unless `hex` holds exactly
/// 2 * out.size() hex digits.
std::string to_hex(std::span<const std::uint8_t> bytes);
bool from_hex(std::string_view hex, std::span<std::uint8_t> out) noexcept;

/// `text` unchanged if it is valid UTF-8 without NUL; otherwise a copy in which each byte that
/// is not part of a valid sequence (or is NUL) becomes U+FFFD. For text that came from a
/// peer and goes into JSON or messages.
std::string sanitized_utf8(std::string_view text);
/// Whether `text` is valid UTF-8 without NUL (no overlongs, no surrogates, nothing above
/// U+10FFFF): what sanitized_utf8() leaves unchanged.
bool valid_utf8(std::string_view text) noexcept;

}  // namespace ferry::loop
