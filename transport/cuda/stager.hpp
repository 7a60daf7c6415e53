#pragma once

// Staging of CUDA memory for the methods that move host memory only (tcp; cma on its active
// side; verbs where the NIC cannot reach the GPU), written once. No <cuda.h> here: the
// methods compile the same with and without CUDA; without it, making a Stager throws.

#include <uv.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <ferry/error.hpp>

#include "loop/log.hpp"
#include "transport/context.hpp"

namespace ferry::transport::cuda {

struct CudaApi;

/// Moves CUDA memory through pinned host chunks, copied to and from the device on its stream
/// (CopyEngine) while other chunks cross to the peer.
///
/// A unit is one chunk's worth of a transfer or of a served request: up to chunk_size bytes
/// of device memory in one or more pieces, laid out in the chunk in order. Outbound (the bytes
/// leave): fill() copies the pieces into the chunk; the method sends the chunk's bytes, then
/// close()s the unit. Inbound: the method receives into the chunk, drain() copies it into the
/// pieces, then close(). Every unit belongs to an owner (a transfer's or an exposure's id):
/// drop(owner) cancels its copies (waiting for one under way: a copy is at most a chunk) and
/// gives its chunks back, so that when it returns nothing of the stager touches either memory.
///
/// Chunks: at most `chunks`, pinned on first need (portable to every context) and kept until the
/// stager goes. When none is free, open() returns 0 and remembers the owner; once one comes
/// back, wake(owner) runs after the current loop callback for each owner that waited, in
/// order. Loop thread only.
class Stager {
 public:
  /// A range of CUDA memory on device `ordinal`.
  struct Piece {
    std::byte* device = nullptr;
    std::uint64_t len = 0;
    int ordinal = -1;
  };
  using Done = std::function<void(const std::optional<Error>& error)>;
  using Wake = std::function<void(std::uint64_t owner)>;

  /// Throws Error(Unsupported) in a build without CUDA, Error(InvalidArgument) for fewer than two
  /// chunks or empty ones.
  Stager(uv_loop_s* loop, const CudaApi& api, Defer defer, std::size_t chunk_size,
         std::size_t chunks, loop::Log log);
  /// Cancels every copy (waiting for those under way) and frees the chunks.
  ~Stager();
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;

  std::size_t chunk_size() const noexcept;
  void set_wake(Wake wake);

  /// A unit of `owner` over `pieces` (together at most chunk_size bytes), or 0 when no chunk is
  /// free (the owner is woken once one is). `heap_if_none`: never 0, a heap buffer stands in
  /// for the chunk, also for more than chunk_size bytes (for a sink needed at once; slower
  /// copies, as correct). Throws
  /// Error(Internal) when the driver refuses a context or pinned memory.
  std::uint64_t open(std::uint64_t owner, std::vector<Piece> pieces, bool heap_if_none = false);
  /// The unit's chunk: its bytes, in the pieces' order.
  std::byte* chunk(std::uint64_t unit) const;
  std::uint64_t bytes(std::uint64_t unit) const;
  /// Device to chunk (outbound); `done` runs on the loop once every piece is copied, or the
  /// first copy failed. Throws Error(Internal) when the driver refuses to queue a copy.
  void fill(std::uint64_t unit, Done done);
  /// Chunk to device (inbound), likewise.
  void drain(std::uint64_t unit, Done done);
  /// The unit's chunk goes back. Its copies must be over (after their done, or cancelled).
  void close(std::uint64_t unit);
  /// Every unit of `owner` goes, copies cancelled first; `owner` waits for no chunk any more.
  void drop(std::uint64_t owner);
  /// Whether `owner` has copies under way; with `up_to`, among its units opened up to that
  /// one (see last_unit()).
  bool copying(std::uint64_t owner, std::uint64_t up_to = ~std::uint64_t{0}) const;
  /// The unit opened last (0: none yet): units opened later have higher numbers.
  std::uint64_t last_unit() const noexcept;
  /// Chunks held by units.
  std::size_t held() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::transport::cuda
