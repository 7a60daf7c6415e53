#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/context.hpp"
#include "transport/kit/exposure_table.hpp"
#include "transport/kit/interval_set.hpp"
#include "transport/kit/lifetime.hpp"
#include "transport/transport.hpp"

namespace ferry::transport::kit {

/// What a claim carries (the payload Exposures::check_claim reads): the owner ranges
/// `segments` reach, merged where they follow each other, as (addr, len) pairs of 8 + 8 bytes.
/// Empty segments reach nothing and are left out.
std::vector<std::byte> claim_payload(const std::vector<Segment>& segments);

/// The bookkeeping every transport shares for the passive operations it serves: the access
/// checks (ExposureTable), who claimed what, which bytes of a writable were written, sends
/// still reading a readable's memory, and the observer calls, always deferred so that an
/// observer is never called from inside a call into the transport, and never after revoke().
///
/// A transport calls it on the loop thread only. Destructor: pending observer calls are
/// dropped.
class Exposures {
 public:
  Exposures(std::string method, Defer defer);
  ~Exposures();
  Exposures(const Exposures&) = delete;
  Exposures& operator=(const Exposures&) = delete;

  using Entry = ExposureTable::Entry;

  /// Starts serving; throws Error(Internal) if the id is taken.
  void add(const Exposure& exposure, ExposureObserver& observer);
  Entry* find(std::uint64_t id) { return table_.find(id); }
  /// See ExposureTable::check.
  ExposureTable::Verdict check(std::uint64_t id, const Token& token, Access access,
                               std::uint64_t addr, std::uint64_t len, std::uint64_t conn) {
    return table_.check(id, token, access, addr, len, conn);
  }

  /// Checks a DONE for operation `id` from connection `conn`: `flags` names an access kind
  /// (else ProtocolError), and the token is live for that kind, as check() does.
  ExposureTable::Verdict check_done(std::uint64_t id, const Token& token, std::uint16_t flags,
                                    std::uint64_t conn);

  /// The (addr, len) ranges a claim names.
  using Ranges = std::vector<std::pair<std::uint64_t, std::uint64_t>>;
  /// Checks a claim of operation `id` by connection `conn`: the access kind (the frame's
  /// flags), then every range of `payload` (pairs of 8-byte address and length, as the wire
  /// carries them) as check() does, none empty. On success the verdict names the entry and
  /// `ranges` holds the ranges; else the verdict says why.
  ExposureTable::Verdict check_claim(std::uint64_t id, const Token& token, std::uint16_t flags,
                                     const void* payload, std::size_t bytes, std::uint64_t conn,
                                     Ranges& ranges);

  /// Binds `entry` to connection `conn` if nobody has claimed it yet, draws the claim's
  /// secret and tells the observer (deferred). Returns the secret when this call claimed it:
  /// the transport hands it to that peer alone.
  /// `name` is the peer's name as refusals to others show it; `description` names it in
  /// full for the owner's own messages.
  std::optional<Token> claim(Entry& entry, std::uint64_t conn, const std::string& name,
                             const std::string& description, const std::string& peer_id);

  /// A writable's bytes [addr, addr + len) landed.
  void landed(std::uint64_t id, std::uint64_t addr, std::uint64_t len);
  /// Bytes of a writable written at least once, and bytes it exposes.
  std::uint64_t written(std::uint64_t id) const;
  std::uint64_t exposed(std::uint64_t id) const;
  /// For a writable whose peer `peer` says it is done: why it is not (ProtocolError: "peer P
  /// said it was done after writing W of E bytes"); none when every exposed byte was written
  /// at least once (bytes written twice do not count twice).
  std::optional<Error> unwritten(std::uint64_t id, const std::string& peer) const;

  /// A send reading the memory of readable `id` started / finished. sent() returns true when
  /// the peer already said it was done and this was the last send: finish it now.
  void sending(std::uint64_t id);
  bool sent(std::uint64_t id);
  /// The peer said it is done reading: true if no send still reads the memory (finish now);
  /// else it finishes when sent() says so.
  bool done_reading(std::uint64_t id);

  /// The peer finished (with `error`: it failed). The token dies now; the observer hears
  /// on_peer_finished (deferred). Returns the connection the exposure was bound to (0: none).
  std::uint64_t finish(std::uint64_t id, std::optional<Error> error);
  /// Ends serving without an observer call (the owner revoked it). Returns the bound
  /// connection (0: none).
  std::uint64_t revoke(std::uint64_t id);
  /// Connection `conn` is gone: every exposure it claimed ends, and its observer hears
  /// on_peer_lost(error) (deferred).
  void lose_connection(std::uint64_t conn, const Error& error);
  /// Drops everything, with no observer calls.
  void clear();
  std::size_t size() const noexcept { return table_.size(); }

 private:
  struct Extra {
    ExposureObserver* observer = nullptr;
    IntervalSet written;
    std::uint64_t sends = 0;    ///< sends still reading the memory (readables)
    bool done_pending = false;  ///< the peer said done; finish once sends is 0
  };
  void notify(std::uint64_t id, std::function<void(ExposureObserver&)> call, bool last);

  std::string method_;
  Defer defer_;
  ExposureTable table_;
  std::unordered_map<std::uint64_t, Extra> extra_;
  /// Deferred calls do nothing once this object is gone, or cleared.
  Lifetime life_;
};

}  // namespace ferry::transport::kit
