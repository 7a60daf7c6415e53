// CUDA memory on cma's active side: process_vm_readv/writev cannot reach device memory, so the
// transfer's CUDA segments pass through pinned host chunks of chunk_size bytes
// (cuda::StagingPool), copied to and from the device on its stream (cuda::CopyEngine) while
// other chunks are copied to or from the owner on libuv's pool. The owner's memory is host
// memory: cma does not serve CUDA memory (register_exposed refuses it; cuda_ipc or tcp moves
// it).
//
// Read, per unit: a pool job copies the owner's ranges into the chunk (under the grant, as any
// job), then the chunk is copied to the device; the unit is done, and its chunk goes back, when
// the last of those copies ends. Write, per unit: the device is copied into the chunk, then a
// pool job copies the chunk to the owner; the unit is done when that job ends. DONE therefore
// leaves only after the last process_vm_* job has ended, and a read completes only after the
// last host-to-device copy has ended. Host segments of the same transfer are copied straight,
// by plain jobs, as in a host-only transfer; a host-only transfer never comes here.
//
// Ending a transfer (finish_transfer: cancel, deadline, lost owner, error) halts its jobs
// first, then cancels its device copies (CopyEngine::cancel waits for one under way), then
// gives its chunks back: when it returns, nothing touches either side's memory.

#include <algorithm>
#include <climits>

#include "transport/cma/cma_internal.hpp"
#include "transport/cuda/copy_engine.hpp"

