#include <algorithm>
#include <cstdio>

#include "sdk/src/core.hpp"
#include "sidechannel/pairing.hpp"
#include "loop/uv_handle.hpp"

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
  // libuv counts from the time it cached at the start of this loop turn; refresh it so
  // that the deadline never fires before `timeout` has passed since this call.
  uv_update_time(core->loop->uv());
  uv_timer_start(deadline_, &OperationState::on_deadline,
                 static_cast<std::uint64_t>(timeout.count()) + 1, 0);
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
  // Transports call in through a plain observer pointer. Once the final status is published
  // below, a thread waiting for it may drop the last handle at once: hold the state until
  // this call is done. (Before that, a live operation always has an owner: its handle, or
  // the cancel() under way on this loop.)
  auto keep = shared_from_this();
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
  stop_pairing();
  if (serving != 0 && core->nats) core->nats->unsubscribe(serving);
  serving = 0;
  if (remote)
    notify_peer(final_status == OperationStatus::complete ? std::nullopt : std::optional(reason));
  if (deadline_ != nullptr) {
    uv_timer_stop(deadline_);
    deadline_->data = nullptr;
    loop::close_and_delete(deadline_);
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

std::string OperationState::method() const {
  std::lock_guard lock(mu_);
  return method_;
}

void OperationState::set_method(const std::string& m) {
  std::lock_guard lock(mu_);
  method_ = m;
}

void OperationState::on_claimed(const std::string& m, const std::string&,
                                const std::string& peer_id) {
  set_method(m);
  claimant = peer_id;
  if (status() == OperationStatus::initialized) set_status(OperationStatus::in_progress);
}

// Pairing by subject, active side ---------------------------------------------------------

void OperationState::request_metadata() {
  auto& nats = *core->nats;
  sidechannel::MetadataRequest ask{kind, core->identity.name};
  std::weak_ptr<OperationState> weak = weak_from_this();
  auto request_id = std::make_shared<std::uint64_t>(0);
  *request_id = nats.request(subject, sidechannel::encode(ask),
                             [weak, request_id](const sidechannel::Message& m) {
                               if (auto self = weak.lock()) self->on_metadata_reply(*request_id, m);
                             });
  requests.push_back(*request_id);
  // An answer lost in a reconnect is asked for again after request_timeout.
  if (retry == nullptr) {
    retry = new uv_timer_t{};
    uv_timer_init(core->loop->uv(), retry);
    retry->data = this;
  }
  uv_timer_start(retry, &OperationState::on_retry,
                 static_cast<std::uint64_t>(core->options.nats.request_timeout.count()), 0);
}

void OperationState::on_retry(uv_timer_t* timer) {
  auto* self = static_cast<OperationState*>(timer->data);
  if (self == nullptr || is_final(self->status())) return;
  auto keep = self->shared_from_this();
  // Earlier requests stay open: an answer that is merely late still counts.
  if (self->core->nats) self->request_metadata();
}

void OperationState::on_metadata_reply(std::uint64_t request, const sidechannel::Message& reply) {
  std::erase(requests, request);
  if (is_final(status()) || remote) return;
  if (reply.no_responders) {
    // Nobody serves the subject yet. The first time, ask again at once (the server may only
    // just be getting the subscription); then after 1, 2, 4 ... ms, up to a quarter second.
    using std::chrono::milliseconds;
    uv_timer_start(retry, &OperationState::on_retry, static_cast<std::uint64_t>(backoff.count()),
                   0);
    backoff = std::clamp(backoff * 2, milliseconds(1), milliseconds(250));
    return;
  }
  uv_timer_stop(retry);
  stop_pairing();  // the first answer wins; the others are dropped
  auto keep = shared_from_this();
  try {
    RdmaMetadata m = RdmaMetadata::from_json(reply.data);
    // Valid metadata names its owner: from here on, however this ends, the owner is told.
    remote = m;
    check_remote(m, kind, local);
    core->start_transfer(*this, m);
  } catch (const Error& e) {
    finish(OperationStatus::errored,
           Error(e.code(), "the metadata served at '" + subject + "': " + e.message(), e.field()));
  }
}

void OperationState::stop_pairing() {
  if (core->nats)
    for (std::uint64_t r : requests) core->nats->cancel_request(r);
  requests.clear();
  if (retry != nullptr) {
    uv_timer_stop(retry);
    retry->data = nullptr;
    loop::close_and_delete(retry);
    retry = nullptr;
  }
}

void OperationState::notify_peer(const std::optional<Error>& error) {
  if (!core->nats) return;
  sidechannel::CompletionNotice notice{remote->notification_key, remote->token, core->identity.name,
                                       core->identity.id, error};
  core->nats->publish(core->nats->own_subject("notify." + remote->owner.id),
                      sidechannel::encode(notice));
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
