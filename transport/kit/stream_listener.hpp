#pragma once

#include <uv.h>

#include <functional>
#include <string>

#include <ferry/options.hpp>

#include "loop/log.hpp"
#include "loop/uv_handle.hpp"
#include "transport/kit/admission.hpp"

namespace ferry::transport::kit {

/// Accepts on a listening stream socket (tcp's TCP socket, the same-host methods' Unix socket)
/// under the Admission bounds: at most kAcceptBatch connections per loop turn, so that a flood
/// of connects cannot keep the loop to itself (the socket stays readable and the loop comes
/// back after its other handles); a pause of 100 ms when the process runs out of descriptors;
/// a new connection refused at once when the listener is full. Loop thread only.
class StreamListener {
 public:
  static constexpr int kAcceptBatch = 32;
  /// Makes the accepted socket `fd` (non-blocking, close-on-exec) a connection, and calls
  /// admission().accepted() with its id; or closes it.
  using Accept = std::function<void(int fd)>;

  /// Takes `fd`, listening and non-blocking; `what` names the listener in messages ("tcp").
  /// Throws Error(Internal) when libuv refuses the fd (which is closed then).
  StreamListener(uv_loop_t* loop, int fd, std::string what, const ListenerOptions& bounds,
                 Admission::Evict evict, Accept accept, loop::Log log);
  /// Closes the socket.
  ~StreamListener();
  StreamListener(const StreamListener&) = delete;
  StreamListener& operator=(const StreamListener&) = delete;

  int fd() const noexcept { return fd_; }
  Admission& admission() noexcept { return admission_; }
  const Admission& admission() const noexcept { return admission_; }
  /// Stops accepting and closes the socket.
  void close();

 private:
  static void on_listen(uv_poll_t* handle, int status, int events);
  void accept_batch();
  void pause(int err);

  int fd_;
  std::string what_;
  Accept accept_;
  loop::Log log_;
  Admission admission_;
  loop::Poll poll_;
  loop::Timer retry_;  ///< resumes accepting after running out of descriptors
};

}  // namespace ferry::transport::kit
