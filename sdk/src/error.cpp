#include <ferry/error.hpp>

namespace ferry {

std::string_view to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::InvalidArgument:
      return "InvalidArgument";
    case ErrorCode::InvalidMetadata:
      return "InvalidMetadata";
    case ErrorCode::KindMismatch:
      return "KindMismatch";
    case ErrorCode::SizeMismatch:
      return "SizeMismatch";
    case ErrorCode::NoCommonMethod:
      return "NoCommonMethod";
    case ErrorCode::AccessDenied:
      return "AccessDenied";
    case ErrorCode::Timeout:
      return "Timeout";
    case ErrorCode::Cancelled:
      return "Cancelled";
    case ErrorCode::PeerLost:
      return "PeerLost";
    case ErrorCode::ProtocolError:
      return "ProtocolError";
    case ErrorCode::WrongThread:
      return "WrongThread";
    case ErrorCode::InvalidState:
      return "InvalidState";
    case ErrorCode::Unsupported:
      return "Unsupported";
    case ErrorCode::SideChannel:
      return "SideChannel";
    case ErrorCode::Internal:
      return "Internal";
  }
  return "Unknown";
}

bool is_retryable(ErrorCode code) noexcept {
  return code == ErrorCode::Timeout || code == ErrorCode::PeerLost ||
         code == ErrorCode::SideChannel;
}

namespace {

std::string compose(ErrorCode code, const std::string& message, const std::string& field) {
  std::string what(to_string(code));
  what += ": ";
  if (!field.empty()) what += field + ": ";
  what += message;
  return what;
}

}  // namespace

Error::Error(ErrorCode code, const std::string& message, std::string field)
    : std::runtime_error(""),  // what() is what_: the base's text is shared between copies
      code_(code),
      retryable_(is_retryable(code)),
      message_(message),
      field_(std::move(field)),
      what_(compose(code, message, field_)) {}

}  // namespace ferry
