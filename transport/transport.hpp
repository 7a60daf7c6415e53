#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ferry/error.hpp>
#include <ferry/rdma_metadata.hpp>

#include "transport/memory.hpp"
#include "transport/registration.hpp"

namespace ferry::transport {

/// What the peer of a passive operation may do to its memory. A request names read or write;
/// a region's attachment may allow both (read_write, the two bits together).
enum class Access : std::uint8_t { read = 1, write = 2, read_write = 3 };

/// Whether `allowed` (a kind or read_write) lets a peer do `wanted` (read or write).
constexpr bool allows(Access allowed, Access wanted) noexcept {
  return (static_cast<std::uint8_t>(allowed) & static_cast<std::uint8_t>(wanted)) != 0;
}

/// One contiguous piece of an active transfer: `len` bytes at the peer's `remote_addr`
/// (inside one of its regions) matched with `len` bytes at `local`.
struct Segment {
  std::uint64_t remote_addr = 0;
  std::byte* local = nullptr;
  std::uint64_t len = 0;
  /// The CUDA device ordinal of the local memory; -1 when it is host memory.
  int cuda_device = -1;
};

/// What a transport can do; the method selector chooses by these, never by name.
struct Capabilities {
  std::string method;  ///< the name put into endpoints ("tcp")
  /// Preference among the methods both sides offer: the highest rank that fits wins
  /// (verbs 300, cma 200, tcp 100).
  int rank = 0;
  /// The memory kinds it moves, as a set of bit(MemoryKind); host at least.
  std::uint8_t memory_kinds = bit(MemoryKind::host);
  bool same_host_only = false;    ///< works only between processes of one host
  bool passive_cpu_free = false;  ///< the passive side's CPU does not touch the bytes
  bool moves(MemoryKind kind) const noexcept { return (memory_kinds & bit(kind)) != 0; }
};

/// The claim of a passive operation by its one peer.
struct Claim {
  std::string method;     ///< the method it came by
  std::string peer;       ///< the peer, described for messages
  std::string peer_name;  ///< its connector's name, as its HELLO gave it
  std::string peer_id;  ///< its connector id (16 hex digits) if the transport learns it, else empty
  /// A fresh secret the transport handed to the claimant alone (over the claim's own
  /// connection): completion notices that arrive by other ways count only if they carry it.
  Token secret{};
};

/// A passive operation's memory as a transport serves it.
struct Exposure {
  std::uint64_t id = 0;
  Token token{};
  Access access = Access::read;
  std::vector<Region> regions;
};

/// How a transport reports on an exposure. Called on the loop thread, never from inside a
/// call into the transport, and never after revoke() of that exposure has returned.
class ExposureObserver {
 public:
  virtual ~ExposureObserver() = default;
  /// A peer presented the token for the first time; the exposure is now bound to it.
  virtual void on_claimed(const Claim& claim) = 0;
  /// The peer finished: with no error, all its bytes are in place (write) or it has read
  /// all it needed (read); with an error, it failed and says why. The exposure is gone.
  virtual void on_peer_finished(const std::string& peer, const std::optional<Error>& error) = 0;
  /// The peer's connection dropped before it finished. The exposure is gone.
  virtual void on_peer_lost(const Error& error) = 0;
};

/// How a transport reports on an active transfer. Called on the loop thread, never from
/// inside a call into the transport, and never after the transfer was cancelled.
class TransferObserver {
 public:
  virtual ~TransferObserver() = default;
  virtual void on_transfer_complete() = 0;
  virtual void on_transfer_failed(const Error& error) = 0;
  /// The transfer failed while being set up, before any byte of the local or remote memory
  /// was touched (the method was refused or cannot reach the peer): another method may still
  /// work. By default the same as on_transfer_failed.
  virtual void on_transfer_setup_failed(const Error& error) { on_transfer_failed(error); }
};

/// Tells `observer` how a transfer ended: complete (no error), failed, or failed at set-up.
inline void report(TransferObserver& observer, const std::optional<Error>& error, bool setup) {
  if (error && setup)
    observer.on_transfer_setup_failed(*error);
  else if (error)
    observer.on_transfer_failed(*error);
  else
    observer.on_transfer_complete();
}

/// Reports the end of transfer `id` to its observer after the current loop callback (through
/// `defer`), once: nothing if the transport is gone by then (`life` expired), or the transfer
/// was forgotten or already reported. `transfers` maps ids to transfers that have an
/// `observer` and a `notified` flag.
template <class Defer, class Transfers>
void report_later(const Defer& defer, std::weak_ptr<int> life, Transfers& transfers,
                  std::uint64_t id, std::optional<Error> error, bool setup) {
  defer([life = std::move(life), &transfers, id, error = std::move(error), setup] {
    if (life.expired()) return;
    auto it = transfers.find(id);
    if (it == transfers.end() || it->second->notified) return;
    it->second->notified = true;
    report(*it->second->observer, error, setup);
  });
}

/// What `fn` throws as Error, or none when it returns: a check ("may this be done?") made of
/// a call that throws when it may not (Transport::endpoint_error of a parse, say).
template <class F>
std::optional<Error> refusal(F&& fn) {
  try {
    std::forward<F>(fn)();
  } catch (const Error& e) {
    return e;
  }
  return std::nullopt;
}

struct RegionExposure;
class RegionObserver;
struct AttachSpec;
class AttachObserver;
class RemoteRegion;

/// What an active operation asks of a transport.
struct TransferSpec {
  std::uint64_t remote_id = 0;  ///< the passive operation's id at its owner
  Token token{};
  Access access = Access::read;  ///< read: remote -> local; write: local -> remote
  std::vector<Segment> segments;
  Endpoint endpoint;      ///< one of the passive owner's endpoints, of this transport's method
  std::string peer_name;  ///< for error messages
  /// A transfer on a region's attachment (remote_id and token are the attachment's): it ends
  /// with an ENDED notice carrying this tag and its ranges, and does not end the attachment.
  std::optional<std::string> region_tag;
};

/// An active transfer under way. Destroying it cancels it.
class Transfer {
 public:
  virtual ~Transfer() = default;
  /// The claim secret the owner handed to this transfer, once it has (see Claim::secret).
  virtual std::optional<Token> claim_secret() const { return std::nullopt; }
  /// Stops the transfer and tells the peer `reason`. When it returns, the transport touches
  /// the local memory no more and the observer is not called again.
  virtual void cancel(const Error& reason) = 0;
};

/// A way to move bytes (tcp, cma, verbs). Every method runs on the loop thread.
///
/// Cancellation contract: revoke() and Transfer::cancel() are synchronous; when they return,
/// no byte of that memory is read or written by the transport again, and no observer call
/// for it follows.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual const Capabilities& capabilities() const = 0;
  /// Where peers reach this transport; put into metadata.
  virtual std::vector<Endpoint> endpoints() const = 0;

