#pragma once

#include <cstdint>
#include <unordered_set>
#include <vector>

#include "transport/kit/transfers.hpp"

namespace ferry::transport::tcp {

class TcpLink;

/// An active transfer by tcp: its segments are cut into requests of at most chunk_size bytes,
/// with at most `window` bytes requested and not yet done. CUDA memory goes through staging
/// chunks (cuda::Stager), one unit per request.
class TcpTransfer final : public kit::TransferBase<TcpTransfer> {
 public:
  TcpTransfer(TransferSpec what, TransferObserver& observer)
      : TransferBase(std::move(what), observer) {}

  TcpLink* link = nullptr;  ///< null once its connection closed
  std::size_t seg = 0;      ///< the next byte to request: segment, and offset in it
  std::uint64_t seg_off = 0;
  std::uint64_t inflight = 0;  ///< bytes requested, not yet done
  std::uint64_t done = 0;      ///< bytes in place
  bool done_sent = false;
  std::unordered_set<std::uint64_t> reqs;  ///< requests awaiting an answer
  unsigned copying = 0;                    ///< write units still being copied out of the device
  bool waiting_chunk = false;              ///< stopped for want of a staging chunk
  std::vector<std::byte> ended_ranges;     ///< a region write's ENDED payload, until it leaves
};

}  // namespace ferry::transport::tcp
