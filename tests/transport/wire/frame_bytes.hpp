#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "transport/wire/frame.hpp"

namespace ferry::transport::wire::test {

/// One frame as bytes on the wire: a header of `type` with `req_id`, then `message`, then
/// `payload` (its length in the header only for the types that carry one).
inline std::string frame_bytes(FrameType type, std::uint64_t req_id, std::string_view message,
                               std::string_view payload = {}) {
  FrameHeader h;
  h.type = type;
  h.req_id = req_id;
  h.msg_len = static_cast<std::uint32_t>(message.size());
  h.len = has_payload(type) ? payload.size() : 0;
  const HeaderBytes bytes = encode(h);
  std::string out(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  out += message;
  out += payload;
  return out;
}

}  // namespace ferry::transport::wire::test
