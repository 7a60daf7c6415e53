#pragma once

// Shared by the parts of the verbs transport (verbs_device.cpp: devices, registrations, the
// completion poller; verbs_transport.cpp: rdma_cm and connections; verbs_server.cpp: serving
// exposures; verbs_client.cpp: active transfers). Not an interface.

#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "transport/verbs/verbs_transport.hpp"

namespace ferry::transport::verbs {

/// Bytes of one control buffer: a control message's bytes travel in SENDs of at most this.
inline constexpr std::uint32_t kCtlBytes = 4096;
inline constexpr std::uint32_t kRecvSlots = 32;  ///< receive buffers posted per connection
inline constexpr std::uint32_t kSendSlots = 32;  ///< control SENDs in flight per connection
/// Most bytes of ranges (CLAIM) or windows (CLAIMED) one control message carries.
inline constexpr std::uint64_t kMaxCtlPayload = 8u << 20;
/// wr_id of receive work requests: this bit, then the buffer slot.
inline constexpr std::uint64_t kRecvBit = 1ull << 63;
/// The private data of rdma_cm's connect and accept: magic, version, connector id.
inline constexpr std::uint32_t kCmMagic = 0x56595246;  // "FRYV" on the wire
struct CmPrivate {
  std::uint32_t magic = kCmMagic;
  std::uint32_t version = 1;
  std::uint64_t id = 0;
};

/// A protection domain, kept while anything registered in it lives.
struct DevicePd {
  const VerbsApi* api = nullptr;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  DevicePd() = default;
  DevicePd(const DevicePd&) = delete;
  DevicePd& operator=(const DevicePd&) = delete;
  ~DevicePd() {
    if (pd != nullptr) api->dealloc_pd(pd);
  }
};

/// One address range registered on every device, in pieces of at most the device's
/// max_mr_size (and, for CUDA memory, within one allocation each): the handle of a
/// Registration. Destructor: deregisters (keys die at once).
struct MrSet {
  struct Piece {
    std::uint64_t addr = 0;
    std::uint64_t len = 0;
    ibv_mr* mr = nullptr;
  };
  struct OnDevice {
    std::shared_ptr<DevicePd> pd;
    std::vector<Piece> pieces;  ///< by address
  };
  std::uint64_t base = 0;
  std::uint64_t size = 0;
  std::vector<OnDevice> devices;
  /// CUDA memory that no device reaches (no dmabuf, no peermem): no piece; an active transfer
  /// stages it through pinned host chunks, and it cannot be exposed.
  bool staged = false;
  int cuda_device = -1;  ///< the first CUDA device of its memory; -1: host memory
  /// CUDA memory: the base and buffer id of each allocation it lies in (the driver reuses
  /// addresses, never buffer ids: a registration whose buffers are gone is stale).
  std::vector<std::pair<std::uint64_t, unsigned long long>> buffers;
  MrSet() = default;
  MrSet(const MrSet&) = delete;
  MrSet& operator=(const MrSet&) = delete;
  ~MrSet();
  /// The MR of device `ctx` holding `addr`, and how many bytes of it lie from `addr` on; null
  /// if none.
  ibv_mr* find(const ibv_context* ctx, std::uint64_t addr, std::uint64_t& room) const;
  /// Deregisters every piece.
  void clear();
};

/// One RDMA device as rdma_cm opened it, with what the transport keeps on it.
struct Device {
  VerbsTransport* owner = nullptr;
  ibv_context* ctx = nullptr;
  std::string name;
  ibv_device_attr attr{};
  std::vector<ibv_port_attr> ports;  ///< by port number - 1
  std::shared_ptr<DevicePd> pd;
  ibv_comp_channel* channel = nullptr;
  ibv_cq* cq = nullptr;
  int cq_size = 0;
  loop::Poll comp_poll;
  loop::Poll async_poll;
  unsigned unacked = 0;  ///< completion events gotten, not yet acknowledged
  bool windows = false;  ///< type-2 memory windows are in use
  std::uint64_t max_mr = 0;
  std::uint64_t max_msg = 0;  ///< bytes one work request may move
  int max_sge = 1;
};

/// A window onto the owner's memory: `len` bytes at `addr`, reachable with `rkey`.
struct Window {
  std::uint64_t addr = 0;
  std::uint64_t len = 0;
  std::uint32_t rkey = 0;
};

/// One work request in a connection's send queue.
struct Posted {
  std::uint64_t seq = 0;       ///< its wr_id
  std::uint64_t transfer = 0;  ///< the active transfer it moves data for (0: control)
  std::int32_t slot = -1;      ///< the control buffer it sends from (-1: none)
  std::uint64_t chunk = 0;     ///< the staging chunk it moves (0: none)
};

/// A staging chunk of an active transfer: `len` bytes of local CUDA memory at `device`, moved
/// from or to the owner's `remote` through pinned host memory at `buf`.
struct Chunk {
  std::byte* buf = nullptr;
  int ordinal = -1;
  std::byte* device = nullptr;
  std::uint64_t remote = 0;
  std::uint64_t len = 0;
  std::uint64_t posted = 0;  ///< bytes of it posted as work requests
  unsigned wrs = 0;          ///< its work requests not yet complete
  std::uint64_t copy = 0;    ///< the copy engine's id while a copy runs
};

/// A control item waiting for room in the send queue: message bytes, or a window to bind.
struct CtlItem {
  std::string bytes;
  ibv_mw* mw = nullptr;
  ibv_mw_bind_info bind{};
  std::uint32_t rkey = 0;
};

/// One RC connection to a peer, by rdma_cm. Shared by every operation between the two.
struct Conn {
  enum class State { resolving, connecting, accepting, up, failed };
  VerbsTransport* owner = nullptr;
  std::uint64_t id = 0;
  rdma_cm_id* cm = nullptr;
  Device* dev = nullptr;
  ibv_qp* qp = nullptr;
  std::uint32_t qp_num = 0;
  bool active = false;  ///< we connected (else we accepted)
  State state = State::resolving;
  std::string address;  ///< the peer's listener ("ip:port"), once known
  std::string peer_name = "?";
  std::string peer_id;  ///< its connector id (16 hex digits)

