#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
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
  /// Address the listener binds to. Empty: the local address of the NATS connection's socket
  /// (the interface that faces the cluster), or 127.0.0.1 without a side channel.
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

/// What happened to the NATS side channel's connection.
enum class SideChannelEvent { disconnected, reconnected, closed, error };

/// The NATS side channel's settings. Every string left empty is read from the environment
/// variable named beside it (unless use_environment is false). With no server at all, the
/// connector has no side channel: explicit metadata still works, subjects do not.
struct NatsOptions {
  /// Server URLs, e.g. "nats://10.0.0.5:4222"; several for a cluster. FERRY_NATS_URL
  /// (comma-separated).
  std::vector<std::string> servers;
  std::string user;             ///< FERRY_NATS_USER
  std::string password;         ///< FERRY_NATS_PASSWORD
  std::string token;            ///< FERRY_NATS_TOKEN
  std::string nkey_public;      ///< FERRY_NATS_NKEY: the public NKey ("U...")
  std::string nkey_seed_file;   ///< FERRY_NATS_NKEY_SEED_FILE: the file holding its seed
  std::string creds_file;       ///< FERRY_NATS_CREDS: a JWT + NKey credentials file
  std::string tls_ca_file;      ///< FERRY_NATS_TLS_CA; any TLS file set turns TLS on
  std::string tls_cert_file;    ///< FERRY_NATS_TLS_CERT
  std::string tls_key_file;     ///< FERRY_NATS_TLS_KEY
  std::string connection_name;  ///< FERRY_NATS_NAME; empty: the connector's name
  /// Namespace of ferry's own subjects (reply inboxes, completion notices). FERRY_NATS_PREFIX.
  std::string prefix;
  std::chrono::milliseconds connect_timeout{2000};
  /// Reconnect policy: wait between rounds over the server list, and how many rounds
  /// (-1: forever).
  std::chrono::milliseconds reconnect_wait{250};
  int max_reconnect = -1;
  /// How long one metadata request waits for an answer before it is sent again (requests
  /// are retried until the operation's deadline).
  std::chrono::milliseconds request_timeout{1000};
  bool use_environment = true;
  /// Called on the loop thread when the connection drops, comes back, closes or errs.
  std::function<void(SideChannelEvent event, const std::string& detail)> on_event;
};

/// A Connector's settings.
struct ConnectorOptions {
  /// Shown in peers' errors and in metadata (at most 256 characters); empty: "ferry-<pid>".
  std::string name;
  /// Embedded mode: run on this caller-owned libuv loop instead of a thread of its own.
  /// Construct and destroy the connector on the thread that runs this loop (ferry takes the
  /// constructing thread to be the loop's), and keep running the loop while operations are
  /// under way.
  uv_loop_s* loop = nullptr;
  /// Deadline for operations that set none; zero: no deadline.
  std::chrono::milliseconds default_timeout{0};
  /// How long a silent peer connection may stay unanswered before its operations are errored
  /// with PeerLost; a peer whose process dies is noticed at once by its closed socket.
  std::chrono::milliseconds peer_timeout{2000};
  TcpOptions tcp;
  NatsOptions nats;
};

/// A NATS subject at which a passive operation serves its metadata; begin_read/begin_write
/// take one in place of metadata. Explicit, so that a subject is never mistaken for JSON.
struct Subject {
  explicit Subject(std::string subject_name) : name(std::move(subject_name)) {}
  std::string name;
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

  /// Reads the readable operation that serves its metadata at `subject`: asks for it there
  /// (retrying while nobody answers, until the deadline), checks it as above, transfers, and
  /// tells the passive side how it ended. Throws InvalidArgument for a bad subject,
  /// InvalidState without a side channel; everything later is the operation's error.
  ReadOperation begin_read(const Subject& subject, std::vector<Descriptor> local,
                           OperationOptions options = {});
  /// Writes into the writable operation that serves its metadata at `subject`.
  WriteOperation begin_write(std::vector<Descriptor> local, const Subject& subject,
                             OperationOptions options = {});

  /// Whether this connector has a NATS side channel (and so can pair by subject). Any thread.
  bool has_side_channel() const noexcept;

  /// This connector's name, id, host and process, as put into metadata. Any thread.
  const PeerIdentity& identity() const noexcept;
  /// The endpoints put into metadata, one per method served. Any thread.
  std::vector<Endpoint> endpoints() const;

 private:
  std::shared_ptr<detail::Core> core_;
};

}  // namespace ferry
