#include "transport/wire/stream_connection.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include "loop/ids.hpp"
#include "transport/wire/socket.hpp"
#include "transport/wire/status.hpp"

namespace ferry::transport::wire {

namespace {

// Work done per readiness callback before yielding to the loop's other handles; the socket
// stays readable, so the loop comes straight back.
constexpr std::uint64_t kReadBudget = 16u << 20;
constexpr int kMaxIov = 64;

// Back-pressure on server connections (see owned_bytes_).
constexpr std::size_t kHighFrames = 4096;
constexpr std::uint64_t kHighBytes = 8u << 20;

// The per-thread buffers below are allocated on a thread's first use, never as static TLS:
// a library's static TLS is carved out of every thread's stack in the process (ferry's 384 KiB
// of it made prometheus-cpp's HTTP server, whose threads have small stacks, fail to start).

// Input read and dropped while closing.
constexpr std::size_t kDrainSize = 64 * 1024;
std::byte* drain_buffer() {
  thread_local std::unique_ptr<std::byte[]> buffer;
  if (!buffer) buffer = std::make_unique_for_overwrite<std::byte[]>(kDrainSize);
  return buffer.get();
}

// read_some()'s read-ahead buffer, one per thread; a payload of at least kDirect bytes is read
// straight into its sink instead.
constexpr std::size_t kAheadSize = 64 * 1024;
constexpr std::size_t kDirect = 16 * 1024;
struct ReadAhead {
  std::byte bytes[kAheadSize];
  std::size_t at = 0;
  std::size_t end = 0;
  bool in_use = false;
};
ReadAhead& read_ahead() {
  thread_local std::unique_ptr<ReadAhead> ahead;
  if (!ahead) ahead = std::make_unique<ReadAhead>();
  return *ahead;
}

}  // namespace

StreamConnection::StreamConnection(uv_loop_t* loop, Handler& handler, Role role, int fd,
                                   std::uint64_t id, std::string peer_address,
                                   std::chrono::milliseconds peer_timeout, bool connecting,
                                   Hello local, loop::Log log)
    : loop_(loop),
      handler_(handler),
      local_(std::move(local)),
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
  if (role_ == Role::client) {
    FrameHeader hello;
    hello.type = FrameType::hello;
    hello.op_id = local_.id;
    send(hello, std::string_view(local_.name).substr(0, 256));
  }
  watchdog();
  update_poll();
}

StreamConnection::~StreamConnection() {
  closed_ = true;
  close_socket();
}

std::string StreamConnection::describe_peer() const {
  if (peer_name_.empty()) return "at " + peer_address_;
  return "'" + peer_name_ + "' at " + peer_address_;
}

void StreamConnection::close_socket() {
  if (poll_) {
    // Closing the poll handle takes the fd out of the loop's epoll set at once, so closing
    // the fd right after is safe even if its number is reused at once.
    poll_.reset();
    ::close(fd_);
    fd_ = -1;
  }
  timer_.reset();
}

void StreamConnection::expect_answers(int delta) noexcept {
  const bool before = awaiting_ > 0;
  awaiting_ += delta;
  if ((awaiting_ > 0) != before) watchdog();
}

void StreamConnection::set_notice(std::uint32_t status, std::string message) {
  notice_status_ = status;
  notice_ = std::move(message);
}

bool StreamConnection::awaiting_peer() const noexcept {
  return connecting_ || closing_after_flush_ || !greeted_ || awaiting_ > 0;
}

void StreamConnection::watchdog() {
  if (closed_ || !timer_ || !broken_.empty()) return;
  if (!awaiting_peer()) {
    uv_timer_stop(timer_.get());
    return;
  }
  uv_timer_start(timer_.get(), &StreamConnection::on_timer,
                 static_cast<std::uint64_t>(peer_timeout_.count()), 0);
}

