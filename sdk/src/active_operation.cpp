#include "sdk/src/active_operation.hpp"

#include "sdk/src/core.hpp"
#include "sdk/src/stream_match.hpp"
#include "sdk/src/subject_pairing.hpp"
#include "transport/token.hpp"

namespace ferry::detail {

ActiveOperation::ActiveOperation(std::shared_ptr<Core> core_, std::uint64_t id_,
                                 OperationKind kind_, std::vector<Descriptor> local_)
    : OperationState(std::move(core_), id_, kind_, false, std::move(local_)) {}

void ActiveOperation::start(const RdmaMetadata& m) {
  // Valid metadata names its owner: from here on, however this ends, the owner is told.
  m.validate();
  remote = m;
  set_peer(m.owner);
  check_remote(m, kind, local);
  candidates_ = core->choose(m, memory_kinds_of(local));
  next_candidate_ = 0;
  if (!try_next()) throw Error(ErrorCode::NoCommonMethod, no_method_text());
}

std::string ActiveOperation::no_method_text() const {
  return "no method could reach peer '" + remote->owner.name + "' (" + tried_ + ")";
}

bool ActiveOperation::try_next() {
  const RdmaMetadata& m = *remote;
  while (next_candidate_ < candidates_.size()) {
    auto [transport, endpoint] = candidates_[next_candidate_++];
    transport::TransferSpec spec;
    spec.remote_id = std::stoull(m.notification_key, nullptr, 16);
    transport::token_from_hex(m.token, spec.token);
    spec.access = m.operation_kind == OperationKind::read ? transport::Access::read
                                                          : transport::Access::write;
    spec.segments = match_streams(m.descriptors, local);
    spec.endpoint = endpoint;
    spec.peer_name = m.owner.name;
    const std::string method = transport->capabilities().method;
    try {
      std::vector<std::shared_ptr<const transport::Registration>> regs;
      for (const Descriptor& d : local) regs.push_back(transport->register_memory(region_of(d)));
      set_method(method);
      registrations_ = std::move(regs);
      transfer_ = transport->start(std::move(spec), *this);
      return true;
    } catch (const Error& e) {
      // Bad metadata fails the operation; a refusal at set-up (no memory was touched) is
      // remembered for this peer, and the next method is tried.
      if (e.code() == ErrorCode::InvalidMetadata || e.code() == ErrorCode::InvalidState) throw;
      setup_failed(method, e);
    }
  }
  return false;
}

void ActiveOperation::setup_failed(const std::string& method, const Error& e) {
  core->stats.fell_back(method);
  // A method refused (not permitted, unsupported) stays refused for a while; a peer that could
  // not be reached (PeerLost, Timeout) may be back for the next operation: only tried next.
  if (!is_retryable(e.code())) {
    core->selector.failed(remote->owner.id, method, e);
    only_unreachable_ = false;
  }
  tried_ += (tried_.empty() ? "" : "; ") + method + ": " + e.message();
}

void ActiveOperation::on_transfer_setup_failed(const Error& error) {
  // The transport let go of the memory before touching it: fall back to the next method.
  setup_failed(method(), error);
  if (transfer_) transfer_.reset();
  registrations_.clear();
  auto keep = shared_from_this();
  try {
    if (try_next()) return;
    // Every method tried and none worked. A peer that no method could reach (gone, say) is
    // lost, as it would be with one method; methods refused outright leave none in common.
    if (candidates_.size() <= 1)
      finish(OperationStatus::errored, error);
    else if (only_unreachable_)
      finish(OperationStatus::errored,
             Error(error.code(), no_method_text()).set_retryable(error.retryable()));
    else
      finish(OperationStatus::errored, Error(ErrorCode::NoCommonMethod, no_method_text()));
  } catch (const Error& e) {
    finish(OperationStatus::errored, e);
  }
}

std::string ActiveOperation::deadline_text(std::chrono::milliseconds timeout) const {
  std::string text = OperationState::deadline_text(timeout);
  if (asking && !remote)
    text += " while asking for the metadata at subject '" + asking->subject +
            "': nobody served it" + core->nats_note();
  return text;
}

std::string ActiveOperation::pairing_text(std::chrono::milliseconds timeout) const {
  return "asked for the metadata at subject '" + (asking ? asking->subject : std::string()) +
         "' for " + std::to_string(timeout.count()) + " ms: nobody served it" + core->nats_note() +
         " (ConnectorOptions::subject_timeout; give the operation a deadline of its own to wait "
         "longer)";
}

void ActiveOperation::release(OperationStatus final_status, const Error& reason) {
  std::optional<transport::Token> claim;
  if (transfer_) {
    claim = transfer_->claim_secret();
    if (final_status != OperationStatus::complete) transfer_->cancel(reason);
    transfer_.reset();
  }
  registrations_.clear();
  pairing::stop_asking(*this);
  if (asking && remote)
    pairing::notify_owner(
        *this, final_status == OperationStatus::complete ? std::nullopt : std::optional(reason),
        claim);
}

void ActiveOperation::on_transfer_complete() { finish(OperationStatus::complete, std::nullopt); }

void ActiveOperation::on_transfer_failed(const Error& error) {
  finish(OperationStatus::errored, error);
}

}  // namespace ferry::detail
