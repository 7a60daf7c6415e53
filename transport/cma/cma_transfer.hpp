#pragma once

#include <sys/uio.h>
#include <uv.h>

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "transport/kit/lifetime.hpp"
#include "transport/kit/transfers.hpp"
#include "transport/same_host/link.hpp"

namespace ferry::transport::cma {

class CmaCopier;

/// Shared by a transfer and its copy jobs: a job starts copying only while `stop` is false,
/// and counts itself in `copying` meanwhile; stopping waits until `copying` is 0.
struct CopyState {
  std::mutex mu;
  std::condition_variable cv;
  int copying = 0;
  bool stop = false;
  /// Stops jobs from starting, and waits for the ones copying. Bounded: a job copies one
  /// chunk.
  void halt() {
    std::unique_lock lock(mu);
    stop = true;
    cv.wait(lock, [&] { return copying == 0; });
  }
};

/// One copy job: up to chunk_size bytes in at most IOV_MAX pieces, under one grant, on libuv's
/// pool (or on the loop, for small transfers).
struct Job {
  uv_work_t req{};
  kit::Lifetime::Watch life;  ///< the copier's: after_job does nothing once it is closed
  CmaCopier* copier = nullptr;
  std::uint64_t transfer = 0;
  std::shared_ptr<CopyState> state;
  std::shared_ptr<same_host::OwnerProcess> owner;
  same_host::Grant grant;
  Access access = Access::read;
  std::vector<iovec> local;
  std::vector<iovec> remote;
  std::uint64_t bytes = 0;
  std::uint64_t unit = 0;  ///< staging: the staging unit it copies; 0: none
  // Results.
  std::uint64_t moved = 0;
  int err = 0;
  bool refused = false;  ///< the owner had ended the grant
  bool skipped = false;  ///< the transfer stopped before the job ran
  /// The copy itself; on a pool thread, or on the loop for small transfers.
  void run() noexcept;
};

/// CUDA memory of the active side, staged: one chunk's worth of consecutive CUDA segments. A
/// read copies the owner's ranges into the chunk on the pool, then the chunk to the device; a
/// write the device into the chunk, then the chunk to the owner on the pool.
struct StagedUnit {
  std::vector<iovec> remote;  ///< the owner's ranges, in the chunk's order
  bool queued = false;        ///< its process_vm_* job is on the pool
};

/// An active transfer by cma: the claim exchange (same_host::Claimant), then copy jobs of up to
/// chunk_size bytes, `parallel` at once, each under the owner's grant.
class CmaTransfer final : public kit::TransferBase<CmaTransfer>, public same_host::Claimant {
 public:
  CmaTransfer(TransferSpec what, TransferObserver& observer)
      : TransferBase(std::move(what), observer) {
    transfer_spec = &this->spec;
  }

  same_host::Link* link = nullptr;  ///< null once its connection closed
  std::shared_ptr<CopyState> copy = std::make_shared<CopyState>();
  std::size_t seg = 0;  ///< the next byte to copy: segment, and offset in it
  std::uint64_t seg_off = 0;
  unsigned jobs = 0;  ///< queued on the pool, not yet back
  std::uint64_t done = 0;
  bool staged = false;         ///< some local segment is CUDA memory
  bool waiting_chunk = false;  ///< no chunk was free: pumped again when one comes back
  std::map<std::uint64_t, StagedUnit> units;  ///< by staging unit
};

}  // namespace ferry::transport::cma
