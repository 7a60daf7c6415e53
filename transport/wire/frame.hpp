#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <ferry/error.hpp>

#include "transport/memory.hpp"

namespace ferry::transport::wire {

/// ferry's frames (docs/protocol.md): tcp's protocol over TCP, the control connection of the
/// same-host methods (cma, cuda_ipc) over a Unix socket, and verbs' control messages over RDMA
/// SENDs. Every frame starts with this fixed 64-byte header, little-endian; `msg_len` bytes of
/// text follow it, then, for the types has_payload() names, `len` bytes of payload.
enum class FrameType : std::uint8_t {
  hello = 1,    ///< first frame each way: msg = the sender's name, op_id = its connector id
  read = 2,     ///< tcp client: send `len` bytes at `addr` of operation `op_id`
  data = 3,     ///< tcp server: the bytes of read request `req_id` at `addr`
  write = 4,    ///< tcp client: `len` bytes for `addr` of operation `op_id` follow
  status = 5,   ///< outcome of request `req_id` (a WireStatus); with req_id 0, a notice
  done = 6,     ///< client: the active operation ended with `status` (msg: the reason)
  claimed = 7,  ///< server: operation `op_id` is now this connection's; `token` is the claim's
                ///< secret; the payload is the method's (verbs: keys, cuda_ipc: IPC handles)
  claim = 8,    ///< cma, cuda_ipc, verbs client: claims `op_id` for the ranges in its payload
  // Regions (docs/regions.md).
  attach = 9,        ///< client: attaches to region `op_id` with its `token`; flags: the access
  attached = 10,     ///< server: answers ATTACH `req_id`: attachment `op_id`, its secret `token`;
                     ///< the payload is the method's (as CLAIMED's)
  ended = 11,        ///< client: a transfer on attachment `op_id` (`token`: its secret) ended with
                     ///< `status`; flags: read or write; msg: the tag; payload: its ranges
  detach = 12,       ///< client: attachment `op_id` (`token`: its secret) ends
  read_ranges = 13,  ///< tcp client: send the ranges in the payload (pairs of 8-byte address
                     ///< and length) of operation `op_id`, each in a DATA whose `addr` names it
};

inline constexpr std::uint32_t kMagic = 0x59525246;  // "FRRY" on the wire
inline constexpr std::uint8_t kVersion = 1;
inline constexpr std::size_t kHeaderSize = 64;
inline constexpr std::uint32_t kMaxMessage = 4096;
/// Most ranges one READ_RANGES may name (16 bytes each).
inline constexpr std::size_t kMaxReadRanges = 4096;

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

/// Checks what every frame must satisfy (magic, version, known type, message length): what
/// is wrong ("bad magic"), or none when the header is well formed.
std::optional<std::string> malformed(const FrameHeader& header);

/// The STATUS frame that answers request `req_id` (0: a notice about the connection): success
/// when `error` is null, else its code (status.hpp). Its text is status_text(error).
FrameHeader status_frame(std::uint64_t req_id, const Error* error) noexcept;
/// The text of status_frame(req_id, error): the error's message, cut to kMaxMessage.
std::string_view status_text(const Error* error) noexcept;

/// Whether a frame of this type carries `len` bytes of payload after its message. The one rule,
/// whatever carries the frames.
constexpr bool has_payload(FrameType type) noexcept {
  return type == FrameType::data || type == FrameType::write || type == FrameType::claim ||
         type == FrameType::claimed || type == FrameType::attached || type == FrameType::ended ||
         type == FrameType::read_ranges;
}

}  // namespace ferry::transport::wire
