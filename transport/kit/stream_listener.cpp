#include "transport/kit/stream_listener.hpp"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ferry::transport::kit {

StreamListener::StreamListener(uv_loop_t* loop, int fd, std::string what,
                               const ListenerOptions& bounds, Admission::Evict evict, Accept accept,
                               loop::Log log)
    : fd_(fd),
      what_(std::move(what)),
      accept_(std::move(accept)),
      log_(std::move(log)),
      admission_(loop, bounds, std::move(evict)) {
  try {
    poll_ = loop::Poll::poll(loop, fd_, this);
  } catch (...) {
    ::close(fd_);
    throw;
  }
  retry_ = loop::Timer::timer(loop, this);
  uv_poll_start(poll_.get(), UV_READABLE, &StreamListener::on_listen);
}

StreamListener::~StreamListener() { close(); }

void StreamListener::close() {
  admission_.stop();
  retry_.reset();
  if (poll_) {
    poll_.reset();
    ::close(fd_);
    fd_ = -1;
  }
}

void StreamListener::on_listen(uv_poll_t* handle, int status, int) {
  auto* self = static_cast<StreamListener*>(handle->data);
  if (status < 0 || self == nullptr) return;
  loop::guarded(self->log_, "a listener", [self] { self->accept_batch(); });
}

void StreamListener::accept_batch() {
  for (int i = 0; i < kAcceptBatch && poll_; ++i) {
    const int fd = ::accept4(fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      pause(errno);
      return;
    }
    if (!admission_.admit()) {
      ::close(fd);
      continue;
    }
    accept_(fd);
  }
}

void StreamListener::pause(int err) {
  // Out of descriptors or memory: the socket stays readable, so stop watching it for a moment
  // instead of spinning, and say so once per pause.
  log_.warning(what_ + ": accepting a connection failed (" + std::strerror(err) +
               "); pausing the listener for 100 ms");
  uv_poll_stop(poll_.get());
  uv_timer_start(
      retry_.get(),
      [](uv_timer_t* t) {
        auto* self = static_cast<StreamListener*>(t->data);
        if (self != nullptr && self->poll_)
          uv_poll_start(self->poll_.get(), UV_READABLE, &StreamListener::on_listen);
      },
      100, 0);
}

}  // namespace ferry::transport::kit
