#pragma once

#include <uv.h>

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "loop/uv_handle.hpp"
#include "transport/exposures.hpp"
#include "transport/registration_cache.hpp"
#include "transport/tcp/frame.hpp"
#include "transport/tcp/socket.hpp"
#include "transport/transport.hpp"
#include "transport/verbs/verbs_api.hpp"

#ifdef FERRY_WITH_CUDA
struct CUctx_st;
namespace ferry::transport::cuda {
struct CudaApi;
class CopyEngine;
class StagingPool;
}  // namespace ferry::transport::cuda
#endif

namespace ferry::transport::verbs {

class VerbsTransfer;
struct Device;
struct Conn;
struct Served;
struct MrSet;

/// The RDMA method: one-sided READ and WRITE over reliable-connected queue pairs that rdma_cm
/// sets up, one connection per peer pair shared by every operation between them. The passive
/// side's CPU never touches the bytes: it answers a claim with memory keys valid for that
/// operation alone (type-2 memory windows bound to the claimant's queue pair, or registrations
/// of the operation's own where the device has no windows), and hears DONE, a SEND ordered
/// after the data, on the same connection (docs/protocol.md).
///
/// Every fd (rdma_cm's event channel, each device's completion channel and async events) is
/// non-blocking under uv_poll on the loop; every call runs on the loop thread.
class VerbsTransport final : public Transport {
 public:
  struct Options {
    /// The functions to call (system_verbs(), or a simulated fabric in tests); not null.
    const VerbsApi* api = nullptr;
    std::string bind_address = "127.0.0.1";  ///< the address rdma_cm listens on
    std::uint16_t port = 0;                  ///< 0: any free port
    /// Work requests one connection keeps in its send queue at once (data and control).
    unsigned queue_depth = 128;
    /// Signal one data work request in this many (and the last one posted in a turn).
    unsigned signal_every = 16;
    /// Bytes one RDMA READ or WRITE moves at most (also capped by the port's max_msg_sz).
    std::uint64_t max_wr_bytes = 1u << 20;
    /// After draining the completion queue, poll it this long before sleeping on the
    /// completion channel again (0: sleep at once; lower latency costs CPU).
    std::chrono::microseconds spin{0};
    /// While work requests are outstanding, poll the completion queue this often even without
    /// an event (a missed wakeup costs at most this much).
    std::chrono::milliseconds watchdog{20};
    /// Use memory windows where the device has type-2 windows; false: always per-operation
    /// registrations.
    bool memory_windows = true;
    std::chrono::milliseconds peer_timeout{2000};
    std::string local_name;
    std::uint64_t local_id = 0;
    loop::Log log;
#ifdef FERRY_WITH_CUDA
    /// The CUDA driver; when set, CUDA memory is moved too: registered with the NIC by dmabuf
    /// or nvidia-peermem (GPUDirect RDMA), else staged by the active side through pinned host
    /// chunks (docs/cuda.md).
    const cuda::CudaApi* cuda = nullptr;
    std::uint64_t staging_chunk = 2u << 20;  ///< bytes of one staging chunk
    std::size_t staging_chunks = 8;          ///< chunks of the pool, shared by every transfer
#endif
  };
  using Defer = std::function<void(std::function<void()>)>;

  /// Why `api` (null: the system's) cannot offer verbs here, without keeping anything open:
  /// the libraries are missing, or no RDMA device is found. Empty: it can.
  static std::string unavailable(const VerbsApi* api);

  /// Opens every device rdma_cm sees (a protection domain, a completion channel and queue,
  /// async events each) and listens on `bind_address`. Throws Error(Unsupported) when there is
  /// no device or rdma_cm cannot listen there, Error(InvalidArgument) for bad options.
  VerbsTransport(uv_loop_t* loop, Defer defer, Options options);
  ~VerbsTransport() override;

  const Capabilities& capabilities() const override { return caps_; }
  std::vector<Endpoint> endpoints() const override;
  std::shared_ptr<const Registration> register_memory(const Region& region) override;
  std::string expose(const Exposure& exposure, ExposureObserver& observer) override;
  void revoke(std::uint64_t id, const Error& reason) override;
  std::optional<Error> endpoint_error(const Endpoint& endpoint) const override;
  std::unique_ptr<Transfer> start(TransferSpec spec, TransferObserver& observer) override;
  std::string unreachable(const Endpoint& endpoint) const override;
  void close() override;

