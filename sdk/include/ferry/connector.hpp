#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ferry/descriptor.hpp>
#include <ferry/operation.hpp>
#include <ferry/rdma_metadata.hpp>

// libuv's loop type, declared here so that this header does not pull in uv.h.
struct uv_loop_s;

namespace ferry {

namespace detail {
class Core;
}

/// The TCP transport's settings.
struct TcpOptions {
  /// Address the listener binds to. Empty: the loopback address 127.0.0.1.
  std::string bind_address;
  /// Port of the listener; 0 picks a free one.
  std::uint16_t port = 0;
  /// Address put into metadata; empty: the bound address. Needed when binding a wildcard.
  std::string advertise_address;
  /// Largest request an active operation sends at once (its transfer is split into these).
  std::size_t chunk_size = 2u << 20;
  /// Bytes an active operation keeps requested but not yet done, per operation.
  std::size_t window = 16u << 20;
  /// Largest request the listener serves: a larger read is refused (AccessDenied); a larger
  /// write ends the connection (ProtocolError), since its payload cannot be skipped safely.
  std::size_t max_request = 16u << 20;
};

/// A Connector's settings.
struct ConnectorOptions {
  /// Shown in peers' errors and in metadata; empty: "ferry-<pid>".
  std::string name;
  /// Embedded mode: run on this caller-owned libuv loop instead of a thread of its own.
  /// Construct and destroy the connector on the thread that runs this loop (or while it is
  /// not running), and keep running the loop while operations are under way.
  uv_loop_s* loop = nullptr;
  /// Deadline for operations that set none; zero: no deadline.
  std::chrono::milliseconds default_timeout{0};
  /// How long a silent peer connection may stay unanswered before its operations are errored
  /// with PeerLost; a peer whose process dies is noticed at once by its closed socket.
  std::chrono::milliseconds peer_timeout{2000};
  TcpOptions tcp;
};

/// One per worker: owns the event loop (or joins the caller's), the transports and the pool
/// of peer connections, and creates every operation.
///
/// Every method is safe from any thread; from a foreign thread the work is posted to the loop
/// and the call waits for it.
///
/// Destructor: cancels every operation that has not ended (their handles then report
/// `cancelled`), closes all connections and stops the loop thread. Handles may outlive it.
class Connector {
 public:
  /// Starts the loop (or attaches to options.loop) and the TCP listener.
  /// Throws Error(InvalidArgument) for bad options, Error(Internal) when the listener fails.
  explicit Connector(ConnectorOptions options = {});
  ~Connector();
  Connector(const Connector&) = delete;
  Connector& operator=(const Connector&) = delete;

  /// Exposes `local` for one peer to read. Throws InvalidArgument for an empty list,
  /// Unsupported for device memory this build cannot serve.
  ReadableOperation create_readable(std::vector<Descriptor> local, OperationOptions options = {});
  /// Exposes `local` for one peer to write. Throws as create_readable does.
  WritableOperation create_writable(std::vector<Descriptor> local, OperationOptions options = {});

  /// Reads the peer's readable operation described by `remote` into `local`. The two lists
  /// are matched as one byte stream (their lengths may differ, their totals may not).
  /// Throws InvalidMetadata, KindMismatch (remote is not a readable's), SizeMismatch,
  /// InvalidArgument (empty list), NoCommonMethod. Transfer failures come later, as the
  /// operation's error.
  ReadOperation begin_read(const RdmaMetadata& remote, std::vector<Descriptor> local,
                           OperationOptions options = {});
  /// Writes `local` into the peer's writable operation described by `remote`.
  /// Throws as begin_read does (KindMismatch when remote is not a writable's).
  WriteOperation begin_write(std::vector<Descriptor> local, const RdmaMetadata& remote,
                             OperationOptions options = {});

  /// This connector's name, id, host and process, as put into metadata. Any thread.
  const PeerIdentity& identity() const noexcept;
  /// The endpoints put into metadata, one per method served. Any thread.
  std::vector<Endpoint> endpoints() const;

 private:
  std::shared_ptr<detail::Core> core_;
};

}  // namespace ferry
