#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/context.hpp"
#include "transport/kit/exposures.hpp"
#include "transport/kit/lifetime.hpp"
#include "transport/region.hpp"

namespace ferry::transport::kit {

/// The bookkeeping every transport shares for the regions it serves (docs/regions.md).
///
/// An attachment is an exposure of its own in the transport's Exposures: a fresh id (bit 62
/// set) and secret, the region's memory, the access the peer asked for, bound to the
/// connection that attached. So every request on an attachment is checked where every
/// request of a passive operation is (ExposureTable::check), and revoking one peer is revoking
/// one exposure. What differs: a transfer's end (ENDED) is a notice, not the exposure's end,
/// and losing the connection ends the attachment, not the region.
///
/// Loop thread only. Observer calls are deferred, in the order of the events, and dropped once
/// the region ended or the attachment was revoked by its owner.
class Regions {
 public:
  Regions(std::string method, Exposures& exposures, Defer defer);
  ~Regions();
  Regions(const Regions&) = delete;
  Regions& operator=(const Regions&) = delete;

  /// Starts serving; throws Error(Internal) if the id is taken.
  void add(const RegionExposure& region, RegionObserver& observer);

  struct Verdict {
    ErrorCode code = ErrorCode::Internal;  ///< meaningful only when !ok
    std::string message;
    std::uint64_t attachment = 0;
    Token secret{};
    bool ok() const noexcept { return attachment != 0; }
  };
  /// An ATTACH of region `region` by connection `conn`: the token, then the access `flags`
  /// ask for (read, write or both, within the region's). On success the attachment exists,
  /// bound to `conn`, and the verdict holds its id and secret for that peer alone. The same
  /// refusal for an unknown region and a wrong token.
  Verdict attach(std::uint64_t region, const Token& token, std::uint16_t flags, std::uint64_t conn,
                 const std::string& name, const std::string& description,
                 const std::string& peer_id);

  /// Whether `id` is a live attachment (not an operation).
  bool is_attachment(std::uint64_t id) const { return attachments_.count(id) != 0; }

  /// An ENDED on attachment `id` from connection `conn`: the secret, the access kind (flags:
  /// read or write, one the attachment allows), and every (addr, len) range of `payload`
  /// inside the region. On success the owner hears of it (deferred); else the verdict says
  /// why and nobody hears anything.
  Verdict ended(std::uint64_t id, const Token& secret, std::uint16_t flags,
                std::optional<Error> outcome, std::string tag, const void* payload,
                std::size_t bytes, std::uint64_t conn);
  /// Most bytes of ranges an ENDED may carry.
  static constexpr std::size_t kMaxEndedBytes = 16 * 4096;
  /// Most bytes of tag.
  static constexpr std::size_t kMaxTag = 256;
  /// Most live attachments one connection may hold, and one region may have: each costs the
  /// owner memory, and a grant slot or memory windows by some methods.
  static constexpr std::size_t kMaxPerConnection = 256;
  static constexpr std::size_t kMaxPerRegion = 4096;

  /// A DETACH of `id` by connection `conn` with its secret: the attachment ends and the owner
  /// hears on_detached (no error). False when the secret or connection does not fit.
  bool detach(std::uint64_t id, const Token& secret, std::uint64_t conn);
  /// Whether `secret` and `conn` are those of live attachment `id`.
  bool holds(std::uint64_t id, const Token& secret, std::uint64_t conn) const;

  /// The owner ends attachment `id`; no observer call. Returns the connection it was bound to
  /// (0: none or unknown).
  std::uint64_t revoke(std::uint64_t id);
  /// The owner ends region `id`: every attachment is revoked. Returns them as
  /// (attachment, connection) pairs.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> end(std::uint64_t id);
  /// Region `id`'s attachments as (attachment, connection) pairs.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> attachments_of(std::uint64_t id) const;
  /// Region `id`'s live attachments made by connections that said they are connector
  /// `peer_id` (in their HELLO), whether or not the owner has heard of them yet.
  std::vector<std::uint64_t> attachments_of_peer(std::uint64_t id,
                                                 const std::string& peer_id) const;
  /// Drops everything, with no observer calls.
  void clear();

  std::size_t regions() const noexcept { return regions_.size(); }
  std::size_t attachments() const noexcept { return attachments_.size(); }

 private:
  struct Served {
    RegionExposure region;
    RegionObserver* observer = nullptr;
  };
  /// Hears the attachment's exposure lost with its connection.
  struct Lost final : ExposureObserver {
    Regions* owner = nullptr;
    std::uint64_t id = 0;
    void on_claimed(const Claim&) override {}
    void on_peer_finished(const std::string&, const std::optional<Error>&) override {}
    void on_peer_lost(const Error& error) override { owner->lost(id, error); }
  };
  struct Att {
    std::uint64_t region = 0;
    std::uint64_t conn = 0;
    Token secret{};
    Access access = Access::read;
    std::string peer_id;
    std::unique_ptr<Lost> lost;
    bool gone = false;  ///< the peer detached or was lost; the owner hears it next
  };

  void lost(std::uint64_t id, const Error& error);
  /// Tells the region's observer, later, unless the region or the attachment has gone by then.
  void notify(std::uint64_t id, std::function<void(RegionObserver&)> call, bool last);

  std::string method_;
  Exposures& exposures_;
  Defer defer_;
  std::unordered_map<std::uint64_t, Served> regions_;
  std::unordered_map<std::uint64_t, Att> attachments_;
  std::uint64_t next_ = 1;
  Lifetime life_;
};

}  // namespace ferry::transport::kit
