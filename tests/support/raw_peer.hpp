#pragma once

// A peer that speaks ferry's TCP frames by hand over blocking sockets on loopback, for tests
// of hostile or broken peers (docs/protocol.md). Every call is bounded by socket timeouts.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>
#include <algorithm>

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ferry/ferry.hpp>

#include "tests/support/patterns.hpp"
#include "transport/kit/exposure_table.hpp"
#include "transport/wire/frame.hpp"
#include "transport/wire/status.hpp"

namespace ferry::test {

using transport::Token;
using transport::wire::FrameHeader;
using transport::wire::FrameType;

constexpr int kSocketTimeoutSeconds = 5;
constexpr std::size_t kLargestPayloadAccepted = 64u << 20;

inline std::uint32_t wire_status(ErrorCode code) { return transport::wire::to_wire(code); }

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// What a raw client needs from a passive operation's metadata.
struct Target {
  std::string address;  ///< "127.0.0.1:port"
  std::uint64_t op_id = 0;
  Token token{};
  std::uint64_t base = 0;  ///< the first descriptor's address in the owner's memory
  std::uint64_t size = 0;
};

inline Target target_of(const RdmaMetadata& m) {
  Target t;
  EXPECT_FALSE(m.endpoints.empty());
  EXPECT_FALSE(m.descriptors.empty());
  if (m.endpoints.empty() || m.descriptors.empty()) return t;
  // A raw peer speaks tcp: the owner's tcp endpoint, whatever else it offers.
  auto tcp = std::find_if(m.endpoints.begin(), m.endpoints.end(),
                          [](const Endpoint& e) { return e.method == "tcp"; });
  EXPECT_NE(tcp, m.endpoints.end());
  if (tcp == m.endpoints.end()) return t;
  t.address = tcp->address;
  EXPECT_EQ(m.notification_key.size(), 16u);
  t.op_id = std::stoull(m.notification_key, nullptr, 16);
  EXPECT_TRUE(transport::token_from_hex(m.token, t.token)) << m.token;
  t.base = m.descriptors[0].ptr;
  t.size = m.descriptors[0].size;
  return t;
}

inline Token flipped(Token token) {
  token[0] = static_cast<std::uint8_t>(token[0] ^ 0x80);
  return token;
}

struct Frame {
  FrameHeader header;
  std::string message;
  std::vector<std::byte> payload;
};

/// A blocking TCP client that speaks the frame protocol by hand. Every call is bounded by
/// the socket's send and receive timeouts, so a silent server fails the test, not hangs it.
class RawClient {
 public:
  /// Takes over a connected socket (the accepting side of a fake server).
  struct Adopt {};
  RawClient(Adopt, int fd) : fd_(fd) {
    timeval tv{};
    tv.tv_sec = kSocketTimeoutSeconds;
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  }
  explicit RawClient(const std::string& address) {
    const auto colon = address.rfind(':');
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    if (colon == std::string::npos ||
        inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr) != 1) {
      error_ = "not an IPv4 ip:port: '" + address + "'";
      return;
    }
    if (sa.sin_addr.s_addr != htonl(INADDR_LOOPBACK)) {
      error_ = "tests talk to 127.0.0.1 only, not " + address;
      return;
    }
    sa.sin_port = htons(static_cast<std::uint16_t>(std::stoul(address.substr(colon + 1))));
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) {
      error_ = std::string("socket: ") + std::strerror(errno);
      return;
    }
    timeval tv{};
    tv.tv_sec = kSocketTimeoutSeconds;
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (::connect(fd_, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) != 0) {
      error_ = "connect to " + address + ": " + std::strerror(errno);
      close();
    }
  }
  ~RawClient() { close(); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool connected() const noexcept { return fd_ >= 0; }
  int fd() const noexcept { return fd_; }
  const std::string& error() const noexcept { return error_; }

  bool send_bytes(const void* data, std::size_t size) {
    const auto* p = static_cast<const char*>(data);
    while (size > 0) {
      ssize_t n = ::send(fd_, p, size, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        error_ = std::string("send: ") + std::strerror(errno);
        return false;
      }
      p += n;
      size -= static_cast<std::size_t>(n);
    }
    return true;
  }

  /// Sends `h` with msg_len set to the message's size, then exactly `payload` (which may be
  /// shorter than h.len, to play a client that stops midway).
  bool send_frame(FrameHeader h, std::string_view message = {},
                  const std::vector<std::byte>& payload = {}) {
    h.msg_len = static_cast<std::uint32_t>(message.size());
    const auto bytes = transport::wire::encode(h);
    return send_bytes(bytes.data(), bytes.size()) && send_bytes(message.data(), message.size()) &&
           send_bytes(payload.data(), payload.size());
  }

  /// The next frame other than CLAIMED (whose secrets are kept: claim_secret()), or nothing
  /// on end of stream, reset, timeout or an implausible header (error() says which).
  std::optional<Frame> read_frame() {
    for (;;) {
      auto f = read_any_frame();
      if (!f || f->header.type != FrameType::claimed) return f;
      claims_[f->header.op_id] = f->header.token;
    }
  }
  /// The claim secret the server sent for operation `op_id`, if it did.
  std::optional<transport::Token> claim_secret(std::uint64_t op_id) const {
    auto it = claims_.find(op_id);
    if (it == claims_.end()) return std::nullopt;
    return it->second;
  }

  /// The next frame, CLAIMED included.
  std::optional<Frame> read_any_frame() {
    transport::wire::HeaderBytes bytes{};
    if (!read_exact(bytes.data(), bytes.size())) return std::nullopt;
    Frame f;
    f.header = transport::wire::decode(bytes.data());
    if (auto what = transport::wire::malformed(f.header)) {
      error_ = "the server sent a malformed header: " + *what;
      return std::nullopt;
    }
    f.message.resize(f.header.msg_len);
    if (!read_exact(f.message.data(), f.message.size())) return std::nullopt;
    if (transport::wire::has_payload(f.header.type)) {
      if (f.header.len > kLargestPayloadAccepted) {
        error_ = "the server announced " + std::to_string(f.header.len) + " bytes of payload";
        return std::nullopt;
      }
      f.payload.resize(f.header.len);
      if (!read_exact(f.payload.data(), f.payload.size())) return std::nullopt;
    }
    return f;
  }

  /// Sends HELLO with `name` and reads the server's HELLO; true if it came.
  bool greet(const std::string& name, std::uint64_t connector_id = 0) {
    FrameHeader h;
    h.type = FrameType::hello;
    h.op_id = connector_id;
    if (!send_frame(h, name)) return false;
    auto reply = read_frame();
    if (!reply) return false;
    if (reply->header.type != FrameType::hello) {
      error_ = "the server answered HELLO with frame type " +
               std::to_string(static_cast<int>(reply->header.type)) + ": " + reply->message;
      return false;
    }
    server_name_ = reply->message;
    return true;
  }
  const std::string& server_name() const noexcept { return server_name_; }
  std::map<std::uint64_t, transport::Token> claims_;

  /// Whether the server closes the connection (end of stream or reset) without sending
  /// anything more, within the receive timeout.
  bool closed_by_peer() {
    char c;
    for (;;) {
      ssize_t n = ::recv(fd_, &c, 1, 0);
      if (n == 0) return true;
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        error_ = std::string("recv: ") + std::strerror(errno);
        return errno == ECONNRESET;
      }
      error_ = "the server sent more bytes instead of closing";
      return false;
    }
  }

  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  bool read_exact(void* dst, std::size_t size) {
    auto* p = static_cast<char*>(dst);
    while (size > 0) {
      ssize_t n = ::recv(fd_, p, size, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) {
        error_ = "the server closed the connection";
        return false;
      }
      if (n < 0) {
        error_ = errno == EAGAIN || errno == EWOULDBLOCK
                     ? "no answer within " + std::to_string(kSocketTimeoutSeconds) + " s"
                     : std::string("recv: ") + std::strerror(errno);
        return false;
      }
      p += n;
      size -= static_cast<std::size_t>(n);
    }
    return true;
  }

  int fd_ = -1;
  std::string error_;
  std::string server_name_;
};