  /// For tests and statistics.
  struct Counters {
    std::uint64_t registrations = 0;   ///< memory regions registered
    std::uint64_t windows_bound = 0;   ///< memory windows bound
    std::uint64_t comp_events = 0;     ///< completion channel events read
    std::uint64_t comp_wakeups = 0;    ///< completion channel fd wakeups
    std::uint64_t empty_wakeups = 0;   ///< wakeups that found no completion
    std::uint64_t watchdog_polls = 0;  ///< completion queue polls by the watchdog timer
    std::uint64_t watchdog_found = 0;  ///< ...that found completions (missed wakeups)
    std::uint64_t completions = 0;
    std::uint64_t connections = 0;  ///< connections established (both directions)
    std::uint64_t data_wrs = 0;     ///< RDMA READ/WRITE work requests posted
    std::uint64_t signaled_wrs = 0;
    std::uint64_t dmabuf_registrations = 0;   ///< CUDA memory regions registered by dmabuf
    std::uint64_t peermem_registrations = 0;  ///< ...by ibv_reg_mr of the device pointer
    std::uint64_t staged_chunks = 0;          ///< staging chunks moved for active transfers
  };
  const Counters& counters() const noexcept { return counters_; }
  /// Whether the devices have type-2 memory windows and they are in use.
  bool uses_memory_windows() const noexcept;

 private:
  friend class VerbsTransfer;
  friend struct Conn;

  // Devices and the poller (verbs_device.cpp).
  void open_devices();
  Device* device_of(ibv_context* ctx);
  static void on_comp(uv_poll_t* handle, int status, int events);
  static void on_async(uv_poll_t* handle, int status, int events);
  static void on_watchdog(uv_timer_t* timer);
  void comp_ready(Device& dev);
  /// Polls `dev`'s CQ until it is empty; returns how many completions it handled.
  std::size_t drain(Device& dev);
  void async_ready(Device& dev);
  /// Starts the watchdog timer if anything is under way and it is not running.
  void arm_watchdog();
  bool busy() const;
  std::shared_ptr<void> register_region(const Region& region);
  /// Registers `region` on every device, in pieces of at most its max_mr_size, with `access`;
  /// throws Error naming the device's refusal. CUDA memory that no device can reach gives a
  /// set marked `staged`, with no region.
  std::shared_ptr<MrSet> register_everywhere(const Region& region, int access);
  /// Registers [addr, addr + len) of host memory (or, with `cuda`, device memory the NIC reaches
  /// by peermem) on device `d` of `set`, in pieces; false (errno set) when a piece is refused.
  bool register_pieces(MrSet& set, std::size_t d, std::uint64_t addr, std::uint64_t len,
                       int access);

  // CUDA memory (verbs_cuda.cpp).
  /// Registers the CUDA memory `set` spans (base, size), each allocation by dmabuf, else by
  /// peermem, else marks the set staged. Throws Error for memory the driver does not know or
  /// a way that worked before and fails now.
  void register_cuda(MrSet& set, int access);
  /// Registers [addr, addr + len) of the allocation [base, base + size) of CUDA device
  /// `ordinal` by the first way that works for it (dmabuf, peermem); false when none does.
  bool register_gpudirect(MrSet& set, int ordinal, std::uint64_t base, std::uint64_t size,
                          std::uint64_t addr, std::uint64_t len, int access);
  /// Registers [addr, addr + len) of the allocation at `base` on every device by dmabuf; false
  /// with why when the driver or a device refuses (nothing of the attempt stays registered).
  bool register_dmabuf(MrSet& set, std::uint64_t base, std::uint64_t addr, std::uint64_t len,
                       int access, std::string& why);
  /// Why the CUDA memory of a staged registration cannot be served to a peer.
  std::string cuda_unreachable(const MrSet& set) const;
  /// Whether segment `i` of `t` is CUDA memory moved through staging chunks.
  static bool staged_segment(const VerbsTransfer& t, std::size_t i);
  /// Takes a staging chunk for the next piece of `t`'s current (staged) segment: a write copies
  /// the device's bytes into it first. False when no chunk is free (the transfer waits).
  bool start_chunk(VerbsTransfer& t);
  /// Posts the next work request of `t`'s first chunk ready to be posted; false when it must
  /// stop (failed, or the queue is full).
  bool post_chunk_wr(Conn& conn, VerbsTransfer& t);
  /// Every work request of chunk `id` of `t` completed: a read copies it to the device, a write
  /// gives it back.
  void chunk_moved(VerbsTransfer& t, std::uint64_t id);
  void chunk_copied(std::uint64_t transfer, std::uint64_t id, const std::optional<Error>& error);
  /// Cancels the copies of `t`'s chunks (waiting for one under way) and gives the chunks back;
  /// only once no work request of `t` is outstanding.
  void drop_chunks(VerbsTransfer& t);
  /// Puts `t` back on its connection's ready list and posts.
  void make_ready(VerbsTransfer& t);
  /// A staging copy of `t` failed: it ends, and the owner hears why.
  void staging_failed(VerbsTransfer& t, const Error& error);
  /// Sends DONE once every work request and chunk of `t` is through.
  void maybe_done(Conn& conn, VerbsTransfer& t);
  /// A staging chunk came back: transfers waiting for one go on.
  void chunk_freed();
  void close_cuda();
  /// A registration covering `region`: from the cache; for CUDA memory, of its whole
  /// allocation, after dropping cached ones of memory freed since.
  std::shared_ptr<const Registration> acquire(const Region& region);
  std::shared_ptr<const Registration> acquire_cuda(const Region& region);

