#pragma once

#include <string_view>

namespace ferry {

/// What the active side does to a passive operation's memory. A readable operation's
/// metadata carries `read` (the peer reads it), a writable's carries `write`.
enum class OperationKind : int { unspecified = 0, read = 1, write = 2 };

/// The life of an operation. `complete`, `cancelled` and `errored` are final.
enum class OperationStatus : int {
  uninitialized = 0,  ///< an empty handle (default-constructed or moved from)
  initialized,        ///< a passive operation waiting for its peer
  in_progress,        ///< bytes are moving (active), or a peer has claimed it (passive)
  complete,           ///< the data is in place; the memory may be reused
  cancelled,          ///< cancel() or connector shutdown; the memory may be reused
  errored,            ///< failed; error() says why; the memory may be reused
};

/// "read", "write", "unspecified".
std::string_view to_string(OperationKind kind) noexcept;
/// "initialized", "complete", ...
std::string_view to_string(OperationStatus status) noexcept;

constexpr bool is_final(OperationStatus s) noexcept {
  return s == OperationStatus::complete || s == OperationStatus::cancelled ||
         s == OperationStatus::errored;
}

}  // namespace ferry
