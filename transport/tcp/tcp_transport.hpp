#pragma once

#include <uv.h>

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "loop/uv_handle.hpp"
#include "transport/exposures.hpp"
#include "transport/registration_cache.hpp"
#include "transport/tcp/connection.hpp"
#include "transport/tcp/socket.hpp"
#include "transport/transport.hpp"

#ifdef FERRY_WITH_CUDA
struct CUctx_st;
namespace ferry::transport::cuda {
struct CudaApi;
class CopyEngine;
class StagingPool;
}  // namespace ferry::transport::cuda
#endif

namespace ferry::transport::tcp {

class TcpTransfer;

/// ferry's own framed protocol over TCP (docs/protocol.md): one listener; client connections
/// pooled per peer address and shared by every transfer to that peer; payload bytes read
/// straight into their destination and written straight from their source.
class TcpTransport final : public Transport, private Connection::Handler {
 public:
  struct Options {
    std::string bind_address = "127.0.0.1";
    std::uint16_t port = 0;
    std::string advertise_address;  ///< empty: the bound address
    std::uint64_t chunk_size = 2u << 20;
    std::uint64_t window = 16u << 20;
    std::uint64_t max_request = 16u << 20;
    std::size_t max_connections = 4096;  ///< accepted ones; more are closed at once
    std::size_t max_unclaimed = 256;     ///< accepted ones that claimed no operation yet
    std::chrono::milliseconds unclaimed_timeout{10000};
    std::chrono::milliseconds peer_timeout{2000};
    std::string local_name;      ///< sent in HELLO, shown in peers' errors
    std::uint64_t local_id = 0;  ///< the connector's id, sent in HELLO
    loop::Log log;               ///< where failures the transport cannot report otherwise go
#ifdef FERRY_WITH_CUDA
    /// The CUDA driver; when set, CUDA memory is moved too, staged through pinned host
    /// chunks of chunk_size bytes (docs/design.md).
    const cuda::CudaApi* cuda = nullptr;
#endif
  };
  /// Runs `task` after the current loop callback (EventLoop::defer).
  using Defer = std::function<void(std::function<void()>)>;

  /// Binds and listens. Throws Error(InvalidArgument) for a bad address, Error(Internal) when
  /// the socket cannot be bound.
  TcpTransport(uv_loop_t* loop, Defer defer, Options options);
  ~TcpTransport() override;

  const Capabilities& capabilities() const override { return caps_; }
  std::vector<Endpoint> endpoints() const override;
  std::shared_ptr<const Registration> register_memory(const Region& region) override;
  std::string expose(const Exposure& exposure, ExposureObserver& observer) override;
  void revoke(std::uint64_t id, const Error& reason) override;
  std::optional<Error> endpoint_error(const Endpoint& endpoint) const override;
  std::unique_ptr<Transfer> start(TransferSpec spec, TransferObserver& observer) override;
  void close() override;

 private:
  friend class TcpTransfer;

  Connection::Handler& handler() noexcept { return *this; }

  enum class PendingKind { read_chunk, write_chunk, done };
  struct Pending {
    std::uint64_t transfer = 0;  ///< 0: nobody waits for the answer
    PendingKind kind = PendingKind::done;
    std::byte* local = nullptr;
    std::uint64_t len = 0;
    std::uint64_t conn = 0;
    /// A staging chunk the request's DATA lands in (CUDA memory at `local`), else null.
    std::byte* staging = nullptr;
    int cuda_device = -1;
  };

  // Connection::Handler
  Connection::Sink on_frame(Connection& conn, const FrameHeader& h, std::string message) override;
  void on_payload(Connection& conn, const FrameHeader& h, std::uint64_t tag, bool intact) override;
  void on_sent(Connection& conn, std::uint64_t tag) override;
  void on_closed(Connection& conn, const std::string& reason) override;

