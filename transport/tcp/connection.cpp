#include "transport/tcp/connection.hpp"

#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "loop/ids.hpp"
#include "loop/uv_handle.hpp"
#include "transport/tcp/socket.hpp"

namespace ferry::transport::tcp {

namespace {

// Refused payloads and responses for cancelled transfers are read into this and dropped.
thread_local std::byte discard_buffer[256 * 1024];

// Work done per readiness callback before yielding to the loop's other handles; the socket
// stays readable, so the loop comes straight back.
constexpr std::uint64_t kReadBudget = 16u << 20;
constexpr int kMaxIov = 64;

// Back-pressure on server connections (see owned_bytes_).
constexpr std::size_t kHighFrames = 4096;
constexpr std::uint64_t kHighBytes = 8u << 20;

}  // namespace

Connection::Connection(uv_loop_t* loop, Handler& handler, Role role, int fd, std::uint64_t id,
                       std::string peer_address, std::chrono::milliseconds peer_timeout,
                       bool connecting, loop::Log log)
    : loop_(loop),
      handler_(handler),
      log_(std::move(log)),
      role_(role),
      fd_(fd),
      id_(id),
      peer_address_(std::move(peer_address)),
      peer_timeout_(peer_timeout),
      connecting_(connecting) {
  try {
    poll_ = loop::Poll::poll(loop_, fd_, this);
  } catch (...) {
    ::close(fd_);
    throw;
  }
  timer_ = loop::Timer::timer(loop_, this);
  watchdog();
  update_poll();
}

Connection::~Connection() {
  closed_ = true;
  close_socket();
}

std::string Connection::describe_peer() const {
  if (peer_name_.empty()) return "at " + peer_address_;
  return "'" + peer_name_ + "' at " + peer_address_;
}

void Connection::close_socket() {
  if (poll_) {
    // Closing the poll handle takes the fd out of the loop's epoll set at once, so closing
    // the fd right after is safe even if its number is reused at once.
    poll_.reset();
    ::close(fd_);
    fd_ = -1;
  }
  timer_.reset();
}

void Connection::set_greeted() noexcept {
  greeted_ = true;
  watchdog();
}

void Connection::expect_answers(int delta) noexcept {
  bool before = awaiting_ > 0;
  awaiting_ += delta;
  if ((awaiting_ > 0) != before) watchdog();
}

void Connection::set_notice(std::uint32_t code, std::string message) {
  notice_code_ = code;
  notice_ = std::move(message);
}

bool Connection::awaiting_peer() const noexcept {
  return connecting_ || closing_after_flush_ || !greeted_ || awaiting_ > 0;
}

void Connection::watchdog() {
  if (closed_ || !timer_) return;
  if (!awaiting_peer()) {
    uv_timer_stop(timer_.get());
    return;
  }
  uv_timer_start(timer_.get(), &Connection::on_timer,
                 static_cast<std::uint64_t>(peer_timeout_.count()), 0);
}

void Connection::account(std::int64_t owned_delta) noexcept {
  owned_bytes_ = static_cast<std::uint64_t>(static_cast<std::int64_t>(owned_bytes_) + owned_delta);
  if (role_ != Role::server) return;
  if (!backlogged_ && (out_.size() > kHighFrames || owned_bytes_ > kHighBytes)) {
    backlogged_ = true;
    update_poll();
  } else if (backlogged_ && out_.size() < kHighFrames / 2 && owned_bytes_ < kHighBytes / 2) {
    backlogged_ = false;
    update_poll();
  }
}

void Connection::update_poll() {
  if (closed_ || !poll_) return;
  int events = 0;
  if (connecting_) {
    events = UV_WRITABLE;
  } else {
    // Closing: input is still read (and dropped) until the peer closes; see drain().
    if (closing_after_flush_ || !backlogged_) events |= UV_READABLE;
    if (!out_.empty()) events |= UV_WRITABLE;
  }
  if (events == poll_events_) return;
  poll_events_ = events;
  if (events == 0)
    uv_poll_stop(poll_.get());
  else
    uv_poll_start(poll_.get(), events, &Connection::on_poll);
}

void Connection::on_poll(uv_poll_t* handle, int status, int events) {
  auto* conn = static_cast<Connection*>(handle->data);
  if (conn == nullptr) return;
  loop::guarded(
      conn->log_, "tcp connection", [&] { poll_event(handle, status, events); },
      [handle](const char* what) {
        // The stream cannot be trusted after a failure halfway through a frame.
        if (auto* self = static_cast<Connection*>(handle->data); self && !self->closed_)
          self->fail(std::string("internal error: ") + what);
      });
}

void Connection::poll_event(uv_poll_t* handle, int status, int events) {
  auto* self = static_cast<Connection*>(handle->data);
  if (self == nullptr || self->closed_) return;
  if (status < 0) {
    // libuv reports any POLLERR as EBADF; the socket knows what really happened.
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(self->fd_, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err == 0) err = EIO;
    // Frames the peer sent before its reset (a notice saying why) are still queued: read them.
    if (!self->connecting_ && !self->closing_after_flush_) self->read_some();
    if (self->closed_) return;
    self->fail(socket_error_text(err));
    return;
  }
  if (self->connecting_) {
    self->finish_connect();
    return;
  }
  if ((events & UV_WRITABLE) != 0) self->flush();
  if ((events & UV_READABLE) != 0 && !self->closed_) self->read_some();
}

void Connection::on_timer(uv_timer_t* handle) {
  auto* conn = static_cast<Connection*>(handle->data);
  if (conn == nullptr) return;
  loop::guarded(conn->log_, "tcp watchdog", [&] { watchdog_fired(handle); });
}

void Connection::watchdog_fired(uv_timer_t* handle) {
  auto* self = static_cast<Connection*>(handle->data);
  if (self == nullptr || self->closed_) return;
  const std::string ms = std::to_string(self->peer_timeout_.count()) + " ms";
  if (self->connecting_)
    self->fail("connect timed out after " + ms);
  else if (self->closing_after_flush_)
    self->fail(self->close_reason_);
  else if (!self->greeted_)
    self->fail("no HELLO from the peer within " + ms);
  else
    self->fail("the peer has not answered for " + ms);
}

void Connection::finish_connect() {
  int err = 0;
  socklen_t len = sizeof err;
  if (getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
  if (err != 0) {
    fail("connect failed: " + socket_error_text(err));
    return;
  }
  connecting_ = false;
  watchdog();
  update_poll();
  flush();
}

void Connection::send(const FrameHeader& header, std::string_view message, const std::byte* payload,
                      std::uint64_t tag) {
  if (closed_) return;
  OutFrame& f = out_.emplace_back();
  f.header = header;
  f.header.msg_len = static_cast<std::uint32_t>(message.size());
  f.header_bytes = encode(f.header);
  f.message.assign(message);
  if (has_payload(header.type)) {
    f.payload = payload;
    f.payload_len = header.len;
  }
  f.tag = tag;
  account(static_cast<std::int64_t>(kHeaderSize + f.message.size()));
  // Writing at once keeps a lone small frame off the next loop turn; a queue that is still
  // draining is left to the writable event.
  if (out_.size() == 1 && corked_ == 0) flush();
}

void Connection::release(std::uint64_t tag,
                         const std::function<void(FrameHeader&, std::string&)>& replacement) {
  for (auto it = out_.begin(); it != out_.end();) {
    OutFrame& f = *it;
    if (f.tag != tag) {
      ++it;
      continue;
    }
    f.tag = 0;
    if (f.sent > 0) {
      // Partly on the wire: the frame must be finished or the stream breaks. Finish it from
      // a private copy so that the caller's memory is free when we return.
      std::uint64_t head = kHeaderSize + f.message.size();
      std::uint64_t from = f.sent > head ? f.sent - head : 0;
      if (f.payload != nullptr && from < f.payload_len) {
        std::uint64_t rest = f.payload_len - from;
        auto copy = std::make_unique<std::byte[]>(rest);
        std::memcpy(copy.get(), f.payload + from, rest);
        f.owned = std::move(copy);
        f.owned_from = from;
        f.payload = nullptr;
        account(static_cast<std::int64_t>(rest));
      }
      ++it;
      continue;
    }
    if (replacement) {
      auto before = static_cast<std::int64_t>(f.message.size());
      f.message.clear();
      replacement(f.header, f.message);
      account(static_cast<std::int64_t>(f.message.size()) - before);
      f.header.len = 0;
      f.header.msg_len = static_cast<std::uint32_t>(f.message.size());
      f.header_bytes = encode(f.header);
      f.payload = nullptr;
      f.payload_len = 0;
      ++it;
    } else {
      account(-static_cast<std::int64_t>(kHeaderSize + f.message.size()));
      it = out_.erase(it);
    }
  }
  update_poll();
}

void Connection::drop_sink(std::uint64_t tag) noexcept {
  if (state_ == ReadState::payload && sink_.dest != nullptr && sink_.tag == tag) {
    sink_.dest = nullptr;
    sink_intact_ = false;
  }
}

void Connection::close_gracefully() noexcept {
  if (closed_) return;
  try {
    // What is queued (the notices that tell the peer why) leaves if the socket takes it now;
    // unread input is discarded first, since closing a socket with unread input makes the
    // kernel send a reset that can destroy what we just sent before the peer reads it.
    quiet_ = true;
    flush();
    for (int i = 0; i < 64; ++i) {
      ssize_t n = ::read(fd_, discard_buffer, sizeof discard_buffer);
      if (n <= 0 && !(n < 0 && errno == EINTR)) break;
    }
    if (fd_ >= 0) ::shutdown(fd_, SHUT_WR);
  } catch (...) {
  }
}

void Connection::flush() {
  if (closed_ || connecting_ || out_.empty()) return;
  std::vector<std::uint64_t> sent_tags;
  while (!out_.empty()) {
    iovec iov[kMaxIov];
    int count = 0;
    for (auto it = out_.begin(); it != out_.end() && count + 3 <= kMaxIov; ++it) {
      OutFrame& f = *it;
      std::uint64_t off = f.sent;
      if (off < kHeaderSize) {
        iov[count++] = {f.header_bytes.data() + off, kHeaderSize - off};
        off = 0;
      } else {
        off -= kHeaderSize;
      }
      if (off < f.message.size()) {
        iov[count++] = {f.message.data() + off, f.message.size() - off};
        off = 0;
      } else {
        off -= f.message.size();
      }
      if (off < f.payload_len) {
        const std::byte* at = f.owned ? f.owned.get() + (off - f.owned_from) : f.payload + off;
        iov[count++] = {const_cast<std::byte*>(at), f.payload_len - off};
      }
    }
    // sendmsg, not writev: MSG_NOSIGNAL turns a write to a reset peer into EPIPE instead of
    // a SIGPIPE that would kill the process.
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<std::size_t>(count);
    ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      if (quiet_) return;
      fail("send failed: " + socket_error_text(errno));
      return;
    }
    auto left = static_cast<std::uint64_t>(n);
    while (left > 0 && !out_.empty()) {
      OutFrame& f = out_.front();
      std::uint64_t take = std::min(left, f.total() - f.sent);
      f.sent += take;
      left -= take;
      if (f.sent == f.total()) {
        if (f.tag != 0) sent_tags.push_back(f.tag);
        std::uint64_t owned =
            kHeaderSize + f.message.size() + (f.owned ? f.payload_len - f.owned_from : 0);
        out_.pop_front();
        account(-static_cast<std::int64_t>(owned));
      }
    }
    // The peer takes our bytes: it is alive.
    if (awaiting_peer()) watchdog();
  }
  update_poll();
  if (quiet_) return;
  for (std::uint64_t tag : sent_tags) {
    if (closed_) return;
    handler_.on_sent(*this, tag);
  }
  if (closing_after_flush_ && out_.empty() && !closed_) drain();
}

void Connection::drain() {
  if (!write_shut_ && out_.empty()) {
    // Our last frame (the notice) has left: say we are done sending, but keep reading until
    // the peer closes. Closing a socket with unread input makes the kernel send a reset,
    // which can destroy the notice before the peer reads it.
    ::shutdown(fd_, SHUT_WR);
    write_shut_ = true;
    update_poll();
  }
  // At most a read budget per loop turn; the watchdog, which reading does not re-arm here,
  // ends the whole drain after peer_timeout.
  for (std::uint64_t budget = kReadBudget; budget > 0;) {
    ssize_t n = ::read(fd_, discard_buffer, sizeof discard_buffer);
    if (n > 0) {
      budget -= std::min(budget, static_cast<std::uint64_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    fail(close_reason_);
    return;
  }
}

void Connection::read_some() {
  if (closing_after_flush_) {
    drain();
    return;
  }
  // Answers to all the frames read in this callback leave together.
  Cork cork(*this);
  std::uint64_t budget = kReadBudget;
  bool heard = false;
  while (!closed_ && !closing_after_flush_ && !backlogged_ && budget > 0) {
    ssize_t n = 0;
    switch (state_) {
      case ReadState::header:
        n = ::read(fd_, header_buf_.data() + header_got_, kHeaderSize - header_got_);
        break;
      case ReadState::message:
        n = ::read(fd_, message_.data() + payload_got_, message_.size() - payload_got_);
        break;
      case ReadState::payload: {
        std::uint64_t rest = header_.len - payload_got_;
        if (sink_.dest != nullptr) {
          n = ::read(fd_, sink_.dest + payload_got_, std::min<std::uint64_t>(rest, 1u << 30));
        } else {
          n = ::read(fd_, discard_buffer, std::min<std::uint64_t>(rest, sizeof discard_buffer));
        }
        break;
      }
    }
    if (n == 0) {
      fail("connection closed by the peer");
      return;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      fail("receive failed: " + socket_error_text(errno));
      return;
    }
    auto got = static_cast<std::uint64_t>(n);
    budget -= std::min(budget, got);
    if (!heard) {
      heard = true;
      if (awaiting_peer()) watchdog();
    }
    switch (state_) {
      case ReadState::header:
        header_got_ += got;
        if (header_got_ < kHeaderSize) break;
        header_got_ = 0;
        header_ = decode(header_buf_.data());
        if (auto what = malformed(header_); !what.empty()) {
          fail_after_notice(static_cast<std::uint32_t>(ErrorCode::ProtocolError), what);
          return;
        }
        if (header_.msg_len > 0) {
          message_.assign(header_.msg_len, '\0');
          payload_got_ = 0;
          state_ = ReadState::message;
        } else {
          message_.clear();
          start_frame();
        }
        break;
      case ReadState::message:
        payload_got_ += got;
        if (payload_got_ == message_.size()) start_frame();
        break;
      case ReadState::payload:
        payload_got_ += got;
        if (payload_got_ == header_.len) finish_payload();
        break;
    }
  }
}

void Connection::start_frame() {
  state_ = ReadState::header;
  // A peer's text (names, reasons) goes into errors and JSON: only valid UTF-8 gets there.
  if (!message_.empty() && !loop::valid_utf8(message_)) message_ = loop::sanitized_utf8(message_);
  Sink sink = handler_.on_frame(*this, header_, std::move(message_));
  message_.clear();
  if (closed_ || closing_after_flush_) return;
  if (sink.fatal) {
    fail_after_notice(static_cast<std::uint32_t>(ErrorCode::ProtocolError), sink.error);
    return;
  }
  if (!has_payload(header_.type)) return;
  sink_ = std::move(sink);
  sink_intact_ = sink_.dest != nullptr;
  payload_got_ = 0;
  if (header_.len == 0) {
    finish_payload();
    return;
  }
  state_ = ReadState::payload;
}

void Connection::finish_payload() {
  state_ = ReadState::header;
  std::uint64_t tag = sink_.tag;
  bool intact = sink_intact_ && sink_.dest != nullptr;
  sink_ = Sink{};
  handler_.on_payload(*this, header_, tag, intact);
}

void Connection::fail_after_notice(std::uint32_t code, const std::string& reason) {
  if (closed_ || closing_after_flush_) return;
  FrameHeader h;
  h.type = FrameType::status;
  h.status = code;
  send(h, reason.substr(0, kMaxMessage));
  closing_after_flush_ = true;
  close_reason_ = "protocol error: " + reason;
  if (closed_) return;
  update_poll();
  watchdog();
  if (out_.empty()) drain();
}

void Connection::fail(const std::string& reason) {
  if (closed_) return;
  closed_ = true;
  close_socket();
  out_.clear();
  handler_.on_closed(*this, reason);
}

}  // namespace ferry::transport::tcp