inline FrameHeader request(FrameType type, const Target& t, std::uint64_t req_id,
                           std::uint64_t addr, std::uint64_t len) {
  FrameHeader h;
  h.type = type;
  h.req_id = req_id;
  h.op_id = t.op_id;
  h.addr = addr;
  h.len = len;
  h.token = t.token;
  return h;
}

inline FrameHeader done_frame(const Target& t, std::uint64_t req_id, transport::Access access,
                              std::uint32_t status) {
  FrameHeader h = request(FrameType::done, t, req_id, 0, 0);
  h.flags = static_cast<std::uint16_t>(access);
  h.status = status;
  return h;
}

/// Whether `f` is a STATUS frame for `req_id` with `code` and a message containing `point`.
inline ::testing::AssertionResult is_status(const std::optional<Frame>& f, std::uint64_t req_id,
                                            ErrorCode code, const std::string& point) {
  if (!f) return ::testing::AssertionFailure() << "no frame arrived";
  const FrameHeader& h = f->header;
  if (h.type != FrameType::status || h.req_id != req_id || h.status != wire_status(code) ||
      !contains(f->message, point))
    return ::testing::AssertionFailure()
           << "got type " << static_cast<int>(h.type) << " req " << h.req_id << " status "
           << h.status << " '" << f->message << "'; wanted STATUS req " << req_id << " status "
           << wire_status(code) << " (" << to_string(code) << ") with '" << point << "'";
  return ::testing::AssertionSuccess();
}