  // Server side.
  Connection::Sink serve_frame(Connection& conn, const FrameHeader& h, std::string message);
  void serve_read(Connection& conn, const FrameHeader& h);
  Connection::Sink serve_write(Connection& conn, const FrameHeader& h);
  void serve_done(Connection& conn, const FrameHeader& h, const std::string& message);
  void claim(Exposures::Entry& entry, Connection& conn);
  /// The claim of exposure `id` by connection `conn_id` (0: none) ended: queued answers become
  /// `reason`, a payload being received is drained, the connection stops waiting for the peer
  /// on its account. Returns the connection, if it is still there.
  Connection* end_claim(std::uint64_t conn_id, std::uint64_t id, const Error& reason);
  void finish_exposure(std::uint64_t id, std::optional<Error> peer_error);
  void reply_status(Connection& conn, std::uint64_t req, ErrorCode code, const std::string& msg);
  void reply_ok(Connection& conn, std::uint64_t req);

  // Client side.
  Connection::Sink client_frame(Connection& conn, const FrameHeader& h, std::string message);
  Connection* connect_to(const SocketAddress& address, const std::string& peer_name,
                         std::string& error);
  void pump(TcpTransfer& t);
  void chunk_done(TcpTransfer& t, std::uint64_t req, std::uint64_t len);
  /// `setup`: the transfer failed before touching any memory (the observer hears
  /// on_transfer_setup_failed).
  void finish_transfer(TcpTransfer& t, std::optional<Error> error, bool setup = false);
  void cancel_transfer(TcpTransfer& t, const Error& reason);
  void forget_transfer(TcpTransfer& t);
  void send_done(Connection& conn, TcpTransfer& t, const Error* error);

  // Requests awaiting an answer; the connection's watchdog counts them.
  void add_pending(std::uint64_t req, const Pending& p);
  void erase_pending(std::unordered_map<std::uint64_t, Pending>::iterator it);
  void erase_pending(std::uint64_t req);
  Connection* find_conn(std::uint64_t id);

#ifdef FERRY_WITH_CUDA
  // CUDA memory, staged through pinned host chunks (tcp_staging.cpp).
  /// A free staging chunk for a copy with device `ordinal`, or null when all are held (the
  /// pool's release re-pumps waiting transfers and serves waiting reads). Makes the copy
  /// engine and the pool on first use. Throws Error(Internal) when the driver refuses.
  /// Client and server draw from pools of their own: a server waiting for a chunk never
  /// waits for a client of the same transport (which holds its chunks until its peer's
  /// answers come), so a connector may even serve its own transfers.
  std::byte* acquire_chunk(int ordinal, bool server);
  void chunk_freed();
  /// The CUDA device of the exposure's memory at `ptr`; -1 for host memory.
  int region_device(const Exposures::Entry& entry, const std::byte* ptr) const;
  // Client.
  void stage_write(TcpTransfer& t, std::uint64_t req, const FrameHeader& h, const std::byte* src,
                   int ordinal);
  void staged_write_ready(std::uint64_t transfer, std::uint64_t req, const FrameHeader& h,
                          const std::optional<Error>& error);
  void stage_read_landed(TcpTransfer& t, std::uint64_t req, const Pending& p);
  void staged_read_done(std::uint64_t transfer, std::uint64_t req, std::uint64_t len,
                        const std::optional<Error>& error);
  void staging_failed(TcpTransfer& t, const Error& error);
  void release_chunk(TcpTransfer& t, std::uint64_t req);
  // Server.
  void serve_read_staged(Connection& conn, const FrameHeader& h, const std::byte* src, int ordinal);
  void served_read_copied(std::uint64_t tag, const std::optional<Error>& error);
  Connection::Sink serve_write_staged(Connection& conn, const FrameHeader& h, std::byte* dst,
                                      int ordinal);
  bool staged_payload(Connection& conn, const FrameHeader& h, bool intact);
  void served_write_copied(std::uint64_t tag, const std::optional<Error>& error);
  bool writes_copying(std::uint64_t op) const;
  /// Exposure `op` ends: its copies are cancelled (waiting for those in flight), its frames
  /// from staging chunks are dropped from `conn` (rewritten by `replace`), its chunks go back.
  void drop_staged(std::uint64_t op, Connection* conn,
                   const std::function<void(FrameHeader&, std::string&)>& replace);
  /// Connection `conn` is gone: the same for everything it had staged.
  void drop_staged_conn(std::uint64_t conn);
  void serve_waiting_reads();
#endif

