#include "transport/token.hpp"

#include "loop/ids.hpp"

namespace ferry::transport {

bool tokens_equal(const Token& a, const Token& b) noexcept {
  std::uint8_t diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff |= static_cast<std::uint8_t>(a[i] ^ b[i]);
  return diff == 0;
}

Token random_token() {
  Token token{};
  loop::random_bytes(token);
  return token;
}

std::string token_to_hex(const Token& token) { return loop::to_hex(token); }

bool token_from_hex(std::string_view hex, Token& out) noexcept { return loop::from_hex(hex, out); }

}  // namespace ferry::transport
