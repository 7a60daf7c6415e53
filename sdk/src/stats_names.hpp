#pragma once

#include <ferry/operation_status.hpp>

namespace ferry::detail {

/// The words stats' JSON and the Prometheus labels use: "read", "write" ("unknown");
/// "complete", "cancelled", "errored".
const char* kind_name(OperationKind kind);
const char* outcome_name(OperationStatus status);

}  // namespace ferry::detail
