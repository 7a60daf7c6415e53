#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

#include <ferry/options.hpp>

#include "transport/context.hpp"
#include "transport/kit/connections.hpp"
#include "transport/kit/exposures.hpp"
#include "transport/kit/regions.hpp"
#include "transport/kit/stream_listener.hpp"
#include "transport/wire/socket.hpp"
#include "transport/wire/stream_connection.hpp"

namespace ferry::transport::cuda {
class Stager;
}

namespace ferry::transport::tcp {

/// The passive side of tcp: the listening socket, the connections it accepts (under the kit's
/// bounds), and the exposures it serves: each READ answered with DATA straight from the
/// exposed memory, each WRITE's payload read straight into it, DONE ending the exposure. CUDA
/// memory is served through staging chunks of its own (a server waiting for a chunk never
/// waits for a client of the same transport, which holds its chunks until its peer answers).
class TcpListener final : private wire::StreamConnection::Handler {
 public:
  /// Binds and listens at `bind` (ctx.bind_address, the port of `options`). Throws
  /// Error(Internal) when the socket cannot be bound.
  TcpListener(const Context& ctx, const TcpOptions& options, const wire::SocketAddress& bind);
  ~TcpListener() override;

  /// The address the socket is bound to.
  wire::SocketAddress bound() const;

  void expose(const Exposure& exposure, ExposureObserver& observer);
  /// Ends serving `id`: its claimant hears `reason`, queued answers become that reason.
  void revoke(std::uint64_t id, const Error& reason);
  /// Closes every connection and the socket, without observer calls.
  void close();

  // Regions (docs/regions.md): ATTACH makes an attachment (kit::Regions), whose requests are
  // served as an exposure's; ENDED tells the owner of a transfer; DETACH ends it.
  void serve_region(const RegionExposure& region, RegionObserver& observer);
  void revoke_attachment(std::uint64_t attachment, const Error& reason);
  void end_region(std::uint64_t id, const Error& reason);
  std::vector<std::uint64_t> attachments_of_peer(std::uint64_t id,
                                                 const std::string& peer_id) const {
    return regions_.attachments_of_peer(id, peer_id);
  }
  /// Peers connected now.
  std::size_t connections() const noexcept {
    return socket_ ? socket_->admission().connections() : 0;
  }

 private:
  /// A request served through a staging unit: a READ being copied out of the device and sent,
  /// or a WRITE being received and copied into it.
  struct Staged {
    std::uint64_t op = 0;
    std::uint64_t conn = 0;
    std::uint64_t req = 0;
    bool write = false;
    std::uint64_t addr = 0;
    std::uint64_t len = 0;
  };
  /// A READ of CUDA memory waiting for a staging chunk, or a DONE waiting for a write's copies.
  struct Parked {
    std::uint64_t conn = 0;
    wire::FrameHeader h;
    std::string message;
    std::vector<std::byte> payload;  ///< an ENDED's ranges
    /// Served once the staging units opened up to this one are copied (an attachment's ENDED
    /// waits for the WRITEs before it, not for later ones).
    std::uint64_t up_to = ~std::uint64_t{0};
  };
  /// An ENDED whose ranges are being received.
  struct Ending {
    std::string tag;
    std::vector<std::byte> ranges;
  };

  // wire::StreamConnection::Handler
  wire::Sink on_frame(wire::StreamConnection& conn, const wire::FrameHeader& h,
                      std::string message) override;
  void on_payload(wire::StreamConnection& conn, const wire::FrameHeader& h, std::uint64_t tag,
                  bool intact) override;
  void on_sent(wire::StreamConnection& conn, std::uint64_t tag) override;
  void on_closed(wire::StreamConnection& conn, const std::string& reason) override;
  std::optional<Error> on_hello(wire::StreamConnection& conn, const wire::FrameHeader& hello,
                                wire::FrameHeader& reply) override;

