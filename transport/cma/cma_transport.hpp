#pragma once

#include <uv.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "loop/uv_handle.hpp"
#include "transport/cma/grant_table.hpp"
#include "transport/exposures.hpp"
#include "transport/registration_cache.hpp"
#include "transport/tcp/connection.hpp"
#include "transport/transport.hpp"

namespace ferry::transport::cuda {
struct CudaApi;
class CopyEngine;
}  // namespace ferry::transport::cuda

namespace ferry::transport::cma {

class CmaTransfer;
class VmmExports;
struct PeerLink;
struct OwnerInfo;

/// The same-host method: the active side copies straight between the two address spaces with
/// process_vm_readv / process_vm_writev, on libuv's thread pool, one copy job per chunk, each
/// under a grant from the owner (grant_table.hpp). A control connection over an abstract Unix
/// socket carries the claim (token and ranges checked by the owner), the grant's slot, the
/// claim secret, and the DONE that tells the owner the bytes are in place (docs/protocol.md).
///
/// With Options::cuda_ipc set, the same machinery is the cuda_ipc method: it moves the owner's
/// CUDA memory to or from the active side's memory (CUDA or host) between two processes of one
/// host. The owner sends how to open the claimed memory's allocations (legacy IPC handles, or
/// its fds of VMM exports) with its grant (HANDLES), and the active side copies with the GPU
/// (cuda/copy_engine.hpp) between its own memory and the owner's, opened once per owner and
/// allocation (cuda_ipc.hpp), each chunk's copy under the grant from its start until the
/// driver reports its end.
class CmaTransport final : public Transport, private tcp::Connection::Handler {
 public:
  struct Options {
    std::uint64_t chunk_size = 4u << 20;   ///< bytes per copy job (and grant)
    unsigned parallel = 4;                 ///< copy jobs in flight per transfer
    std::uint64_t inline_max = 64u << 10;  ///< transfers up to this size copy on the loop
    bool ptracer_any = false;              ///< under Yama scope 1, let same-user peers in
    std::chrono::milliseconds peer_timeout{2000};
    std::string local_name;
    std::uint64_t local_id = 0;
    std::uint32_t grant_slots = 16384;  ///< operations claimed at once, at most
    loop::Log log;
    /// The CUDA driver: this transport is the cuda_ipc method (FERRY_WITH_CUDA builds only).
    const cuda::CudaApi* cuda_ipc = nullptr;
    /// cma: the CUDA driver, to stage CUDA memory of the active side through pinned host
    /// chunks (cma_staging.cpp); null: host memory only (FERRY_WITH_CUDA builds only).
    const cuda::CudaApi* cuda = nullptr;
  };
  using Defer = std::function<void(std::function<void()>)>;

  /// Why this process cannot offer cma (empty: it can); see system.hpp.
  static std::string unavailable(bool ptracer_any);

  /// Listens on a fresh abstract Unix socket. Throws Error(Unsupported) when this process
  /// cannot offer cma, Error(InvalidArgument) for bad options, Error(Internal) when the socket
  /// or the grant table cannot be made.
  CmaTransport(uv_loop_t* loop, Defer defer, Options options);
  ~CmaTransport() override;

  const Capabilities& capabilities() const override { return caps_; }
  std::vector<Endpoint> endpoints() const override;
  std::shared_ptr<const Registration> register_memory(const Region& region) override;
  std::shared_ptr<const Registration> register_exposed(const Region& region) override;
  std::string expose(const Exposure& exposure, ExposureObserver& observer) override;
  void revoke(std::uint64_t id, const Error& reason) override;
  std::optional<Error> endpoint_error(const Endpoint& endpoint) const override;
  std::unique_ptr<Transfer> start(TransferSpec spec, TransferObserver& observer) override;
  std::string unreachable(const Endpoint& endpoint) const override;
  void close() override;

  /// Grants given up because a peer's copy outlived peer_timeout after a revoke (for tests).
  std::uint32_t quarantined_grants() const noexcept { return grants_.quarantined(); }

