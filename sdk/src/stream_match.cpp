#include "sdk/src/stream_match.hpp"

#include <algorithm>

namespace ferry::detail {

std::vector<transport::Segment> match_streams(const std::vector<RemoteDescriptor>& remote,
                                              const std::vector<Descriptor>& local) {
  std::vector<transport::Segment> out;
  out.reserve(std::max(remote.size(), local.size()));
  std::size_t r = 0;
  std::size_t l = 0;
  std::uint64_t r_off = 0;
  std::uint64_t l_off = 0;
  while (r < remote.size() && l < local.size()) {
    std::uint64_t len = std::min(remote[r].size - r_off, local[l].size() - l_off);
    const Device dev = local[l].device();
    out.push_back({remote[r].ptr + r_off, local[l].bytes() + l_off, len,
                   dev.kind() == DeviceKind::cuda ? dev.id() : -1});
    r_off += len;
    l_off += len;
    if (r_off == remote[r].size) {
      ++r;
      r_off = 0;
    }
    if (l_off == local[l].size()) {
      ++l;
      l_off = 0;
    }
  }
  return out;
}

}  // namespace ferry::detail
