#pragma once

#include <uv.h>

#include <atomic>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include <ferry/error.hpp>

#include "loop/log.hpp"

namespace ferry::loop {

/// One libuv loop: ferry's own thread, or a caller's loop (embedded mode). Every state change
/// of a connector happens on it; other threads reach it through post() and call().
class EventLoop {
  struct Shared;

 public:
  using Task = std::function<void()>;

  /// Owned mode (external == nullptr): starts a loop thread. Embedded mode: attaches to
  /// `external`; must be called on the thread that runs it, or while it is not running.
  /// `log` gets the failures of tasks (which are caught, never unwound through libuv).
  explicit EventLoop(uv_loop_t* external = nullptr, Log log = {});
  /// Closes the loop if close() was not called.
  ~EventLoop();
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  uv_loop_t* uv() const noexcept { return loop_; }
  const Log& log() const noexcept;
  bool in_loop_thread() const noexcept;

  /// Queues `task` for the loop. Any thread. False (and `task` dropped) once closed.
  bool post(Task task);

  /// A copyable handle that posts to this loop from any thread, and stays safe to use after
  /// the EventLoop object is gone (it then refuses, as post() does once closed). For
  /// libraries that call back on threads of their own.
  class Poster {
   public:
    /// Refuses everything until assigned from EventLoop::poster().
    Poster() = default;
    bool post(Task task) const;

   private:
    friend class EventLoop;
    explicit Poster(std::shared_ptr<struct EventLoop::Shared> shared)
        : shared_(std::move(shared)) {}
    std::shared_ptr<struct EventLoop::Shared> shared_;
  };
  Poster poster() const { return Poster(shared_); }

  /// Loop thread only: runs `task` after the current callback returns, in the same turn of the
  /// loop: deferred work runs in the loop's check phase, right after the I/O callbacks of that
  /// turn (and the loop does not block in between), and work deferred by deferred work runs
  /// in the same check phase. Used so that user callbacks never run inside ferry's own I/O
  /// handling, at no cost in latency.
  void defer(Task task);

  /// Runs `fn` on the loop and returns its result (or rethrows its exception): inline on the
  /// loop thread, else posted, waiting for it. Throws Error(InvalidState) once closed.
  template <class F>
  auto call(F&& fn) -> std::invoke_result_t<F&> {
    using R = std::invoke_result_t<F&>;
    if (in_loop_thread()) return fn();
    auto task = std::make_shared<std::packaged_task<R()>>(std::forward<F>(fn));
    auto result = task->get_future();
    if (!post([task] { (*task)(); })) throw closed_error();
    try {
      return result.get();
    } catch (const std::future_error&) {
      // The task was dropped unrun: the loop closed under us.
      throw closed_error();
    }
  }

  /// Runs `teardown` on the loop (it must close every handle it owns there), then closes the
  /// loop's own handles and, in owned mode, lets the thread finish and joins it. Any thread;
  /// idempotent. From a foreign thread in embedded mode the caller's loop must be running.
  void close(Task teardown);

 private:
  static void on_async(uv_async_t* handle);
  static void on_check(uv_check_t* handle);
  static void run_deferred(Shared& s);
  static Error closed_error();

  std::shared_ptr<Shared> shared_;
  uv_loop_t* loop_ = nullptr;
  bool embedded_ = false;
  std::thread thread_;
};

}  // namespace ferry::loop
