#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/memory.hpp"
#include "transport/token.hpp"
#include "transport/transport.hpp"

namespace ferry::transport::kit {

/// Whether [addr, addr + len) lies inside `region`, without overflow for any inputs.
bool range_inside(const Region& region, std::uint64_t addr, std::uint64_t len) noexcept;

/// The exposures a transport serves, and the one place where a peer's request is checked:
/// live operation, token, kind, claim and range. Loop thread only.
class ExposureTable {
 public:
  /// The refusal of a request whose id and token match no live operation: the same words for
  /// an unknown id, a wrong token and an operation that is over (no oracle), with the likely
  /// reason for the last.
  static constexpr const char* kNoLiveOperation =
      "no live operation matches this id and token (a passive operation serves one peer, once: "
      "it may be over already, e.g. read by another peer, or never was)";

  struct Entry {
    Exposure exposure;
    ExposureObserver* observer = nullptr;
    std::uint64_t bound_to = 0;  ///< the connection (transport-defined id) that claimed it
    std::string peer;            ///< the claiming peer's name
    /// The memory the token grants: the regions merged where they overlap or touch, sorted
    /// by address, disjoint. Requests are checked against these.
    std::vector<Region> spans;
    /// tcp: whether the host memory of `spans` was found mapped, looked at once, at the first
    /// read (memory freed while exposed is refused by name instead of failing a send).
    enum class Mapped : std::uint8_t { unchecked, yes, no };
    Mapped mapped = Mapped::unchecked;
  };

  struct Verdict {
    ErrorCode code = ErrorCode::Internal;  ///< meaningful only when !ok
    std::string message;
    Entry* entry = nullptr;
    std::byte* ptr = nullptr;  ///< where the checked range starts in local memory
    bool ok() const noexcept { return entry != nullptr; }
  };

  /// Throws Error(Internal) if the id is taken.
  Entry& add(const Exposure& exposure, ExposureObserver& observer);
  /// `regions` merged where they overlap or touch, sorted by address, disjoint: what an
  /// entry's spans are.
  static std::vector<Region> merged(std::vector<Region> regions);
  /// False if unknown.
  bool remove(std::uint64_t id);
  Entry* find(std::uint64_t id);
  const Entry* find(std::uint64_t id) const;
  std::size_t size() const noexcept { return entries_.size(); }
  template <class F>
  void for_each(F&& fn) {
    for (auto& [id, entry] : entries_) fn(entry);
  }

  /// Checks a request from connection `conn` for `len` bytes at the owner's address `addr`;
  /// `len == 0` checks a notice (no range). The same message for an unknown id and a wrong
  /// token, so that probing learns nothing.
  Verdict check(std::uint64_t id, const Token& token, Access access, std::uint64_t addr,
                std::uint64_t len, std::uint64_t conn);

  /// Binds the entry to `conn` if unbound; returns true when this call bound it.
  static bool claim(Entry& entry, std::uint64_t conn, const std::string& peer);

 private:
  std::unordered_map<std::uint64_t, Entry> entries_;
};

}  // namespace ferry::transport::kit
