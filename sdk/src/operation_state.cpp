#include "sdk/src/operation_state.hpp"

#include <algorithm>

#include "loop/ids.hpp"
#include "sdk/src/core.hpp"

namespace ferry::detail {

OperationState::OperationState(std::shared_ptr<Core> core_, std::uint64_t id_, OperationKind kind_,
                               bool passive_, std::vector<Descriptor> local_)
    : core(std::move(core_)),
      id(id_),
      id_hex(loop::hex16(id_)),
      kind(kind_),
      passive(passive_),
      local(std::move(local_)) {}

OperationState::~OperationState() = default;

void OperationState::arm(std::chrono::milliseconds timeout) {
  core->live[id] = weak_from_this();
  core->stats.started(passive);
  counted_ = true;
  if (timeout.count() <= 0) return;
  timeout_ = timeout;
  deadline_ = loop::Timer::timer(core->loop->uv(), this);
  // libuv counts from the time it cached at the start of this loop turn; refresh it so
  // that the deadline never fires before `timeout` has passed since this call.
  uv_update_time(core->loop->uv());
  uv_timer_start(deadline_.get(), &OperationState::on_deadline,
                 static_cast<std::uint64_t>(timeout.count()) + 1, 0);
}

void OperationState::arm_pairing(std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0 || is_final(status())) return;
  pairing_timeout_ = timeout;
  pairing_ = loop::Timer::timer(core->loop->uv(), this);
  uv_update_time(core->loop->uv());
  uv_timer_start(pairing_.get(), &OperationState::on_pairing_deadline,
                 static_cast<std::uint64_t>(timeout.count()) + 1, 0);
}

std::string OperationState::pairing_text(std::chrono::milliseconds timeout) const {
  return "not paired within the pairing deadline of " + std::to_string(timeout.count()) + " ms";
}

void OperationState::on_pairing_deadline(uv_timer_t* timer) {
  auto* self = static_cast<OperationState*>(timer->data);
  if (self == nullptr) return;
  auto keep = self->shared_from_this();
  loop::guarded(self->core->loop->log(), "pairing deadline", [&] {
    self->finish(OperationStatus::errored,
                 Error(ErrorCode::Timeout, self->pairing_text(self->pairing_timeout_)));
  });
}

std::optional<PeerIdentity> OperationState::peer() const {
  std::lock_guard lock(mu_);
  return peer_;
}

void OperationState::set_peer(PeerIdentity peer) {
  std::lock_guard lock(mu_);
  peer_ = std::move(peer);
}

std::string OperationState::deadline_text(std::chrono::milliseconds timeout) const {
  return "the operation's deadline of " + std::to_string(timeout.count()) + " ms passed";
}

void OperationState::on_deadline(uv_timer_t* timer) {
  auto* self = static_cast<OperationState*>(timer->data);
  if (self == nullptr) return;
  // Keep the state alive through finish(): the table holds it only weakly.
  auto keep = self->shared_from_this();
  loop::guarded(self->core->loop->log(), "operation deadline", [&] {
    self->finish(OperationStatus::errored,
                 Error(ErrorCode::Timeout, self->deadline_text(self->timeout_)));
  });
}

