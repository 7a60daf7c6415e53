#pragma once

#include <cstdint>
#include <string>

#include <ferry/error.hpp>

namespace ferry::transport::wire {

/// What a STATUS or DONE frame's `status` carries: the wire's own table, fixed by the protocol
/// (docs/protocol.md). The public ErrorCode may change; these numbers may not.
enum class WireStatus : std::uint32_t {
  ok = 0,
  invalid_argument = 1,
  invalid_metadata = 2,
  kind_mismatch = 3,
  size_mismatch = 4,
  no_common_method = 5,
  access_denied = 6,
  timeout = 7,
  cancelled = 8,
  peer_lost = 9,
  protocol_error = 10,
  wrong_thread = 11,
  invalid_state = 12,
  unsupported = 13,
  side_channel = 14,
  internal = 15,
};

/// The wire's number for `code`.
std::uint32_t to_wire(ErrorCode code) noexcept;
/// The ErrorCode a peer's status names; ProtocolError for 0 (no error) or a number the table
/// does not have.
ErrorCode from_wire(std::uint32_t status) noexcept;

/// What a peer's STATUS or DONE says went wrong: its text, else the name of its status.
std::string reason_of(std::uint32_t status, const std::string& message);
/// The error a peer's failing DONE ends an operation with: the peer's code, naming the peer
/// (`peer`, as StreamConnection::describe_peer() says it).
Error ended_by_peer(std::uint32_t status, const std::string& message, const std::string& peer);

}  // namespace ferry::transport::wire