void StreamConnection::account(std::int64_t owned_delta) noexcept {
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

void StreamConnection::update_poll() {
  if (closed_ || !poll_) return;
  int events = 0;
  if (connecting_) {
    events = UV_WRITABLE;
  } else {
    // Closing: input is still read (and dropped) until the peer closes; see drain(). Broken:
    // what the peer sent before is still read.
    if (closing_after_flush_ || !backlogged_ || !broken_.empty()) events |= UV_READABLE;
    if (!out_.empty() && broken_.empty()) events |= UV_WRITABLE;
  }
  if (events == poll_events_) return;
  poll_events_ = events;
  if (events == 0)
    uv_poll_stop(poll_.get());
  else
    uv_poll_start(poll_.get(), events, &StreamConnection::on_poll);
}

void StreamConnection::on_poll(uv_poll_t* handle, int status, int events) {
  auto* self = static_cast<StreamConnection*>(handle->data);
  if (self == nullptr || self->closed_) return;
  loop::guarded(
      self->log_, "a stream connection", [&] { self->poll_event(status, events); },
      [handle](const char* what) {
        // The stream cannot be trusted after a failure halfway through a frame.
        if (auto* conn = static_cast<StreamConnection*>(handle->data); conn && !conn->closed_)
          conn->fail(std::string("internal error: ") + what);
      });
}

void StreamConnection::poll_event(int status, int events) {
  if (status < 0) {
    // libuv reports any POLLERR as EBADF; the socket knows what really happened.
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err == 0) err = EIO;
    // Frames the peer sent before its reset (a notice saying why) are still queued: read them.
    if (!connecting_ && !closing_after_flush_) read_some();
    if (closed_) return;
    fail(broken_.empty() ? socket_error_text(err) : broken_);
    return;
  }
  if (connecting_) {
    finish_connect();
    return;
  }
  if ((events & UV_WRITABLE) != 0) flush();
  if ((events & UV_READABLE) != 0 && !closed_) read_some();
}

void StreamConnection::on_timer(uv_timer_t* handle) {
  auto* self = static_cast<StreamConnection*>(handle->data);
  if (self == nullptr || self->closed_) return;
  loop::guarded(self->log_, "a stream connection's watchdog", [self] { self->timer_fired(); });
}

void StreamConnection::timer_fired() {
  if (!broken_.empty()) {
    // Writing failed a turn ago: read what the peer sent before, then fail.
    read_some();
    if (!closed_) fail(broken_);
    return;
  }
  // libuv runs due timers before it polls: a loop held off the CPU past peer_timeout finds
  // the watchdog due although the connect may have ended, or the peer's bytes wait unread.
  // The peer is judged by its socket, not by our lateness: with what it waits for ready, the
  // watchdog starts again and this turn's poll handles it.
  if (!closing_after_flush_ && ready_now()) {
    watchdog();
    return;
  }
  const std::string ms = std::to_string(peer_timeout_.count()) + " ms";
  if (connecting_)
    fail("connect timed out after " + ms);
  else if (closing_after_flush_)
    fail(close_reason_);
  else if (!greeted_)
    fail("no HELLO from the peer within " + ms);
  else
    fail("the peer has not answered for " + ms);
}

bool StreamConnection::ready_now() const {
  const int wanted = poll_events_ & (connecting_ ? UV_WRITABLE : UV_READABLE);
  if (fd_ < 0 || wanted == 0) return false;
  pollfd p{fd_, static_cast<short>(connecting_ ? POLLOUT : POLLIN), 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & p.events) != 0;
}

