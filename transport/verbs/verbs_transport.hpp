#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ferry/options.hpp>

#include "loop/uv_handle.hpp"
#include "transport/context.hpp"
#include "transport/kit/admission.hpp"
#include "transport/kit/exposures.hpp"
#include "transport/kit/pending.hpp"
#include "transport/kit/regions.hpp"
#include "transport/kit/registration_cache.hpp"
#include "transport/kit/remote_region.hpp"
#include "transport/kit/transfers.hpp"
#include "transport/transport.hpp"
#include "transport/verbs/verbs_api.hpp"
#include "transport/verbs/verbs_conn.hpp"
#include "transport/verbs/verbs_device.hpp"
#include "transport/wire/socket.hpp"

namespace ferry::transport::cuda {
class Stager;
}

namespace ferry::transport::verbs {

class VerbsTransport;

/// A window onto the owner's memory: `len` bytes at `addr`, reachable with `rkey`.
struct Window {
  std::uint64_t addr = 0;
  std::uint64_t len = 0;
  std::uint32_t rkey = 0;
};

/// A staging unit of an active transfer: `len` bytes of local CUDA memory moved from or to the
/// owner's `remote` through a pinned chunk of the transfer's stager.
struct Chunk {
  std::uint64_t remote = 0;
  std::uint64_t len = 0;
  std::uint64_t posted = 0;  ///< bytes of it posted as work requests
  unsigned wrs = 0;          ///< its work requests not yet complete
};

/// An active transfer by verbs: a claim, then one-sided READs or WRITEs under the keys the
/// owner gave, then DONE on the same queue pair (so that it reaches the owner after the data).
class VerbsTransfer final : public kit::TransferBase<VerbsTransfer> {
 public:
  VerbsTransfer(TransferSpec what, TransferObserver& observer)
      : TransferBase(std::move(what), observer) {}

  std::vector<std::shared_ptr<const Registration>> regs;  ///< one per segment
  std::uint64_t conn = 0;
  std::vector<Window> windows;
  std::size_t seg = 0;  ///< the next byte to post: segment, and offset in it
  std::uint64_t off = 0;
  unsigned outstanding = 0;  ///< data work requests posted, not yet complete
  bool all_posted = false;
  bool done_sent = false;
  std::optional<Error> ended_by_owner;  ///< the owner's notice: it ended the operation
  // Staging (CUDA memory that the NIC cannot reach): units by id, those whose bytes may be
  // posted (a read's at once, a write's once copied from the device), in order.
  std::map<std::uint64_t, Chunk> chunks;
  std::deque<std::uint64_t> postable;
  bool waiting_chunk = false;  ///< stopped posting for want of a free chunk
};

/// The passive side of verbs: rdma_cm's connect requests (under the kit's bounds), and the
/// exposures served: a claim answered with keys valid for that operation alone, bound to the
/// claimant's queue pair; DONE ending it. The owner's CPU never touches the bytes.
class VerbsServer {
 public:
  VerbsServer(VerbsTransport& t, Defer defer);
  /// Accepts a peer's connection, or rejects it and returns the id to destroy once the event
  /// is acknowledged.
  rdma_cm_id* connect_request(rdma_cm_event& event);
  void expose(const Exposure& exposure, ExposureObserver& observer);
  void revoke(std::uint64_t id, const Error& reason);
  void serve_claim(Conn& conn, const wire::FrameHeader& h, const std::string& payload);
  void serve_done(Conn& conn, const wire::FrameHeader& h, const std::string& msg);
  /// Sizes a CLAIM's buffer once its token has been checked.
  wire::Sink receive_claim(Conn& conn, const wire::FrameHeader& h);

  // Regions (docs/regions.md): ATTACH answered as a claim of the whole region is, with keys
  // valid for that attachment alone (windows bound to its queue pair, or registrations of its
  // own), which revocation invalidates; ENDED, a SEND behind the data, tells the owner.
  void serve_region(const RegionExposure& region, RegionObserver& observer);
  void revoke_attachment(std::uint64_t attachment, const Error& reason);
  void end_region(std::uint64_t id, const Error& reason);
  std::vector<std::uint64_t> attachments_of_peer(std::uint64_t id,
                                                 const std::string& peer_id) const {
    return regions_.attachments_of_peer(id, peer_id);
  }
  void serve_attach(Conn& conn, const wire::FrameHeader& h);
  wire::Sink receive_ended(Conn& conn, const wire::FrameHeader& h, std::string tag);
  void serve_ended(Conn& conn, const wire::FrameHeader& h, const std::string& ranges);
  void serve_detach(Conn& conn, const wire::FrameHeader& h);
  /// Connection `conn` is gone: every exposure it claimed ends, their keys die now.
  void lose(Conn& conn, const Error& error);
  void heard(Conn& conn) { admission_.heard(conn.id); }
  bool serving() const;
  void close();

