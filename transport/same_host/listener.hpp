#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/context.hpp"
#include "transport/kit/connections.hpp"
#include "transport/kit/exposures.hpp"
#include "transport/kit/lifetime.hpp"
#include "transport/kit/regions.hpp"
#include "transport/kit/stream_listener.hpp"
#include "transport/same_host/grant_table.hpp"
#include "transport/wire/stream_connection.hpp"

namespace ferry::transport::same_host {

/// Most bytes of (addr, len) pairs one CLAIM carries: two ranges per descriptor of the
/// longest lists metadata allows, and some.
inline constexpr std::uint64_t kMaxClaimBytes = 4u << 20;

/// The owner's side of a same-host method (cma, cuda_ipc): an abstract Unix socket, the
/// connections it accepts (under the kit's bounds, each peer's process known from SO_PEERCRED),
/// the exposures it serves, and the claim exchange (docs/protocol.md):
///  - HELLO is answered with a probe of that connection's own: the address of a fresh nonce in
///    this process, which the peer reads with process_vm_readv. Its socket's owner (the kernel
///    says) holds what it reads: this is the process the metadata names, and the peer may read
///    it.
///  - CLAIM: the token is checked before anything is sized by what the peer says; then every
///    range. The answer, CLAIMED, carries a grant in the shared grant table (grant_table.hpp),
///    the claim's secret, and what the method adds (cuda_ipc: the memory's IPC handles).
///  - DONE ends the exposure; the owner's CPU never touches the bytes.
/// Loop thread only.
class Listener final : private wire::StreamConnection::Handler {
 public:
  /// The claiming process as the kernel names it (SO_PEERCRED of its connection).
  struct Claimant {
    std::int64_t pid = 0;
    std::uint32_t uid = ~0u;
    std::uint32_t gid = ~0u;
    std::string name;  ///< as its connection describes it
  };
  /// What CLAIMED (and ATTACHED) carries for `exposure` beyond the grant; throws Error to
  /// refuse the claim.
  using ClaimPayload =
      std::function<std::vector<std::byte>(const Exposure& exposure, const Claimant& claimant)>;

  /// Listens on a fresh abstract socket "@<prefix>-<16 hex digits>". Throws Error(Internal)
  /// when the socket or the grant table cannot be made.
  Listener(const Context& ctx, std::string method, const std::string& prefix,
           std::uint32_t grant_slots, ClaimPayload payload);
  ~Listener() override;

  const std::string& address() const noexcept { return address_; }
  /// The endpoint's info (owner_info.hpp).
  const std::string& info() const noexcept { return info_; }
  void expose(const Exposure& exposure, ExposureObserver& observer);
  /// Ends serving `id`: its grant closes (waiting for the peer's copies under way, at most
  /// peer_timeout), and its claimant hears `reason`.
  void revoke(std::uint64_t id, const Error& reason);
  /// Closes every connection and the socket, without observer calls.
  void close();

  // Regions (docs/regions.md). ATTACH is answered as a claim of the whole region is: ATTACHED
  // carries the attachment's grant, its secret and what the method adds; the peer then copies
  // under that grant with no exchange per transfer, and tells the owner of each with a one-way
  // ENDED. Revoking an attachment closes its grant (waiting for copies under way).
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
  /// Grants given up because a peer's copy outlived peer_timeout after a revoke (for tests).
  std::uint32_t quarantined_grants() const noexcept { return grants_.quarantined(); }

 private:
  struct Peer {
    std::int64_t pid = 0;  ///< from SO_PEERCRED
    std::uint32_t uid = ~0u;
    std::uint32_t gid = ~0u;
    int pidfd = -1;
    std::unique_ptr<Token> probe;  ///< this connection's nonce, at a fixed address
    std::vector<std::byte> claim;  ///< a CLAIM's (or an ENDED's) ranges being received
    std::optional<Error> refused;  ///< a CLAIM refused before its ranges arrived
    std::string tag;               ///< an ENDED's tag, while its ranges arrive
    bool stalled = false;          ///< held a copy grant past peer_timeout: waited for no more
  };
  struct Claimed {
    std::uint64_t conn = 0;
    Grant grant;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;  ///< (addr, len) granted
    std::vector<std::byte> payload;  ///< what CLAIMED carries, while it may be queued
  };

  // wire::StreamConnection::Handler
  wire::Sink on_frame(wire::StreamConnection& conn, const wire::FrameHeader& h,
                      std::string message) override;
  void on_payload(wire::StreamConnection& conn, const wire::FrameHeader& h, std::uint64_t tag,
                  bool intact) override;
  void on_sent(wire::StreamConnection&, std::uint64_t) override {}
  void on_closed(wire::StreamConnection& conn, const std::string& reason) override;
  std::optional<Error> on_hello(wire::StreamConnection& conn, const wire::FrameHeader& hello,
                                wire::FrameHeader& reply) override;

  void accept(int fd);
  wire::Sink receive_claim(wire::StreamConnection& conn, const wire::FrameHeader& h);
  void serve_claim(wire::StreamConnection& conn, const wire::FrameHeader& h);
  void serve_done(wire::StreamConnection& conn, const wire::FrameHeader& h,
                  const std::string& message);
  void serve_attach(wire::StreamConnection& conn, const wire::FrameHeader& h);
  void serve_ended(wire::StreamConnection& conn, const wire::FrameHeader& h);
  void serve_detach(wire::StreamConnection& conn, const wire::FrameHeader& h);
  /// The owner ends attachment `id`: its grant closes, its peer hears `reason`.
  void end_attachment(std::uint64_t id, const Error& reason);
  /// Ends the claim of exposure `id` (if any): its grant closes, waiting for copies under way;
  /// the connection stops waiting for the peer on its account. Returns the connection.
  wire::StreamConnection* end_claim(std::uint64_t conn_id, std::uint64_t id);
  void finish_exposure(std::uint64_t id, std::optional<Error> peer_error);
  /// Closes `claim`'s grant, waiting for its peer's copies until `deadline` (by default
  /// peer_timeout from now); false when they outlived it. A peer that made the owner wait
  /// that long once is not waited for again (its grants close at once) and is disconnected:
  /// the loop is held up at most peer_timeout per peer connection, not per claim.
  bool close_grant(const Claimed& claim,
                   std::optional<std::chrono::steady_clock::time_point> deadline = {});
  Claimant claimant(const wire::StreamConnection& conn);
  /// Whether the peer of connection `conn_id` copies nothing: exited, or stopped (and, for
  /// quarantined grants, once its connection is gone: see GrantTable::close).
  bool peer_idle(std::uint64_t conn_id) const;

  Context ctx_;
  std::string method_;
  ClaimPayload payload_;
  std::string address_;  ///< "@<prefix>-<hex>": the abstract socket's name
  std::string info_;
  bool closed_ = false;
  GrantTable grants_;
  kit::Exposures exposures_;
  kit::Regions regions_;
  kit::ConnectionSet<wire::StreamConnection> conns_;
  std::unordered_map<std::uint64_t, Peer> peers_;       ///< by connection
  std::unordered_map<std::uint64_t, Claimed> claimed_;  ///< by exposure id
  std::uint64_t next_conn_ = 1;
  std::unique_ptr<kit::StreamListener> socket_;
  kit::Lifetime life_;  ///< last: deferred work sees it end first
};

}  // namespace ferry::transport::same_host
