#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace ferry {

/// The one set of error codes ferry reports, both as exceptions (`ferry::Error`) at the call
/// that was wrong, and as the error of an operation that failed later.
enum class ErrorCode : int {
  InvalidArgument = 1,  ///< bad input at the call: null pointer, empty list, bad device string
  InvalidMetadata,      ///< RdmaMetadata failed validation; Error::field() names the field
  KindMismatch,         ///< readable pairs with read, writable with write; anything else
  SizeMismatch,         ///< the two descriptor lists hold different byte totals
  NoCommonMethod,       ///< the peer offers no transfer method this connector has
  AccessDenied,   ///< the peer refused the request: unknown, dead or wrong token, kind or range
  Timeout,        ///< a deadline passed
  Cancelled,      ///< cancelled locally, by the peer, or by connector shutdown
  PeerLost,       ///< the peer could not be reached, or its connection dropped
  ProtocolError,  ///< a malformed or unexpected frame or message
  WrongThread,    ///< a blocking call on the connector's loop thread (it would deadlock)
  InvalidState,   ///< the call does not fit the object's state (empty handle, closed connector)
  Unsupported,    ///< this build or host lacks the feature (e.g. CUDA memory)
  SideChannel,    ///< the NATS side channel failed: connect, auth, payload limit
  Internal,       ///< a system failure ferry did not expect
};

/// "InvalidMetadata", "Timeout", ...
std::string_view to_string(ErrorCode code) noexcept;

/// Whether retrying the same request may succeed (a timeout, a lost peer, an unreachable
/// side channel), as opposed to a request that is wrong and will stay wrong.
bool is_retryable(ErrorCode code) noexcept;

/// The exception ferry throws, and the error a failed operation carries.
/// `what()` reads "<Code>: <message>" and names the field when there is one.
///
/// Copies share nothing: an Error copied to another thread (an operation's error, read by the
/// thread that waits while the loop thread drops its own copy) holds its own text, never a
/// buffer reference-counted inside the standard library.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message, std::string field = {});

  const char* what() const noexcept override { return what_.c_str(); }
  ErrorCode code() const noexcept { return code_; }
  /// The message without the code prefix.
  const std::string& message() const noexcept { return message_; }
  /// For InvalidMetadata: the JSON path of the offending field ("descriptors[2].size").
  const std::string& field() const noexcept { return field_; }
  /// Whether retrying may help: what is_retryable(code()) says, unless ferry knows better (a
  /// peer whose process is gone, say: PeerLost, but no retry reaches it).
  bool retryable() const noexcept { return retryable_; }
  /// Overrides retryable() (for errors whose code says more than is true).
  Error& set_retryable(bool retryable) noexcept {
    retryable_ = retryable;
    return *this;
  }

 private:
  ErrorCode code_;
  bool retryable_;
  std::string message_;
  std::string field_;
  std::string what_;
};

}  // namespace ferry
