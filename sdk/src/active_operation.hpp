#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loop/uv_handle.hpp"
#include "sdk/src/operation_state.hpp"
#include "transport/transport.hpp"

namespace ferry::sidechannel {
struct Message;
}

namespace ferry::detail {

/// An active operation paired by subject, while it asks for the metadata. (At namespace scope:
/// a nested struct with member initializers cannot sit in a std::optional member of the class
/// that encloses it.)
struct AskingState {
  std::string subject;
  std::vector<std::uint64_t> requests;  ///< still unanswered, oldest first: any answer counts
  loop::Timer retry;
  std::chrono::milliseconds backoff{0};
};

/// A read or write: acts on a peer's passive operation, described by metadata given or asked
/// for at a subject.
class ActiveOperation final : public OperationState, public transport::TransferObserver {
 public:
  ActiveOperation(std::shared_ptr<Core> core, std::uint64_t id, OperationKind kind,
                  std::vector<Descriptor> local);

  /// Loop thread: checks `remote` against this operation and starts the transfer by the best
  /// method both sides have, falling back to the next when one fails at set-up. Throws as
  /// begin_read / begin_write do.
  void start(const RdmaMetadata& remote);

  /// Pairing by subject: where to ask, and the pairing's own state (sdk/src/subject_pairing).
  using Asking = AskingState;
  std::optional<Asking> asking;
  /// The peer's metadata once known: however the operation ends, its owner is told.
  std::optional<RdmaMetadata> remote;

  // transport::TransferObserver
  void on_transfer_complete() override;
  void on_transfer_failed(const Error& error) override;
  void on_transfer_setup_failed(const Error& error) override;

 private:
  bool try_next();
  void setup_failed(const std::string& method, const Error& e);
  std::string no_method_text() const;

  void release(OperationStatus final_status, const Error& reason) override;
  std::string deadline_text(std::chrono::milliseconds timeout) const override;
  std::string pairing_text(std::chrono::milliseconds timeout) const override;

  std::unique_ptr<transport::Transfer> transfer_;
  std::vector<std::shared_ptr<const transport::Registration>> registrations_;
  std::vector<std::pair<transport::Transport*, Endpoint>> candidates_;  ///< best first
  std::size_t next_candidate_ = 0;
  std::string tried_;             ///< the methods that failed at set-up, and why
  bool only_unreachable_ = true;  ///< every set-up failure so far was retryable (PeerLost, ...)
};

}  // namespace ferry::detail