  std::vector<std::byte> bufs;  ///< kRecvSlots receive then kSendSlots send buffers
  ibv_mr* bufs_mr = nullptr;
  std::vector<std::uint32_t> free_sends;
  std::uint32_t recvs_posted = 0;
  std::deque<CtlItem> outbox;
  std::string inbox;  ///< control bytes received, not yet a whole message

  std::uint64_t next_seq = 1;
  std::deque<Posted> posted;
  unsigned since_signal = 0;
  std::deque<std::uint64_t> ready;     ///< transfers with data work requests to post
  std::vector<std::uint64_t> waiting;  ///< transfers waiting for the connection to be up
  loop::Timer timer;                   ///< connect deadline; then the flush deadline

  std::string describe() const {
    return "'" + peer_name + "'" + (address.empty() ? std::string() : " at " + address);
  }
};

/// What serving one exposure holds beyond the exposure table.
struct Served {
  std::vector<Region> spans;
  std::vector<std::shared_ptr<const Registration>> regs;  ///< cache registrations of the spans
  std::vector<std::shared_ptr<MrSet>> own;                ///< registrations of its own (no windows)
  std::vector<ibv_mw*> mws;                               ///< windows bound for its claimant
  std::uint64_t conn = 0;                                 ///< the claimant's connection
  Exposures::Ranges ranges;                               ///< claimed
};

class VerbsTransfer final : public Transfer {
 public:
  VerbsTransfer(VerbsTransport& transport, std::uint64_t transfer_id, TransferSpec what,
                TransferObserver& obs)
      : owner(&transport), id(transfer_id), spec(std::move(what)), observer(&obs) {}
  ~VerbsTransfer() override {
    if (owner != nullptr) owner->forget_transfer(*this);
  }
  void cancel(const Error& reason) override {
    if (owner != nullptr) owner->cancel_transfer(*this, reason);
  }
  std::optional<Token> claim_secret() const override { return secret; }

  VerbsTransport* owner;
  std::uint64_t id;
  TransferSpec spec;
  TransferObserver* observer;
  std::vector<std::shared_ptr<const Registration>> regs;  ///< one per segment
  std::uint64_t conn = 0;
  std::vector<Window> windows;
  std::optional<Token> secret;
  std::size_t seg = 0;  ///< the next byte to post: segment, and offset in it
  std::uint64_t off = 0;
  unsigned outstanding = 0;  ///< data work requests posted, not yet complete
  bool all_posted = false;
  bool done_sent = false;
  bool finished = false;
  bool notified = false;
  std::optional<Error> ended_by_owner;  ///< the owner's notice: it ended the operation
  // Staging (CUDA memory that the NIC cannot reach): chunks by id, those whose bytes may be
  // posted (a read's at once, a write's once copied from the device), in order.
  std::map<std::uint64_t, Chunk> chunks;
  std::deque<std::uint64_t> postable;
  bool waiting_chunk = false;  ///< stopped posting for want of a free chunk
};

}  // namespace ferry::transport::verbs
