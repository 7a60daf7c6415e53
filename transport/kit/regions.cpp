#include "transport/kit/regions.hpp"

#include <cstring>

namespace ferry::transport::kit {

namespace {

Regions::Verdict refuse(ErrorCode code, std::string message) {
  Regions::Verdict v;
  v.code = code;
  v.message = std::move(message);
  return v;
}

bool one_kind(std::uint16_t flags) {
  return flags == static_cast<std::uint16_t>(Access::read) ||
         flags == static_cast<std::uint16_t>(Access::write);
}

}  // namespace

Regions::Regions(std::string method, Exposures& exposures, Defer defer)
    : method_(std::move(method)), exposures_(exposures), defer_(std::move(defer)) {}

Regions::~Regions() = default;

void Regions::add(const RegionExposure& region, RegionObserver& observer) {
  auto [it, inserted] = regions_.emplace(region.id, Served{region, &observer});
  if (!inserted) throw Error(ErrorCode::Internal, "region id already in use");
}

Regions::Verdict Regions::attach(std::uint64_t region, const Token& token, std::uint16_t flags,
                                 std::uint64_t conn, const std::string& name,
                                 const std::string& description, const std::string& peer_id) {
  auto it = regions_.find(region);
  if (it == regions_.end() || !tokens_equal(it->second.region.token, token))
    return refuse(ErrorCode::AccessDenied, "no live region matches this id and token");
  const Access offered = it->second.region.access;
  if (flags == 0 || flags > static_cast<std::uint16_t>(Access::read_write))
    return refuse(ErrorCode::ProtocolError, "ATTACH names no access kind");
  const auto wanted = static_cast<Access>(flags);
  if ((static_cast<std::uint8_t>(wanted) & ~static_cast<std::uint8_t>(offered)) != 0)
    return refuse(ErrorCode::AccessDenied, offered == Access::read
                                               ? "the region is readable; it cannot be written"
                                               : "the region is writable; it cannot be read");
  std::size_t on_conn = 0, on_region = 0;
  for (const auto& [other, a] : attachments_) {
    on_conn += a.conn == conn ? 1 : 0;
    on_region += a.region == region ? 1 : 0;
  }
  if (on_conn >= kMaxPerConnection || on_region >= kMaxPerRegion)
    return refuse(
        ErrorCode::Unsupported,
        on_conn >= kMaxPerConnection
            ? "too many attachments on this connection (" + std::to_string(kMaxPerConnection) + ")"
            : "too many attachments to this region (" + std::to_string(kMaxPerRegion) + ")");
  Att att;
  att.region = region;
  att.conn = conn;
  att.secret = random_token();
  att.access = wanted;
  att.peer_id = peer_id;
  const std::uint64_t id = attachment_id(next_++);
  att.lost = std::make_unique<Lost>();
  att.lost->owner = this;
  att.lost->id = id;
  Exposure exposure;
  exposure.id = id;
  exposure.token = att.secret;
  exposure.access = wanted;
  exposure.regions = it->second.region.regions;
  exposures_.add(exposure, *att.lost);
  // Bound at once: no other connection may use this attachment, and no claim exchange follows.
  Exposures::Entry* entry = exposures_.find(id);
  ExposureTable::claim(*entry, conn, name);

  Attachment a;
  a.id = id;
  a.region = region;
  a.method = method_;
  a.peer = description;
  a.peer_id = peer_id;
  a.access = wanted;
  Verdict v;
  v.attachment = id;
  v.secret = att.secret;
  attachments_.emplace(id, std::move(att));
  notify(
      id, [a](RegionObserver& o) { o.on_attached(a); }, false);
  return v;
}

Regions::Verdict Regions::ended(std::uint64_t id, const Token& secret, std::uint16_t flags,
                                std::optional<Error> outcome, std::string tag, const void* payload,
                                std::size_t bytes, std::uint64_t conn) {
  if (!one_kind(flags)) return refuse(ErrorCode::ProtocolError, "ENDED names no access kind");
  if (bytes % 16 != 0 || bytes > kMaxEndedBytes)
    return refuse(ErrorCode::ProtocolError, "ENDED carries " + std::to_string(bytes) +
                                                " bytes of ranges (a multiple of 16, at most " +
                                                std::to_string(kMaxEndedBytes) + ")");
  if (tag.size() > kMaxTag)
    return refuse(ErrorCode::ProtocolError, "ENDED carries a tag of " + std::to_string(tag.size()) +
                                                " bytes (at most " + std::to_string(kMaxTag) + ")");
  auto it = attachments_.find(id);
  const auto access = static_cast<Access>(flags);
  auto v = exposures_.check(id, secret, access, 0, 0, conn);
  if (it == attachments_.end() || it->second.gone || !v.ok())
    return refuse(v.ok() ? ErrorCode::AccessDenied : v.code,
                  v.ok() ? "no live attachment matches this id and secret" : v.message);
  RegionNotice notice;
  notice.attachment = id;
  notice.access = access;
  notice.tag = std::move(tag);
  notice.error = std::move(outcome);
  const auto* at = static_cast<const std::byte*>(payload);
  for (std::size_t i = 0; i + 16 <= bytes; i += 16) {
    std::uint64_t addr = 0;
    std::uint64_t len = 0;
    std::memcpy(&addr, at + i, 8);
    std::memcpy(&len, at + i + 8, 8);
    auto r = exposures_.check(id, secret, access, addr, len, conn);
    if (len == 0 || !r.ok())
      return refuse(ErrorCode::AccessDenied,
                    len == 0 ? "ENDED names an empty range" : "ENDED: " + r.message);
    notice.ranges.emplace_back(addr, len);
  }
  Verdict ok;
  ok.attachment = id;
  notify(
      id, [n = std::move(notice)](RegionObserver& o) { o.on_region_transfer(n); }, false);
  return ok;
}

bool Regions::holds(std::uint64_t id, const Token& secret, std::uint64_t conn) const {
  auto it = attachments_.find(id);
  return it != attachments_.end() && !it->second.gone && it->second.conn == conn &&
         tokens_equal(it->second.secret, secret);
}

bool Regions::detach(std::uint64_t id, const Token& secret, std::uint64_t conn) {
  if (!holds(id, secret, conn)) return false;
  auto it = attachments_.find(id);
  it->second.gone = true;
  exposures_.revoke(id);  // the secret dies now; the Lost adapter hears nothing more
  notify(
      id, [id](RegionObserver& o) { o.on_detached(id, std::nullopt); }, true);
  return true;
}

void Regions::lost(std::uint64_t id, const Error& error) {
  // Deferred already (Exposures told the adapter after the connection closed): tell the owner
  // now, in order behind the notices before it.
  auto it = attachments_.find(id);
  if (it == attachments_.end()) return;
  auto r = regions_.find(it->second.region);
  RegionObserver* observer = r == regions_.end() ? nullptr : r->second.observer;
  attachments_.erase(it);  // destroys the adapter this call came through; nothing touches it after
  if (observer != nullptr) observer->on_detached(id, error);
}

std::uint64_t Regions::revoke(std::uint64_t id) {
  auto it = attachments_.find(id);
  if (it == attachments_.end()) return 0;
  const std::uint64_t conn = it->second.conn;
  exposures_.revoke(id);
  attachments_.erase(it);
  return conn;
}

std::vector<std::pair<std::uint64_t, std::uint64_t>> Regions::attachments_of(
    std::uint64_t id) const {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  for (const auto& [att, a] : attachments_)
    if (a.region == id) out.emplace_back(att, a.conn);
  return out;
}

std::vector<std::uint64_t> Regions::attachments_of_peer(std::uint64_t id,
                                                        const std::string& peer_id) const {
  std::vector<std::uint64_t> out;
  if (peer_id.empty()) return out;
  for (const auto& [att, a] : attachments_)
    if (a.region == id && !a.gone && a.peer_id == peer_id) out.push_back(att);
  return out;
}

std::vector<std::pair<std::uint64_t, std::uint64_t>> Regions::end(std::uint64_t id) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out = attachments_of(id);
  for (const auto& [att, conn] : out) revoke(att);
  regions_.erase(id);
  return out;
}

void Regions::clear() {
  regions_.clear();
  attachments_.clear();
  life_.renew();
}

void Regions::notify(std::uint64_t id, std::function<void(RegionObserver&)> call, bool last) {
  life_.defer(defer_, [this, id, call = std::move(call), last] {
    auto it = attachments_.find(id);
    if (it == attachments_.end()) return;  // revoked by its owner, or its region ended
    auto r = regions_.find(it->second.region);
    if (r == regions_.end()) return;
    RegionObserver* observer = r->second.observer;
    if (last) attachments_.erase(it);
    call(*observer);
  });
}

}  // namespace ferry::transport::kit
