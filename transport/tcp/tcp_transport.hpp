#pragma once

#include <uv.h>

#include <chrono>
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

  /// Deferred notifications hold a weak reference; they do nothing once the transport is gone.
  std::shared_ptr<int> life_ = std::make_shared<int>(0);
};

}  // namespace ferry::transport::tcp