 private:
  /// What serving one exposure holds beyond the exposure table.
  struct Served {
    std::vector<Region> spans;
    std::vector<std::shared_ptr<const Registration>> regs;  ///< cache registrations of the spans
    std::vector<std::shared_ptr<MrSet>> own;  ///< registrations of its own (no windows)
    std::vector<ibv_mw*> mws;                 ///< windows bound for its claimant
    std::uint64_t conn = 0;                   ///< the claimant's connection
    kit::Exposures::Ranges ranges;            ///< claimed
  };
  /// Ends what serving `id` holds: its windows (or registrations) are invalidated now.
  void end_served(std::uint64_t id);
  /// Registers `served.spans`: through the cache (`cached`), and with registrations of its own
  /// for `access` (`own`: where the device has no windows). Throws as expose() does.
  void register_spans(Served& served, Access access, bool cached, bool own);
  /// The owner ends attachment `id`: its keys die, its peer hears `reason`.
  void end_attachment(std::uint64_t id, const Error& reason);
  void finish_exposure(std::uint64_t id, std::optional<Error> peer_error);
  void reply(Conn& conn, std::uint64_t req, const Error* error);
  /// The claimant's keys for `served`, bound to `conn`, into `out` (and the window binds to
  /// send first into `binds`). Throws Error(Internal) when they cannot be had.
  void windows_for(Conn& conn, Served& served, Access access, std::vector<Window>& out,
                   std::vector<CtlItem>& binds);

  VerbsTransport& t_;
  kit::Exposures exposures_;
  std::unordered_map<std::uint64_t, std::unique_ptr<Served>> served_;  ///< by exposure id
  kit::Regions regions_;
  /// By region id: its spans and their cache registrations, copied into each attachment.
  std::unordered_map<std::uint64_t, std::unique_ptr<Served>> region_served_;
  std::unordered_map<std::uint64_t, std::optional<Error>> refused_;  ///< conn -> CLAIM refused
  kit::Admission admission_;
};

class VerbsClient;

/// The windows of a CLAIMED's or ATTACHED's payload (24 bytes each: addr, len, rkey), sorted
/// by address.
std::vector<Window> windows_of(const std::string& payload);

/// An attachment to a peer's region by verbs, the active side: ATTACH on the connection to the
/// owner, answered with keys of its own; then every transfer posts its work requests under
/// them at once and ends with a one-way ENDED, a SEND behind its data (docs/regions.md).
/// Destroying it sends DETACH.
class VerbsRemoteRegion final : public kit::RemoteRegionBase {
 public:
  VerbsRemoteRegion(VerbsClient& client, Defer defer, std::uint64_t region_key, AttachSpec spec,
                    AttachObserver& observer)
      : RemoteRegionBase(std::move(defer), std::move(spec), observer),
        key(region_key),
        client_(&client) {}
  ~VerbsRemoteRegion() override;
  std::unique_ptr<Transfer> start(TransferSpec spec, TransferObserver& observer) override;
  /// The transport closed (its client goes before this object may): nothing more is sent, and
  /// start() refuses.
  void orphan() noexcept {
    client_ = nullptr;
    conn = 0;
  }

  const std::uint64_t key;
  std::uint64_t conn = 0;  ///< 0 once its connection is gone
  bool sent = false;       ///< its ATTACH went out
  std::uint64_t attachment = 0;
  Token secret{};
  std::vector<Window> windows;  ///< sorted by address

 private:
  VerbsClient* client_;  ///< null once the transport closed
};

/// The active side of verbs: transfers on connections, their requests, work requests and
/// staging chunks.
class VerbsClient final : private kit::TransferHooks<VerbsTransfer> {
 public:
  VerbsClient(VerbsTransport& t, Defer defer);
  ~VerbsClient();
  std::unique_ptr<Transfer> start(TransferSpec spec, TransferObserver& observer);
  /// The connection of `t` is up: claim.
  void begin(VerbsTransfer& t);
  /// `conn` is up: the transfers that waited for it claim.
  void connected(Conn& conn, const std::vector<std::uint64_t>& waiting);
  void on_reply(Conn& conn, const wire::FrameHeader& h, std::string msg, std::string payload);
  /// Sizes a CLAIMED's (or ATTACHED's) payload, if it answers a claim (attach) of ours on
  /// `conn`; else drops it.
  wire::Sink receive_claimed(Conn& conn, const wire::FrameHeader& h);

