#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "loop/uv_handle.hpp"
#include "transport/context.hpp"
#include "transport/kit/pending.hpp"
#include "transport/same_host/grant_table.hpp"
#include "transport/same_host/owner_info.hpp"
#include "transport/same_host/system.hpp"
#include "transport/wire/stream_connection.hpp"

namespace ferry::transport::same_host {

/// The owner's process as the active side knows it once proven: what copies need. Copy jobs
/// hold it as long as they run.
struct OwnerProcess {
  std::int64_t pid = 0;
  int pidfd = -1;  ///< -1 where pidfds do not exist
  std::unique_ptr<GrantView> grants;
  OwnerProcess() = default;
  OwnerProcess(const OwnerProcess&) = delete;
  OwnerProcess& operator=(const OwnerProcess&) = delete;
  ~OwnerProcess() { close_fetched(pidfd); }
};

/// What a same-host transfer has of the claim exchange.
struct Claimant {
  const TransferSpec* transfer_spec = nullptr;  ///< what the transfer claims
  std::uint64_t claim_req = 0;
  std::uint64_t done_req = 0;
  bool claimed = false;
  bool ended_by_owner = false;  ///< a copy was refused: the owner's notice says why
  bool done_sent = false;
  Grant grant;
  std::vector<std::byte> ranges;   ///< the CLAIM's payload, while it may be queued
  std::vector<std::byte> payload;  ///< what CLAIMED carried (cuda_ipc: the IPC handles)
};

/// What a same-host attachment to a region has of the ATTACH exchange (docs/regions.md).
struct RegionAttach {
  std::uint64_t region = 0;  ///< the region's id at the owner
  Token token{};
  Access access = Access::read;
  std::uint64_t attach_req = 0;
  bool attached = false;
  std::uint64_t attachment = 0;  ///< its id at the owner, once attached
  Token secret{};
  Grant grant;
  std::vector<std::byte> payload;  ///< what ATTACHED carried (cuda_ipc: the IPC handles)
};

/// The active side's connection to one owner of a same-host method (cma, cuda_ipc). Before it
/// claims anything it proves the owner: the metadata's process must be the one behind the
/// socket (SO_PEERCRED), and this process must be able to read it (the probe of HELLO, read
/// with process_vm_readv, must hold the nonce HELLO gives). Then it carries the claims and
/// DONEs of the transfers toward that owner, answers counting only from its own connection,
/// and keeps the owner's connection alive while they copy. What a transfer does between
/// CLAIMED and DONE is its transport's business (Client). Loop thread only.
class Link final : private wire::StreamConnection::Handler {
 public:
  class Client {
   public:
    /// The transfer `id`, if it lives and has not ended.
    virtual Claimant* claimant(std::uint64_t id) = 0;
    /// Its claim was granted (`grant` and `payload` set): copy.
    virtual void granted(std::uint64_t id, const Token& secret) = 0;
    /// It ended: the owner answered its DONE (no error), refused it, or ended the operation;
    /// or the connection is gone (`setup`: before anything was claimed, so another method may
    /// still work).
    virtual void ended(std::uint64_t id, std::optional<Error> error, bool setup) = 0;
    /// The link's connection closed (its transfers heard ended() first): the link goes.
    virtual void link_closed(Link& link) = 0;
    /// Region attachment `key`, if it is waiting for its ATTACHED or attached.
    virtual RegionAttach* attaching(std::uint64_t key) {
      (void)key;
      return nullptr;
    }
    /// It is attached (grant, secret and payload set).
    virtual void region_attached(std::uint64_t key) { (void)key; }
    /// It was refused or ended by the owner, or the connection is gone (`setup`: before it
    /// was attached and before the owner answered).
    virtual void region_ended(std::uint64_t key, const Error& error, bool setup) {
      (void)key;
      (void)error;
      (void)setup;
    }

   protected:
    ~Client() = default;
  };

  /// Connects to the owner `info` describes, at `address`. Throws Error(Unsupported) when this
  /// process cannot reach it by this method (another PID namespace, no permission), with why;
  /// Error(PeerLost) when the owner is gone. `max_payload`: the most CLAIMED may carry.
  Link(const Context& ctx, Client& client, std::string method, std::uint64_t id,
       const std::string& address, const OwnerInfo& info, const std::string& peer_name,
       std::uint64_t max_payload);
  ~Link() override;

