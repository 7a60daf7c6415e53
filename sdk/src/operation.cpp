#include <ferry/operation.hpp>

#include "sdk/src/operation_state.hpp"

namespace ferry {

Operation::Operation() noexcept = default;

Operation::Operation(std::shared_ptr<detail::OperationState> state) noexcept
    : state_(std::move(state)) {}

Operation::Operation(Operation&& other) noexcept = default;

Operation& Operation::operator=(Operation&& other) noexcept {
  if (this != &other) {
    if (state_) state_->cancel();
    state_ = std::move(other.state_);
  }
  return *this;
}

Operation::~Operation() {
  // cancel() swallows a closed loop; nothing else in it throws.
  if (state_) state_->cancel();
}

const detail::OperationState& Operation::state() const {
  if (!state_) throw Error(ErrorCode::InvalidState, "empty operation handle");
  return *state_;
}

OperationKind Operation::kind() const { return state().kind; }

OperationStatus Operation::status() const noexcept {
  return state_ ? state_->status() : OperationStatus::uninitialized;
}

const std::string& Operation::id() const { return state().id_hex; }

const std::vector<Descriptor>& Operation::descriptors() const { return state().local; }

std::string Operation::method() const { return state().method(); }

std::optional<Error> Operation::error() const { return state().error(); }

void Operation::wait_for_completion() const { state().wait(); }

bool Operation::wait_for_completion(std::chrono::nanoseconds timeout) const {
  return state().wait_for(timeout);
}

std::optional<PeerIdentity> Operation::peer() const { return state().peer(); }

OperationStatus Operation::wait(std::chrono::nanoseconds timeout) const {
  return state().wait_status(timeout);
}

void Operation::on_complete(CompletionCallback callback) {
  if (!callback) throw Error(ErrorCode::InvalidArgument, "on_complete needs a callback");
  state();
  state_->on_complete(std::move(callback));
}

void Operation::cancel() {
  state();
  state_->cancel();
}

const RdmaMetadata& ReadableOperation::metadata() const { return state().metadata; }

const RdmaMetadata& WritableOperation::metadata() const { return state().metadata; }

}  // namespace ferry
