#include "transport/kit/silence.hpp"

namespace ferry::transport::kit {

SilenceWatch::SilenceWatch(uv_loop_t* loop, std::chrono::milliseconds timeout,
                           std::function<void()> on_silent, loop::Log log)
    : timeout_(timeout),
      on_silent_(std::move(on_silent)),
      log_(std::move(log)),
      timer_(loop::Timer::timer(loop, this)) {}

void SilenceWatch::expect(int delta) noexcept {
  const bool before = awaited_ > 0;
  awaited_ += delta;
  if (awaited_ < 0) awaited_ = 0;
  if ((awaited_ > 0) != before) arm();
}

void SilenceWatch::heard() noexcept {
  if (awaited_ > 0) arm();
}

void SilenceWatch::stop() noexcept {
  awaited_ = 0;
  timer_.reset();
}

void SilenceWatch::arm() noexcept {
  if (!timer_) return;
  if (awaited_ == 0) {
    uv_timer_stop(timer_.get());
    return;
  }
  uv_timer_start(timer_.get(), &SilenceWatch::fired, static_cast<std::uint64_t>(timeout_.count()),
                 0);
}

void SilenceWatch::fired(uv_timer_t* timer) {
  auto* self = static_cast<SilenceWatch*>(timer->data);
  if (self == nullptr || self->awaited_ == 0) return;
  loop::guarded(self->log_, "a peer's silence watch", [self] { self->on_silent_(); });
}

}  // namespace ferry::transport::kit
