#pragma once

#include <sys/socket.h>

#include <chrono>
#include <string>
#include <string_view>

#include <ferry/rdma_metadata.hpp>

namespace ferry::transport::wire {

/// A numeric socket address: "127.0.0.1:4000" or "[::1]:4000".
struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;

  /// Parses `ip:port` / `[ipv6]:port` (numeric only: resolving names would block the loop).
  /// Returns false on anything else.
  static bool parse(std::string_view text, SocketAddress& out);
  /// From an address and a separate port; false if `ip` is not numeric.
  static bool from_parts(std::string_view ip, std::uint16_t port, SocketAddress& out);

  const sockaddr* get() const noexcept { return reinterpret_cast<const sockaddr*>(&storage); }
  int family() const noexcept { return storage.ss_family; }
  bool is_wildcard() const noexcept;
  std::uint16_t port() const noexcept;
  std::string to_string() const;
};

/// The address of an endpoint that names a numeric ip:port (tcp's, verbs'). Throws
/// Error(InvalidMetadata, field "endpoints") for anything else.
SocketAddress endpoint_address(const Endpoint& endpoint);

/// Non-blocking, close-on-exec stream socket with ferry's options: no Nagle delay, and a
/// keepalive plus user timeout so that a silent peer is dropped after about `peer_timeout`.
int make_stream_socket(int family, std::chrono::milliseconds peer_timeout);
void apply_peer_options(int fd, std::chrono::milliseconds peer_timeout);

/// "errno text" of the socket's pending error.
std::string socket_error_text(int err);

}  // namespace ferry::transport::wire