/// Whether `f` is a DATA frame for `req_id` carrying `len` bytes of pattern `seed` from
/// `offset` on.
inline ::testing::AssertionResult is_data(const std::optional<Frame>& f, std::uint64_t req_id,
                                          std::size_t len, std::uint64_t seed,
                                          std::uint64_t offset) {
  if (!f) return ::testing::AssertionFailure() << "no frame arrived";
  if (f->header.type != FrameType::data || f->header.req_id != req_id || f->payload.size() != len)
    return ::testing::AssertionFailure()
           << "got type " << static_cast<int>(f->header.type) << " req " << f->header.req_id
           << " with " << f->payload.size() << " bytes '" << f->message << "'";
  if (auto at = first_mismatch(f->payload.data(), len, seed, offset); at != -1)
    return ::testing::AssertionFailure() << "DATA differs from the source at byte " << at;
  return ::testing::AssertionSuccess();
}

/// Whether `f` is a STATUS frame reporting success for `req_id`.
inline ::testing::AssertionResult is_ok(const std::optional<Frame>& f, std::uint64_t req_id) {
  if (!f) return ::testing::AssertionFailure() << "no frame arrived";
  const FrameHeader& h = f->header;
  if (h.type != FrameType::status || h.req_id != req_id || h.status != 0)
    return ::testing::AssertionFailure()
           << "got type " << static_cast<int>(h.type) << " req " << h.req_id << " status "
           << h.status << " '" << f->message << "'; wanted a successful STATUS for " << req_id;
  return ::testing::AssertionSuccess();
}

/// A listening socket on 127.0.0.1 for fake servers.
class RawListener {
 public:
  RawListener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
    ::listen(fd_, 16);
    socklen_t len = sizeof sa;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&sa), &len);
    port_ = ntohs(sa.sin_port);
    timeval tv{};
    tv.tv_sec = kSocketTimeoutSeconds;
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);  // bounds accept()
  }
  ~RawListener() { ::close(fd_); }
  RawListener(const RawListener&) = delete;
  RawListener& operator=(const RawListener&) = delete;

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  /// The next connection, or -1 when none comes within the timeout.
  int accept() { return ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC); }

 private:
  int fd_ = -1;
  std::uint16_t port_ = 0;
};

}  // namespace ferry::test
