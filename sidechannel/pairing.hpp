#pragma once

#include <optional>
#include <string>
#include <string_view>

#include <ferry/error.hpp>
#include <ferry/operation_status.hpp>

namespace ferry::sidechannel {

// The messages of pairing by subject (docs/sidechannel.md). All JSON, all versioned.

/// Asked at a passive operation's subject; answered with the operation's RdmaMetadata JSON.
struct MetadataRequest {
  OperationKind want = OperationKind::unspecified;  ///< what the asker will do
  std::string from;                                 ///< the asker's connector name
};
std::string encode(const MetadataRequest& request);

/// Published by an active operation that paired by subject when it ends, to
/// "<prefix>.notify.<owner id>": completes the passive operation, or errors it with `error`.
struct CompletionNotice {
  std::string key;             ///< the passive operation's notification key
  std::string token;           ///< its token, proving the sender holds the metadata
  std::string from;            ///< the active side's connector name
  std::string from_id;         ///< and its id
  std::optional<Error> error;  ///< empty: the transfer finished
  /// The claim secret the owner handed to the sender's transfer (32 hex digits), empty if it
  /// never claimed: once an operation is claimed, only a notice that carries it counts.
  std::string claim;
};
std::string encode(const CompletionNotice& notice);
/// Empty when `json` is not a well-formed notice.
std::optional<CompletionNotice> decode_notice(std::string_view json);

}  // namespace ferry::sidechannel
