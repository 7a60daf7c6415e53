#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <ferry/options.hpp>

#include "loop/uv_handle.hpp"
#include "transport/context.hpp"
#include "transport/kit/silence.hpp"
#include "transport/transport.hpp"
#include "transport/verbs/verbs_device.hpp"
#include "transport/wire/frame_reader.hpp"

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

/// One work request in a connection's send queue.
struct Posted {
  std::uint64_t seq = 0;       ///< its wr_id
  std::uint64_t transfer = 0;  ///< the active transfer it moves data for (0: control)
  std::int32_t slot = -1;      ///< the control buffer it sends from (-1: none)
  std::uint64_t chunk = 0;     ///< the staging unit it moves (0: none)
  bool signaled = true;        ///< it gives a completion even when it succeeds
};

/// A control item waiting for room in the send queue: message bytes, or a window to bind.
struct CtlItem {
  std::string bytes;
  ibv_mw* mw = nullptr;
  ibv_mw_bind_info bind{};
  std::uint32_t rkey = 0;
};

/// One RC connection to a peer, by rdma_cm, shared by every operation between the two (either
/// side may have set it up). Its control messages are the wire's frames (wire/frame.hpp),
/// carried by SENDs of at most kCtlBytes from registered buffers, in order with the data on the
/// same queue pair, and read back with the wire's FrameReader.
///
/// Silence: while answers are due or work requests are posted, the peer must show life (any
/// completion on this queue pair) within peer_timeout, or the connection fails.
class Conn final : private wire::FrameReader::Handler {
 public:
  enum class State { resolving, connecting, accepting, up, failed };

  class Owner {
   public:
    /// A control message's header and text; says where its payload goes.
    virtual wire::Sink ctl_frame(Conn& conn, const wire::FrameHeader& h, std::string msg) = 0;
    virtual void ctl_payload(Conn& conn, const wire::FrameHeader& h, bool intact) = 0;
    /// The connection broke the protocol, or its peer went silent.
    virtual void conn_failed(Conn& conn, ErrorCode code, const std::string& why) = 0;

   protected:
    ~Owner() = default;
  };

  Conn(Owner& owner, const Context& ctx, const VerbsApi& api, const VerbsOptions& options,
       Counters& counters, std::uint64_t id, bool active);
  ~Conn() override;
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;

  /// Makes the QP on `dev` and posts the receive buffers. Throws Error(Internal) naming the
  /// call that failed and errno.
  void make_qp(Device& dev);
  /// Queues a control message (header, text, payload) and sends what the queue allows.
  void send_ctl(const wire::FrameHeader& h, std::string_view msg = {},
                std::string_view payload = {});
  /// Queues a window bind ahead of what is queued later.
  void bind(CtlItem item) { outbox.push_back(std::move(item)); }
  void pump_ctl();
  /// Posts one RDMA READ or WRITE; false when the queue pair refused it (the owner hears).
  bool post_data(std::uint64_t transfer, Access access, std::uint64_t remote, std::uint32_t rkey,
                 ibv_sge* sges, std::size_t n, bool last, std::uint64_t chunk);
  /// A receive completed: its bytes go through the frame reader.
  void received(const ibv_wc& wc);
  /// The queue pair is in error (the connection failed): unless the newest work request is
  /// signalled, posts a signalled marker behind it, flushed at once, whose completion retires
  /// every work request before it; one that completed unsignalled before the error leaves no
  /// completion of its own (the kernel's ib_drain_sq does the same). False when none was
  /// needed or the queue pair refused it.
  bool post_drain_marker();
  /// A send completion retires every work request up to it (they complete in order); returns
  /// them, oldest first.
  std::vector<Posted> retire(const ibv_wc& wc);
  /// An answer is due from the peer (+1), or came or was forgotten (-1).
  void expect_answers(int delta) noexcept;
  /// The connection failed: the watch stops.
  void quiet() noexcept;
  /// Fails the connection (PeerLost) unless it is up within `limit`; established() stops it.
  void arm_deadline(std::chrono::milliseconds limit);
  void established() noexcept { timer_.reset(); }
  /// What an error completion on this connection means, with the state of its port when that
  /// explains it ("transport retry counter exceeded (sim0 port 1 is down)").
  std::string why_failed(ibv_wc_status status) const;
  /// " (<device> port N is down)" when the port under this connection is not active, else
  /// empty (a suffix for a message).
  std::string port_down() const;
  /// Whether a control message (or window bind) is queued or in the send queue.
  bool telling() const noexcept {
    return !outbox.empty() || std::any_of(posted.begin(), posted.end(),
                                          [](const Posted& p) { return p.transfer == 0; });
  }

  std::string describe() const {
    return "'" + peer_name + "'" + (address.empty() ? std::string() : " at " + address);
  }

  std::uint64_t id;
  bool active;  ///< we connected (else we accepted)
  State state = State::resolving;
  rdma_cm_id* cm = nullptr;
  Device* dev = nullptr;
  ibv_qp* qp = nullptr;
  std::uint32_t qp_num = 0;
  std::string address;  ///< the peer's listener ("ip:port"), once known
  std::string peer_name = "?";
  std::string peer_id;  ///< its connector id (16 hex digits)
  std::deque<CtlItem> outbox;
  std::deque<Posted> posted;
  std::deque<std::uint64_t> ready;     ///< transfers with data work requests to post
  std::vector<std::uint64_t> waiting;  ///< transfers waiting for the connection to be up
  std::string payload;                 ///< a control message's payload being received
  std::string tag;                     ///< an ENDED's tag, while its ranges arrive

 private:
  // wire::FrameReader::Handler
  wire::Sink on_frame(const wire::FrameHeader& h, std::string message) override;
  void on_payload(const wire::FrameHeader& h, std::uint64_t tag, bool intact) override;
  void post_recv(std::uint32_t slot);
  void watch() noexcept;

  Owner& owner_;
  uv_loop_s* loop_;
  loop::Log log_;
  const VerbsApi& api_;
  unsigned queue_depth_;
  unsigned signal_every_;
  Counters& counters_;
  std::vector<std::byte> bufs_;  ///< kRecvSlots receive then kSendSlots send buffers
  ibv_mr* bufs_mr_ = nullptr;
  std::vector<std::uint32_t> free_sends_;
  std::uint64_t next_seq_ = 1;
  unsigned since_signal_ = 0;
  wire::FrameReader reader_{*this};
  loop::Timer timer_;  ///< the connect deadline
  kit::SilenceWatch silence_;
  int answers_ = 0;
  bool awaiting_ = false;
};

}  // namespace ferry::transport::verbs
