#pragma once

#include <string_view>

#include <ferry/rdma_metadata.hpp>

namespace ferry::detail {

/// RdmaMetadata::from_json through the general JSON reader alone, for any document. from_json
/// reads the form to_json writes directly and gives the same answer; tests and the fuzzer
/// compare the two.
RdmaMetadata metadata_from_json_general(std::string_view text);

}  // namespace ferry::detail
