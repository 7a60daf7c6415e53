#include "transport/tcp/tcp_region.hpp"

#include "transport/tcp/tcp_link.hpp"
#include "transport/tcp/tcp_transport.hpp"

namespace ferry::transport::tcp {

TcpRemoteRegion::TcpRemoteRegion(TcpTransport& owner, std::uint64_t id, AttachSpec spec,
                                 AttachObserver& observer)
    : owner_(owner), id_(id), spec_(std::move(spec)), observer_(&observer) {}

TcpRemoteRegion::~TcpRemoteRegion() {
  life_.end();
  owner_.forget_region(*this, /*detach=*/state_ == State::attached);
}

void TcpRemoteRegion::report(std::function<void(AttachObserver&)> call) {
  life_.defer(owner_.ctx_.defer, [this, call = std::move(call)] { call(*observer_); });
}

std::unique_ptr<Transfer> TcpRemoteRegion::start(TransferSpec spec, TransferObserver& observer) {
  if (state_ != State::attached || link == nullptr)
    throw Error(ErrorCode::InvalidState, state_ == State::attaching
                                             ? "the attachment is not attached yet"
                                             : "the attachment has ended");
  spec.remote_id = attachment_;
  spec.token = secret_;
  spec.endpoint = spec_.endpoint;
  spec.peer_name = spec_.peer_name;
  if (!spec.region_tag) spec.region_tag = std::string();
  return owner_.start_on(*link, std::move(spec), observer);
}

void TcpRemoteRegion::attached(std::uint64_t attachment, const Token& secret) {
  if (state_ != State::attaching) return;
  state_ = State::attached;
  attachment_ = attachment;
  secret_ = secret;
  report([](AttachObserver& o) { o.on_attached(); });
}

void TcpRemoteRegion::refused(const Error& error) {
  if (state_ != State::attaching) return;
  state_ = State::over;
  report([error](AttachObserver& o) { o.on_attach_failed(error, false); });
}

void TcpRemoteRegion::ended(const Error& error) {
  if (state_ != State::attached) return;
  state_ = State::over;
  report([error](AttachObserver& o) { o.on_detached(error); });
}

void TcpRemoteRegion::lost(const Error& error, bool setup) {
  link = nullptr;
  const State was = state_;
  state_ = State::over;
  if (was == State::attaching)
    report([error, setup](AttachObserver& o) { o.on_attach_failed(error, setup); });
  else if (was == State::attached)
    report([error](AttachObserver& o) { o.on_detached(error); });
}

}  // namespace ferry::transport::tcp
