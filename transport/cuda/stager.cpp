#include "transport/cuda/stager.hpp"

#include <algorithm>
#include <deque>
#include <map>
#include <set>

#include "transport/cuda/copy_engine.hpp"
#include "transport/kit/lifetime.hpp"

namespace ferry::transport::cuda {

struct Stager::Impl {
  struct Unit {
    std::uint64_t owner = 0;
    std::vector<Piece> pieces;
    std::uint64_t bytes = 0;
    std::byte* chunk = nullptr;         ///< from the pool, or heap's
    std::unique_ptr<std::byte[]> heap;  ///< when no chunk was free and the caller could not wait
    std::vector<std::uint64_t> copies;  ///< queued, not yet ended
    std::optional<Error> failed;        ///< the first copy that failed
    Done done;
  };

  Impl(uv_loop_s* loop_, const CudaApi& api_, Defer defer_, std::size_t chunk_size,
       std::size_t chunks, loop::Log log_)
      : loop(loop_),
        api(api_),
        defer(std::move(defer_)),
        log(std::move(log_)),
        pool(api_, chunk_size, chunks) {
    pool.set_on_release([this] { chunk_back(); });
  }
  ~Impl() {
    engine.reset();  // waits for copies in flight, without their done
    for (auto& [id, u] : units)
      if (!u.heap) pool.release(u.chunk);
    units.clear();
    if (context != nullptr) (void)api.device_primary_ctx_release(device);
  }

  /// A free chunk, or null. The first one makes the context pinned memory is allocated with
  /// (pinned chunks are portable: one context serves every device).
  std::byte* take_chunk(int ordinal) {
    if (context == nullptr) {
      CUresult r = api.device_get(&device, ordinal);
      if (r == CUDA_SUCCESS) r = api.device_primary_ctx_retain(&context, device);
      if (r != CUDA_SUCCESS) {
        context = nullptr;
        throw Error(ErrorCode::Internal, "cannot stage CUDA memory of cuda:" +
                                             std::to_string(ordinal) + ": " + result_text(&api, r));
      }
    }
    return pool.acquire(context);
  }

  CopyEngine& copies() {
    if (!engine) engine = std::make_unique<CopyEngine>(loop, api, log);
    return *engine;
  }

  /// Queues the copies between `u`'s chunk and its pieces: pieces that follow each other in
  /// one device's memory make one copy.
  void copy(std::uint64_t id, Unit& u, bool to_chunk, Done done) {
    u.done = std::move(done);
    u.failed.reset();
    std::uint64_t off = 0;
    std::size_t i = 0;
    while (i < u.pieces.size()) {
      const Piece& first = u.pieces[i];
      std::uint64_t len = first.len;
      for (++i; i < u.pieces.size() && u.pieces[i].ordinal == first.ordinal &&
                u.pieces[i].device == first.device + len;
           ++i)
        len += u.pieces[i].len;
      std::byte* host = u.chunk + off;
      off += len;
      // The copy's id is known once copy() returns; its end is reported only later.
      auto copy_id = std::make_shared<std::uint64_t>(0);
      *copy_id = copies().copy(
          first.ordinal, to_chunk ? static_cast<void*>(host) : first.device,
          to_chunk ? static_cast<const void*>(first.device) : host, static_cast<std::size_t>(len),
          [this, id, copy_id, watch = life.watch()](const std::optional<Error>& error) {
            if (watch.alive()) copied(id, *copy_id, error);
          });
      u.copies.push_back(*copy_id);
    }
  }

  void copied(std::uint64_t id, std::uint64_t copy, const std::optional<Error>& error) {
    auto it = units.find(id);
    if (it == units.end()) return;
    Unit& u = it->second;
    auto c = std::find(u.copies.begin(), u.copies.end(), copy);
    if (c == u.copies.end()) return;  // cancelled
    u.copies.erase(c);
    if (error && !u.failed) u.failed = error;
    if (!u.copies.empty()) return;
    Done done = std::move(u.done);
    std::optional<Error> failed = std::move(u.failed);
    if (done) done(failed);
  }

  void cancel_copies(Unit& u) {
    for (std::uint64_t c : u.copies) engine->cancel(c);  // waits for one under way
    u.copies.clear();
    u.done = nullptr;
  }

  void give_back(Unit& u) {
    if (u.heap)
      u.heap.reset();
    else
      pool.release(u.chunk);  // may wake owners that wait
  }

  void chunk_back() {
    if (waiting.empty() || wake_scheduled) return;
    wake_scheduled = true;
    life.defer(defer, [this] {
      wake_scheduled = false;
      std::deque<std::uint64_t> owners;
      owners.swap(waiting);
      waiting_set.clear();
      for (std::uint64_t owner : owners)
        if (wake) wake(owner);
    });
  }