  // Listener.
  static void on_listen(uv_poll_t* handle, int status, int events);
  void accept_all();
  void evict(std::uint64_t conn_id, const std::string& why);
  void arm_sweep();
  void sweep();
  void bury(Connection& conn);

  uv_loop_t* loop_;
  Defer defer_;
  Options options_;
  Capabilities caps_;
  std::string advertised_;
  bool closed_ = false;

  int listen_fd_ = -1;
  loop::Poll listen_poll_;
  loop::Timer listen_retry_;      ///< resumes accepting after running out of fds
  std::size_t accepted_ = 0;      ///< server connections open
  std::size_t max_accepted_ = 0;  ///< max_connections, within the descriptor limit
  /// Server connections that have not claimed an operation yet, oldest (smallest id) first.
  std::map<std::uint64_t, std::uint64_t> unclaimed_;
  loop::Timer sweep_;  ///< closes unclaimed connections past their time

  std::uint64_t next_conn_ = 1;
  std::uint64_t next_req_ = 1;
  std::uint64_t next_transfer_ = 1;
  std::unordered_map<std::uint64_t, std::unique_ptr<Connection>> conns_;
  std::unordered_map<std::string, Connection*> pool_;  ///< client connections by address
  std::vector<std::unique_ptr<Connection>> graveyard_;

  Exposures exposures_;
  /// Host memory needs no registration for tcp; the cache still answers for it, so that every
  /// method registers the same way.
  RegistrationCache registrations_{nullptr};

  std::unordered_map<std::uint64_t, TcpTransfer*> transfers_;
  std::unordered_map<std::uint64_t, Pending> pending_;

#ifdef FERRY_WITH_CUDA
  /// Server frames sent from staging chunks are tagged with this bit and a serial number
  /// (operation ids never have it), so on_sent names the chunk.
  static constexpr std::uint64_t kStagedTag = std::uint64_t{1} << 63;
  /// A request the server stages through host memory: a READ being copied out of the
  /// device and sent, or a WRITE being received and copied into it.
  struct ServerStaged {
    std::uint64_t op = 0;
    std::uint64_t conn = 0;
    std::uint64_t req = 0;
    bool write = false;
    std::byte* chunk = nullptr;         ///< from the pool, or heap below
    std::unique_ptr<std::byte[]> heap;  ///< when no chunk was free for a WRITE
    std::byte* device = nullptr;        ///< where a WRITE's bytes go
    std::uint64_t addr = 0;
    std::uint64_t len = 0;
    int ordinal = -1;
    std::uint64_t copy = 0;  ///< the copy in flight; 0: none
  };
  struct WaitingRead {
    std::uint64_t conn = 0;
    FrameHeader h;
  };
  struct ParkedDone {
    std::uint64_t conn = 0;
    FrameHeader h;
    std::string message;
  };
  const cuda::CudaApi* cuda_ = nullptr;
  std::unique_ptr<cuda::CopyEngine> copies_;
  std::unique_ptr<cuda::StagingPool> client_staging_;
  std::unique_ptr<cuda::StagingPool> server_staging_;
  CUctx_st* staging_ctx_ = nullptr;  ///< a primary context retained for pinned allocations
  int staging_device_ = -1;
  bool repump_scheduled_ = false;
  std::uint64_t next_staged_ = 1;
  std::map<std::uint64_t, ServerStaged> server_staged_;         ///< by tag
  std::unordered_map<std::uint64_t, std::uint64_t> receiving_;  ///< conn -> tag of its WRITE
  std::deque<WaitingRead> waiting_reads_;  ///< READs of CUDA memory waiting for a chunk
  std::unordered_map<std::uint64_t, ParkedDone> parked_done_;  ///< by op: DONE after copies
#endif

  /// Deferred notifications hold a weak reference; they do nothing once the transport is gone.
  std::shared_ptr<int> life_ = std::make_shared<int>(0);
};

}  // namespace ferry::transport::tcp
