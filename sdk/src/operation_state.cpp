#include <cstdio>

#include "sdk/src/core.hpp"
#include "transport/uv_handle.hpp"

namespace ferry::detail {

std::string hex16(std::uint64_t value) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(value));
  return buf;
}

OperationState::OperationState(std::shared_ptr<Core> core_, std::uint64_t id_, OperationKind kind_,
                               bool passive_, std::vector<Descriptor> local_)
    : core(std::move(core_)),
      id(id_),
      id_hex(hex16(id_)),
      kind(kind_),
      passive(passive_),
      local(std::move(local_)) {}

OperationState::~OperationState() = default;

void OperationState::arm(std::chrono::milliseconds timeout) {
  core->live[id] = weak_from_this();
  if (timeout.count() <= 0) return;
  timeout_ = timeout;
  deadline_ = new uv_timer_t{};
  uv_timer_init(core->loop->uv(), deadline_);
  deadline_->data = this;
  uv_timer_start(deadline_, &OperationState::on_deadline,
                 static_cast<std::uint64_t>(timeout.count()), 0);
}

void OperationState::on_deadline(uv_timer_t* timer) {
  auto* self = static_cast<OperationState*>(timer->data);
  if (self == nullptr) return;
  // Keep the state alive through finish(): the table holds it only weakly.
  auto keep = self->shared_from_this();
  self->finish(
      OperationStatus::errored,
      Error(ErrorCode::Timeout, "the operation's deadline of " +
                                    std::to_string(self->timeout_.count()) + " ms passed"));
}

void OperationState::finish(OperationStatus final_status, std::optional<Error> error) {
  if (is_final(status())) return;
  // First make the memory unreachable: revoke the token / stop the transfer, telling the
  // peer why. Only then publish the final status, so that a waiter woken by it may reuse
  // the memory at once.
  Error reason = error ? *error : Error(ErrorCode::Cancelled, "the operation ended");
  for (transport::Transport* t : exposed_on) t->revoke(id, reason);
  exposed_on.clear();
  if (transfer) {
    if (final_status != OperationStatus::complete) transfer->cancel(reason);
    transfer.reset();
  }
  if (deadline_ != nullptr) {
    uv_timer_stop(deadline_);
    deadline_->data = nullptr;
    transport::close_and_delete(deadline_);
    deadline_ = nullptr;
  }
  core->live.erase(id);

  std::vector<CompletionCallback> callbacks;
  {
    std::lock_guard lock(mu_);
    error_ = std::move(error);
    callbacks.swap(waiting_);
    set_status(final_status);
  }
  cv_.notify_all();
  for (auto& cb : callbacks) {
    core->loop->defer([self = shared_from_this(), cb = std::move(cb)] {
      std::optional<Error> e = self->error();
      cb(self->status(), e ? &*e : nullptr);
    });
  }
}

void OperationState::cancel() {
  if (is_final(status())) return;
  try {
    core->loop->call([self = shared_from_this()] {
      self->finish(OperationStatus::cancelled,
                   Error(ErrorCode::Cancelled, "the operation was cancelled"));
    });
  } catch (const Error&) {
    // The loop is closed: shutdown has ended every operation already.
  }
}

std::optional<Error> OperationState::error() const {
  std::lock_guard lock(mu_);
  return error_;
}

void OperationState::throw_if_failed() const {
  // Called with a final status; the error is set before the status.
  if (status() == OperationStatus::complete) return;
  std::lock_guard lock(mu_);
  if (error_) throw *error_;
  throw Error(ErrorCode::Cancelled, "the operation was cancelled");
}

void OperationState::wait() const {
  if (core->loop->in_loop_thread())
    throw Error(ErrorCode::WrongThread,
                "wait_for_completion() on the connector's loop thread would deadlock; use "
                "on_complete()");
  {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return is_final(status()); });
  }
  throw_if_failed();
}

bool OperationState::wait_for(std::chrono::nanoseconds timeout) const {
  if (core->loop->in_loop_thread())
    throw Error(ErrorCode::WrongThread,
                "wait_for_completion() on the connector's loop thread would deadlock; use "
                "on_complete()");
  {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return is_final(status()); })) return false;
  }
  throw_if_failed();
  return true;
}

void OperationState::on_complete(CompletionCallback callback) {
  {
    std::lock_guard lock(mu_);
    if (!is_final(status())) {
      waiting_.push_back(std::move(callback));
      return;
    }
  }
  auto self = shared_from_this();
  auto run = [self, callback] {
    std::optional<Error> e = self->error();
    callback(self->status(), e ? &*e : nullptr);
  };
  if (core->loop->in_loop_thread()) {
    core->loop->defer(run);
    return;
  }
  if (!core->loop->post(run)) run();
}

void OperationState::on_claimed(const std::string&) {
  if (status() == OperationStatus::initialized) set_status(OperationStatus::in_progress);
}

void OperationState::on_peer_finished(const std::string&, const std::optional<Error>& error) {
  if (error)
    finish(OperationStatus::errored, *error);
  else
    finish(OperationStatus::complete, std::nullopt);
}

void OperationState::on_peer_lost(const Error& error) { finish(OperationStatus::errored, error); }

void OperationState::on_transfer_complete() { finish(OperationStatus::complete, std::nullopt); }

void OperationState::on_transfer_failed(const Error& error) {
  finish(OperationStatus::errored, error);
}

}  // namespace ferry::detail
