#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "transport/kit/pending.hpp"
#include "transport/tcp/tcp_region.hpp"
#include "transport/tcp/tcp_transfer.hpp"
#include "transport/wire/socket.hpp"
#include "transport/wire/stream_connection.hpp"

namespace ferry::transport::tcp {

class TcpTransport;

/// One connection to a peer's tcp listener, the active side: shared by every transfer toward
/// that address (kit::LinkPool keeps it while idle). Sends the transfers' requests within their
/// windows, takes the answers (only those to requests it sent), and ends its transfers when
/// the connection goes.
class TcpLink final : private wire::StreamConnection::Handler {
 public:
  /// Connects to `address` (non-blocking). Throws Error(PeerLost) when the connect is refused
  /// at once.
  TcpLink(TcpTransport& owner, std::uint64_t id, const wire::SocketAddress& address,
          const std::string& peer_name);
  ~TcpLink() override;

  /// Takes `t` on and sends what its window allows.
  void attach(TcpTransfer& t);
  /// `t` is let go of: its requests are forgotten, its frames dropped or finished from a copy.
  void detach(TcpTransfer& t);
  /// Sends the requests `t`'s window allows, then a write's DONE behind its last chunk.
  void pump(TcpTransfer& t);
  /// Tells the owner that `t` ended: with no error a read's last notice, else why.
  void send_done(TcpTransfer& t, const Error* error);
  /// Forgets `t`'s requests and its queued frames; nothing of it is read or written after.
  void release(TcpTransfer& t);
  /// Sends `region`'s ATTACH; the answer goes to it.
  void attach_region(TcpRemoteRegion& region);
  /// `region` is going: forgotten, and when `detach`, its owner told (DETACH).
  void drop_region(TcpRemoteRegion& region, bool detach);

  bool usable() const noexcept { return conn_->usable(); }
  bool idle() const noexcept { return transfers_.empty() && regions_.empty(); }
  /// Closes without calling back (the pool lets an idle link go, or the transport closes).
  void close() noexcept { conn_->close_gracefully(); }
  std::chrono::steady_clock::time_point idle_since{};

 private:
  enum class Kind { read_chunk, read_ranges, write_chunk, done, attach };
  /// One range of a READ_RANGES: where its DATA goes.
  struct Piece {
    std::byte* local = nullptr;
    std::uint64_t remote = 0;
    std::uint64_t len = 0;
    bool arrived = false;
  };
  struct Request {
    Request() = default;
    Request(std::uint64_t transfer_, Kind kind_, std::byte* local_ = nullptr,
            std::uint64_t len_ = 0, std::uint64_t unit_ = 0)
        : transfer(transfer_), kind(kind_), local(local_), len(len_), unit(unit_) {}
    std::uint64_t transfer = 0;  ///< 0: nobody waits for the answer (a notice); attach: region
    Kind kind = Kind::done;
    std::byte* local = nullptr;
    std::uint64_t len = 0;
    std::uint64_t unit = 0;  ///< the staging unit its bytes pass through; 0: none
    /// read_ranges: its ranges, the list sent (kept until the frame has left: the request is
    /// answered only after), and how many have not arrived.
    std::vector<Piece> pieces;
    std::vector<std::byte> list;
    std::size_t left = 0;
    std::size_t next = 0;  ///< the piece the next DATA most likely carries
  };

  // wire::StreamConnection::Handler
  wire::Sink on_frame(wire::StreamConnection& conn, const wire::FrameHeader& h,
                      std::string message) override;
  void on_payload(wire::StreamConnection& conn, const wire::FrameHeader& h, std::uint64_t tag,
                  bool intact) override;
  void on_sent(wire::StreamConnection&, std::uint64_t tag) override { notices_.erase(tag); }
  void on_closed(wire::StreamConnection& conn, const std::string& reason) override;

  void send_ended(TcpTransfer& t, const Error* error, bool awaited);
  /// Queues the next request of `t`; false when the window or a staging chunk stops it.
  bool request(TcpTransfer& t);
  /// Queues one READ_RANGES for the next whole segments of `t` (host memory, shorter than a
  /// chunk, up to a chunk in all); false when fewer than two fit, and nothing was sent.
  bool request_ranges(TcpTransfer& t);
  /// The sink for a DATA answering READ_RANGES `r`: the piece at its address.
  wire::Sink piece_sink(Request& r, const wire::FrameHeader& h);
  wire::Sink on_status(const wire::FrameHeader& h, const std::string& message);
  /// Request `req` of `t` is done: its bytes are in place (staged: on the device too).
  void answered(TcpTransfer& t, std::uint64_t req, const Request& r);
  TcpTransfer* live(std::uint64_t id) const;
  std::string peer() const { return "peer " + conn_->describe_peer(); }

  TcpTransport& owner_;
  std::unique_ptr<wire::StreamConnection> conn_;
  kit::PendingRequests<Request> pending_;
  std::unordered_set<std::uint64_t> transfers_;
  /// Regions attached (or attaching) through this link, by their id at the transport.
  std::unordered_map<std::uint64_t, TcpRemoteRegion*> regions_;
  /// The ranges of ENDED notices not yet sent, by their frame's tag (kNoticeTag set).
  std::unordered_map<std::uint64_t, std::vector<std::byte>> notices_;
  std::uint64_t next_notice_ = 1;
  static constexpr std::uint64_t kNoticeTag = std::uint64_t{1} << 61;
};

}  // namespace ferry::transport::tcp
