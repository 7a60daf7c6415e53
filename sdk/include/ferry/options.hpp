#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ferry/log.hpp>

// libuv's loop type, declared here so that this header does not pull in uv.h.
struct uv_loop_s;

namespace ferry {

/// The Prometheus endpoint (docs/operations.md). Off unless an address is given.
struct MetricsOptions {
  /// "host:port" (or "[v6]:port") to serve GET /metrics on in the Prometheus text format,
  /// e.g. "127.0.0.1:9464"; every connector of the process that names the same address is
  /// served there, told apart by the labels connector and connector_id. Empty:
  /// FERRY_METRICS_LISTEN (under ConnectorOptions::use_environment), else off. The server is
  /// a thread of its own (prometheus-cpp's); a scrape reads stats() and asks the loop only to
  /// count its connections. Error(Unsupported) at construction in a build without
  /// prometheus-cpp, InvalidArgument when the address cannot be served.
  std::string listen;
};

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

/// Bounds on the peers every method's listener accepts (tcp's and cma's sockets, cuda_ipc's,
/// verbs' connect requests) before they prove anything: a peer counts as unclaimed until it
/// presents a live operation's token.
struct ListenerOptions {
  /// Most connections a listener keeps open at once; also kept below the process's
  /// descriptor limit (RLIMIT_NOFILE), less a reserve for everything else.
  std::size_t max_connections = 4096;
  /// Most accepted connections that have not yet claimed an operation; past it, one of them
  /// is closed to make room: first the oldest that has sent nothing, then the oldest that only
  /// said HELLO. A connection that claimed an operation is never closed for room.
  std::size_t max_unclaimed = 256;
  /// How long an accepted connection may stay open without claiming an operation before it
  /// is closed.
  std::chrono::milliseconds unclaimed_timeout{10000};
};

/// The same-host transport's settings (cma: process_vm_readv / process_vm_writev).
struct CmaOptions {
  /// Bytes one copy job moves under one grant from the owner; also the most an owner's
  /// cancel() waits for (one job's copy). Jobs run on libuv's thread pool. Also the size of
  /// the pinned host chunks the active side stages its CUDA memory through (2 × parallel of
  /// them, made on first use; docs/cuda.md).
  std::size_t chunk_size = 4u << 20;
  /// Copy jobs an active operation keeps in flight at once (each on a thread-pool thread;
  /// libuv's pool has UV_THREADPOOL_SIZE threads, 4 by default).
  unsigned parallel = 4;
  /// Transfers up to this size are copied on the loop thread at once, without the pool.
  std::size_t inline_max = 64u << 10;
  /// Where Yama's ptrace_scope is 1 (Ubuntu's default), only a process's ancestors may read
  /// it, so peers cannot use cma toward this process and it is not offered. Set this to let
  /// any process of the same user in (prctl PR_SET_PTRACER_ANY, for the whole process), and
  /// offer cma. FERRY_CMA_PTRACER_ANY=1 sets it too (when ConnectorOptions::use_environment
  /// is on).
  bool ptracer_any = false;
};

/// The RDMA transport's settings (verbs: one-sided READ and WRITE over RC queue pairs set up by
/// rdma_cm). It listens on the address TcpOptions::bind_address names (else the NATS socket's
/// local address), which must be one of an RDMA device's.
struct VerbsOptions {
  /// rdma_cm's port; 0: any free port.
  std::uint16_t port = 0;
  /// Work requests one connection keeps in its send queue at once.
  unsigned queue_depth = 128;
  /// Signal one data work request in this many (and always the last one a turn posts).
  unsigned signal_every = 16;
  /// Bytes one RDMA READ or WRITE moves at most (also capped by the port's max_msg_sz).
  std::size_t max_wr_bytes = 1u << 20;
  /// After draining the completion queue, keep polling it this long before sleeping on the
  /// completion channel (0: sleep at once). Lower latency for a core's worth of CPU.
  std::chrono::microseconds spin{0};
  /// Memory keys a peer gets die with the operation: through type-2 memory windows bound to
  /// the claimant's queue pair where every device has them; else (or when false) through
  /// registrations of the operation's own.
  bool memory_windows = true;
};

/// What happened to the NATS side channel's connection. `connected`: the first connection is
/// made (by the Connector's constructor, or later in the background); `closed`: cnats gave up
/// for good (NatsOptions::connect_deadline, max_reconnect), or the connection was closed.
enum class SideChannelEvent { disconnected, reconnected, closed, error, connected };

/// Where a connector's NATS side channel stands (Connector::side_channel_state()).
enum class SideChannelState {
  none,          ///< no server configured: no side channel
  connecting,    ///< never connected yet: connecting in the background, retrying
  connected,     ///< connected (detail: the server's URL)
  reconnecting,  ///< the connection dropped; cnats is reconnecting
  closed,        ///< given up (detail: the servers and the last error), or the connector closed
};
/// "none", "connecting", "connected", "reconnecting", "closed".
const char* to_string(SideChannelState state) noexcept;

/// A SideChannelState and, for people, what it is about: the server connected to, or the
/// servers tried and the last error.
struct SideChannelStatus {
  SideChannelState state = SideChannelState::none;
  std::string detail;
};

/// The NATS side channel's settings. Every string left empty is read from the environment
/// variable named beside it (unless this struct's use_environment is false). With no server at all,
/// the connector has no side channel: explicit metadata still works, subjects do not.
struct NatsOptions {
  /// Server URLs, e.g. "nats://10.0.0.5:4222"; several for a cluster, tried in order. An
  /// entry may itself be a comma-separated list, as FERRY_NATS_URL is.
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
  /// One server's connect and handshake, at most.
  std::chrono::milliseconds connect_timeout{2000};
  /// When no server can be reached at construction, the Connector is made anyway and the side
  /// channel keeps connecting in the background, a round over the servers every
  /// reconnect_wait (docs/sidechannel.md, "Connecting in the background"). This bounds that:
  /// once it has passed without a connection, the side channel gives up and is closed (as it
  /// is after max_reconnect rounds, when that is not -1). Two minutes by default (about what
  /// NATS clients retry a first connection for: 60 rounds of 2 s); zero: keep trying.
  std::chrono::milliseconds connect_deadline{120000};
  /// Reconnect policy: wait between rounds over the server list, and how many rounds
  /// (-1: forever).
  std::chrono::milliseconds reconnect_wait{250};
  int max_reconnect = -1;
  /// How a server that went silent without closing the connection (a partition, a host
  /// powered off) is noticed: a PING every ping_interval, and the connection is taken for
  /// lost (then reconnected, to another server of the list where there is one) once
  /// max_pings_out of them are unanswered: within about ping_interval * (max_pings_out + 1),
  /// 15 s by default. (NATS clients' own default, 2 minutes and 2, left a worker cut off for
  /// 6 minutes.)
  std::chrono::milliseconds ping_interval{5000};
  int max_pings_out = 2;
  /// How long one metadata request waits for an answer before it is sent again (requests
  /// are retried until the operation's deadline).
  std::chrono::milliseconds request_timeout{1000};
  /// How many metadata requests an operation or region served at a subject answers: a token
  /// bucket of its own that holds answer_burst answers and refills answers_per_second.
  /// Requests beyond it are dropped unanswered (the asker asks again after its
  /// request_timeout), so that a flood of requests naming someone else's reply inbox makes
  /// this connector publish a bounded volume there (docs/sidechannel.md, "Who gets the
  /// metadata"). answers_per_second 0: no limit.
  int answer_burst = 32;
  int answers_per_second = 16;
  /// Whether this connector answers requests at the well-known stats subject "<prefix>.stats"
  /// with its name, id, host, methods, side channel state and stats() as JSON, so that
  /// `ferry-top` can see the whole cluster (docs/operations.md). Answered on the NATS
  /// delivery thread, within the answer limit above; the loop only counts its connections
  /// (at most 100 ms waited for it). FERRY_NATS_STATS=0 turns it off as false does.
  bool answer_stats = true;
  /// Whether the FERRY_NATS_* variables fill what is left empty here. The connector's other
  /// variables follow ConnectorOptions::use_environment.
  bool use_environment = true;
  /// Called on the loop thread when the first connection is made (`connected`, detail: the
  /// URL; also when the constructor made it), and when the connection drops, comes back,
  /// closes or errs.
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
  /// How long an operation paired by subject that has no deadline of its own (neither
  /// OperationOptions::timeout nor default_timeout) waits to be paired: the asker until the
  /// metadata arrives ("nobody served it"), the server until a peer claims it ("nobody asked
  /// for it"); then it ends with Timeout naming its subject. The transfer after pairing has
  /// no such limit. Zero: wait forever.
  std::chrono::milliseconds subject_timeout{30000};
  /// How long a silent peer connection may stay unanswered before its operations are errored
  /// with PeerLost; a peer whose process dies is noticed at once by its closed socket.
  std::chrono::milliseconds peer_timeout{2000};
  /// The methods this connector may use, by name ("tcp", "cma"), as offered and as chosen;
  /// empty: every method built and available here. FERRY_TRANSPORTS (comma-separated) when
  /// empty and use_environment is on.
  std::vector<std::string> transports;
  /// Networks a peer's endpoint address must lie in before this connector connects to it, as
  /// CIDRs ("10.0.0.0/8", "::1/128"); empty: any. Metadata names the address to connect to:
  /// without a list, whoever can hand metadata to this connector can make it connect anywhere
  /// (see docs/design.md, "Trust").
  std::vector<std::string> endpoint_allow;
  /// Whether the connector reads FERRY_TRANSPORTS, FERRY_CMA_PTRACER_ANY, FERRY_LOG and
  /// FERRY_METRICS_LISTEN for what is left at its default here. The NATS variables follow
  /// NatsOptions::use_environment.
  bool use_environment = true;
  /// Where diagnostics go: stderr, warnings and errors, by default (see LogOptions).
  LogOptions log;
  ListenerOptions listener;
  TcpOptions tcp;
  CmaOptions cma;
  VerbsOptions verbs;
  NatsOptions nats;
  MetricsOptions metrics;
};

}  // namespace ferry
