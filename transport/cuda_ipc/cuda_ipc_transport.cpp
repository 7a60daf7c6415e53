#include "transport/cuda_ipc/cuda_ipc_transport.hpp"

#include <unistd.h>

#include <algorithm>

#include "transport/cuda/copy_engine.hpp"
#include "transport/cuda/cuda_memory.hpp"
#include "transport/method.hpp"
#include "transport/same_host/owner_info.hpp"
#include "transport/same_host/system.hpp"

namespace ferry::transport {
const Method& cuda_ipc_method();
}

namespace ferry::transport::cuda_ipc {

namespace {

/// The owner's memory opened here, kept with the link to that owner.
struct OwnerMemory final : same_host::Link::Extra {
  explicit OwnerMemory(const cuda::CudaApi& api) : imports(api) {}
  IpcImports imports;
};

}  // namespace

std::optional<Error> CudaIpcTransport::unavailable(bool ptracer_any) {
  if (auto why = cuda::unavailable()) return why;
  // It claims and grants as cma does: it needs what cma needs.
  return same_host::unavailable_reason(ptracer_any);
}

CudaIpcTransport::CudaIpcTransport(const Context& ctx, const CmaOptions& options,
                                   std::uint32_t grant_slots)
    : ctx_(ctx),
      options_(options),
      caps_(cuda_ipc_method().capabilities(ctx)),
      links_(ctx.loop, ctx.defer),
      transfers_(ctx.defer, static_cast<kit::TransferHooks<CudaIpcTransfer>&>(*this)) {
  if (ctx_.cuda == nullptr) {
    const std::optional<Error> why = cuda::unavailable();
    throw Error(ErrorCode::Unsupported,
                "cuda_ipc: " + (why ? why->message() : std::string("no CUDA driver")));
  }
  if (options_.chunk_size == 0 || options_.parallel == 0)
    throw Error(ErrorCode::InvalidArgument, "cma.chunk_size and cma.parallel must be positive");
  if (auto why = unavailable(options_.ptracer_any))
    throw Error(ErrorCode::Unsupported, "cuda_ipc: " + why->message());
  if (options_.ptracer_any && same_host::yama_ptrace_scope() == 1)
    if (auto why = refusal([] { same_host::allow_any_ptracer(); }))
      throw Error(why->code(), "cuda_ipc: " + why->message());
  listener_ = std::make_unique<same_host::Listener>(
      ctx_, "cuda_ipc", "ferry-cudaipc", grant_slots,
      [this](const Exposure& exposure, const same_host::Listener::Claimant& claimant) {
        if (std::optional<Error> why = untrusted(claimant)) throw *why;
        return handles_of(exposure);
      });
}

std::optional<Error> CudaIpcTransport::untrusted(const same_host::Listener::Claimant& claimant) {
  // An IPC handle opens the whole allocation, and stays open in the claimant after a
  // cancel(): it goes only to a process the kernel would let read this one's memory anyway,
  // by the credentials ptrace compares (docs/security.md): our user and group, or root.
  if (claimant.uid == 0 || (claimant.uid == ::geteuid() && claimant.uid == ::getuid() &&
                            claimant.gid == ::getegid() && claimant.gid == ::getgid()))
    return std::nullopt;
  return Error(ErrorCode::AccessDenied,
               "cuda_ipc hands its IPC handles only to a process of its own user and group, or "
               "root; " +
                   claimant.name + " runs as uid " + std::to_string(claimant.uid) + " gid " +
                   std::to_string(claimant.gid));
}

CudaIpcTransport::~CudaIpcTransport() { close(); }

std::vector<Endpoint> CudaIpcTransport::endpoints() const {
  return {Endpoint{caps_.method, listener_->address(), listener_->info()}};
}

std::optional<Error> CudaIpcTransport::unreachable(const Endpoint& endpoint) const {
  same_host::OwnerInfo info;
  if (auto e = refusal([&] { info = same_host::parse_endpoint(endpoint); })) return e;
  // The driver refuses to open a process's own IPC handles.
  if (info.scope.pid == ::getpid())
    return Error(ErrorCode::Unsupported,
                 "the peer is this process (CUDA IPC opens only another process's memory)");
  return same_host::scope_mismatch(info.scope);
}

std::optional<Error> CudaIpcTransport::endpoint_error(const Endpoint& endpoint) const {
  return refusal([&] { (void)same_host::parse_endpoint(endpoint); });
}

void CudaIpcTransport::close() {
  if (closed_) return;
  closed_ = true;
  life_.end();
  transfers_.detach_all();  // every copy cancelled, every grant given back
  engine_.reset();
  listener_->close();
  links_.close();
  vmm_.reset();
}

std::shared_ptr<const Registration> CudaIpcTransport::register_memory(const Region& region) {
  // The active side's memory may be host memory too: the GPU copies to and from it.
  return registrations_.acquire(region);
}

std::shared_ptr<const Registration> CudaIpcTransport::register_exposed(const Region& region) {
  if (region.kind != MemoryKind::cuda)
    throw Error(ErrorCode::Unsupported,
                "cuda_ipc shares CUDA memory only (host memory is the cma method's)");
  // Memory that cannot be shared is refused here, so the operation is not offered by this
  // method (another one moves it).
  (void)handles_of(Exposure{0, {}, Access::read, {region}});
  return register_memory(region);
}

std::vector<std::byte> CudaIpcTransport::handles_of(const Exposure& exposure) {
  if (!vmm_) vmm_ = std::make_unique<VmmExports>(*ctx_.cuda);
  return encode_ranges(export_ranges(*ctx_.cuda, exposure.regions, vmm_.get()));
}

std::string CudaIpcTransport::expose(const Exposure& exposure, ExposureObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  listener_->expose(exposure, observer);
  return listener_->info();
}

void CudaIpcTransport::revoke(std::uint64_t id, const Error& reason) {
  listener_->revoke(id, reason);
}

std::unique_ptr<Transfer> CudaIpcTransport::start(TransferSpec spec, TransferObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  // An endpoint that does not parse is bad metadata: thrown, not a set-up failure.
  (void)same_host::parse_endpoint(spec.endpoint);
  auto handle = transfers_.make(std::move(spec), observer);
  auto* t = &handle->get();
  try {
    t->link = &link_to(t->spec.endpoint, t->spec.peer_name);
  } catch (const Error& e) {
    transfers_.finish(*t, e, /*setup=*/true);
    return handle;
  }
  t->owner = t->link->owner();
  t->link->attach(t->id());
  links_.used(t->link);
  t->link->claim(t->id(), *t);
  return handle;
}

same_host::Link& CudaIpcTransport::link_to(const Endpoint& endpoint, const std::string& peer_name) {
  if (same_host::Link* link = links_.find(endpoint.address)) return *link;
  return *links_.add(
      endpoint.address,
      std::make_unique<same_host::Link>(
          ctx_, static_cast<same_host::Link::Client&>(*this), "cuda_ipc", next_link_++,
          endpoint.address, same_host::parse_info(endpoint.info), peer_name, kMaxHandleBytes));
}

same_host::Claimant* CudaIpcTransport::claimant(std::uint64_t id) {
  CudaIpcTransfer* t = transfers_.find(id);
  return t == nullptr || t->finished() ? nullptr : t;
}

void CudaIpcTransport::granted(std::uint64_t id, const Token& secret) {
  CudaIpcTransfer* t = transfers_.find(id);
  if (t == nullptr || t->finished()) return;
  t->secret = secret;
  begin_copies(*t);
}

void CudaIpcTransport::begin_copies(CudaIpcTransfer& tr) {
  CudaIpcTransfer* t = &tr;
  std::vector<IpcRange> ranges;
  std::optional<Error> error;
  if (!decode_ranges(t->payload.data(), t->payload.size(), ranges)) {
    error = Error(ErrorCode::ProtocolError, "peer '" + t->spec.peer_name +
                                                "' granted a cuda_ipc claim without valid handles");
  } else {
    try {
      if (!t->link->extra) t->link->extra = std::make_unique<OwnerMemory>(*ctx_.cuda);
      auto& imports = static_cast<OwnerMemory&>(*t->link->extra).imports;
      // Each allocation is opened on the device holding it; one this process cannot see is
      // opened on the device of the transfer's first device memory (reached through peer
      // access), else on device 0.
      int fallback = 0;
      for (const Segment& s : t->spec.segments)
        if (s.cuda_device >= 0) {
          fallback = s.cuda_device;
          break;
        }
      const auto owner = t->link->owner();
      imports.open(ranges, fallback,
                   [owner](int fd) { return same_host::fetch_fd(owner->pidfd, owner->pid, fd); });
    } catch (const Error& e) {
      error = e;
    }
  }
  t->payload.clear();
  t->payload.shrink_to_fit();
  if (error) {
    failed(*t, *error);
    return;
  }
  if (t->total == 0)
    all_copied(*t);
  else
    pump(*t);
}

void CudaIpcTransport::pump(CudaIpcTransfer& t) {
  if (!engine_) engine_ = std::make_unique<cuda::CopyEngine>(ctx_.loop, *ctx_.cuda, ctx_.log);
  auto& imports = static_cast<OwnerMemory&>(*t.link->extra).imports;
  const same_host::GrantView& grants = *t.owner->grants;
  while (!t.finished() && !t.ended_by_owner && t.copies.size() < options_.parallel &&
         t.seg < t.spec.segments.size()) {
    const Segment& s = t.spec.segments[t.seg];
    const std::uint64_t len = std::min<std::uint64_t>(options_.chunk_size, s.len - t.seg_off);
    std::byte* local = s.local + t.seg_off;
    const IpcImports::Place place = imports.translate(s.remote_addr + t.seg_off, len);
    if (place.at == nullptr) {
      failed(t, Error(ErrorCode::ProtocolError,
                      "peer '" + t.spec.peer_name +
                          "' sent cuda_ipc handles that do not cover the claimed memory"));
      return;
    }
    // The owner's grant first, held until the driver reports the copy's end: while it is
    // held, the owner's cancel() waits; once the owner has ended it, no copy starts.
    if (!grants.acquire(t.grant)) {
      t.link->await_notice(t);  // its notice, which says why, is on its way
      return;
    }
    std::uint64_t id = 0;
    try {
      const bool reading = t.spec.access == Access::read;
      // The copy's id is known once copy() returns, and its end is reported only later.
      auto copy_id = std::make_shared<std::uint64_t>(0);
      // On the stream of the local device memory, or for host memory of the device the
      // owner's memory was opened on.
      const int device = s.cuda_device >= 0 ? s.cuda_device : place.device;
      id = engine_->copy(device, reading ? local : place.at, reading ? place.at : local, len,
                         [this, transfer = t.id(), watch = life_.watch(),
                          copy_id](const std::optional<Error>& error) {
                           if (watch.alive()) copied(transfer, *copy_id, error);
                         });
      *copy_id = id;
    } catch (const Error& e) {
      grants.release(t.grant);
      failed(t, e);
      return;
    }
    t.copies[id] = len;
    t.seg_off += len;
    if (t.seg_off == s.len) {
      ++t.seg;
      t.seg_off = 0;
    }
  }
}

void CudaIpcTransport::copied(std::uint64_t transfer, std::uint64_t copy,
                              const std::optional<Error>& error) {
  CudaIpcTransfer* t = transfers_.find(transfer);
  if (t == nullptr) return;
  auto c = t->copies.find(copy);
  if (c == t->copies.end()) return;  // cancelled
  const std::uint64_t len = c->second;
  t->copies.erase(c);
  t->owner->grants->release(t->grant);
  if (t->finished()) return;
  if (error) {
    failed(*t, Error(ErrorCode::Internal, "cuda_ipc copy failed: " + error->message()));
    return;
  }
  t->done += len;
  if (t->done == t->total && t->copies.empty()) {
    all_copied(*t);
    return;
  }
  pump(*t);
}

void CudaIpcTransport::all_copied(CudaIpcTransfer& t) {
  // On an attachment both kinds are complete now (this side's copies put every byte in
  // place), and the owner's ENDED is a notice.
  tell_end(t, nullptr);
  if (t.spec.access == Access::read || t.spec.region_tag) transfers_.finish(t, std::nullopt);
}

void CudaIpcTransport::tell_end(CudaIpcTransfer& t, const Error* error) {
  if (t.link == nullptr) return;
  if (t.spec.region_tag)
    t.link->send_ended(t.id(), t, error);
  else
    t.link->send_done(t.id(), t, error);
}

void CudaIpcTransport::ended(std::uint64_t id, std::optional<Error> error, bool setup) {
  if (CudaIpcTransfer* t = transfers_.find(id)) transfers_.finish(*t, std::move(error), setup);
}

void CudaIpcTransport::link_closed(same_host::Link& link) {
  for (CudaIpcTransfer* t : transfers_.all())
    if (t->link == &link) t->link = nullptr;
  regions_.link_closed(link);
  links_.remove(&link);
}

void CudaIpcTransport::stop(CudaIpcTransfer& t) {
  // Its GPU copies stop (cancel returns once a copy touches no memory), and their grants go
  // back; then the link forgets it.
  for (const auto& [id, len] : t.copies) {
    if (engine_) engine_->cancel(id);
    t.owner->grants->release(t.grant);
  }
  t.copies.clear();
  if (t.link != nullptr) t.link->release(t.id(), t);
}

void CudaIpcTransport::tell_peer(CudaIpcTransfer& t, const Error& reason) { tell_end(t, &reason); }

void CudaIpcTransport::settle(CudaIpcTransfer& t) {
  if (t.link == nullptr) return;
  same_host::Link* link = t.link;
  link->detach(t.id());
  t.link = nullptr;
  links_.released(link);
}

void CudaIpcTransport::failed(CudaIpcTransfer& t, const Error& error) {
  if (t.finished()) return;
  transfers_.finish(t, error);
  tell_end(t, &error);
}

std::string CudaIpcTransport::serve_region(const RegionExposure& region, RegionObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  listener_->serve_region(region, observer);
  return listener_->info();
}

void CudaIpcTransport::revoke_attachment(std::uint64_t attachment, const Error& reason) {
  listener_->revoke_attachment(attachment, reason);
}

void CudaIpcTransport::end_region(std::uint64_t id, const Error& reason) {
  listener_->end_region(id, reason);
}

std::unique_ptr<RemoteRegion> CudaIpcTransport::attach(AttachSpec spec, AttachObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  (void)same_host::parse_endpoint(spec.endpoint);  // bad metadata: thrown
  return regions_.attach(
      *this, ctx_.defer, links_,
      [this](const AttachSpec& s) -> same_host::Link& { return link_to(s.endpoint, s.peer_name); },
      std::move(spec), observer);
}

std::unique_ptr<Transfer> CudaIpcTransport::start_attached(Attached& region, TransferSpec spec,
                                                           TransferObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  auto handle = transfers_.make(std::move(spec), observer);
  auto* t = &handle->get();
  if (region.link == nullptr) {
    transfers_.finish(*t, Error(ErrorCode::PeerLost, "the attachment's connection is gone"));
    return handle;
  }
  // Granted already: the attachment's grant and handles cover every transfer on it.
  t->link = region.link;
  t->owner = t->link->owner();
  t->link->attach(t->id());
  links_.used(t->link);
  t->claimed = true;
  t->grant = region.attach.grant;
  t->secret = region.attach.secret;
  t->payload = region.attach.payload;
  begin_copies(*t);
  return handle;
}

void CudaIpcTransport::forget_region(Attached& region) { regions_.forget(region, links_, closed_); }

}  // namespace ferry::transport::cuda_ipc