  // Regions.
  std::unique_ptr<RemoteRegion> attach(AttachSpec spec, AttachObserver& observer);
  std::unique_ptr<Transfer> start_attached(VerbsRemoteRegion& region, TransferSpec spec,
                                           TransferObserver& observer);
  void forget_region(VerbsRemoteRegion& region);
  void on_notice(Conn& conn, const wire::FrameHeader& h, const std::string& msg);
  /// Posts data work requests of transfers waiting on `conn`, within its queue depth.
  void pump(Conn& conn);
  /// A work request of transfer `tid` completed (`error`: failed).
  void wr_done(Conn& conn, std::uint64_t tid, const ibv_wc* error);
  /// Every work request of staging unit `chunk` of `tid` completed.
  void chunk_moved(std::uint64_t tid, std::uint64_t chunk);
  void wr_retired(std::uint64_t tid, const Posted& p, bool failed);
  /// Connection `conn` failed: every transfer on it fails with `why` (setup: before anything).
  void conn_lost(Conn& conn, ErrorCode code, const std::string& why, bool was_up, bool setup);
  /// Answers awaited, or a transfer not yet ended.
  bool busy() const;
  void close();

 private:
  struct Pending {
    std::uint64_t transfer = 0;
    bool done = false;  ///< the answer to DONE (else to CLAIM)
    std::uint64_t op = 0;
    Token token{};
    Access access = Access::read;
    std::uint64_t region = 0;  ///< the answer to this attachment's ATTACH (key)
  };
  void send_attach(Conn& conn, VerbsRemoteRegion& region);
  void attach_answered(Conn& conn, VerbsRemoteRegion& region, const wire::FrameHeader& h,
                       const std::string& msg, const std::string& payload);
  /// Tells the owner that transfer `t` on an attachment ended (ENDED; `error`: why it failed).
  void send_ended(Conn& conn, const VerbsTransfer& t, const std::optional<Error>& error);

  // kit::TransferHooks
  void stop(VerbsTransfer& t) override;
  void tell_peer(VerbsTransfer& t, const Error& reason) override;
  void settle(VerbsTransfer& t) override;

  bool post_some(Conn& conn, VerbsTransfer& t);
  /// Posts the next work request of `t`'s first unit ready to be posted; false when it must
  /// stop (failed, or the queue is full).
  bool post_chunk_wr(Conn& conn, VerbsTransfer& t);
  void maybe_done(Conn& conn, VerbsTransfer& t);
  void send_done(Conn& conn, const Pending& what, const std::optional<Error>& error,
                 std::uint64_t req = 0);
  /// Polls the completion queues until `t` has no work request outstanding, at most until
  /// `deadline`; false if some remain.
  bool wait_quiet(VerbsTransfer& t, std::chrono::steady_clock::time_point deadline);
  void make_ready(VerbsTransfer& t);
  void failed(VerbsTransfer& t, const Error& error);

  // Staging (verbs_staging.cpp).
  cuda::Stager& stager(int ordinal);
  /// Whether segment `i` of `t` is CUDA memory moved through staging chunks.
  static bool staged_segment(const VerbsTransfer& t, std::size_t i);
  /// Opens a unit for the next piece of `t`'s current (staged) segment: a write copies the
  /// device's bytes into it first. False when no chunk is free (the transfer waits).
  bool start_chunk(VerbsTransfer& t);
  void chunk_copied(std::uint64_t tid, std::uint64_t chunk, const std::optional<Error>& error);
  /// The registration of staging unit `chunk`'s chunk, registered on first use.
  const MrSet* chunk_set(std::uint64_t chunk);

  /// Staging: chunks of this many bytes, this many of them, shared by every transfer.
  static constexpr std::size_t kStagingChunk = 2u << 20;
  static constexpr std::size_t kStagingChunks = 8;

  VerbsTransport& t_;
  kit::PendingRequests<Pending> pending_;
  std::unique_ptr<cuda::Stager> stager_;
  /// The registration of each staging chunk, held as long as the stager.
  std::map<const std::byte*, std::shared_ptr<const Registration>> chunk_regs_;
  kit::TransferTable<VerbsTransfer> transfers_;
  std::unordered_map<std::uint64_t, VerbsRemoteRegion*> regions_;  ///< by key
  std::uint64_t next_region_ = 1;
};

/// The RDMA method: one-sided READ and WRITE over reliable-connected queue pairs that rdma_cm
/// sets up, one connection per peer pair shared by every operation between them. The owner
/// (VerbsServer) answers a claim with memory keys valid for that operation alone (type-2
/// memory windows bound to the claimant's queue pair, or registrations of the operation's own
/// where the device has no windows), and hears DONE, a SEND ordered after the data, on the same
/// connection (docs/protocol.md). The active side (VerbsClient) posts the data. CUDA memory
/// is registered with the NIC where it can be (GpuDirect), else staged by the active side.
///
/// Every fd (rdma_cm's event channel, each device's completion channel and async events) is
/// non-blocking under uv_poll on the loop; every call runs on the loop thread.
class VerbsTransport final : public Transport, private Devices::Handler, private Conn::Owner {
 public:
  /// Why `api` (null: the system's) cannot offer verbs here, without keeping anything open:
  /// the libraries are missing, or no RDMA device is found. None: it can.
  static std::optional<Error> unavailable(const VerbsApi* api);

