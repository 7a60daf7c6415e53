// The public Connector: argument checks on the calling thread, then the work on the loop
// (sdk/src/core.cpp).
#include <ferry/connector.hpp>

#include "sdk/src/active_operation.hpp"
#include "sdk/src/core.hpp"
#include "sdk/src/metrics.hpp"
#include "sdk/src/options.hpp"
#include "sdk/src/passive_operation.hpp"

namespace ferry {

namespace {

using detail::check_writable;

// Common front of create_readable / create_writable.
std::shared_ptr<detail::PassiveOperation> create(detail::Core& core, OperationKind kind,
                                                 std::vector<Descriptor> local,
                                                 const OperationOptions& options) {
  detail::check_local(local);
  if (kind == OperationKind::write) check_writable(local, "create_writable");
  auto timeout = core.effective_timeout(options);
  if (!options.subject.empty()) {
    detail::check_subject(options.subject, core.nats_prefix);
    if (!core.has_nats)
      throw Error(ErrorCode::InvalidState,
                  "serving at a subject needs the NATS side channel (NatsOptions::servers or "
                  "FERRY_NATS_URL)");
    core.require_open_side_channel("serving at a subject");
  }
  auto op = core.loop->call(
      [&] { return core.create_passive(kind, std::move(local), timeout, options.subject); });
  // Off the loop, return only once the server has the subscription (or request_timeout has
  // passed): a peer told right after this call finds the subject served. (On the loop thread
  // this cannot wait; a peer that asks too early is answered "no responders" and asks again
  // at once.)
  // Nor while the side channel is not connected: the server gets the subscription once it is.
  if (op->served.valid() && !core.loop->in_loop_thread() &&
      core.nats_status->get().state == SideChannelState::connected)
    op->served.wait_for(core.options.nats.request_timeout);
  return op;
}

std::shared_ptr<detail::ActiveOperation> begin(detail::Core& core, OperationKind kind,
                                               const RdmaMetadata& remote,
                                               std::vector<Descriptor> local,
                                               const OperationOptions& options) {
  detail::check_remote(remote, kind, local);
  if (kind == OperationKind::read) check_writable(local, "begin_read");
  auto timeout = core.effective_timeout(options);
  // Off the loop, the call does not wait for it (one thread hop less per operation). From
  // every thread, what only the loop can find out ends the operation with an error; what is
  // checked here is thrown.
  return core.begin_active(remote, std::move(local), timeout);
}

std::shared_ptr<detail::ActiveOperation> begin(detail::Core& core, OperationKind kind,
                                               const Subject& subject,
                                               std::vector<Descriptor> local,
                                               const OperationOptions& options) {
  detail::check_subject(subject.name, core.nats_prefix);
  if (!core.has_nats)
    throw Error(ErrorCode::InvalidState,
                "pairing by subject needs the NATS side channel (NatsOptions::servers or "
                "FERRY_NATS_URL)");
  core.require_open_side_channel("pairing by subject");
  detail::check_local(local);
  if (kind == OperationKind::read) check_writable(local, "begin_read");
  auto timeout = core.effective_timeout(options);
  return core.begin_by_subject(kind, subject.name, std::move(local), timeout);
}

}  // namespace

Connector::Connector(ConnectorOptions options)
    : core_(std::make_shared<detail::Core>(std::move(options))) {
  core_->start();
}

Connector::~Connector() {
  if (core_) core_->shutdown();
}

Connector::Connector(Connector&& other) noexcept : core_(std::move(other.core_)) {}

Connector& Connector::operator=(Connector&& other) noexcept {
  if (this != &other) {
    if (core_) core_->shutdown();
    core_ = std::move(other.core_);
  }
  return *this;
}

detail::Core& Connector::core() const {
  if (!core_) throw Error(ErrorCode::InvalidState, "this connector was moved from");
  return *core_;
}

const PeerIdentity& Connector::identity() const noexcept {
  static const PeerIdentity none{};
  return core_ ? core_->identity : none;
}

std::vector<Endpoint> Connector::endpoints() const { return core().endpoints; }

bool Connector::has_side_channel() const noexcept { return core_ && core_->has_nats; }

SideChannelStatus Connector::side_channel_state() const {
  if (core_ && core_->nats_status) return core_->nats_status->get();
  return {SideChannelState::none, core_ ? "no NATS server configured (NatsOptions::servers or "
                                          "FERRY_NATS_URL)"
                                        : "this connector was moved from"};
}

const char* to_string(SideChannelState state) noexcept {
  switch (state) {
    case SideChannelState::none:
      return "none";
    case SideChannelState::connecting:
      return "connecting";
    case SideChannelState::connected:
      return "connected";
    case SideChannelState::reconnecting:
      return "reconnecting";
    case SideChannelState::closed:
      return "closed";
  }
  return "?";
}

std::vector<MethodInfo> Connector::methods() const { return core().methods; }

ConnectorStats Connector::stats() const { return core().stats_now(); }

std::string Connector::metrics() const { return detail::metrics_text(core()); }

ReadableOperation Connector::create_readable(std::vector<Descriptor> local,
                                             OperationOptions options) {
  return ReadableOperation(create(core(), OperationKind::read, std::move(local), options));
}

WritableOperation Connector::create_writable(std::vector<Descriptor> local,
                                             OperationOptions options) {
  return WritableOperation(create(core(), OperationKind::write, std::move(local), options));
}

ReadOperation Connector::begin_read(const RdmaMetadata& remote, std::vector<Descriptor> local,
                                    OperationOptions options) {
  return ReadOperation(begin(core(), OperationKind::read, remote, std::move(local), options));
}

WriteOperation Connector::begin_write(std::vector<Descriptor> local, const RdmaMetadata& remote,
                                      OperationOptions options) {
  return WriteOperation(begin(core(), OperationKind::write, remote, std::move(local), options));
}

ReadOperation Connector::begin_read(const Subject& subject, std::vector<Descriptor> local,
                                    OperationOptions options) {
  return ReadOperation(begin(core(), OperationKind::read, subject, std::move(local), options));
}

WriteOperation Connector::begin_write(std::vector<Descriptor> local, const Subject& subject,
                                      OperationOptions options) {
  return WriteOperation(begin(core(), OperationKind::write, subject, std::move(local), options));
}

}  // namespace ferry
