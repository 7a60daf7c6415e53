#pragma once

#include <vector>

#include <ferry/descriptor.hpp>
#include <ferry/rdma_metadata.hpp>

#include "transport/transport.hpp"

namespace ferry::detail {

/// Matches the remote and local descriptor lists as one byte stream each: the result pairs
/// every remote byte with the local byte at the same stream offset, cut wherever either
/// list's descriptor ends. The totals must be equal (checked before).
std::vector<transport::Segment> match_streams(const std::vector<RemoteDescriptor>& remote,
                                              const std::vector<Descriptor>& local);

}  // namespace ferry::detail
