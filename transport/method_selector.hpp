#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ferry/rdma_metadata.hpp>

#include "transport/transport.hpp"

namespace ferry::transport {

/// Chooses how an active operation reaches a peer: among the methods both sides offer, those
/// that move the memory kinds of both sides and fit the locality (a same-host-only method only
/// between processes of one host), best rank first, minus the methods that already failed at
/// set-up toward that peer. Knows capabilities only, never transports by name.
///
/// Loop thread only.
class MethodSelector {
 public:
  /// What the operation needs of a method.
  struct Needs {
    std::string peer;       ///< the peer's connector id: failures are remembered per peer
    std::string peer_name;  ///< for messages
    bool same_host = false;
    std::uint8_t memory_kinds = bit(MemoryKind::host);  ///< of both sides' memory together
    /// Why a local method cannot reach the peer's endpoint of its method (its transport's
    /// own judgement, Transport::unreachable), by method; absent: it may.
    std::map<std::string, Error> unreachable{};
  };
  struct Choice {
    std::size_t local = 0;  ///< index into the capabilities given
    Endpoint endpoint;      ///< the peer's endpoint of that method
  };

  /// A failure is remembered for this long; then the method is tried again.
  explicit MethodSelector(std::chrono::milliseconds remember = std::chrono::minutes(5))
      : remember_(remember) {}

  /// Usable methods, best first. Throws Error(NoCommonMethod) naming what each side offers and
  /// why each shared method was passed over, when none is usable.
  std::vector<Choice> choose(const std::vector<Capabilities>& local,
                             const std::vector<Endpoint>& remote, const Needs& needs) const;

  /// `method` failed at set-up toward `peer` with `error` (refused, unreachable, not
  /// permitted): later choices for that peer fall back to the next method.
  void failed(const std::string& peer, const std::string& method, const Error& error);
  /// Why `method` is passed over for `peer` because it failed there before: the remembered
  /// error's code, and a message that says so; none when it did not fail, or long enough ago.
  std::optional<Error> failure(const std::string& peer, const std::string& method) const;

 private:
  /// Why `caps`'s method cannot serve `needs`; none when it may.
  std::optional<std::string> passed_over_because(const Capabilities& caps,
                                                 const Needs& needs) const;

  struct Failure {
    Error error;
    std::chrono::steady_clock::time_point at;
  };
  std::chrono::milliseconds remember_;
  std::map<std::pair<std::string, std::string>, Failure> failed_;  // (peer, method)
};

}  // namespace ferry::transport