  uv_loop_s* loop;
  const CudaApi& api;
  Defer defer;
  loop::Log log;
  StagingPool pool;
  std::unique_ptr<CopyEngine> engine;
  CUdevice device = 0;
  CUcontext context = nullptr;
  std::map<std::uint64_t, Unit> units;
  std::uint64_t next_unit = 1;
  std::deque<std::uint64_t> waiting;  ///< owners waiting for a chunk, in order
  std::set<std::uint64_t> waiting_set;
  bool wake_scheduled = false;
  Wake wake;
  kit::Lifetime life;
};

Stager::Stager(uv_loop_s* loop, const CudaApi& api, Defer defer, std::size_t chunk_size,
               std::size_t chunks, loop::Log log)
    : impl_(std::make_unique<Impl>(loop, api, std::move(defer), chunk_size, chunks,
                                   std::move(log))) {}

Stager::~Stager() = default;

std::size_t Stager::chunk_size() const noexcept { return impl_->pool.chunk_size(); }

void Stager::set_wake(Wake wake) { impl_->wake = std::move(wake); }

std::uint64_t Stager::open(std::uint64_t owner, std::vector<Piece> pieces, bool heap_if_none) {
  Impl& s = *impl_;
  std::uint64_t bytes = 0;
  for (const Piece& p : pieces) bytes += p.len;
  if (pieces.empty() || (bytes > s.pool.chunk_size() && !heap_if_none))
    throw Error(ErrorCode::Internal, "a staged unit of " + std::to_string(bytes) +
                                         " bytes does not fit a chunk of " +
                                         std::to_string(s.pool.chunk_size()));
  std::byte* chunk = nullptr;
  try {
    if (bytes <= s.pool.chunk_size()) chunk = s.take_chunk(pieces.front().ordinal);
  } catch (const Error&) {
    // A sink is needed now: unpinned memory still works; the copy tells if the driver does not.
    if (!heap_if_none) throw;
  }
  Impl::Unit u;
  if (chunk == nullptr) {
    if (!heap_if_none) {
      if (s.waiting_set.insert(owner).second) s.waiting.push_back(owner);
      return 0;
    }
    u.heap = std::make_unique_for_overwrite<std::byte[]>(static_cast<std::size_t>(bytes));
    chunk = u.heap.get();
  }
  u.owner = owner;
  u.pieces = std::move(pieces);
  u.bytes = bytes;
  u.chunk = chunk;
  const std::uint64_t id = s.next_unit++;
  s.units.emplace(id, std::move(u));
  return id;
}

std::byte* Stager::chunk(std::uint64_t unit) const { return impl_->units.at(unit).chunk; }

std::uint64_t Stager::bytes(std::uint64_t unit) const { return impl_->units.at(unit).bytes; }

void Stager::fill(std::uint64_t unit, Done done) {
  impl_->copy(unit, impl_->units.at(unit), /*to_chunk=*/true, std::move(done));
}

void Stager::drain(std::uint64_t unit, Done done) {
  impl_->copy(unit, impl_->units.at(unit), /*to_chunk=*/false, std::move(done));
}

void Stager::close(std::uint64_t unit) {
  auto it = impl_->units.find(unit);
  if (it == impl_->units.end()) return;
  Impl::Unit u = std::move(it->second);
  impl_->units.erase(it);
  if (!u.copies.empty()) impl_->cancel_copies(u);
  impl_->give_back(u);
}

void Stager::drop(std::uint64_t owner) {
  Impl& s = *impl_;
  if (s.waiting_set.erase(owner) != 0) std::erase(s.waiting, owner);
  std::vector<Impl::Unit> gone;
  for (auto it = s.units.begin(); it != s.units.end();) {
    if (it->second.owner != owner) {
      ++it;
      continue;
    }
    gone.push_back(std::move(it->second));
    it = s.units.erase(it);
  }
  // Every copy stops first, then the chunks go back (which may wake other owners).
  for (Impl::Unit& u : gone)
    if (!u.copies.empty()) s.cancel_copies(u);
  for (Impl::Unit& u : gone) s.give_back(u);
}

bool Stager::copying(std::uint64_t owner, std::uint64_t up_to) const {
  const auto end = impl_->units.upper_bound(up_to);
  return std::any_of(impl_->units.begin(), end, [owner](const auto& kv) {
    return kv.second.owner == owner && !kv.second.copies.empty();
  });
}

std::uint64_t Stager::last_unit() const noexcept { return impl_->next_unit - 1; }

std::size_t Stager::held() const noexcept { return impl_->pool.held(); }

}  // namespace ferry::transport::cuda
