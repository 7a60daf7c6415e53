#include "loop/ids.hpp"

#include <sys/random.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <ferry/error.hpp>

namespace ferry::loop {

void random_bytes(std::span<std::uint8_t> out) {
  std::size_t got = 0;
  // EINTR and short reads retry; any other failure is final (getrandom only fails on a
  // broken kernel or seccomp policy, where retrying cannot help).
  for (int tries = 0; got < out.size(); ++tries) {
    ssize_t n = getrandom(out.data() + got, out.size() - got, 0);
    if (n > 0) {
      got += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR && tries < 64) continue;
    throw Error(ErrorCode::Internal,
                std::string("getrandom: ") + (n < 0 ? std::strerror(errno) : "no bytes"));
  }
}

std::uint64_t random_u64() {
  std::uint8_t b[8];
  random_bytes(b);
  std::uint64_t v = 0;
  for (std::uint8_t x : b) v = v << 8 | x;
  return v;
}

std::string hex16(std::uint64_t value) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(value));
  return buf;
}

namespace {
int nibble(char c) noexcept {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}
}  // namespace

bool is_lower_hex(std::string_view text) noexcept {
  if (text.empty()) return false;
  for (char c : text)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

bool parse_hex16(std::string_view text, std::uint64_t& out) noexcept {
  if (text.size() != 16) return false;
  std::uint64_t v = 0;
  for (char c : text) {
    int n = nibble(c);
    if (n < 0) return false;
    v = v << 4 | static_cast<std::uint64_t>(n);
  }
  out = v;
  return true;
}

std::string to_hex(std::span<const std::uint8_t> bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (std::uint8_t b : bytes) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 0xf]);
  }
  return out;
}

bool from_hex(std::string_view hex, std::span<std::uint8_t> out) noexcept {
  if (hex.size() != out.size() * 2) return false;
  for (std::size_t i = 0; i < out.size(); ++i) {
    // Lowercase only: tokens have one spelling, so that two spellings cannot name one token.
    char a = hex[2 * i], b = hex[2 * i + 1];
    if ((a >= 'A' && a <= 'F') || (b >= 'A' && b <= 'F')) return false;
    int hi = nibble(a);
    int lo = nibble(b);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<std::uint8_t>(hi << 4 | lo);
  }
  return true;
}

namespace {

// Length of the valid UTF-8 sequence starting at s[i], or 0 if none starts there.
std::size_t sequence_at(std::string_view s, std::size_t i) noexcept {
  auto u = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = u(i);
  if (c == 0) return 0;
  if (c < 0x80) return 1;
  std::size_t len = 0;
  std::uint32_t cp = 0;
  if (c >= 0xc2 && c <= 0xdf) {
    len = 2;
    cp = c & 0x1f;
  } else if (c >= 0xe0 && c <= 0xef) {
    len = 3;
    cp = c & 0x0f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    len = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + len > s.size()) return 0;
  for (std::size_t k = 1; k < len; ++k) {
    if ((u(i + k) & 0xc0) != 0x80) return 0;
    cp = cp << 6 | (u(i + k) & 0x3f);
  }
  if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000)) return 0;  // overlong
  if (cp >= 0xd800 && cp <= 0xdfff) return 0;                            // surrogate
  if (cp > 0x10ffff) return 0;
  return len;
}

}  // namespace

bool valid_utf8(std::string_view text) noexcept {
  for (std::size_t i = 0; i < text.size();) {
    std::size_t n = sequence_at(text, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string sanitized_utf8(std::string_view text) {
  if (valid_utf8(text)) return std::string(text);
  std::string out;
  out.reserve(text.size() + 8);
  for (std::size_t i = 0; i < text.size();) {
    std::size_t n = sequence_at(text, i);
    if (n == 0) {
      out += "\xef\xbf\xbd";
      ++i;
    } else {
      out.append(text.substr(i, n));
      i += n;
    }
  }
  return out;
}

}  // namespace ferry::loop