  /// Opens every device rdma_cm sees and listens on ctx.bind_address, calling `api` (null: the
  /// system's). Throws Error(Unsupported) when there is no device or rdma_cm cannot listen
  /// there, Error(InvalidArgument) for bad options.
  VerbsTransport(const Context& ctx, const VerbsOptions& options, const VerbsApi* api = nullptr);
  ~VerbsTransport() override;

  const Capabilities& capabilities() const override { return caps_; }
  std::vector<Endpoint> endpoints() const override;
  std::shared_ptr<const Registration> register_memory(const Region& region) override;
  std::string expose(const Exposure& exposure, ExposureObserver& observer) override;
  void revoke(std::uint64_t id, const Error& reason) override;
  std::optional<Error> endpoint_error(const Endpoint& endpoint) const override;
  std::unique_ptr<Transfer> start(TransferSpec spec, TransferObserver& observer) override;
  std::optional<Error> unreachable(const Endpoint& endpoint) const override;
  void close() override;

  bool serves_regions() const override { return true; }
  std::string serve_region(const RegionExposure& region, RegionObserver& observer) override;
  void revoke_attachment(std::uint64_t attachment, const Error& reason) override;
  void end_region(std::uint64_t id, const Error& reason) override;
  std::unique_ptr<RemoteRegion> attach(AttachSpec spec, AttachObserver& observer) override;
  std::vector<std::uint64_t> attachments_of_peer(std::uint64_t id,
                                                 const std::string& peer_id) const override {
    return server_->attachments_of_peer(id, peer_id);
  }
  std::size_t connections() const override { return conns_.size(); }

  const Counters& counters() const noexcept { return counters_; }
  /// Whether the devices have type-2 memory windows and they are in use.
  bool uses_memory_windows() const noexcept { return devices_->uses_memory_windows(); }

 private:
  friend class VerbsServer;
  friend class VerbsClient;

  /// The most close() waits for the control messages already sent to leave (linger()).
  static constexpr std::chrono::milliseconds kLinger{200};
  /// Waits, kLinger at most, until no connection that is up has a control message queued or
  /// in flight.
  void linger();

  // Devices::Handler
  void completion(const ibv_wc& wc) override;
  void async_event(Device& dev, const ibv_async_event& event) override;
  bool busy() const override;
  // Conn::Owner
  wire::Sink ctl_frame(Conn& conn, const wire::FrameHeader& h, std::string msg) override;
  void ctl_payload(Conn& conn, const wire::FrameHeader& h, bool intact) override;
  void conn_failed(Conn& conn, ErrorCode code, const std::string& why) override;

  static void on_cm(uv_poll_t* handle, int status, int events);
  void cm_ready();
  void cm_event(rdma_cm_event& event);
  void on_established(Conn& conn, const rdma_cm_event& event);
  Conn* conn_of(std::uint64_t id);
  /// The connection to the listener at `dst`: the live one, or a new one being set up; throws
  /// Error(PeerLost) when rdma_cm refuses at once.
  std::shared_ptr<Conn> link_to(const wire::SocketAddress& dst);
  std::shared_ptr<Conn> new_conn(bool active);
  /// The connection failed (or closed): its QP goes to error, every transfer and claim on it
  /// fails with `why`, and it is destroyed once its work requests are flushed.
  void fail_conn(Conn& conn, ErrorCode code, const std::string& why, bool setup = false);
  void destroy_conn(std::uint64_t id);
  /// A registration covering `region`; for CUDA memory, of its whole allocation.
  std::shared_ptr<const Registration> acquire(const Region& region);

  Context ctx_;
  VerbsOptions options_;
  const VerbsApi& api_;
  Capabilities caps_;
  Counters counters_;
  bool closed_ = false;
  kit::Lifetime life_;
  std::unique_ptr<Devices> devices_;
  kit::RegistrationCache registrations_{nullptr};
  rdma_event_channel* cm_channel_ = nullptr;
  loop::Poll cm_poll_;
  rdma_cm_id* listener_ = nullptr;
  std::string address_;  ///< "ip:port" where rdma_cm listens
  std::uint64_t next_conn_ = 1;
  std::unordered_map<std::uint64_t, std::shared_ptr<Conn>> conns_;
  std::unordered_map<std::uint32_t, std::uint64_t> by_qp_;  ///< qp_num -> conn
  std::unordered_map<std::string, std::uint64_t> links_;    ///< address -> conn
  std::unique_ptr<VerbsServer> server_;
  std::unique_ptr<VerbsClient> client_;
};

}  // namespace ferry::transport::verbs
