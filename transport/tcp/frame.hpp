#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "transport/transport.hpp"

namespace ferry::transport::tcp {

/// ferry's stream frames (docs/protocol.md): the TCP protocol, and the control connection of
/// the same-host method (cma) over a Unix socket. Every frame starts with this fixed 64-byte
/// header, little-endian; `msg_len` bytes of text follow it, then, for DATA, WRITE and CLAIM,
/// `len` bytes of payload.
enum class FrameType : std::uint8_t {
  hello = 1,   ///< first frame each way: msg = the sender's name
  read = 2,    ///< client: send `len` bytes at `addr` of operation `op_id`
  data = 3,    ///< server: the bytes of read request `req_id`
  write = 4,   ///< client: `len` bytes for `addr` of operation `op_id` follow
  status = 5,  ///< server: outcome of request `req_id`; status 0 is success, else an ErrorCode
  done = 6,    ///< client: the active operation ended with `status` (msg: the reason)
  claimed =
      7,      ///< server: operation `op_id` is now this connection's; `token` is the claim's secret
  claim = 8,  ///< cma client: claims `op_id` for the ranges in its payload (cma only)
  /// cuda_ipc server: the IPC handles of claim `req_id`'s memory in its payload, ahead of
  /// CLAIMED (cuda_ipc only)
  handles = 9,
};

inline constexpr std::uint32_t kMagic = 0x59525246;  // "FRRY" on the wire
inline constexpr std::uint8_t kVersion = 1;
inline constexpr std::size_t kHeaderSize = 64;
inline constexpr std::uint32_t kMaxMessage = 4096;

struct FrameHeader {
  std::uint32_t magic = kMagic;
  std::uint8_t version = kVersion;
  FrameType type = FrameType::hello;
  std::uint16_t flags = 0;
  std::uint32_t status = 0;
  std::uint32_t msg_len = 0;
  std::uint64_t req_id = 0;
  std::uint64_t op_id = 0;
  std::uint64_t addr = 0;
  std::uint64_t len = 0;
  Token token{};
};

using HeaderBytes = std::array<std::byte, kHeaderSize>;

HeaderBytes encode(const FrameHeader& header) noexcept;
FrameHeader decode(const std::byte* bytes) noexcept;

/// Checks what every frame must satisfy (magic, version, known type, message length);
/// returns an empty string when the header is well formed, else what is wrong.
std::string malformed(const FrameHeader& header);

/// The ErrorCode a STATUS or DONE frame carries; ProtocolError for a value that is none.
inline ErrorCode code_from_wire(std::uint32_t status) {
  if (status >= static_cast<std::uint32_t>(ErrorCode::InvalidArgument) &&
      status <= static_cast<std::uint32_t>(ErrorCode::Internal))
    return static_cast<ErrorCode>(status);
  return ErrorCode::ProtocolError;
}

/// Whether a frame of this type carries `len` bytes of payload after its message.
constexpr bool has_payload(FrameType type) noexcept {
  return type == FrameType::data || type == FrameType::write || type == FrameType::claim ||
         type == FrameType::handles;
}

}  // namespace ferry::transport::tcp
