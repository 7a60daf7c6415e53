#include <ferry/operation_status.hpp>

namespace ferry {

std::string_view to_string(OperationKind kind) noexcept {
  switch (kind) {
    case OperationKind::read:
      return "read";
    case OperationKind::write:
      return "write";
    case OperationKind::unspecified:
      break;
  }
  return "unspecified";
}

std::string_view to_string(OperationStatus status) noexcept {
  switch (status) {
    case OperationStatus::uninitialized:
      return "uninitialized";
    case OperationStatus::initialized:
      return "initialized";
    case OperationStatus::in_progress:
      return "in_progress";
    case OperationStatus::complete:
      return "complete";
    case OperationStatus::cancelled:
      return "cancelled";
    case OperationStatus::errored:
      return "errored";
  }
  return "unknown";
}

}  // namespace ferry
