#include "transport/cma/cma_transport.hpp"

#include <algorithm>

#include "transport/method.hpp"
#include "transport/same_host/owner_info.hpp"
#include "transport/same_host/system.hpp"

namespace ferry::transport {
const Method& cma_method();
}

namespace ferry::transport::cma {

std::optional<Error> CmaTransport::unavailable(bool ptracer_any) {
  return same_host::unavailable_reason(ptracer_any);
}

CmaTransport::CmaTransport(const Context& ctx, const CmaOptions& options, std::uint32_t grant_slots)
    : ctx_(ctx),
      options_(options),
      caps_(cma_method().capabilities(ctx)),
      copier_(ctx, options, static_cast<CmaCopier::Owner&>(*this)),
      links_(ctx.loop, ctx.defer),
      transfers_(ctx.defer, static_cast<kit::TransferHooks<CmaTransfer>&>(*this)) {
  if (options_.chunk_size == 0 || options_.parallel == 0)
    throw Error(ErrorCode::InvalidArgument, "cma.chunk_size and cma.parallel must be positive");
  if (auto why = unavailable(options_.ptracer_any))
    throw Error(ErrorCode::Unsupported, "cma: " + why->message());
  if (options_.ptracer_any && same_host::yama_ptrace_scope() == 1)
    if (auto why = refusal([] { same_host::allow_any_ptracer(); }))
      throw Error(why->code(), "cma: " + why->message());
  listener_ = std::make_unique<same_host::Listener>(ctx_, "cma", "ferry-cma", grant_slots,
                                                    same_host::Listener::ClaimPayload{});
}

CmaTransport::~CmaTransport() { close(); }

std::vector<Endpoint> CmaTransport::endpoints() const {
  return {Endpoint{caps_.method, listener_->address(), listener_->info()}};
}

std::optional<Error> CmaTransport::unreachable(const Endpoint& endpoint) const {
  same_host::OwnerInfo info;
  if (auto e = refusal([&] { info = same_host::parse_endpoint(endpoint); })) return e;
  return same_host::scope_mismatch(info.scope);
}

std::optional<Error> CmaTransport::endpoint_error(const Endpoint& endpoint) const {
  return refusal([&] { (void)same_host::parse_endpoint(endpoint); });
}

void CmaTransport::close() {
  if (closed_) return;
  closed_ = true;
  life_.end();
  transfers_.detach_all();  // every copy halted, every chunk back
  copier_.close();
  listener_->close();
  links_.close();
}

std::shared_ptr<const Registration> CmaTransport::register_memory(const Region& region) {
  // CUDA memory of the active side too, where the driver is usable (staged by the copier).
  if (!caps_.moves(region.kind)) throw Error(ErrorCode::Unsupported, "cma moves host memory only");
  return registrations_.acquire(region);
}

std::shared_ptr<const Registration> CmaTransport::register_exposed(const Region& region) {
  // A peer's process_vm_readv/writev cannot reach this process's device memory: cma stages
  // CUDA memory of its active side only, so the operation is not offered by cma.
  if (region.kind != MemoryKind::host)
    throw Error(ErrorCode::Unsupported,
                "cma does not serve CUDA memory (process_vm_readv/writev cannot reach it; "
                "cuda_ipc or tcp moves it)");
  return register_memory(region);
}

std::string CmaTransport::expose(const Exposure& exposure, ExposureObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  listener_->expose(exposure, observer);
  return listener_->info();
}

void CmaTransport::revoke(std::uint64_t id, const Error& reason) { listener_->revoke(id, reason); }

std::unique_ptr<Transfer> CmaTransport::start(TransferSpec spec, TransferObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  // An endpoint that does not parse is bad metadata: thrown, not a set-up failure.
  (void)same_host::parse_endpoint(spec.endpoint);
  const bool staged = std::any_of(spec.segments.begin(), spec.segments.end(),
                                  [](const Segment& s) { return s.cuda_device >= 0; });
  if (staged && !caps_.moves(MemoryKind::cuda))
    throw Error(ErrorCode::Unsupported, "cma moves host memory only here (no CUDA driver)");
  auto handle = transfers_.make(std::move(spec), observer);
  auto* t = &handle->get();
  t->staged = staged;
  try {
    t->link = &link_to(t->spec.endpoint, t->spec.peer_name);
  } catch (const Error& e) {
    transfers_.finish(*t, e, /*setup=*/true);
    return handle;
  }
  t->link->attach(t->id());
  links_.used(t->link);
  t->link->claim(t->id(), *t);
  return handle;
}

same_host::Link& CmaTransport::link_to(const Endpoint& endpoint, const std::string& peer_name) {
  if (same_host::Link* link = links_.find(endpoint.address)) {
    if (link->refused) throw Error(ErrorCode::Unsupported, "cma: " + link->refused->message());
    return *link;
  }
  return *links_.add(endpoint.address,
                     std::make_unique<same_host::Link>(
                         ctx_, static_cast<same_host::Link::Client&>(*this), "cma", next_link_++,
                         endpoint.address, same_host::parse_info(endpoint.info), peer_name,
                         /*max_payload=*/0));
}

same_host::Claimant* CmaTransport::claimant(std::uint64_t id) {
  CmaTransfer* t = transfers_.find(id);
  return t == nullptr || t->finished() ? nullptr : t;
}

void CmaTransport::granted(std::uint64_t id, const Token& secret) {
  CmaTransfer* t = transfers_.find(id);
  if (t == nullptr || t->finished()) return;
  t->secret = secret;
  if (t->total == 0)
    copied(*t);
  else
    copier_.pump(*t);
}

void CmaTransport::ended(std::uint64_t id, std::optional<Error> error, bool setup) {
  if (CmaTransfer* t = transfers_.find(id)) transfers_.finish(*t, std::move(error), setup);
}

void CmaTransport::link_closed(same_host::Link& link) {
  // Every transfer on it (also those of a link replaced in the pool meanwhile) ended first.
  for (CmaTransfer* t : transfers_.all())
    if (t->link == &link) t->link = nullptr;
  regions_.link_closed(link);
  links_.remove(&link);
}

void CmaTransport::stop(CmaTransfer& t) {
  // No copy of this transfer runs after this: the local memory is the caller's again.
  copier_.stop(t);
  if (t.link != nullptr) t.link->release(t.id(), t);
}

void CmaTransport::tell_peer(CmaTransfer& t, const Error& reason) {
  // Also while the claim is unanswered: the owner reads DONE after the CLAIM (or alone, if the
  // CLAIM never left), and ends the operation instead of waiting for this peer.
  tell_end(t, &reason);
}

void CmaTransport::tell_end(CmaTransfer& t, const Error* error) {
  if (t.link == nullptr) return;
  if (t.spec.region_tag)
    t.link->send_ended(t.id(), t, error);
  else
    t.link->send_done(t.id(), t, error);
}

void CmaTransport::settle(CmaTransfer& t) {
  if (t.link == nullptr) return;
  same_host::Link* link = t.link;
  link->detach(t.id());
  t.link = nullptr;
  links_.released(link);
}

CmaTransfer* CmaTransport::transfer(std::uint64_t id) { return transfers_.find(id); }

void CmaTransport::copied(CmaTransfer& t) {
  // Every byte is in place. A read is complete, and the owner learns it may let go; a write
  // completes when the owner has acknowledged DONE: both sides then agree. On an attachment
  // both are complete now (this side made the copies), and the owner's ENDED is a notice.
  tell_end(t, nullptr);
  if (t.spec.access == Access::read || t.spec.region_tag) transfers_.finish(t, std::nullopt);
}

void CmaTransport::failed(CmaTransfer& t, const Error& error) {
  if (t.finished()) return;
  transfers_.finish(t, error);
  tell_end(t, &error);
}

std::string CmaTransport::serve_region(const RegionExposure& region, RegionObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  listener_->serve_region(region, observer);
  return listener_->info();
}

void CmaTransport::revoke_attachment(std::uint64_t attachment, const Error& reason) {
  listener_->revoke_attachment(attachment, reason);
}

void CmaTransport::end_region(std::uint64_t id, const Error& reason) {
  listener_->end_region(id, reason);
}

std::unique_ptr<RemoteRegion> CmaTransport::attach(AttachSpec spec, AttachObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  (void)same_host::parse_endpoint(spec.endpoint);  // bad metadata: thrown
  return regions_.attach(
      *this, ctx_.defer, links_,
      [this](const AttachSpec& s) -> same_host::Link& { return link_to(s.endpoint, s.peer_name); },
      std::move(spec), observer);
}

std::unique_ptr<Transfer> CmaTransport::start_attached(Attached& region, TransferSpec spec,
                                                       TransferObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  const bool staged = std::any_of(spec.segments.begin(), spec.segments.end(),
                                  [](const Segment& s) { return s.cuda_device >= 0; });
  if (staged && !caps_.moves(MemoryKind::cuda))
    throw Error(ErrorCode::Unsupported, "cma moves host memory only here (no CUDA driver)");
  auto handle = transfers_.make(std::move(spec), observer);
  auto* t = &handle->get();
  t->staged = staged;
  if (region.link == nullptr) {
    transfers_.finish(*t, Error(ErrorCode::PeerLost, "the attachment's connection is gone"));
    return handle;
  }
  // Granted already: the attachment's grant covers every transfer on it.
  t->link = region.link;
  t->link->attach(t->id());
  links_.used(t->link);
  t->claimed = true;
  t->grant = region.attach.grant;
  t->secret = region.attach.secret;
  if (t->total == 0)
    copied(*t);
  else
    copier_.pump(*t);
  return handle;
}

void CmaTransport::region_attached(std::uint64_t key) {
  // Small transfers on this attachment may copy on the calling thread, under its grant.
  if (Attached* region = regions_.find(key); region != nullptr && region->link != nullptr)
    region->direct_copy = std::make_shared<DirectCmaCopy>(
        region->link->owner(), region->attach.grant, region->spec().peer_name);
  regions_.attached(key);
}

void CmaTransport::forget_region(Attached& region) { regions_.forget(region, links_, closed_); }

}  // namespace ferry::transport::cma