  /// Sends `c`'s claim (once the owner is proven).
  void claim(std::uint64_t transfer, Claimant& c);
  /// Tells the owner the transfer ended: with no error it is done (a write awaits the answer),
  /// else why.
  void send_done(std::uint64_t transfer, Claimant& c, const Error* error);
  /// A copy was refused under the grant: the owner ended the operation, and its notice says
  /// why. Wait for it, no longer than the watchdog.
  void await_notice(Claimant& c);
  /// The transfer is let go of: its requests are forgotten, its queued frames dropped.
  void release(std::uint64_t transfer, Claimant& c);
  void attach(std::uint64_t transfer);
  void detach(std::uint64_t transfer);

  /// Sends attachment `key`'s ATTACH (once the owner is proven).
  void attach_region(std::uint64_t key, RegionAttach& a);
  /// Attachment `key` goes: forgotten, and when `detach`, the owner told (DETACH).
  void drop_region(std::uint64_t key, RegionAttach& a, bool detach);
  /// Tells the owner that a transfer on an attachment ended (ENDED: its tag, its ranges, and
  /// with `error` why it failed). One-way: the copies were this side's.
  void send_ended(std::uint64_t transfer, Claimant& c, const Error* error);
  /// The same for a transfer `spec` describes (one made without a Claimant: a direct copy).
  void send_ended(const TransferSpec& spec, const Error* error);

  /// The owner's process, for copies.
  const std::shared_ptr<OwnerProcess>& owner() const noexcept { return owner_; }
  /// A copy was refused by the kernel (EPERM): later transfers toward this owner fall back.
  std::optional<Error> refused;
  /// What the method keeps per owner for as long as the link lives (cuda_ipc: the owner's
  /// memory opened here).
  class Extra {
   public:
    virtual ~Extra() = default;
  };
  std::unique_ptr<Extra> extra;
  const std::string& peer_name() const noexcept { return peer_name_; }

  bool usable() const noexcept { return conn_->usable(); }
  bool idle() const noexcept { return transfers_.empty() && regions_.empty(); }
  void close() noexcept { conn_->close_gracefully(); }
  std::chrono::steady_clock::time_point idle_since{};

 private:
  enum class Kind { claim, done, attach };
  struct Request {
    std::uint64_t transfer = 0;
    Kind kind = Kind::claim;
  };

  // wire::StreamConnection::Handler
  wire::Sink on_frame(wire::StreamConnection& conn, const wire::FrameHeader& h,
                      std::string message) override;
  void on_payload(wire::StreamConnection& conn, const wire::FrameHeader& h, std::uint64_t tag,
                  bool intact) override;
  void on_sent(wire::StreamConnection&, std::uint64_t tag) override { notices_.erase(tag); }
  void on_closed(wire::StreamConnection& conn, const std::string& reason) override;
  std::optional<Error> on_hello(wire::StreamConnection& conn, const wire::FrameHeader& hello,
                                wire::FrameHeader& reply) override;

  void send_claim(std::uint64_t transfer, Claimant& c);
  wire::Sink on_claimed(const wire::FrameHeader& h);
  wire::Sink on_attached(const wire::FrameHeader& h);
  void send_attach(std::uint64_t key, RegionAttach& a);
  void on_status(const wire::FrameHeader& h, const std::string& message);
  void keepalive();
  std::string describe() const;

  Context ctx_;
  Client& client_;
  std::string method_;
  std::string peer_name_;
  std::uint64_t max_payload_;
  std::shared_ptr<OwnerProcess> owner_;
  std::unique_ptr<wire::StreamConnection> conn_;
  kit::PendingRequests<Request> pending_;
  std::unordered_set<std::uint64_t> transfers_;
  /// Transfers whose claims wait for the owner's proof (its HELLO).
  std::vector<std::uint64_t> unsent_;
  /// Region attachments through this link, by key; those whose ATTACH waits for the proof.
  std::unordered_set<std::uint64_t> regions_;
  std::vector<std::uint64_t> unsent_regions_;
  /// The ranges of ENDED notices not yet sent, by their frame's tag (kNoticeTag set).
  std::unordered_map<std::uint64_t, std::vector<std::byte>> notices_;
  std::uint64_t next_notice_ = 1;
  static constexpr std::uint64_t kNoticeTag = std::uint64_t{1} << 61;
  /// The tag of attachment `key`'s ATTACHED payload sink (transfer ids never have bit 60).
  static constexpr std::uint64_t region_sink(std::uint64_t key) noexcept {
    return key | (std::uint64_t{1} << 60);
  }
  bool proven_ = false;
  std::optional<Error> refusal_;  ///< why the owner was refused at HELLO
  loop::Timer keepalive_;
};

}  // namespace ferry::transport::same_host
