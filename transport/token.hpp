#pragma once

#include <string>
#include <string_view>

#include "transport/memory.hpp"

namespace ferry::transport {

/// Compares tokens in time independent of where they differ.
bool tokens_equal(const Token& a, const Token& b) noexcept;

/// A fresh token from the kernel's random source.
Token random_token();

/// "0123abcd..." (32 lowercase hex digits) and back; parse returns false on bad input.
std::string token_to_hex(const Token& token);
bool token_from_hex(std::string_view hex, Token& out) noexcept;

}  // namespace ferry::transport