namespace ferry::transport::cma {

namespace {

constexpr std::size_t kIovMax = IOV_MAX;

/// Jobs on the pool plus units between their device copies: what parallel bounds.
std::size_t busy(const CmaTransfer& t) {
  std::size_t n = t.jobs;
  for (const auto& [id, u] : t.units)
    if (!u.queued) ++n;
  return n;
}

}  // namespace

/// The pinned chunks, and the primary context they were allocated with (pinned chunks are
/// portable: one context serves every device).
struct CmaTransport::Staging {
  explicit Staging(const cuda::CudaApi& driver) : api(driver) {}
  ~Staging() {
    pool.reset();  // frees the chunks
    if (context != nullptr) (void)api.device_primary_ctx_release(device);
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  const cuda::CudaApi& api;
  CUdevice device = 0;
  CUcontext context = nullptr;
  std::unique_ptr<cuda::StagingPool> pool;
};

std::byte* CmaTransport::acquire_chunk(int ordinal) {
  if (!staging_) {
    if (options_.cuda == nullptr)
      throw Error(ErrorCode::Unsupported, "cma moves host memory only here (no CUDA driver)");
    const cuda::CudaApi& api = *options_.cuda;
    auto staging = std::make_shared<Staging>(api);
    CUresult r = api.device_get(&staging->device, ordinal);
    if (r == CUDA_SUCCESS) r = api.device_primary_ctx_retain(&staging->context, staging->device);
    if (r != CUDA_SUCCESS) {
      staging->context = nullptr;
      throw Error(ErrorCode::Internal,
                  "cma cannot stage CUDA memory of cuda:" + std::to_string(ordinal) + ": " +
                      cuda::result_text(&api, r));
    }
    // Two chunks per job a transfer may have in flight, so that device copies overlap the
    // copies to and from the owner.
    const std::uint64_t chunks =
        std::clamp<std::uint64_t>(2ull * options_.parallel, 4, std::uint64_t{64});
    staging->pool = std::make_unique<cuda::StagingPool>(
        api, static_cast<std::size_t>(options_.chunk_size), static_cast<std::size_t>(chunks));
    staging->pool->set_on_release([this] { chunk_freed(); });
    if (!engine_) engine_ = std::make_unique<cuda::CopyEngine>(loop_, api);
    staging_ = std::move(staging);
  }
  return staging_->pool->acquire(staging_->context);
}

void CmaTransport::chunk_freed() {
  // Called from release(), often in the middle of ending a unit or a transfer: the transfers
  // that waited for a chunk go on from the loop, not from here.
  if (closed_) return;
  if (std::none_of(transfers_.begin(), transfers_.end(),
                   [](const auto& kv) { return kv.second->waiting_chunk; }))
    return;
  defer_([this, life = std::weak_ptr<int>(life_)] {
    if (life.expired()) return;
    std::vector<std::uint64_t> waiting;
    for (auto& [id, t] : transfers_)
      if (t->waiting_chunk && !t->finished) waiting.push_back(id);
    for (std::uint64_t id : waiting) {
      auto it = transfers_.find(id);
      if (it == transfers_.end() || it->second->finished || !it->second->waiting_chunk) continue;
      it->second->waiting_chunk = false;
      pump(*it->second);
    }
  });
}

void CmaTransport::pump_staged(CmaTransfer& t) {
  const std::vector<Segment>& segs = t.spec.segments;
  while (!t.finished && !t.ended_by_owner && busy(t) < options_.parallel && t.seg < segs.size()) {
    if (segs[t.seg].cuda_device < 0) {
      // Host memory: copied straight by a plain job, up to the next CUDA segment.
      queue_job(t, /*host_only=*/true);
      continue;
    }
    std::byte* chunk = nullptr;
    try {
      chunk = acquire_chunk(segs[t.seg].cuda_device);
    } catch (const Error& e) {
      staging_failed(t, e);
      return;
    }
    if (chunk == nullptr) {
      t.waiting_chunk = true;  // chunk_freed() pumps again
      return;
    }
    const std::uint64_t id = t.next_unit++;
    StagedUnit& u = t.units[id];
    u.chunk = chunk;
    while (u.bytes < options_.chunk_size && u.pieces.size() < kIovMax && t.seg < segs.size() &&
           segs[t.seg].cuda_device >= 0) {
      const Segment& s = segs[t.seg];
      const std::uint64_t len =
          std::min<std::uint64_t>(options_.chunk_size - u.bytes, s.len - t.seg_off);
      if (len > 0)
        u.pieces.push_back(
            Segment{s.remote_addr + t.seg_off, s.local + t.seg_off, len, s.cuda_device});
      u.bytes += len;
      t.seg_off += len;
      if (t.seg_off == s.len) {
        ++t.seg;
        t.seg_off = 0;
      }
    }
    if (u.pieces.empty()) {
      unit_done(t, id);  // empty segments only
      return;
    }
    if (t.spec.access == Access::read)
      queue_staged_job(t, id);
    else
      queue_device_copies(t, id);
  }
}

void CmaTransport::queue_staged_job(CmaTransfer& t, std::uint64_t unit) {
  StagedUnit& u = t.units.at(unit);
  std::unique_ptr<Job> job = new_job(t);
  job->unit = unit;
  std::uint64_t off = 0;
  for (const Segment& p : u.pieces) {
    job->local.push_back({u.chunk + off, p.len});
    job->remote.push_back({reinterpret_cast<void*>(p.remote_addr), p.len});
    off += p.len;
  }
  job->bytes = u.bytes;
  job->req.data = job.get();
  u.queued = true;
  ++t.jobs;
  uv_queue_work(loop_, &job->req, &CmaTransport::run_job, &CmaTransport::after_job);
  job.release();  // after_job owns it
}

void CmaTransport::staged_job_done(CmaTransfer& t, std::uint64_t unit) {
  auto it = t.units.find(unit);
  if (it == t.units.end()) return;
  it->second.queued = false;
  if (t.spec.access == Access::read)
    queue_device_copies(t, unit);  // the owner's bytes are in the chunk
  else
    unit_done(t, unit);  // the chunk's bytes are in the owner's memory
}

void CmaTransport::queue_device_copies(CmaTransfer& t, std::uint64_t unit) {
  StagedUnit& u = t.units.at(unit);
  const bool reading = t.spec.access == Access::read;
  std::uint64_t off = 0;
  std::size_t i = 0;
  while (i < u.pieces.size()) {
    // Pieces that follow each other in one device's memory make one copy.
    const Segment& first = u.pieces[i];
    std::uint64_t len = first.len;
    for (++i; i < u.pieces.size() && u.pieces[i].cuda_device == first.cuda_device &&
              u.pieces[i].local == first.local + len;
         ++i)
      len += u.pieces[i].len;
    std::byte* host = u.chunk + off;
    off += len;
    try {
      // The copy's id is known once copy() returns, and its end is reported only later.
      auto copy_id = std::make_shared<std::uint64_t>(0);
      *copy_id =
          engine_->copy(first.cuda_device, reading ? first.local : host,
                        reading ? host : first.local, static_cast<std::size_t>(len),
                        [this, transfer = t.id, unit, copy_id,
                         life = std::weak_ptr<int>(life_)](const std::optional<Error>& error) {
                          if (!life.expired()) staged_copied(transfer, unit, *copy_id, error);
                        });
      u.copies.push_back(*copy_id);
    } catch (const Error& e) {
      staging_failed(t, e);
      return;
    }
  }
}

void CmaTransport::staged_copied(std::uint64_t transfer, std::uint64_t unit, std::uint64_t copy,
                                 const std::optional<Error>& error) {
  auto it = transfers_.find(transfer);
  if (it == transfers_.end() || it->second->finished) return;
  CmaTransfer& t = *it->second;
  auto u = t.units.find(unit);
  if (u == t.units.end()) return;
  auto c = std::find(u->second.copies.begin(), u->second.copies.end(), copy);
  if (c == u->second.copies.end()) return;  // cancelled
  u->second.copies.erase(c);
  if (error) {
    staging_failed(t, Error(ErrorCode::Internal,
                            "cma: staging copy of CUDA memory failed: " + error->message()));
    return;
  }
  if (!u->second.copies.empty()) return;
  if (t.spec.access == Access::read)
    unit_done(t, unit);  // the bytes are on the device
  else
    queue_staged_job(t, unit);  // the device's bytes are in the chunk
}

void CmaTransport::unit_done(CmaTransfer& t, std::uint64_t unit) {
  auto u = t.units.find(unit);
  if (u == t.units.end()) return;
  t.done += u->second.bytes;
  std::byte* chunk = u->second.chunk;
  t.units.erase(u);
  staging_->pool->release(chunk);
  if (t.done == t.total && t.jobs == 0) {
    all_copied(t);
    return;
  }
  pump(t);
}

void CmaTransport::staging_failed(CmaTransfer& t, const Error& error) {
  if (t.finished) return;
  finish_transfer(t, error);
  send_done(t, &error);
}

void CmaTransport::drop_staged(CmaTransfer& t) {
  t.waiting_chunk = false;
  if (t.units.empty()) return;
  for (const auto& [id, u] : t.units)
    for (std::uint64_t copy : u.copies) engine_->cancel(copy);  // waits for one under way
  // The jobs were halted and the copies cancelled: no chunk is in use any more.
  std::vector<std::byte*> chunks;
  for (const auto& [id, u] : t.units) chunks.push_back(u.chunk);
  t.units.clear();
  for (std::byte* chunk : chunks) staging_->pool->release(chunk);
}

}  // namespace ferry::transport::cma
