#include "transport/tcp/tcp_transport.hpp"

#include <algorithm>

#include "transport/cuda/stager.hpp"
#include "transport/method.hpp"

namespace ferry::transport {
const Method& tcp_method();
}

namespace ferry::transport::tcp {

namespace {

wire::SocketAddress bind_address(const Context& ctx, const TcpOptions& o) {
  wire::SocketAddress bind;
  if (!wire::SocketAddress::from_parts(ctx.bind_address, o.port, bind))
    throw Error(ErrorCode::InvalidArgument,
                "tcp.bind_address '" + ctx.bind_address + "' is not a numeric IP address");
  if (bind.is_wildcard() && o.advertise_address.empty())
    throw Error(ErrorCode::InvalidArgument, "binding the wildcard address " + ctx.bind_address +
                                                " needs tcp.advertise_address");
  return bind;
}

}  // namespace

TcpTransport::TcpTransport(const Context& ctx, const TcpOptions& options)
    : ctx_(ctx),
      options_(options),
      links_(ctx.loop, ctx.defer),
      transfers_(ctx.defer, static_cast<kit::TransferHooks<TcpTransfer>&>(*this)) {
  caps_ = tcp_method().capabilities(ctx_);
  if (options_.chunk_size == 0 || options_.window < options_.chunk_size)
    throw Error(ErrorCode::InvalidArgument, "tcp.window must be at least tcp.chunk_size (> 0)");
  listener_ = std::make_unique<TcpListener>(ctx_, options_, bind_address(ctx_, options_));
  const wire::SocketAddress bound = listener_->bound();
  if (options_.advertise_address.empty()) {
    advertised_ = bound.to_string();
  } else {
    wire::SocketAddress adv;
    if (!wire::SocketAddress::from_parts(options_.advertise_address, bound.port(), adv))
      throw Error(
          ErrorCode::InvalidArgument,
          "tcp.advertise_address '" + options_.advertise_address + "' is not a numeric IP address");
    advertised_ = adv.to_string();
  }
}

TcpTransport::~TcpTransport() { close(); }

std::vector<Endpoint> TcpTransport::endpoints() const {
  return {Endpoint{caps_.method, advertised_, {}}};
}

void TcpTransport::close() {
  if (closed_) return;
  closed_ = true;
  // Transfers first (their copies stop, their frames go), then the connections, then the
  // staging chunks the last frames may have been sent from.
  transfers_.detach_all();
  listener_->close();
  links_.close();
  stager_.reset();
}

std::shared_ptr<const Registration> TcpTransport::register_memory(const Region& region) {
  if (!caps_.moves(region.kind)) throw Error(ErrorCode::Unsupported, "tcp moves host memory only");
  return registrations_.acquire(region);
}

std::string TcpTransport::expose(const Exposure& exposure, ExposureObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  listener_->expose(exposure, observer);
  return {};
}

void TcpTransport::revoke(std::uint64_t id, const Error& reason) { listener_->revoke(id, reason); }

std::optional<Error> TcpTransport::endpoint_error(const Endpoint& endpoint) const {
  return refusal([&] { (void)wire::endpoint_address(endpoint); });
}

std::unique_ptr<Transfer> TcpTransport::start(TransferSpec spec, TransferObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  const wire::SocketAddress addr = wire::endpoint_address(spec.endpoint);
  auto handle = transfers_.make(std::move(spec), observer);
  auto* t = &handle->get();
  try {
    link_to(addr, t->spec.peer_name).attach(*t);
  } catch (const Error& e) {
    transfers_.finish(*t, e, /*setup=*/true);
  }
  return handle;
}

std::string TcpTransport::serve_region(const RegionExposure& region, RegionObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  listener_->serve_region(region, observer);
  return {};
}

void TcpTransport::revoke_attachment(std::uint64_t attachment, const Error& reason) {
  listener_->revoke_attachment(attachment, reason);
}

void TcpTransport::end_region(std::uint64_t id, const Error& reason) {
  listener_->end_region(id, reason);
}

std::unique_ptr<RemoteRegion> TcpTransport::attach(AttachSpec spec, AttachObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  const wire::SocketAddress addr = wire::endpoint_address(spec.endpoint);
  auto region = std::make_unique<TcpRemoteRegion>(*this, next_region_++, std::move(spec), observer);
  try {
    link_to(addr, region->spec().peer_name).attach_region(*region);
  } catch (const Error& e) {
    region->on_lost(e, /*setup=*/true);
  }
  return region;
}

std::unique_ptr<Transfer> TcpTransport::start_on(TcpLink& link, TransferSpec spec,
                                                 TransferObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  auto handle = transfers_.make(std::move(spec), observer);
  link.attach(handle->get());
  return handle;
}

void TcpTransport::forget_region(TcpRemoteRegion& region, bool detach) {
  if (closed_) region.link = nullptr;  // the links are gone
  if (region.link == nullptr) return;
  TcpLink* link = region.link;
  region.link = nullptr;
  link->drop_region(region, detach);
  if (!closed_) links_.released(link);
}

TcpLink& TcpTransport::link_to(const wire::SocketAddress& address, const std::string& peer_name) {
  const std::string key = address.to_string();
  // A connection that is closing (after a protocol error) takes no new requests.
  if (TcpLink* link = links_.find(key)) return *link;
  return *links_.add(key, std::make_unique<TcpLink>(*this, next_link_++, address, peer_name));
}

void TcpTransport::link_lost(TcpLink& link, const std::vector<TcpTransfer*>& on_it,
                             const Error& error, bool setup) {
  for (TcpTransfer* t : on_it) {
    transfers_.finish(*t, error, setup);
    t->link = nullptr;  // the link is about to be destroyed
  }
  links_.remove(&link);
}

void TcpTransport::stop(TcpTransfer& t) {
  // The connection lets go of the transfer's frames and sinks first, then its staging copies
  // stop (waiting for one under way) and its chunks go back.
  t.waiting_chunk = false;
  if (t.link != nullptr) t.link->release(t);
  if (stager_) stager_->drop(t.id());
  t.copying = 0;
}

void TcpTransport::tell_peer(TcpTransfer& t, const Error& reason) {
  if (t.link != nullptr) t.link->send_done(t, &reason);
}

void TcpTransport::settle(TcpTransfer& t) {
  if (t.link == nullptr) return;
  TcpLink* link = t.link;
  link->detach(t);
  t.link = nullptr;
  links_.released(link);
}

cuda::Stager& TcpTransport::stager() {
  if (!stager_) {
    if (ctx_.cuda == nullptr) throw Error(ErrorCode::Unsupported, "tcp has no CUDA driver");
    const std::uint64_t chunks =
        std::clamp<std::uint64_t>(options_.window / options_.chunk_size + 4, 4, 64);
    stager_ = std::make_unique<cuda::Stager>(ctx_.loop, *ctx_.cuda, ctx_.defer, options_.chunk_size,
                                             chunks, ctx_.log);
    stager_->set_wake([this](std::uint64_t id) {
      TcpTransfer* t = transfers_.find(id);
      if (t == nullptr || t->finished() || !t->waiting_chunk || t->link == nullptr) return;
      t->waiting_chunk = false;
      t->link->pump(*t);
    });
  }
  return *stager_;
}

void TcpTransport::staging_failed(TcpTransfer& t, const Error& error) {
  if (t.finished()) return;
  transfers_.finish(t, error);
  if (t.link != nullptr) t.link->send_done(t, &error);
}

}  // namespace ferry::transport::tcp