  /// The address of a verbs endpoint in `out`, or why start() refuses it.
  static std::optional<Error> parse_endpoint(const Endpoint& endpoint, tcp::SocketAddress& out);

  // Connections (verbs_transport.cpp).
  static void on_cm(uv_poll_t* handle, int status, int events);
  void cm_ready();
  void cm_event(rdma_cm_event& event);
  /// Accepts a peer's connection, or rejects it and returns the id to destroy once the event
  /// is acknowledged.
  rdma_cm_id* on_connect_request(rdma_cm_event& event);
  void on_established(Conn& conn, const rdma_cm_event& event);
  /// Makes the QP of `conn` on its device and posts its receive buffers; false (with why).
  bool make_qp(Conn& conn, std::string& why);
  Conn* conn_of(std::uint64_t id);
  Conn* conn_by_qp(std::uint32_t qp_num);
  /// The connection to the listener at `dst`: the live one, or a new one being set up (null,
  /// with why, when rdma_cm refuses at once).
  std::shared_ptr<Conn> link_to(const tcp::SocketAddress& dst, std::string& why);
  /// The connection failed (or closed): its QP goes to error, every transfer and claim on it
  /// fails with `why`, and it is destroyed once its work requests are flushed.
  void fail_conn(Conn& conn, ErrorCode code, const std::string& why, bool setup = false);
  void destroy_conn(std::uint64_t id);
  void completion(const ibv_wc& wc);
  /// What an error completion on `conn` means, with the state of its port when that explains
  /// it ("transport retry counter exceeded (sim0 port 1 is down)").
  std::string why_failed(const Conn& conn, ibv_wc_status status);
  /// " (<device> port N is down)" when the port under `conn` is not active, else empty.
  std::string port_down(const Conn& conn);
  void send_completion(Conn& conn, const ibv_wc& wc);
  void recv_completion(Conn& conn, const ibv_wc& wc);
  void post_recv(Conn& conn, std::uint32_t slot);
  /// Queues a control message (FrameHeader, message text, payload) on `conn`.
  void send_ctl(Conn& conn, const tcp::FrameHeader& h, std::string_view msg = {},
                std::string_view payload = {});
  void pump_ctl(Conn& conn);
  void on_message(Conn& conn, const tcp::FrameHeader& h, std::string msg, std::string payload);

  // The passive side (verbs_server.cpp).
  void serve_claim(Conn& conn, const tcp::FrameHeader& h, const std::string& payload);
  void serve_done(Conn& conn, const tcp::FrameHeader& h, const std::string& msg);
  void reply_status(Conn& conn, std::uint64_t req, ErrorCode code, const std::string& msg);
  /// Ends what serving `id` holds: its windows (or registrations) are invalidated now.
  void end_served(std::uint64_t id);
  void finish_exposure(std::uint64_t id, std::optional<Error> peer_error);

