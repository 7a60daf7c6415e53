// CUDA memory the NIC cannot reach (no dmabuf, no nvidia-peermem), on verbs' active side:
// through pinned host chunks of the transfer's stager, each registered with the NIC once. A
// read posts RDMA READs into a unit's chunk, then copies it to the device; a write copies the
// device into the chunk, then posts RDMA WRITEs from it. A unit's chunk goes back once its
// bytes are in place.

#include <algorithm>

#include "transport/cuda/stager.hpp"
#include "transport/verbs/verbs_transport.hpp"

namespace ferry::transport::verbs {

cuda::Stager& VerbsClient::stager(int ordinal) {
  if (!stager_) {
    (void)t_.devices_->gpudirect().context(ordinal);  // the driver answers for this device
    stager_ = std::make_unique<cuda::Stager>(t_.ctx_.loop, *t_.ctx_.cuda, t_.ctx_.defer,
                                             kStagingChunk, kStagingChunks, t_.ctx_.log);
    stager_->set_wake([this](std::uint64_t id) {
      VerbsTransfer* t = transfers_.find(id);
      if (t == nullptr || t->finished() || !t->waiting_chunk) return;
      t->waiting_chunk = false;
      make_ready(*t);
    });
  }
  return *stager_;
}

bool VerbsClient::staged_segment(const VerbsTransfer& t, std::size_t i) {
  if (t.spec.segments[i].cuda_device < 0 || i >= t.regs.size() || !t.regs[i]) return false;
  const auto* set = static_cast<const MrSet*>(t.regs[i]->handle.get());
  return set != nullptr && set->staged;
}

const MrSet* VerbsClient::chunk_set(std::uint64_t unit) {
  const std::byte* buf = stager_->chunk(unit);
  auto& reg = chunk_regs_[buf];
  if (!reg) {
    // Pinned chunks are registered once, as host memory, and kept as long as the stager.
    try {
      reg = t_.registrations_.acquire(
          Region{const_cast<std::byte*>(buf), stager_->chunk_size(), MemoryKind::host, -1});
    } catch (...) {
      chunk_regs_.erase(buf);
      throw;
    }
  }
  return static_cast<const MrSet*>(reg->handle.get());
}

bool VerbsClient::start_chunk(VerbsTransfer& t) {
  const Segment& s = t.spec.segments[t.seg];
  const std::uint64_t len =
      std::min<std::uint64_t>(stager(s.cuda_device).chunk_size(), s.len - t.off);
  const std::uint64_t unit = stager_->open(t.id(), {{s.local + t.off, len, s.cuda_device}});
  if (unit == 0) {
    t.waiting_chunk = true;
    return false;
  }
  (void)chunk_set(unit);  // registered before anything is posted from or into it
  t.chunks[unit] = Chunk{s.remote_addr + t.off, len, 0, 0};
  t.off += len;
  if (t.off == s.len) {
    ++t.seg;
    t.off = 0;
  }
  ++t_.counters_.staged_chunks;
  if (t.spec.access == Access::read) {
    t.postable.push_back(unit);
    return true;
  }
  stager_->fill(unit, [this, tid = t.id(), unit](const std::optional<Error>& error) {
    chunk_copied(tid, unit, error);
  });
  return true;
}

bool VerbsClient::post_chunk_wr(Conn& conn, VerbsTransfer& t) {
  const std::uint64_t unit = t.postable.front();
  Chunk& c = t.chunks.at(unit);
  const std::uint64_t remote = c.remote + c.posted;
  auto w = std::upper_bound(t.windows.begin(), t.windows.end(), remote,
                            [](std::uint64_t a, const Window& x) { return a < x.addr; });
  const Window* win = w == t.windows.begin() || remote - std::prev(w)->addr >= std::prev(w)->len
                          ? nullptr
                          : &*std::prev(w);
  if (win == nullptr) {
    transfers_.finish(t, Error(ErrorCode::ProtocolError,
                               "peer '" + t.spec.peer_name +
                                   "' gave no key for a range it accepted in the claim"));
    return false;
  }
  std::uint64_t take =
      std::min({win->addr + win->len - remote, conn.dev->max_msg, c.len - c.posted});
  const auto local = reinterpret_cast<std::uint64_t>(stager_->chunk(unit)) + c.posted;
  std::uint64_t room = 0;
  const MrSet* set = chunk_set(unit);
  ibv_mr* mr = set == nullptr ? nullptr : set->find(conn.dev->ctx, local, room);
  if (mr == nullptr) {
    transfers_.finish(
        t, Error(ErrorCode::Internal, "staging chunk not registered on " + conn.dev->name));
    return false;
  }
  take = std::min({take, room, std::uint64_t{1} << 31});
  ibv_sge sge{local, static_cast<std::uint32_t>(take), mr->lkey};
  const bool last = c.posted + take == c.len;
  if (!conn.post_data(t.id(), t.spec.access, remote, win->rkey, &sge, 1, last, unit)) return false;
  ++t.outstanding;
  c.posted += take;
  ++c.wrs;
  if (last) t.postable.pop_front();
  return true;
}

void VerbsClient::chunk_moved(std::uint64_t tid, std::uint64_t unit) {
  VerbsTransfer* t = transfers_.find(tid);
  if (t == nullptr || t->chunks.count(unit) == 0) return;
  if (t->spec.access == Access::write) {
    t->chunks.erase(unit);
    stager_->close(unit);
    return;
  }
  try {
    stager_->drain(unit, [this, tid, unit](const std::optional<Error>& error) {
      chunk_copied(tid, unit, error);
    });
  } catch (const Error& e) {
    failed(*t, e);
  }
}

void VerbsClient::chunk_copied(std::uint64_t tid, std::uint64_t unit,
                               const std::optional<Error>& error) {
  VerbsTransfer* t = transfers_.find(tid);
  if (t == nullptr || t->chunks.count(unit) == 0) return;
  if (t->finished()) return;  // settle() gives the chunk back
  if (error) {
    failed(*t, *error);
    return;
  }
  if (t->spec.access == Access::read) {
    // Its bytes are on the device: the chunk goes back.
    t->chunks.erase(unit);
    stager_->close(unit);
    if (Conn* conn = t_.conn_of(t->conn)) maybe_done(*conn, *t);
    return;
  }
  t->postable.push_back(unit);
  make_ready(*t);
}

}  // namespace ferry::transport::verbs