void StreamConnection::finish_connect() {
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

void StreamConnection::send(const FrameHeader& header, std::string_view message,
                            const std::byte* payload, std::uint64_t tag) {
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

void StreamConnection::release(std::uint64_t tag,
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
      const std::uint64_t head = kHeaderSize + f.message.size();
      const std::uint64_t from = f.sent > head ? f.sent - head : 0;
      if (f.payload != nullptr && from < f.payload_len) {
        const std::uint64_t rest = f.payload_len - from;
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
      const auto before = static_cast<std::int64_t>(f.message.size());
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

void StreamConnection::close_gracefully() noexcept {
  if (closed_) return;
  try {
    // What is queued (the notices that tell the peer why) leaves if the socket takes it now;
    // unread input is discarded first, since closing a socket with unread input makes the
    // kernel send a reset that can destroy what we just sent before the peer reads it.
    quiet_ = true;
    if (broken_.empty()) flush();
    for (int i = 0; i < 64 && fd_ >= 0; ++i) {
      const ssize_t n = ::read(fd_, drain_buffer(), kDrainSize);
      if (n <= 0 && !(n < 0 && errno == EINTR)) break;
    }
    if (fd_ >= 0) ::shutdown(fd_, SHUT_WR);
  } catch (...) {
  }
}

void StreamConnection::flush() {
  if (closed_ || connecting_ || out_.empty() || !broken_.empty()) return;
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
    const ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      if (quiet_) return;
      broke_while_sending(
          "send failed: " + socket_error_text(errno) +
          (errno == EFAULT ? ": the memory to send is not mapped (freed while exposed?)" : ""));
      return;
    }
    auto left = static_cast<std::uint64_t>(n);
    bool payload_moved = false;
    while (left > 0 && !out_.empty()) {
      OutFrame& f = out_.front();
      const std::uint64_t take = std::min(left, f.total() - f.sent);
      if (f.payload_len > 0 && f.sent + take > kHeaderSize + f.message.size()) payload_moved = true;
      f.sent += take;
      left -= take;
      if (f.sent == f.total()) {
        if (f.tag != 0) sent_tags.push_back(f.tag);
        const std::uint64_t owned =
            kHeaderSize + f.message.size() + (f.owned ? f.payload_len - f.owned_from : 0);
        out_.pop_front();
        account(-static_cast<std::int64_t>(owned));
      }
    }
    // The peer's kernel takes our payload: the peer reads, or its window has room. Small
    // frames prove nothing: a stopped process's kernel buffers them for a long time.
    if (payload_moved && awaiting_peer()) watchdog();
  }
  update_poll();
  if (quiet_) return;
  for (std::uint64_t tag : sent_tags) {
    if (closed_) return;
    handler_.on_sent(*this, tag);
  }
  if (closing_after_flush_ && out_.empty() && !closed_) drain();
}

void StreamConnection::broke_while_sending(const std::string& reason) {
  // Not from here: flush() may run inside a handler call that is reading a frame.
  broken_ = reason;
  update_poll();
  if (timer_) uv_timer_start(timer_.get(), &StreamConnection::on_timer, 0, 0);
}

void StreamConnection::drain() {
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
    const ssize_t n = ::read(fd_, drain_buffer(), kDrainSize);
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

void StreamConnection::read_some() {
  if (closing_after_flush_) {
    drain();
    return;
  }
  // Answers to all the frames read in this callback leave together.
  Cork cork(*this);
  // Small frames are read many at a time into the thread's read-ahead buffer and cut from
  // there (one read(2) for dozens of requests instead of two or three each); a payload, or
  // the rest of one, of kDirect bytes or more is read straight into its sink. What is read
  // ahead is always cut up before the next read (and before this returns, unless the
  // connection closes), so the buffer holds nothing between calls and one per thread serves
  // every connection. A nested call (a handler that makes another connection read) reads
  // without it.
  ReadAhead& mine = read_ahead();
  ReadAhead* ahead = mine.in_use ? nullptr : &mine;
  if (ahead != nullptr) ahead->in_use = true;
  struct Release {
    ReadAhead* ahead;
    ~Release() {
      if (ahead == nullptr) return;
      ahead->at = ahead->end = 0;
      ahead->in_use = false;
    }
  } release{ahead};
  std::uint64_t budget = kReadBudget;
  bool heard = false;
  while (!closed_ && !closing_after_flush_) {
    const std::span<std::byte> into = reader_.next();
    if (ahead != nullptr && ahead->at < ahead->end) {
      // Cut from what was read ahead: the whole of it, also past the budget or a backlog
      // (at most kAheadSize bytes more), since no readiness event would bring it back.
      const std::size_t n = std::min(into.size(), ahead->end - ahead->at);
      std::memcpy(into.data(), ahead->bytes + ahead->at, n);
      ahead->at += n;
      if (auto bad = reader_.advance(n)) {
        fail_after_notice(to_wire(ErrorCode::ProtocolError), *bad);
        return;
      }
      continue;
    }
    if ((backlogged_ && broken_.empty()) || budget == 0) return;
    const bool direct = ahead == nullptr || into.size() >= kDirect;
    std::byte* to = direct ? into.data() : ahead->bytes;
    // Right after a payload read straight into its sink, the next frame likely has one too:
    // read ahead only its header, so that its payload goes straight into its sink as well
    // instead of through the buffer (a second copy of every byte of a stream of 16 KiB blocks).
    const std::size_t room = direct  ? std::min<std::size_t>(into.size(), 1u << 30)
                             : bulk_ ? kHeaderSize
                                     : sizeof ahead->bytes;
    bulk_ = direct;
    const ssize_t n = ::read(fd_, to, room);
    if (n == 0) {
      fail(broken_.empty() ? "connection closed by the peer" : broken_);
      return;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      fail(broken_.empty() ? "receive failed: " + socket_error_text(errno) : broken_);
      return;
    }
    const auto got = static_cast<std::uint64_t>(n);
    budget -= std::min(budget, got);
    if (!heard) {
      heard = true;
      heard_ = true;
      if (awaiting_peer()) watchdog();
    }
    if (!direct) {
      ahead->at = 0;
      ahead->end = static_cast<std::size_t>(n);
      continue;
    }
    if (auto bad = reader_.advance(static_cast<std::size_t>(n))) {
      fail_after_notice(to_wire(ErrorCode::ProtocolError), *bad);
      return;
    }
  }
}

Sink StreamConnection::on_frame(const FrameHeader& header, std::string message) {
  if (closed_ || closing_after_flush_) return {};
  if (!greeted_) return greet(header, std::move(message));
  return handler_.on_frame(*this, header, std::move(message));
}

void StreamConnection::on_payload(const FrameHeader& header, std::uint64_t tag, bool intact) {
  if (closed_ || closing_after_flush_) return;
  handler_.on_payload(*this, header, tag, intact);
}

Sink StreamConnection::greet(const FrameHeader& h, std::string message) {
  if (h.type != FrameType::hello) {
    if (role_ == Role::client && h.type == FrameType::status && h.status != 0)
      return fatal("peer refused the connection: " + message);
    return fatal("expected HELLO as the first frame");
  }
  if (h.op_id != 0) peer_id_ = loop::hex16(h.op_id);
  if (role_ == Role::server || peer_name_.empty()) peer_name_ = message.substr(0, 256);
  greeted_ = true;
  watchdog();
  FrameHeader reply;
  reply.type = FrameType::hello;
  reply.op_id = local_.id;
  if (auto refused = handler_.on_hello(*this, h, reply)) {
    fail(refused->message());
    return {};
  }
  if (role_ == Role::server) send(reply, std::string_view(local_.name).substr(0, 256));
  return {};
}

void StreamConnection::fail_after_notice(std::uint32_t status, const std::string& reason) {
  if (closed_ || closing_after_flush_) return;
  FrameHeader h;
  h.type = FrameType::status;
  h.status = status;
  send(h, reason.substr(0, kMaxMessage));
  sent_notice_status_ = status;
  closing_after_flush_ = true;
  close_reason_ = "protocol error: " + reason;
  if (closed_) return;
  update_poll();
  watchdog();
  if (out_.empty()) drain();
}

void StreamConnection::fail(const std::string& reason) {
  if (closed_) return;
  closed_ = true;
  close_socket();
  out_.clear();
  handler_.on_closed(*this, reason);
}

void reply(StreamConnection& conn, std::uint64_t req_id, const Error* error) {
  conn.send(status_frame(req_id, error), status_text(error));
}

void evict(StreamConnection& conn, const std::string& why) {
  if (!conn.open()) return;
  const Error reason(ErrorCode::AccessDenied, why);
  reply(conn, 0, &reason);
  conn.close_gracefully();
  conn.fail(why);
}

}  // namespace ferry::transport::wire
