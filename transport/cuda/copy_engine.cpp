#include "transport/cuda/copy_engine.hpp"

#include <cstdint>
#include <cstdio>

namespace ferry::transport::cuda {

namespace {

void check(const CudaApi& api, CUresult r, const char* what) {
  if (r != CUDA_SUCCESS)
    throw Error(ErrorCode::Internal, std::string(what) + " failed: " + result_text(&api, r));
}

CUdeviceptr address(const void* p) {
  return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
}

}  // namespace

ScopedContext::ScopedContext(const CudaApi& api, CUcontext ctx) : api_(api) {
  check(api_, api_.ctx_get_current(&previous_), "cuCtxGetCurrent");
  if (previous_ != ctx) {
    check(api_, api_.ctx_set_current(ctx), "cuCtxSetCurrent");
    changed_ = true;
  }
}

ScopedContext::~ScopedContext() {
  if (changed_) (void)api_.ctx_set_current(previous_);
}

CopyEngine::CopyEngine(uv_loop_t* loop, const CudaApi& api, loop::Log log)
    : api_(api),
      log_(std::move(log)),
      async_(loop::Async::async(loop, &CopyEngine::on_async, this)) {
  mailbox_->async = async_.get();
  // The handle keeps the loop alive only while copies are in flight (hold()).
  uv_unref(reinterpret_cast<uv_handle_t*>(async_.get()));
}

void CopyEngine::hold(bool busy) {
  auto* h = reinterpret_cast<uv_handle_t*>(async_.get());
  if (busy)
    uv_ref(h);
  else
    uv_unref(h);
}

CopyEngine::~CopyEngine() {
  for (auto& [ordinal, d] : devices_) {
    try {
      ScopedContext scope(api_, d.context);
      // Every host function queued has run once this returns: none touches the mailbox later.
      (void)api_.stream_synchronize(d.stream);
      (void)api_.stream_destroy(d.stream);
    } catch (const Error& e) {
      log_.warning("closing the CUDA stream of cuda:" + std::to_string(ordinal) + ": " + e.what());
    }
    CUdevice dev = d.device;
    (void)api_.device_primary_ctx_release(dev);
  }
}

CopyEngine::Device& CopyEngine::device(int ordinal) {
  if (auto it = devices_.find(ordinal); it != devices_.end()) return it->second;
  Device d;
  check(api_, api_.device_get(&d.device, ordinal), "cuDeviceGet");
  check(api_, api_.device_primary_ctx_retain(&d.context, d.device), "cuDevicePrimaryCtxRetain");
  try {
    ScopedContext scope(api_, d.context);
    check(api_, api_.stream_create(&d.stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  } catch (...) {
    (void)api_.device_primary_ctx_release(d.device);
    throw;
  }
  return devices_.emplace(ordinal, d).first->second;
}

std::uint64_t CopyEngine::copy(int ordinal, void* dst, const void* src, std::size_t len,
                               Done done) {
  Device& d = device(ordinal);
  ScopedContext scope(api_, d.context);
  check(api_, api_.memcpy_async(address(dst), address(src), len, d.stream), "cuMemcpyAsync");
  const std::uint64_t id = next_id_++;
  auto ticket = std::make_unique<Ticket>(Ticket{mailbox_.get(), id});
  CUresult r = api_.launch_host_func(d.stream, &CopyEngine::host_function, ticket.get());
  if (r != CUDA_SUCCESS) {
    // The copy is queued but nothing would tell of its end: wait for it here instead.
    (void)api_.stream_synchronize(d.stream);
    check(api_, r, "cuLaunchHostFunc");
  }
  (void)ticket.release();  // the host function owns it now
  pending_.emplace(id, Pending{ordinal, std::move(done)});
  if (pending_.size() == 1) hold(true);
  return id;
}

void CopyEngine::cancel(std::uint64_t id) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return;
  const int ordinal = it->second.ordinal;
  pending_.erase(it);
  if (pending_.empty()) hold(false);
  {
    // Finished already: its id waits in the mailbox, and deliver() will skip it.
    std::lock_guard<std::mutex> lock(mailbox_->mutex);
    for (std::uint64_t f : mailbox_->finished)
      if (f == id) return;
  }
  Device& d = devices_.at(ordinal);
  ScopedContext scope(api_, d.context);
  (void)api_.stream_synchronize(d.stream);
}

void CUDA_CB CopyEngine::host_function(void* data) {
  std::unique_ptr<Ticket> ticket(static_cast<Ticket*>(data));
  Mailbox& m = *ticket->mailbox;
  std::lock_guard<std::mutex> lock(m.mutex);
  m.finished.push_back(ticket->id);
  uv_async_send(m.async);
}

void CopyEngine::on_async(uv_async_t* handle) {
  if (handle->data == nullptr) return;
  static_cast<CopyEngine*>(handle->data)->deliver();
}

std::optional<Error> CopyEngine::stream_error(int ordinal) {
  // The host function runs even when a copy before it failed: the failure is the stream's
  // (sticky), and shows in a query. One queued later may have failed too; the copy then
  // counts as failed as well, since the stream is unusable either way.
  Device& d = devices_.at(ordinal);
  CUresult r = CUDA_SUCCESS;
  try {
    ScopedContext scope(api_, d.context);
    r = api_.stream_query(d.stream);
  } catch (const Error& e) {
    return e;
  }
  if (r == CUDA_SUCCESS || r == CUDA_ERROR_NOT_READY) return std::nullopt;
  return Error(ErrorCode::Internal,
               "a copy on cuda:" + std::to_string(ordinal) + " failed: " + result_text(&api_, r));
}

void CopyEngine::deliver() {
  std::vector<std::uint64_t> finished;
  {
    std::lock_guard<std::mutex> lock(mailbox_->mutex);
    finished.swap(mailbox_->finished);
  }
  for (std::uint64_t id : finished) {
    auto it = pending_.find(id);
    if (it == pending_.end()) continue;  // cancelled
    const int ordinal = it->second.ordinal;
    Done done = std::move(it->second.done);
    pending_.erase(it);
    if (pending_.empty()) hold(false);
    std::optional<Error> error = stream_error(ordinal);
    loop::guarded(log_, "a CUDA copy's completion", [&] { done(error); });
  }
}

std::atomic<std::size_t> StagingPool::held_in_process_{0};

std::size_t StagingPool::held_in_process() noexcept { return held_in_process_.load(); }

StagingPool::StagingPool(const CudaApi& api, std::size_t chunk_size, std::size_t max_chunks)
    : api_(api), chunk_size_(chunk_size), max_chunks_(max_chunks) {
  if (chunk_size_ == 0 || max_chunks_ < 2)
    throw Error(ErrorCode::InvalidArgument,
                "a staging pool needs chunks of at least one byte, and two chunks or more");
}

StagingPool::~StagingPool() {
  held_in_process_ -= held();
  for (std::byte* chunk : all_) (void)api_.mem_free_host(chunk);
}

std::byte* StagingPool::acquire(CUcontext ctx) {
  if (!free_.empty()) {
    std::byte* chunk = free_.back();
    free_.pop_back();
    ++held_in_process_;
    return chunk;
  }
  if (all_.size() >= max_chunks_) return nullptr;
  void* p = nullptr;
  CUresult r = CUDA_SUCCESS;
  {
    ScopedContext scope(api_, ctx);
    r = api_.mem_host_alloc(&p, chunk_size_, CU_MEMHOSTALLOC_PORTABLE);
  }
  if (r != CUDA_SUCCESS) {
    // Out of pinned memory: go on with the chunks there are, if any.
    if (!all_.empty()) return nullptr;
    throw Error(ErrorCode::Internal, "cuMemHostAlloc of a " + std::to_string(chunk_size_) +
                                         "-byte staging chunk failed: " + result_text(&api_, r));
  }
  all_.push_back(static_cast<std::byte*>(p));
  ++held_in_process_;
  return all_.back();
}

void StagingPool::release(std::byte* chunk) {
  free_.push_back(chunk);
  --held_in_process_;
  if (on_release_) on_release_();
}

}  // namespace ferry::transport::cuda
