// CUDA memory on cma's active side: process_vm_readv/writev cannot reach device memory, so the
// transfer's CUDA segments pass through pinned host chunks (cuda::Stager), copied to and from
// the device on its stream while other chunks are copied to or from the owner on libuv's pool.
// The owner's memory is host memory: cma does not serve CUDA memory (register_exposed refuses
// it; cuda_ipc or tcp moves it).
//
// Read, per unit: a pool job copies the owner's ranges into the chunk (under the grant, as any
// job), then the chunk is copied to the device; the unit is done, and its chunk goes back, when
// that copy ends. Write, per unit: the device is copied into the chunk, then a pool job copies
// the chunk to the owner; the unit is done when that job ends. DONE therefore leaves only after
// the last process_vm_* job has ended, and a read completes only after the last
// host-to-device copy has ended. Host segments of the same transfer are copied straight, by
// plain jobs, as in a host-only transfer.
//
// Ending a transfer (CmaCopier::stop) halts its jobs first, then the stager drops its units
// (cancelling their device copies, waiting for one under way, then giving the chunks back): when it
// returns, nothing touches either side's memory.

#include <algorithm>

#include "transport/cma/cma_copier.hpp"
#include "transport/cuda/stager.hpp"

namespace ferry::transport::cma {

namespace {

/// Jobs on the pool plus units between their device copies: what `parallel` bounds.
std::size_t busy(const CmaTransfer& t) {
  std::size_t n = t.jobs;
  for (const auto& [id, u] : t.units)
    if (!u.queued) ++n;
  return n;
}

}  // namespace

cuda::Stager& CmaCopier::stager() {
  if (!stager_) {
    if (ctx_.cuda == nullptr)
      throw Error(ErrorCode::Unsupported, "cma moves host memory only here (no CUDA driver)");
    // Two chunks per job a transfer may have in flight, so that device copies overlap the
    // copies to and from the owner.
    const std::uint64_t chunks = std::clamp<std::uint64_t>(2ull * options_.parallel, 4, 64);
    stager_ = std::make_unique<cuda::Stager>(ctx_.loop, *ctx_.cuda, ctx_.defer, options_.chunk_size,
                                             chunks, ctx_.log);
    stager_->set_wake([this](std::uint64_t id) {
      CmaTransfer* t = owner_.transfer(id);
      if (t == nullptr || t->finished() || !t->waiting_chunk) return;
      t->waiting_chunk = false;
      pump(*t);
    });
  }
  return *stager_;
}

void CmaCopier::pump_staged(CmaTransfer& t) {
  const std::vector<Segment>& segs = t.spec.segments;
  while (!t.finished() && !t.ended_by_owner && busy(t) < options_.parallel && t.seg < segs.size()) {
    if (segs[t.seg].cuda_device < 0) {
      // Host memory: copied straight by a plain job, up to the next CUDA segment.
      queue_job(t, /*host_only=*/true);
      continue;
    }
    // One chunk's worth of the consecutive CUDA segments from here.
    std::vector<cuda::Stager::Piece> pieces;
    StagedUnit u;
    std::size_t seg = t.seg;
    std::uint64_t off = t.seg_off;
    std::uint64_t bytes = 0;
    while (bytes < options_.chunk_size && pieces.size() < kIovMax && seg < segs.size() &&
           segs[seg].cuda_device >= 0) {
      const Segment& s = segs[seg];
      const std::uint64_t len = std::min<std::uint64_t>(options_.chunk_size - bytes, s.len - off);
      if (len > 0) {
        pieces.push_back({s.local + off, len, s.cuda_device});
        u.remote.push_back({reinterpret_cast<void*>(s.remote_addr + off), len});
      }
      bytes += len;
      off += len;
      if (off == s.len) {
        ++seg;
        off = 0;
      }
    }
    if (pieces.empty()) {  // empty segments only
      t.seg = seg;
      t.seg_off = off;
      continue;
    }
    std::uint64_t unit = 0;
    try {
      unit = stager().open(t.id(), std::move(pieces));
    } catch (const Error& e) {
      owner_.failed(t, e);
      return;
    }
    if (unit == 0) {
      t.waiting_chunk = true;  // the stager wakes it when a chunk comes back
      return;
    }
    t.seg = seg;
    t.seg_off = off;
    StagedUnit& placed = t.units[unit] = std::move(u);
    try {
      if (t.spec.access == Access::read) {
        // The owner's bytes into the chunk first.
        std::unique_ptr<Job> job = new_job(t);
        job->unit = unit;
        std::uint64_t at = 0;
        for (const iovec& r : placed.remote) {
          job->local.push_back({stager_->chunk(unit) + at, r.iov_len});
          job->remote.push_back(r);
          at += r.iov_len;
        }
        job->bytes = at;
        placed.queued = true;
        queue(std::move(job), t);
      } else {
        // The device's bytes into the chunk first.
        stager_->fill(unit, [this, id = t.id(), unit](const std::optional<Error>& error) {
          unit_copied(id, unit, error);
        });
      }
    } catch (const Error& e) {
      owner_.failed(t, e);
      return;
    }
  }
}

void CmaCopier::unit_moved(CmaTransfer& t, std::uint64_t unit) {
  auto u = t.units.find(unit);
  if (u == t.units.end()) return;
  u->second.queued = false;
  if (t.spec.access == Access::write) {
    unit_done(t, unit);  // the chunk's bytes are in the owner's memory
    return;
  }
  try {
    // The owner's bytes are in the chunk: on to the device.
    stager_->drain(unit, [this, id = t.id(), unit](const std::optional<Error>& error) {
      unit_copied(id, unit, error);
    });
  } catch (const Error& e) {
    owner_.failed(t, e);
  }
}

void CmaCopier::unit_copied(std::uint64_t transfer, std::uint64_t unit,
                            const std::optional<Error>& error) {
  CmaTransfer* t = owner_.transfer(transfer);
  if (t == nullptr || t->finished()) return;
  auto u = t->units.find(unit);
  if (u == t->units.end()) return;
  if (error) {
    owner_.failed(*t, Error(ErrorCode::Internal,
                            "cma: staging copy of CUDA memory failed: " + error->message()));
    return;
  }
  if (t->spec.access == Access::read) {
    unit_done(*t, unit);  // the bytes are on the device
    return;
  }
  // The device's bytes are in the chunk: a job copies them to the owner.
  std::unique_ptr<Job> job = new_job(*t);
  job->unit = unit;
  std::uint64_t at = 0;
  for (const iovec& r : u->second.remote) {
    job->local.push_back({stager_->chunk(unit) + at, r.iov_len});
    job->remote.push_back(r);
    at += r.iov_len;
  }
  job->bytes = at;
  u->second.queued = true;
  queue(std::move(job), *t);
}

void CmaCopier::unit_done(CmaTransfer& t, std::uint64_t unit) {
  t.done += stager_->bytes(unit);
  t.units.erase(unit);
  stager_->close(unit);
  if (t.done == t.total && t.jobs == 0) {
    owner_.copied(t);
    return;
  }
  pump(t);
}

}  // namespace ferry::transport::cma
