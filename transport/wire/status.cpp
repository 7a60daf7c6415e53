#include "transport/wire/status.hpp"

#include <array>
#include <utility>

namespace ferry::transport::wire {

namespace {

constexpr std::array<std::pair<ErrorCode, WireStatus>, 15> kTable{{
    {ErrorCode::InvalidArgument, WireStatus::invalid_argument},
    {ErrorCode::InvalidMetadata, WireStatus::invalid_metadata},
    {ErrorCode::KindMismatch, WireStatus::kind_mismatch},
    {ErrorCode::SizeMismatch, WireStatus::size_mismatch},
    {ErrorCode::NoCommonMethod, WireStatus::no_common_method},
    {ErrorCode::AccessDenied, WireStatus::access_denied},
    {ErrorCode::Timeout, WireStatus::timeout},
    {ErrorCode::Cancelled, WireStatus::cancelled},
    {ErrorCode::PeerLost, WireStatus::peer_lost},
    {ErrorCode::ProtocolError, WireStatus::protocol_error},
    {ErrorCode::WrongThread, WireStatus::wrong_thread},
    {ErrorCode::InvalidState, WireStatus::invalid_state},
    {ErrorCode::Unsupported, WireStatus::unsupported},
    {ErrorCode::SideChannel, WireStatus::side_channel},
    {ErrorCode::Internal, WireStatus::internal},
}};

}  // namespace

std::uint32_t to_wire(ErrorCode code) noexcept {
  for (const auto& [c, w] : kTable)
    if (c == code) return static_cast<std::uint32_t>(w);
  return static_cast<std::uint32_t>(WireStatus::internal);
}

std::string reason_of(std::uint32_t status, const std::string& message) {
  return message.empty() ? std::string(to_string(from_wire(status))) : message;
}

Error ended_by_peer(std::uint32_t status, const std::string& message, const std::string& peer) {
  return Error(from_wire(status),
               "peer " + peer + " ended the transfer: " + reason_of(status, message));
}

ErrorCode from_wire(std::uint32_t status) noexcept {
  for (const auto& [c, w] : kTable)
    if (static_cast<std::uint32_t>(w) == status) return c;
  return ErrorCode::ProtocolError;
}

}  // namespace ferry::transport::wire
