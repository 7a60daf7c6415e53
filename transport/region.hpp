#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ferry/error.hpp>
#include <ferry/rdma_metadata.hpp>

#include "transport/memory.hpp"
#include "transport/token.hpp"
#include "transport/transport.hpp"

namespace ferry::transport {

/// A region as a transport serves it: memory that any number of peers attach to with `token`,
/// each attachment then holding a credential of its own (docs/regions.md).
struct RegionExposure {
  std::uint64_t id = 0;
  Token token{};
  Access access = Access::read;  ///< read, write or read_write
  std::vector<Region> regions;
};

/// (owner address, length) pairs: the ranges a transfer on an attachment reached.
using Ranges = std::vector<std::pair<std::uint64_t, std::uint64_t>>;

/// A peer attached to a region.
struct Attachment {
  std::uint64_t id = 0;  ///< unique among this connector's attachments (bit 62 set)
  std::uint64_t region = 0;
  std::string method;
  std::string peer;     ///< the peer, described for messages
  std::string peer_id;  ///< its connector id (16 hex digits), or empty
  Access access = Access::read;
};

/// A transfer on an attachment ended, as its peer told the owner. For a write that completed,
/// told only once its bytes are in the owner's memory.
struct RegionNotice {
  std::uint64_t attachment = 0;
  Access access = Access::read;
  Ranges ranges;
  std::string tag;
  std::optional<Error> error;  ///< none: it completed
};

/// How a transport reports on a region. Called on the loop thread, never from inside a call
/// into the transport, and never for a region after end_region() (or for an attachment after
/// revoke_attachment()) has returned.
class RegionObserver {
 public:
  virtual ~RegionObserver() = default;
  virtual void on_attached(const Attachment& attachment) = 0;
  virtual void on_region_transfer(const RegionNotice& notice) = 0;
  /// The attachment ended by the peer: it detached (no error) or was lost (error).
  virtual void on_detached(std::uint64_t attachment, const std::optional<Error>& error) = 0;
};

/// What attaching asks of a transport.
struct AttachSpec {
  std::uint64_t region = 0;  ///< the region's id at its owner
  Token token{};
  Access access = Access::read;  ///< what this attachment will do: read, write or both
  Endpoint endpoint;             ///< the owner's endpoint of this transport's method
  std::string peer_name;         ///< for error messages
  /// The region's memory at its owner, as (address, length) ranges (its metadata's
  /// descriptors). Every transfer's remote ranges are checked against them at start(), before
  /// any byte moves (the one-sided methods' owners see no request to refuse); empty: no check.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
};

/// How a transport reports on an attachment, the active side. Called on the loop thread,
/// never from inside a call into the transport, never after the RemoteRegion is gone.
class AttachObserver {
 public:
  virtual ~AttachObserver() = default;
  virtual void on_attached() = 0;
  /// Attaching failed; `setup`: before the owner was reached (another method may work).
  virtual void on_attach_failed(const Error& error, bool setup) = 0;
  /// After on_attached: the owner revoked the attachment or ended the region, or the
  /// connection was lost. Transfers under way end with their own errors.
  virtual void on_detached(const Error& error) = 0;
};

/// A small transfer moved on the calling thread, under an attachment's credential (cma: its
/// grant, held for the copy, so that revoking waits for it as for any copy). Any thread; host
/// memory on both sides. It does not tell the owner: the caller then has RemoteRegion::ended()
/// do that, on the loop.
class DirectCopy {
 public:
  virtual ~DirectCopy() = default;
  /// Copies `segments` for `access`; none: every byte is in place. The credential has ended,
  /// or the copy failed: why (nothing more is done).
  virtual std::optional<Error> copy(Access access, const std::vector<Segment>& segments) const = 0;
  /// Most segments one copy takes.
  virtual std::size_t max_segments() const = 0;
};

/// The active side of one attachment. Destroying it detaches: transfers still under way are
/// cancelled (as Transfer::cancel does) and the owner is told.
class RemoteRegion {
 public:
  virtual ~RemoteRegion() = default;
  /// After on_attached: the calling thread's path for small transfers, or null where the method
  /// has none. Valid until the RemoteRegion goes (a copy after the attachment ended is refused).
  virtual std::shared_ptr<const DirectCopy> direct() const { return nullptr; }
  /// Loop thread: tells the owner that a transfer made through direct() ended (`spec`: its
  /// access, segments and region_tag), as a transfer's own end would.
  virtual void ended(const TransferSpec& spec, const std::optional<Error>& error) {
    (void)spec;
    (void)error;
  }
  /// Starts a transfer on the attachment (after on_attached). `spec.remote_id`, `token` and
  /// `endpoint` are filled in here; `spec.region_tag` is the tag the owner sees. Throws
  /// Error(InvalidState) before on_attached or after on_detached.
  virtual std::unique_ptr<Transfer> start(TransferSpec spec, TransferObserver& observer) = 0;
};

/// The id of the `n`th attachment a transport makes: operation ids never have bit 62.
constexpr std::uint64_t attachment_id(std::uint64_t n) noexcept {
  return (std::uint64_t{1} << 62) | n;
}

}  // namespace ferry::transport
