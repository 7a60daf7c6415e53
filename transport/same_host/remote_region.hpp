#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>

#include "transport/kit/link_pool.hpp"
#include "transport/kit/remote_region.hpp"
#include "transport/same_host/link.hpp"

namespace ferry::transport::same_host {

/// An attachment to a peer's region by a same-host method (cma, cuda_ipc), the active side:
/// ATTACH on the pooled link to the owner (proven as every same-host peer is), answered with the
/// attachment's grant and the method's payload; then every transfer runs under that grant at
/// once, with no exchange, and ends with a one-way ENDED (docs/regions.md). Destroying it sends
/// DETACH. `T` is the transport: start_attached(RemoteRegion<T>&, spec, observer) and
/// forget_region(RemoteRegion<T>&).
template <class T>
class RemoteRegion final : public kit::RemoteRegionBase {
 public:
  RemoteRegion(T& owner, Defer defer, std::uint64_t key, AttachSpec spec, AttachObserver& observer)
      : RemoteRegionBase(std::move(defer), std::move(spec), observer), owner_(owner), key_(key) {
    attach.region = this->spec().region;
    attach.token = this->spec().token;
    attach.access = this->spec().access;
  }
  ~RemoteRegion() override { owner_.forget_region(*this); }

  std::unique_ptr<Transfer> start(TransferSpec spec, TransferObserver& observer) override {
    check_attached();
    if (auto refused = refuse_outside(spec, observer)) return refused;
    spec.remote_id = attach.attachment;
    spec.token = attach.secret;
    spec.endpoint = this->spec().endpoint;
    spec.peer_name = this->spec().peer_name;
    if (!spec.region_tag) spec.region_tag = std::string();
    return owner_.start_attached(*this, std::move(spec), observer);
  }

  std::shared_ptr<const DirectCopy> direct() const override { return direct_copy; }
  void ended(const TransferSpec& spec, const std::optional<Error>& error) override {
    if (link == nullptr || !attached()) return;
    TransferSpec s = spec;
    s.remote_id = attach.attachment;
    s.token = attach.secret;
    link->send_ended(s, error ? &*error : nullptr);
  }

  std::uint64_t key() const noexcept { return key_; }
  RegionAttach attach;
  Link* link = nullptr;
  /// Set by the transport once attached, where it copies on the calling thread (cma).
  std::shared_ptr<const DirectCopy> direct_copy;

 private:
  T& owner_;
  const std::uint64_t key_;
};

/// A same-host transport's attachments, active side: made on the pooled link to the owner,
/// told what the link hears (Link::Client's region calls), forgotten (with a DETACH) when their
/// object goes. Loop thread only.
template <class T>
class RemoteRegions {
 public:
  using Region = RemoteRegion<T>;

  /// Attaches through the link `link_to` gives (it throws when the owner cannot be reached:
  /// a set-up failure the observer hears).
  std::unique_ptr<RemoteRegion<T>> attach(T& owner, Defer defer, kit::LinkPool<Link>& links,
                                          const std::function<Link&(const AttachSpec&)>& link_to,
                                          AttachSpec spec, AttachObserver& observer) {
    const std::uint64_t key = next_++;
    auto region = std::make_unique<Region>(owner, std::move(defer), key, std::move(spec), observer);
    regions_[key] = region.get();
    try {
      region->link = &link_to(region->spec());
    } catch (const Error& e) {
      region->on_lost(e, /*setup=*/true);
      return region;
    }
    links.used(region->link);
    region->link->attach_region(key, region->attach);
    return region;
  }

  /// `region` is going: its link forgets it (a DETACH if it was attached), and is released.
  void forget(Region& region, kit::LinkPool<Link>& links, bool closed) {
    regions_.erase(region.key());
    if (closed) region.link = nullptr;  // the links are gone
    if (region.link == nullptr) return;
    Link* link = region.link;
    region.link = nullptr;
    link->drop_region(region.key(), region.attach, /*detach=*/region.attached());
    links.released(link);
  }

  // What the link hears (Link::Client).
  RegionAttach* attaching(std::uint64_t key) {
    auto it = regions_.find(key);
    return it == regions_.end() ? nullptr : &it->second->attach;
  }
  void attached(std::uint64_t key) {
    if (auto it = regions_.find(key); it != regions_.end()) it->second->on_attach();
  }
  Region* find(std::uint64_t key) {
    auto it = regions_.find(key);
    return it == regions_.end() ? nullptr : it->second;
  }
  void ended(std::uint64_t key, const Error& error, bool setup) {
    auto it = regions_.find(key);
    if (it == regions_.end()) return;
    Region& region = *it->second;
    if (region.attached())
      region.on_ended(error);
    else if (setup)
      region.on_lost(error, true);
    else
      region.on_refused(error);
  }
  /// `link` is about to be destroyed.
  void link_closed(Link& link) {
    for (auto& [key, region] : regions_)
      if (region->link == &link) region->link = nullptr;
  }

 private:
  std::unordered_map<std::uint64_t, Region*> regions_;  ///< by key
  std::uint64_t next_ = 1;
};

}  // namespace ferry::transport::same_host
