#pragma once

#include <uv.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include <ferry/error.hpp>

#include "loop/uv_handle.hpp"
#include "transport/cuda/cuda_api.hpp"

namespace ferry::transport::cuda {

/// Makes device `ordinal`'s primary context current on this thread for a scope, and puts
/// back the one that was. Throws Error(Internal) when the driver refuses.
class ScopedContext {
 public:
  ScopedContext(const CudaApi& api, CUcontext ctx);
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  const CudaApi& api_;
  CUcontext previous_ = nullptr;
  bool changed_ = false;
};

/// Copies between host and CUDA memory, each completed on the loop thread. Behind each copy
/// the driver runs a host function on its stream (cuLaunchHostFunc), which hands the copy's
/// id to the loop through a uv_async: nothing polls, and an idle engine costs no wakeup and
/// keeps no loop alive. One
/// stream per device, made on first use; every driver call here is made with that device's
/// primary context current, and the thread's own context put back after.
///
/// Loop thread only (the host functions alone run on the driver's thread).
class CopyEngine {
 public:
  /// The copy's end: no error when its bytes are in place; an error when the copy (or one
  /// queued on the same stream, whose failures are sticky) failed.
  using Done = std::function<void(const std::optional<Error>& error)>;

  CopyEngine(uv_loop_t* loop, const CudaApi& api, loop::Log log = {});
  /// Waits for the copies in flight (their memory may be freed right after), without
  /// running their Done.
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  /// Queues a copy of `len` bytes from `src` to `dst`, each host or device memory (unified
  /// addressing tells which), on device `ordinal`'s stream; copies on one device run in the
  /// order queued. `done` runs on the loop thread, after the call that queued it has returned.
  /// Returns the copy's id. Throws Error(Internal) when the driver refuses the copy at once.
  std::uint64_t copy(int ordinal, void* dst, const void* src, std::size_t len, Done done);
  /// Forgets copy `id`: its Done does not run. When this returns, the copy touches no memory
  /// any more (it waits for the device's stream if the copy may still be running; a copy is
  /// at most one staging chunk, so the wait is short). No effect for an id already done.
  void cancel(std::uint64_t id);
  /// Copies queued and not yet reported.
  std::size_t in_flight() const noexcept { return pending_.size(); }

 private:
  struct Device {
    CUdevice device = 0;
    CUcontext context = nullptr;
    CUstream stream = nullptr;
  };
  struct Pending {
    int ordinal = 0;
    Done done;
  };
  /// Shared with the host functions, which run on the driver's thread.
  struct Mailbox {
    std::mutex mutex;
    std::vector<std::uint64_t> finished;
    uv_async_t* async = nullptr;
  };
  struct Ticket {
    Mailbox* mailbox;
    std::uint64_t id;
  };

  Device& device(int ordinal);
  /// Refs the async handle while copies are in flight, so that a loop run until it has
  /// nothing to do waits for them; an idle engine keeps no loop alive.
  void hold(bool busy);
  static void CUDA_CB host_function(void* data);
  static void on_async(uv_async_t* handle);
  void deliver();
  /// The error of device `ordinal`'s stream once a copy on it reported, if it failed.
  std::optional<Error> stream_error(int ordinal);

  const CudaApi& api_;
  loop::Log log_;
  std::map<int, Device> devices_;
  std::map<std::uint64_t, Pending> pending_;
  std::uint64_t next_id_ = 1;
  std::unique_ptr<Mailbox> mailbox_ = std::make_unique<Mailbox>();
  loop::Async async_;
};

/// Pinned host buffers of one size, through which a method that moves host memory only stages
/// CUDA memory: up to `max_chunks` of `chunk_size` bytes, allocated on first need
/// (cuMemHostAlloc, portable to every context) and kept until the pool goes. A transfer holds a
/// chunk from the device-to-host copy until its bytes have left (or from their arrival until
/// the host-to-device copy ends), so two chunks or more let copies overlap the network.
///
/// Loop thread only.
class StagingPool {
 public:
  StagingPool(const CudaApi& api, std::size_t chunk_size, std::size_t max_chunks);
  /// Frees every chunk; none may be held.
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  std::size_t chunk_size() const noexcept { return chunk_size_; }
  std::size_t max_chunks() const noexcept { return max_chunks_; }
  /// A free chunk, or null when all are held (release() calls `on_release` then). A new chunk
  /// is allocated with context `ctx` current; throws Error(Internal) when that fails and no
  /// chunk is held that could come back.
  std::byte* acquire(CUcontext ctx);
  /// Gives `chunk` back and tells the owner (set_on_release) that one is free.
  void release(std::byte* chunk);
  /// Called by release(): a transfer waiting for a chunk may go on.
  void set_on_release(std::function<void()> on_release) { on_release_ = std::move(on_release); }
  std::size_t held() const noexcept { return all_.size() - free_.size(); }
  /// Chunks held in every pool of this process (tests: none once every transfer is over).
  static std::size_t held_in_process() noexcept;

 private:
  const CudaApi& api_;
  std::size_t chunk_size_;
  std::size_t max_chunks_;
  std::vector<std::byte*> all_;
  std::vector<std::byte*> free_;
  std::function<void()> on_release_;
  static std::atomic<std::size_t> held_in_process_;
};

}  // namespace ferry::transport::cuda
