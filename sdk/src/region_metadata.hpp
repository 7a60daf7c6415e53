#pragma once

#include <ferry/rdma_metadata.hpp>
#include <ferry/region.hpp>

namespace ferry::detail {

/// The fields a region's metadata shares with an operation's, as a readable's metadata whose
/// key is the region id: what method choice and RdmaMetadata's checks read.
RdmaMetadata operation_view(const RegionMetadata& m);

}  // namespace ferry::detail
