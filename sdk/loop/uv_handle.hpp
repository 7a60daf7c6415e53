#pragma once

#include <uv.h>

#include <cstddef>
#include <exception>
#include <string>
#include <type_traits>
#include <utility>

#include <ferry/error.hpp>

#include "loop/log.hpp"

namespace ferry::loop {

/// Closes a heap-allocated libuv handle and deletes it once libuv is done with it. uv_close
/// stops the handle at once (a poll handle leaves the loop's epoll set before this returns), so
/// its callback never runs again; only the memory outlives the call, until the close callback.
template <class Handle>
void close_and_delete(Handle* handle) {
  if (handle == nullptr) return;
  auto* h = reinterpret_cast<uv_handle_t*>(handle);
  if (uv_is_closing(h)) return;
  uv_close(h, [](uv_handle_t* closed) { delete reinterpret_cast<Handle*>(closed); });
}

/// An owned libuv handle (uv_timer_t, uv_poll_t, uv_async_t, uv_idle_t) on the heap.
/// Destructor (and reset()): clears `data`, so that a callback already dispatched in this turn
/// finds nothing, and closes the handle; libuv frees it after its close callback. Loop thread
/// only. Move-only.
template <class T>
class UvHandle {
 public:
  UvHandle() noexcept = default;
  ~UvHandle() { reset(); }
  UvHandle(UvHandle&& other) noexcept : h_(std::exchange(other.h_, nullptr)) {}
  UvHandle& operator=(UvHandle&& other) noexcept {
    if (this != &other) {
      reset();
      h_ = std::exchange(other.h_, nullptr);
    }
    return *this;
  }
  UvHandle(const UvHandle&) = delete;
  UvHandle& operator=(const UvHandle&) = delete;

  T* get() const noexcept { return h_; }
  T* operator->() const noexcept { return h_; }
  explicit operator bool() const noexcept { return h_ != nullptr; }

  void reset() noexcept {
    if (h_ == nullptr) return;
    h_->data = nullptr;
    close_and_delete(h_);
    h_ = nullptr;
  }

  /// A timer on `loop` whose callbacks see `data`.
  static UvHandle timer(uv_loop_t* loop, void* data) {
    UvHandle out(new T{});
    uv_timer_init(loop, out.h_);
    out.h_->data = data;
    return out;
  }
  /// An idle handle on `loop`.
  static UvHandle idle(uv_loop_t* loop, void* data) {
    UvHandle out(new T{});
    uv_idle_init(loop, out.h_);
    out.h_->data = data;
    return out;
  }
  /// An async handle on `loop` that runs `cb`.
  static UvHandle async(uv_loop_t* loop, uv_async_cb cb, void* data) {
    UvHandle out(new T{});
    uv_async_init(loop, out.h_, cb);
    out.h_->data = data;
    return out;
  }
  /// A poll handle for socket `fd`; throws Error(Internal) when libuv refuses it (the fd is
  /// left open: it is the caller's).
  static UvHandle poll(uv_loop_t* loop, int fd, void* data) {
    T* h = new T{};
    if (int rc = uv_poll_init(loop, h, fd); rc != 0) {
      delete h;
      throw Error(ErrorCode::Internal, std::string("uv_poll_init: ") + uv_strerror(rc));
    }
    UvHandle out(h);
    out.h_->data = data;
    return out;
  }

 private:
  explicit UvHandle(T* h) noexcept : h_(h) {}
  T* h_ = nullptr;
};

using Timer = UvHandle<uv_timer_t>;
using Poll = UvHandle<uv_poll_t>;
using Async = UvHandle<uv_async_t>;
using Idle = UvHandle<uv_idle_t>;

}  // namespace ferry::loop

namespace ferry::loop {

/// Runs `fn` from a libuv callback: an exception must never unwind through libuv's C frames
/// (that would terminate the process). It is logged as an error with `where`, and `on_error`
/// (when given) gets its text so the caller can fail what the callback was serving.
template <class F, class G = std::nullptr_t>
void guarded(const Log& log, const char* where, F&& fn, G&& on_error = nullptr) noexcept {
  std::string what;
  try {
    fn();
    return;
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "unknown exception";
  }
  log.error(std::string(where) + " failed: " + what);
  if constexpr (!std::is_same_v<std::decay_t<G>, std::nullptr_t>) {
    try {
      on_error(what.c_str());
    } catch (...) {
    }
  }
}

}  // namespace ferry::loop
