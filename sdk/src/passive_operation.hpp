#pragma once

#include <atomic>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "sdk/src/operation_state.hpp"
#include "transport/transport.hpp"

namespace ferry::detail {

/// A readable or writable: memory exposed on every transport of the connector (and served by
/// subject when asked), for the one peer that claims it.
class PassiveOperation final : public OperationState, public transport::ExposureObserver {
 public:
  PassiveOperation(std::shared_ptr<Core> core, std::uint64_t id, OperationKind kind,
                   std::vector<Descriptor> local);

  /// Loop thread: registers and exposes the memory on every transport, builds the metadata.
  /// Throws what a transport throws (nothing is left exposed then).
  void expose(const transport::Token& token);

  /// Loop thread: whether a completion notice that names this operation counts: it must
  /// carry the token, and once a peer has claimed the operation, that claim's secret.
  bool accepts_notice(const std::string& token_hex, const std::string& claim_hex) const;

  /// Pairing by subject: the subscription serving the metadata (0: none) and, off the loop
  /// thread, when the server has it.
  std::uint64_t serving = 0;
  std::shared_future<void> served;
  std::string subject;
  /// Set (on cnats' thread) when a peer asked for the metadata at the subject.
  std::atomic<bool> asked{false};

  // transport::ExposureObserver
  void on_claimed(const transport::Claim& claim) override;
  void on_peer_finished(const std::string& peer, const std::optional<Error>& error) override;
  void on_peer_lost(const Error& error) override;

 private:
  void release(OperationStatus final_status, const Error& reason) override;
  std::string pairing_text(std::chrono::milliseconds timeout) const override;

  std::vector<transport::Transport*> exposed_on_;
  std::vector<std::shared_ptr<const transport::Registration>> registrations_;
  std::optional<transport::Claim> claim_;
};

}  // namespace ferry::detail