 private:
  friend class CmaTransfer;
  struct Claimed {
    std::uint64_t conn = 0;
    Grant grant;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;  // (addr, len) granted
    std::vector<std::byte> handles;  // cuda_ipc: the HANDLES payload, while it may be queued
  };
  struct Accepted {
    std::int64_t pid = 0;  // from SO_PEERCRED
    int pidfd = -1;
  };
  struct Pending {
    std::uint64_t transfer = 0;  ///< 0: nobody waits for the answer
    bool done = false;           ///< the answer to DONE (else to CLAIM)
    std::uint64_t conn = 0;
  };
  struct Job;
  struct Staging;

  tcp::Connection::Handler& handler() noexcept { return *this; }

  // Connection::Handler
  tcp::Connection::Sink on_frame(tcp::Connection& conn, const tcp::FrameHeader& h,
                                 std::string message) override;
  void on_payload(tcp::Connection& conn, const tcp::FrameHeader& h, std::uint64_t tag,
                  bool intact) override;
  void on_sent(tcp::Connection&, std::uint64_t) override {}
  void on_closed(tcp::Connection& conn, const std::string& reason) override;

  // Server side (cma_server.cpp).
  tcp::Connection::Sink serve_frame(tcp::Connection& conn, const tcp::FrameHeader& h,
                                    std::string message);
  void serve_claim(tcp::Connection& conn, const tcp::FrameHeader& h);
  void serve_done(tcp::Connection& conn, const tcp::FrameHeader& h, const std::string& message);
  /// Ends the claim of exposure `id` (if any): its grant closes, waiting for copies under way;
  /// the connection stops waiting for the peer on its account. Returns the connection.
  tcp::Connection* end_claim(std::uint64_t conn_id, std::uint64_t id);
  /// Closes `claim`'s grant, waiting at most peer_timeout for its peer's copies; false when
  /// they outlived it.
  bool close_grant(const Claimed& claim);
  void finish_exposure(std::uint64_t id, std::optional<Error> peer_error);
  void reply_status(tcp::Connection& conn, std::uint64_t req, ErrorCode code,
                    const std::string& msg);
  /// Whether the peer of server connection `conn_id` copies nothing: exited, or stopped.
  bool peer_idle(std::uint64_t conn_id) const;

  // Client side (cma_client.cpp).
  tcp::Connection::Sink client_frame(tcp::Connection& conn, const tcp::FrameHeader& h,
                                     std::string message);
  std::shared_ptr<PeerLink> link_to(const TransferSpec& spec, const OwnerInfo& info,
                                    std::string& error, bool& setup);
  void send_claim(CmaTransfer& t);
  void pump(CmaTransfer& t);
  /// A copy job of `t`, under its grant, with nothing to copy yet.
  std::unique_ptr<Job> new_job(CmaTransfer& t);
  /// Queues one copy job of the transfer's next pieces, up to a chunk (`host_only`: up to the
  /// next segment of CUDA memory).
  void queue_job(CmaTransfer& t, bool host_only);
  void copy_inline(CmaTransfer& t);
  static void run_job(uv_work_t* req);
  static void after_job(uv_work_t* req, int status);
  void job_done(Job& job);
  void all_copied(CmaTransfer& t);
  void send_done(CmaTransfer& t, const Error* error);
  /// Stops the transfer's copies (waits for those under way) and tells its observer
  /// (deferred). `setup`: before any memory was touched: on_transfer_setup_failed.
  void finish_transfer(CmaTransfer& t, std::optional<Error> error, bool setup = false);
  void cancel_transfer(CmaTransfer& t, const Error& reason);
  void forget_transfer(CmaTransfer& t);
  void keepalive();