  void accept(int fd);
  void serve_read(wire::StreamConnection& conn, const wire::FrameHeader& h);
  /// One checked range of a READ `h` (or of a READ_RANGES), at `ptr` of `entry`'s memory: one
  /// DATA straight from it, or through a staging chunk from device memory.
  void answer_read(wire::StreamConnection& conn, const wire::FrameHeader& h,
                   const kit::Exposures::Entry& entry, std::byte* ptr);
  wire::Sink receive_read_ranges(wire::StreamConnection& conn, const wire::FrameHeader& h);
  /// A READ_RANGES whose list arrived: every range is checked before one DATA per range leaves.
  void serve_read_ranges(wire::StreamConnection& conn, const wire::FrameHeader& h,
                         const std::vector<std::byte>& list);
  wire::Sink serve_write(wire::StreamConnection& conn, const wire::FrameHeader& h);
  void serve_done(wire::StreamConnection& conn, const wire::FrameHeader& h,
                  const std::string& message);
  void claim(kit::Exposures::Entry& entry, wire::StreamConnection& conn);
  void serve_attach(wire::StreamConnection& conn, const wire::FrameHeader& h);
  wire::Sink receive_ended(wire::StreamConnection& conn, const wire::FrameHeader& h,
                           std::string tag);
  void serve_ended(wire::StreamConnection& conn, const wire::FrameHeader& h, std::string tag,
                   std::vector<std::byte> ranges);
  void serve_detach(wire::StreamConnection& conn, const wire::FrameHeader& h);
  /// The owner ended attachment `id` bound to `conn_id`: its peer hears `reason`.
  void end_attachment(std::uint64_t conn_id, std::uint64_t id, const Error& reason);
  /// The claim of exposure `id` by connection `conn_id` (0: none) ended: queued answers
  /// become `reason`, a payload being received is drained, staged copies stop.
  wire::StreamConnection* end_claim(std::uint64_t conn_id, std::uint64_t id, const Error& reason);
  void finish_exposure(std::uint64_t id, std::optional<Error> peer_error);

  // CUDA memory (tcp_listener_staging.cpp).
  cuda::Stager& stager();
  /// The CUDA device of the exposure's memory at `ptr`; -1 for host memory.
  static int device_of(const kit::Exposures::Entry& entry, const std::byte* ptr);
  void serve_read_staged(wire::StreamConnection& conn, const wire::FrameHeader& h, std::byte* src,
                         int ordinal);
  void read_copied(std::uint64_t unit, const std::optional<Error>& error);
  wire::Sink serve_write_staged(wire::StreamConnection& conn, const wire::FrameHeader& h,
                                std::byte* dst, int ordinal);
  /// The end of a staged WRITE's payload: true when it was one (its copy starts).
  bool staged_payload(wire::StreamConnection& conn, const wire::FrameHeader& h, bool intact);
  void write_copied(std::uint64_t unit, const std::optional<Error>& error);
  /// Exposure `op` ends: its staged frames on `conn` become `replace`, its units go.
  void drop_staged(std::uint64_t op, wire::StreamConnection* conn,
                   const std::function<void(wire::FrameHeader&, std::string&)>& replace);
  /// Connection `conn` is gone: the same for everything it had staged.
  void drop_staged_conn(std::uint64_t conn);
  void serve_waiting_reads();

  /// DATA sent from a staging chunk is tagged with this bit and the unit (operation ids never
  /// have it), so that on_sent names the unit.
  static constexpr std::uint64_t kStagedTag = std::uint64_t{1} << 63;

  Context ctx_;
  TcpOptions options_;
  bool closed_ = false;
  kit::Exposures exposures_;
  kit::ConnectionSet<wire::StreamConnection> conns_;
  std::uint64_t next_conn_ = 1;
  std::unique_ptr<kit::StreamListener> socket_;

  std::unique_ptr<cuda::Stager> stager_;
  std::map<std::uint64_t, Staged> staged_;                      ///< by staging unit
  std::unordered_map<std::uint64_t, std::uint64_t> receiving_;  ///< conn -> unit of its WRITE
  std::deque<Parked> waiting_reads_;                            ///< READs waiting for a chunk
  /// By op: DONE (or an attachment's ENDEDs) after copies.
  std::unordered_multimap<std::uint64_t, Parked> parked_done_;
  kit::Regions regions_;
  std::unordered_map<std::uint64_t, Ending> ending_;  ///< by connection
  /// The range list of a READ_RANGES being received, by connection.
  std::unordered_map<std::uint64_t, std::vector<std::byte>> asking_;
};

}  // namespace ferry::transport::tcp
