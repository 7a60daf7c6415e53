#pragma once

#include <uv.h>

#include <atomic>
#include <chrono>
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
///
/// Embedded mode: the loop's thread is the one that runs it, learned at every turn of the loop
/// (a prepare handle, which costs no wakeup). Until the loop first turns, nobody runs it, and
/// any thread that calls in acts as its thread, one at a time; the first turn waits for the
/// one acting to finish, then takes the loop over. So a connector made in main() whose loop
/// then runs on another thread works from main(): its calls go to that thread once it runs.
class EventLoop {
  struct Shared;

 public:
  using Task = std::function<void()>;
  /// How long a blocking wait on an embedded loop that has never turned waits for it to turn
  /// before it is refused.
  static constexpr std::chrono::seconds kFirstTurn{2};
  /// Kept by a thread while it runs loop work itself (see enter()).
  using Hold = std::unique_lock<std::recursive_mutex>;

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
  /// Whether the calling thread may run loop work itself now: it is the loop's thread, or
  /// (embedded, before the first turn) it acts as the loop's thread while `hold` is kept.
  bool enter(Hold& hold) const;
  /// Whether a blocking wait is safe on this thread: false on the loop's thread. Embedded,
  /// before the loop first turns, waits up to kFirstTurn for it to turn, and throws
  /// WrongThread if it does not: nothing would ever end the wait.
  bool may_block() const;

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
    if (Hold hold; enter(hold)) return fn();
    auto task = std::make_shared<std::packaged_task<R()>>(std::forward<F>(fn));
    auto result = task->get_future();
    // The posted task is its only owner: a loop that closes and drops it unrun breaks the
    // promise, and the wait below ends (a copy kept here kept the promise alive, and a call
    // racing close() waited forever).
    if (!post([t = std::move(task)] { (*t)(); })) throw closed_error();
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
  /// Embedded: whether the loop has turned since this object was made.
  bool turned() const noexcept;
  static void on_prepare(uv_prepare_t* handle);

  std::shared_ptr<Shared> shared_;
  uv_loop_t* loop_ = nullptr;
  bool embedded_ = false;
  std::thread thread_;
};

}  // namespace ferry::loop
