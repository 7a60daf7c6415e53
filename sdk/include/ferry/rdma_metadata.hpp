#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <ferry/device.hpp>
#include <ferry/operation_status.hpp>

namespace ferry {

/// One way to reach the owner of a passive operation: a method ("tcp", ...) and its address
/// in that method's form ("127.0.0.1:41234", "[::1]:41234"), plus what else that method needs
/// to reach this operation's memory (`info`: remote keys, say; empty for tcp).
struct Endpoint {
  std::string method;
  std::string address;
  std::string info{};
  friend bool operator==(const Endpoint&, const Endpoint&) = default;
};

/// A memory range in the owner's address space, as the owner described it.
struct RemoteDescriptor {
  std::uint64_t ptr = 0;
  std::uint64_t size = 0;
  Device device;
  friend bool operator==(const RemoteDescriptor&, const RemoteDescriptor&) = default;
};

/// Who owns a passive operation: the connector's name and unique id, its host and process.
struct PeerIdentity {
  std::string name;
  std::string id;
  std::string host;
  std::int64_t pid = 0;
  friend bool operator==(const PeerIdentity&, const PeerIdentity&) = default;
};

/// What a peer needs to act on a passive operation. It is a credential: whoever holds it may
/// touch the described memory until the operation ends. A value type.
///
/// Its JSON form (`to_json`, `from_json`) is versioned; `from_json` validates strictly and
/// throws Error(InvalidMetadata) whose field() names the first offending field: an unknown
/// version, a missing field, a wrong type, an unknown kind, a zero-size or overflowing range.
struct RdmaMetadata {
  static constexpr int kVersion = 1;
  /// Longest JSON document from_json accepts, and most descriptors and endpoints. Sized for
  /// what a NATS message carries (a server's max_payload is 1 MiB by default, 64 MiB at most)
  /// and what sane use needs (a KV cache of 1024 blocks is about 80 KiB of JSON), so that
  /// parsing a hostile document stays within milliseconds and a few tens of MiB.
  static constexpr std::size_t kMaxJsonBytes = 4u << 20;
  static constexpr std::size_t kMaxDescriptors = 1u << 16;
  static constexpr std::size_t kMaxEndpoints = 16;
  static constexpr std::size_t kMaxEndpointInfo = 4096;

  int version = kVersion;
  /// `read` for a readable operation, `write` for a writable one.
  OperationKind operation_kind = OperationKind::unspecified;
  /// The operation's id at its owner: 16 lowercase hex digits.
  std::string notification_key;
  /// The owner; `owner.id` is its connector id, 16 lowercase hex digits.
  PeerIdentity owner;
  std::vector<Endpoint> endpoints;
  std::vector<RemoteDescriptor> descriptors;
  /// The access token: 32 lowercase hex digits (128 random bits).
  std::string token;

  std::uint64_t total_size() const noexcept;
  std::string to_json() const;
  /// Throws Error(InvalidMetadata) naming the field; see the class comment.
  static RdmaMetadata from_json(std::string_view json);
  /// Applies from_json's checks to this value; throws as from_json does.
  void validate() const;

  friend bool operator==(const RdmaMetadata&, const RdmaMetadata&) = default;
};

}  // namespace ferry