  // The active side (verbs_client.cpp).
  void begin(VerbsTransfer& t);
  void on_reply(Conn& conn, const tcp::FrameHeader& h, std::string msg, std::string payload);
  void on_notice(Conn& conn, const tcp::FrameHeader& h, const std::string& msg);
  /// Posts data work requests of transfers waiting on `conn`, within its queue depth.
  void pump(Conn& conn);
  bool post_some(Conn& conn, VerbsTransfer& t);
  /// Posts one RDMA READ or WRITE of `t` (of staging chunk `chunk`, if not 0); false when the
  /// queue pair refused it (the connection then failed).
  bool post_data(Conn& conn, VerbsTransfer& t, std::uint64_t remote, std::uint32_t rkey,
                 ibv_sge* sges, std::size_t n, bool last, std::uint64_t chunk);
  /// The registration of staging chunk `buf`, or null.
  const MrSet* chunk_set(const std::byte* buf) const;
  void wr_done(Conn& conn, std::uint64_t transfer, const ibv_wc* error);
  struct Pending;
  /// Sends DONE for the operation `what` names: success, or `error` (then a notice).
  void send_done(Conn& conn, const Pending& what, const std::optional<Error>& error,
                 std::uint64_t req = 0);
  void finish_transfer(VerbsTransfer& t, std::optional<Error> error, bool setup = false);
  void cancel_transfer(VerbsTransfer& t, const Error& reason);
  void forget_transfer(VerbsTransfer& t);
  /// Polls the completion queues until transfer `t` has no work request outstanding, at most
  /// until `deadline`; false if some remain.
  bool wait_quiet(VerbsTransfer& t, std::chrono::steady_clock::time_point deadline);

  uv_loop_t* loop_;
  Defer defer_;
  Options options_;
  const VerbsApi& api_;
  Capabilities caps_;
  Counters counters_;
  bool closed_ = false;

  std::vector<std::unique_ptr<Device>> devices_;
  rdma_event_channel* cm_channel_ = nullptr;
  loop::Poll cm_poll_;
  rdma_cm_id* listener_ = nullptr;
  std::string address_;  ///< "ip:port" where rdma_cm listens
  loop::Timer watchdog_;

  std::uint64_t next_conn_ = 1;
  std::uint64_t next_req_ = 1;
  std::uint64_t next_transfer_ = 1;
  std::unordered_map<std::uint64_t, std::shared_ptr<Conn>> conns_;
  std::unordered_map<std::uint32_t, std::uint64_t> by_qp_;  // qp_num -> conn
  std::unordered_map<std::string, std::uint64_t> links_;    // address -> conn
  /// Requests awaiting an answer, by request id.
  struct Pending {
    std::uint64_t transfer = 0;
    bool done = false;  ///< the answer to DONE (else to CLAIM)
    std::uint64_t op = 0;
    Token token{};
    Access access = Access::read;
  };
  std::unordered_map<std::uint64_t, Pending> pending_;

  Exposures exposures_;
  std::unordered_map<std::uint64_t, std::unique_ptr<Served>> served_;  // by exposure id
  RegistrationCache registrations_{nullptr};

  std::unordered_map<std::uint64_t, VerbsTransfer*> transfers_;

#ifdef FERRY_WITH_CUDA
  /// Whether a way for the NIC to reach a CUDA device's memory works, learned at the first
  /// registration that tells and kept, so that a failing way is not tried at every one.
  enum class Way : std::uint8_t { untried, works, fails };
  struct CudaDevice {
    int device = 0;
    CUctx_st* context = nullptr;  ///< its primary context, retained
    Way dmabuf = Way::untried;
    Way peermem = Way::untried;
    std::string no_dmabuf;   ///< why dmabuf did not work (last refusal)
    std::string no_peermem;  ///< why peermem did not
  };
  CudaDevice& cuda_device(int ordinal);
  const cuda::CudaApi* cuda_ = nullptr;
  std::map<int, CudaDevice> cuda_devices_;
  std::unique_ptr<cuda::CopyEngine> copies_;
  std::unique_ptr<cuda::StagingPool> staging_;
  /// The registration of each staging chunk, held as long as the pool.
  std::map<std::byte*, std::shared_ptr<const Registration>> chunk_regs_;
  bool chunk_wakeup_ = false;
  std::uint64_t next_chunk_ = 1;
#endif
  std::shared_ptr<int> life_ = std::make_shared<int>(0);
};

}  // namespace ferry::transport::verbs
