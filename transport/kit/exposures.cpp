#include "transport/kit/exposures.hpp"

#include <cstring>

namespace ferry::transport::kit {

Exposures::Exposures(std::string method, Defer defer)
    : method_(std::move(method)), defer_(std::move(defer)) {}

Exposures::~Exposures() = default;

void Exposures::add(const Exposure& exposure, ExposureObserver& observer) {
  table_.add(exposure, observer);
  extra_[exposure.id].observer = &observer;
}

void Exposures::notify(std::uint64_t id, std::function<void(ExposureObserver&)> call, bool last) {
  // Looked up when the call runs, not now: revoke() in between removes the observer, and
  // nothing is called after it.
  life_.defer(defer_, [this, id, call = std::move(call), last] {
    auto it = extra_.find(id);
    if (it == extra_.end() || it->second.observer == nullptr) return;
    ExposureObserver* observer = it->second.observer;
    if (last) extra_.erase(it);
    call(*observer);
  });
}

std::optional<Token> Exposures::claim(Entry& entry, std::uint64_t conn, const std::string& name,
                                      const std::string& description, const std::string& peer_id) {
  if (!ExposureTable::claim(entry, conn, name)) return std::nullopt;
  Claim c;
  c.method = method_;
  c.peer = description;
  c.peer_name = name;
  c.peer_id = peer_id;
  c.secret = random_token();
  notify(
      entry.exposure.id, [c](ExposureObserver& o) { o.on_claimed(c); }, false);
  return c.secret;
}

void Exposures::landed(std::uint64_t id, std::uint64_t addr, std::uint64_t len) {
  if (auto it = extra_.find(id); it != extra_.end()) it->second.written.add(addr, len);
}

std::uint64_t Exposures::written(std::uint64_t id) const {
  auto it = extra_.find(id);
  return it == extra_.end() ? 0 : it->second.written.covered();
}

std::uint64_t Exposures::exposed(std::uint64_t id) const {
  const Entry* entry = table_.find(id);
  if (entry == nullptr) return 0;
  std::uint64_t total = 0;
  for (const Region& r : entry->spans) total += r.size;
  return total;
}

std::optional<Error> Exposures::unwritten(std::uint64_t id, const std::string& peer) const {
  const std::uint64_t all = exposed(id);
  const std::uint64_t some = written(id);
  if (some >= all) return std::nullopt;
  return Error(ErrorCode::ProtocolError, "peer " + peer + " said it was done after writing " +
                                             std::to_string(some) + " of " + std::to_string(all) +
                                             " bytes");
}

void Exposures::sending(std::uint64_t id) {
  if (auto it = extra_.find(id); it != extra_.end()) ++it->second.sends;
}

bool Exposures::sent(std::uint64_t id) {
  auto it = extra_.find(id);
  if (it == extra_.end() || it->second.sends == 0) return false;
  return --it->second.sends == 0 && it->second.done_pending && table_.find(id) != nullptr;
}

bool Exposures::done_reading(std::uint64_t id) {
  auto it = extra_.find(id);
  if (it == extra_.end()) return true;
  if (it->second.sends == 0) return true;
  it->second.done_pending = true;
  return false;
}

std::uint64_t Exposures::finish(std::uint64_t id, std::optional<Error> error) {
  Entry* entry = table_.find(id);
  if (entry == nullptr) return 0;
  const std::uint64_t bound = entry->bound_to;
  const std::string peer = entry->peer;
  table_.remove(id);  // the token is dead from here on
  notify(
      id, [peer, error](ExposureObserver& o) { o.on_peer_finished(peer, error); }, true);
  return bound;
}

std::uint64_t Exposures::revoke(std::uint64_t id) {
  extra_.erase(id);
  Entry* entry = table_.find(id);
  if (entry == nullptr) return 0;
  const std::uint64_t bound = entry->bound_to;
  table_.remove(id);
  return bound;
}

void Exposures::lose_connection(std::uint64_t conn, const Error& error) {
  std::vector<std::uint64_t> lost;
  table_.for_each([&](Entry& e) {
    if (e.bound_to == conn) lost.push_back(e.exposure.id);
  });
  for (std::uint64_t id : lost) {
    table_.remove(id);
    notify(
        id, [error](ExposureObserver& o) { o.on_peer_lost(error); }, true);
  }
}

void Exposures::clear() {
  table_ = ExposureTable{};
  extra_.clear();
  life_.renew();
}

std::vector<std::byte> claim_payload(const std::vector<Segment>& segments) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
  for (const Segment& s : segments) {
    if (s.len == 0) continue;
    if (!ranges.empty() && ranges.back().first + ranges.back().second == s.remote_addr)
      ranges.back().second += s.len;
    else
      ranges.emplace_back(s.remote_addr, s.len);
  }
  std::vector<std::byte> out(ranges.size() * 16);
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    std::memcpy(out.data() + i * 16, &ranges[i].first, 8);
    std::memcpy(out.data() + i * 16 + 8, &ranges[i].second, 8);
  }
  return out;
}

ExposureTable::Verdict Exposures::check_done(std::uint64_t id, const Token& token,
                                             std::uint16_t flags, std::uint64_t conn) {
  if (flags != static_cast<std::uint16_t>(Access::read) &&
      flags != static_cast<std::uint16_t>(Access::write)) {
    ExposureTable::Verdict v;
    v.code = ErrorCode::ProtocolError;
    v.message = "DONE names no access kind";
    return v;
  }
  return check(id, token, static_cast<Access>(flags), 0, 0, conn);
}

ExposureTable::Verdict Exposures::check_claim(std::uint64_t id, const Token& token,
                                              std::uint16_t flags, const void* payload,
                                              std::size_t bytes, std::uint64_t conn,
                                              Ranges& ranges) {
  ExposureTable::Verdict v;
  v.code = ErrorCode::ProtocolError;
  if (flags != static_cast<std::uint16_t>(Access::read) &&
      flags != static_cast<std::uint16_t>(Access::write)) {
    v.message = "CLAIM names no access kind";
    return v;
  }
  if (bytes == 0 || bytes % 16 != 0) {
    v.message = "CLAIM carries no ranges";
    return v;
  }
  // Every range the peer will reach must lie inside the operation, for the right kind, with
  // the right token, and the operation must be nobody else's.
  const auto* at = static_cast<const std::byte*>(payload);
  ranges.clear();
  for (std::size_t i = 0; i + 16 <= bytes; i += 16) {
    std::uint64_t addr = 0;
    std::uint64_t len = 0;
    std::memcpy(&addr, at + i, 8);
    std::memcpy(&len, at + i + 8, 8);
    if (len == 0) {
      v.code = ErrorCode::AccessDenied;
      v.message = "empty range";
      return v;
    }
    v = table_.check(id, token, static_cast<Access>(flags), addr, len, conn);
    if (!v.ok()) return v;
    ranges.emplace_back(addr, len);
  }
  return v;
}

}  // namespace ferry::transport::kit