  // cuda_ipc (cuda_ipc.cpp).
  bool ipc() const noexcept { return options_.cuda_ipc != nullptr; }
  /// The HANDLES payload for exposure `entry`'s memory; throws Error(Unsupported).
  std::vector<std::byte> handles_of(const Exposure& exposure) const;
  /// The claim was granted: opens the owner's handles, then copies.
  void ipc_claimed(CmaTransfer& t);
  void pump_ipc(CmaTransfer& t);
  void ipc_copied(std::uint64_t transfer, std::uint64_t copy, const std::optional<Error>& error);
  /// Stops the transfer's GPU copies (waits for those under way) and gives their grants back.
  void cancel_copies(CmaTransfer& t);

  // cma staging of CUDA memory on the active side (cma_staging.cpp).
  void pump_staged(CmaTransfer& t);
  /// A staging chunk for device `ordinal`'s memory, or null when all are held.
  std::byte* acquire_chunk(int ordinal);
  void chunk_freed();
  void queue_staged_job(CmaTransfer& t, std::uint64_t unit);
  /// The process_vm_* job of `unit` ended without error.
  void staged_job_done(CmaTransfer& t, std::uint64_t unit);
  void queue_device_copies(CmaTransfer& t, std::uint64_t unit);
  void staged_copied(std::uint64_t transfer, std::uint64_t unit, std::uint64_t copy,
                     const std::optional<Error>& error);
  /// A unit's bytes are in place: its chunk goes back.
  void unit_done(CmaTransfer& t, std::uint64_t unit);
  void staging_failed(CmaTransfer& t, const Error& error);
  /// Cancels the transfer's device copies (waiting for one under way) and gives its chunks
  /// back; its jobs must have been halted.
  void drop_staged(CmaTransfer& t);

  void add_pending(std::uint64_t req, const Pending& p);
  void erase_pending(std::uint64_t req);
  tcp::Connection* find_conn(std::uint64_t id);

  // Listener.
  static void on_listen(uv_poll_t* handle, int status, int events);
  void accept_all();
  void bury(tcp::Connection& conn);

  uv_loop_t* loop_;
  Defer defer_;
  Options options_;
  Capabilities caps_;
  std::string address_;  ///< "@ferry-cma-<hex>": the abstract socket's name
  std::string info_;     ///< the endpoint's info (JSON): pid, boot id, PID namespace, probe
  bool closed_ = false;

  int listen_fd_ = -1;
  loop::Poll listen_poll_;
  loop::Timer keepalive_;
  GrantTable grants_;
  /// 16 random bytes at a fixed address of this process: a peer reads them with
  /// process_vm_readv to prove the pid it was given is this process, and that it may.
  std::unique_ptr<Token> probe_;

  std::uint64_t next_conn_ = 1;
  std::uint64_t next_req_ = 1;
  std::uint64_t next_transfer_ = 1;
  std::unordered_map<std::uint64_t, std::unique_ptr<tcp::Connection>> conns_;
  std::unordered_map<std::uint64_t, Accepted> accepted_;              // server connections
  std::unordered_map<std::string, std::shared_ptr<PeerLink>> links_;  // by address
  std::vector<std::unique_ptr<tcp::Connection>> graveyard_;

  Exposures exposures_;
  std::unordered_map<std::uint64_t, Claimed> claimed_;  // by exposure id
  /// CLAIM payloads being received, by connection.
  std::unordered_map<std::uint64_t, std::vector<std::byte>> claim_bufs_;
  RegistrationCache registrations_{nullptr};

  std::unordered_map<std::uint64_t, CmaTransfer*> transfers_;
  std::unordered_map<std::uint64_t, Pending> pending_;

  std::unique_ptr<cuda::CopyEngine> engine_;  ///< cuda_ipc, cma staging: made on the first copy
  mutable std::unique_ptr<VmmExports> vmm_;   ///< cuda_ipc: the VMM allocations shared
  std::shared_ptr<Staging> staging_;          ///< cma: pinned chunks, made on the first need

  std::shared_ptr<int> life_ = std::make_shared<int>(0);
};

}  // namespace ferry::transport::cma