  /// Registers `region` with this method (a memory registration for RDMA, nothing for tcp)
  /// through the transport's registration cache: a range inside one registered before reuses
  /// it. The registration lasts while the handle lives (and the cache may keep it longer).
  /// Throws Error(Unsupported) for memory this method cannot move.
  virtual std::shared_ptr<const Registration> register_memory(const Region& region) = 0;
  /// The same for memory a peer is to reach (a passive operation's): a method may move memory
  /// on the active side that it cannot let peers reach (cuda_ipc shares CUDA memory only, but
  /// copies it to or from host memory of the active side's).
  virtual std::shared_ptr<const Registration> register_exposed(const Region& region) {
    return register_memory(region);
  }

  /// Serves `exposure` to the one peer that presents its token. Returns what a peer needs
  /// beyond the endpoint to reach this memory by this method (remote keys, say), put into the
  /// metadata's endpoint of this method as its `info`; empty when nothing is needed.
  /// Throws Error(Unsupported) for memory this method can move only from the active side (the
  /// operation is then not offered by this method).
  virtual std::string expose(const Exposure& exposure, ExposureObserver& observer) = 0;
  /// Ends serving exposure `id`: its token is dead, and a peer with requests under way is
  /// answered with `reason`. No effect if unknown.
  virtual void revoke(std::uint64_t id, const Error& reason) = 0;

  /// Loop thread: the connections this transport holds open now, both ways (its links to
  /// peers, and peers connected to its listener). Stats.
  virtual std::size_t connections() const { return 0; }

  /// Why this transport cannot reach the peer endpoint `endpoint` (of its method) from here,
  /// e.g. a same-host method toward another host; none when it may. Judged from the endpoint
  /// alone, before any transfer; a method that passes may still fail at set-up.
  virtual std::optional<Error> unreachable(const Endpoint& endpoint) const {
    (void)endpoint;
    return std::nullopt;
  }

  /// Why start() would refuse `endpoint` (of its method) as InvalidMetadata, e.g. an address
  /// it cannot parse; none when it is well formed. Judged from the endpoint alone, from any
  /// thread (the connector checks metadata before handing the operation to the loop).
  virtual std::optional<Error> endpoint_error(const Endpoint& endpoint) const {
    (void)endpoint;
    return std::nullopt;
  }

  /// Starts an active transfer. Throws Error for a spec it cannot carry out at all
  /// (e.g. an endpoint address it cannot parse); later failures go to the observer.
  virtual std::unique_ptr<Transfer> start(TransferSpec spec, TransferObserver& observer) = 0;

  /// Closes every connection and the listener; every exposure and transfer is dropped
  /// without observer calls. The transport serves nothing after.
  virtual void close() = 0;

  // Regions (transport/region.hpp). A method that does not serve them yet keeps these
  // defaults: serve_region and attach throw Error(Unsupported), and the connector offers
  // regions by the methods that do.

  /// Whether this method serves regions and attaches to them.
  virtual bool serves_regions() const { return false; }
  /// Serves `region` to every peer that attaches with its token. Returns the endpoint info,
  /// as expose() does.
  virtual std::string serve_region(const RegionExposure& region, RegionObserver& observer);
  /// Ends attachment `attachment` (an id on_attached named): its secret dies, its transfers
  /// under way end with `reason` at the peer, and when it returns none of that peer's requests
  /// touches the memory again. No effect if unknown.
  virtual void revoke_attachment(std::uint64_t attachment, const Error& reason);
  /// Region `id`'s live attachments by connector `peer_id` (as its connections said in their
  /// HELLO), also those the observer has not heard of yet.
  virtual std::vector<std::uint64_t> attachments_of_peer(std::uint64_t id,
                                                         const std::string& peer_id) const {
    (void)id;
    (void)peer_id;
    return {};
  }
  /// Ends serving region `id`: its token dies and every attachment is revoked as above.
  /// No observer call follows. No effect if unknown.
  virtual void end_region(std::uint64_t id, const Error& reason);
  /// Attaches to a peer's region. Throws Error for a spec it cannot carry out at all; later
  /// outcomes go to the observer.
  virtual std::unique_ptr<RemoteRegion> attach(AttachSpec spec, AttachObserver& observer);
};

}  // namespace ferry::transport