void OperationState::finish(OperationStatus final_status, std::optional<Error> error) {
  if (is_final(status())) return;
  // Transports call in through a plain observer pointer. Once the final status is published
  // below, a thread waiting for it may drop the last handle at once: hold the state until
  // this call is done. (Before that, a live operation always has an owner: its handle, or
  // the cancel() under way on this loop.)
  auto keep = shared_from_this();
  // First make the memory unreachable, telling the peer why; only then publish the final
  // status, so that a waiter woken by it may reuse the memory at once. Nothing in here may
  // leave the operation short of a final status: a failure to tell the peer is only logged.
  Error reason = error ? *error : Error(ErrorCode::Cancelled, "the operation ended");
  try {
    release(final_status, reason);
  } catch (const std::exception& e) {
    core->loop->log().error("releasing operation " + id_hex + ": " + e.what());
  }
  deadline_.reset();
  pairing_.reset();
  core->live.erase(id);
  if (counted_) {
    std::uint64_t bytes = 0;
    for (const Descriptor& d : local) bytes += d.size();
    const auto now = std::chrono::steady_clock::now();
    const std::optional<PeerIdentity> with = peer();
    OperationEnd end;
    end.method = method();
    end.kind = kind;
    end.passive = passive;
    end.status = final_status;
    if (final_status != OperationStatus::complete) end.code = reason.code();
    end.bytes = bytes;
    end.latency = now - created_;
    if (claimed_at_) end.wait = *claimed_at_ - created_;
    end.peer = with ? &*with : nullptr;
    core->stats.ended(end);
    core->refresh_gauges();
  }

  std::vector<CompletionCallback> callbacks;
  {
    std::lock_guard lock(mu_);
    error_ = std::move(error);
    callbacks.swap(waiting_);
    set_status(final_status);
  }
  cv_.notify_all();
  for (auto& cb : callbacks) {
    core->loop->defer([self = keep, cb = std::move(cb)] {
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

void OperationState::completed_here(const std::string& m) {
  set_method(m);
  std::uint64_t bytes = 0;
  for (const Descriptor& d : local) bytes += d.size();
  core->stats.started(passive);
  const std::optional<PeerIdentity> with = peer();
  OperationEnd end;
  end.method = m;
  end.kind = kind;
  end.passive = passive;
  end.bytes = bytes;
  end.latency = std::chrono::steady_clock::now() - created_;
  end.peer = with ? &*with : nullptr;
  core->stats.ended(end);
  set_status(OperationStatus::complete);
}

void OperationState::abandon(Error error) {
  if (is_final(status())) return;
  auto keep = shared_from_this();
  std::vector<CompletionCallback> callbacks;
  {
    std::lock_guard lock(mu_);
    error_ = std::move(error);
    callbacks.swap(waiting_);
    set_status(OperationStatus::cancelled);
  }
  cv_.notify_all();
  for (auto& cb : callbacks) {
    std::optional<Error> e = keep->error();
    cb(OperationStatus::cancelled, e ? &*e : nullptr);
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

namespace {
Error wrong_thread() {
  return Error(ErrorCode::WrongThread,
               "wait_for_completion() on the connector's loop thread would deadlock; use "
               "on_complete()");
}
}  // namespace

void OperationState::wait() const {
  if (!core->loop->may_block()) throw wrong_thread();
  {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return is_final(status()); });
  }
  throw_if_failed();
}

OperationStatus OperationState::wait_status(std::chrono::nanoseconds timeout) const {
  if (!core->loop->may_block()) throw wrong_thread();
  // condition_variable::wait_for adds the timeout to now(): a huge timeout (say
  // nanoseconds::max()) overflows into the past and returns at once. Cap it at a century
  // and wait against a deadline computed without overflow.
  using namespace std::chrono;
  const auto cap = duration_cast<nanoseconds>(hours(24 * 365 * 100));
  const auto deadline = steady_clock::now() + std::min(std::max(timeout, nanoseconds(0)), cap);
  std::unique_lock lock(mu_);
  cv_.wait_until(lock, deadline, [&] { return is_final(status()); });
  return status();
}

bool OperationState::wait_for(std::chrono::nanoseconds timeout) const {
  if (!is_final(wait_status(timeout))) return false;
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
  if (loop::EventLoop::Hold hold; core->loop->enter(hold)) {
    core->loop->defer(run);
    return;
  }
  if (!core->loop->post(run)) run();
}

std::string OperationState::method() const {
  std::lock_guard lock(mu_);
  return method_;
}

void OperationState::set_method(const std::string& m) {
  std::lock_guard lock(mu_);
  method_ = m;
}

}  // namespace ferry::detail
