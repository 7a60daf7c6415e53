#include "transport/wire/frame.hpp"

#include <endian.h>

#include <cstring>

#include "transport/wire/status.hpp"

namespace ferry::transport::wire {

namespace {

template <class T>
void put(std::byte* at, T value) noexcept {
  if constexpr (sizeof(T) == 2) value = static_cast<T>(htole16(value));
  if constexpr (sizeof(T) == 4) value = static_cast<T>(htole32(value));
  if constexpr (sizeof(T) == 8) value = static_cast<T>(htole64(value));
  std::memcpy(at, &value, sizeof value);
}

template <class T>
T get(const std::byte* at) noexcept {
  T value;
  std::memcpy(&value, at, sizeof value);
  if constexpr (sizeof(T) == 2) value = static_cast<T>(le16toh(value));
  if constexpr (sizeof(T) == 4) value = static_cast<T>(le32toh(value));
  if constexpr (sizeof(T) == 8) value = static_cast<T>(le64toh(value));
  return value;
}

}  // namespace

HeaderBytes encode(const FrameHeader& h) noexcept {
  HeaderBytes b{};
  std::byte* p = b.data();
  put<std::uint32_t>(p + 0, h.magic);
  p[4] = static_cast<std::byte>(h.version);
  p[5] = static_cast<std::byte>(h.type);
  put<std::uint16_t>(p + 6, h.flags);
  put<std::uint32_t>(p + 8, h.status);
  put<std::uint32_t>(p + 12, h.msg_len);
  put<std::uint64_t>(p + 16, h.req_id);
  put<std::uint64_t>(p + 24, h.op_id);
  put<std::uint64_t>(p + 32, h.addr);
  put<std::uint64_t>(p + 40, h.len);
  std::memcpy(p + 48, h.token.data(), h.token.size());
  return b;
}

FrameHeader decode(const std::byte* p) noexcept {
  FrameHeader h;
  h.magic = get<std::uint32_t>(p + 0);
  h.version = static_cast<std::uint8_t>(p[4]);
  h.type = static_cast<FrameType>(p[5]);
  h.flags = get<std::uint16_t>(p + 6);
  h.status = get<std::uint32_t>(p + 8);
  h.msg_len = get<std::uint32_t>(p + 12);
  h.req_id = get<std::uint64_t>(p + 16);
  h.op_id = get<std::uint64_t>(p + 24);
  h.addr = get<std::uint64_t>(p + 32);
  h.len = get<std::uint64_t>(p + 40);
  std::memcpy(h.token.data(), p + 48, h.token.size());
  return h;
}

FrameHeader status_frame(std::uint64_t req_id, const Error* error) noexcept {
  FrameHeader h;
  h.type = FrameType::status;
  h.req_id = req_id;
  if (error != nullptr) h.status = to_wire(error->code());
  return h;
}

std::string_view status_text(const Error* error) noexcept {
  if (error == nullptr) return {};
  return std::string_view(error->message()).substr(0, kMaxMessage);
}

std::optional<std::string> malformed(const FrameHeader& h) {
  if (h.magic != kMagic) return "bad magic";
  if (h.version != kVersion) return "unsupported protocol version " + std::to_string(h.version);
  switch (h.type) {
    case FrameType::hello:
    case FrameType::read:
    case FrameType::data:
    case FrameType::write:
    case FrameType::status:
    case FrameType::done:
    case FrameType::claimed:
    case FrameType::claim:
    case FrameType::attach:
    case FrameType::attached:
    case FrameType::ended:
    case FrameType::detach:
    case FrameType::read_ranges:
      break;
    default:
      return "unknown frame type " + std::to_string(static_cast<int>(h.type));
  }
  if (h.msg_len > kMaxMessage) return "message of " + std::to_string(h.msg_len) + " bytes";
  return std::nullopt;
}

}  // namespace ferry::transport::wire
