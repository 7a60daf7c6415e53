#pragma once

#include <uv.h>

#include <chrono>
#include <functional>

#include "loop/log.hpp"
#include "loop/uv_handle.hpp"

namespace ferry::transport::kit {

/// Notices a peer that went silent while something waits for it (answers to requests, work
/// requests in flight): once expect() counts anything awaited and the peer has not been heard
/// for `timeout`, `on_silent` runs, once per silence. Only what the peer itself does counts
/// (heard()): a stopped process can keep its connection open for ever. The timer runs only
/// while something is awaited. Loop thread only.
class SilenceWatch {
 public:
  SilenceWatch(uv_loop_t* loop, std::chrono::milliseconds timeout, std::function<void()> on_silent,
               loop::Log log);
  SilenceWatch(const SilenceWatch&) = delete;
  SilenceWatch& operator=(const SilenceWatch&) = delete;

  /// +1 when something awaited starts, -1 when it ends (answered, completed, forgotten).
  void expect(int delta) noexcept;
  /// The peer did something: the silence starts over.
  void heard() noexcept;
  /// No more calls of on_silent.
  void stop() noexcept;
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }

 private:
  static void fired(uv_timer_t* timer);
  void arm() noexcept;

  std::chrono::milliseconds timeout_;
  std::function<void()> on_silent_;
  loop::Log log_;
  loop::Timer timer_;
  int awaited_ = 0;
};

}  // namespace ferry::transport::kit
