#include "transport/kit/exposure_table.hpp"

#include "loop/ids.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace ferry::transport::kit {

bool range_inside(const Region& region, std::uint64_t addr, std::uint64_t len) noexcept {
  const auto base = reinterpret_cast<std::uint64_t>(region.ptr);
  // Written so that no sum can wrap: addr - base only after addr >= base is known, and the
  // length compared against what is left of the region.
  return addr >= base && len <= region.size && addr - base <= region.size - len;
}

std::vector<Region> ExposureTable::merged(std::vector<Region> sorted) {
  // Merging makes the check independent of how the caller cut its memory: a descriptor
  // nested in another, or two that touch, grant exactly the bytes they cover together.
  std::sort(sorted.begin(), sorted.end(),
            [](const Region& a, const Region& b) { return a.ptr < b.ptr; });
  auto start = [](const Region& r) { return reinterpret_cast<std::uint64_t>(r.ptr); };
  std::vector<Region> spans;
  for (const Region& r : sorted) {
    if (!spans.empty()) {
      Region& last = spans.back();
      // Regions are real local memory, so start + size does not wrap.
      const std::uint64_t last_end = start(last) + last.size;
      if (start(r) <= last_end) {
        const std::uint64_t end = start(r) + r.size;
        if (end > last_end) last.size = end - start(last);
        continue;
      }
    }
    spans.push_back(r);
  }
  return spans;
}

ExposureTable::Entry& ExposureTable::add(const Exposure& exposure, ExposureObserver& observer) {
  Entry entry;
  entry.exposure = exposure;
  entry.observer = &observer;
  entry.spans = merged(exposure.regions);
  auto [it, inserted] = entries_.emplace(exposure.id, std::move(entry));
  if (!inserted) throw Error(ErrorCode::Internal, "exposure id already in use");
  return it->second;
}

bool ExposureTable::remove(std::uint64_t id) { return entries_.erase(id) > 0; }

ExposureTable::Entry* ExposureTable::find(std::uint64_t id) {
  auto it = entries_.find(id);
  return it == entries_.end() ? nullptr : &it->second;
}

const ExposureTable::Entry* ExposureTable::find(std::uint64_t id) const {
  auto it = entries_.find(id);
  return it == entries_.end() ? nullptr : &it->second;
}

ExposureTable::Verdict ExposureTable::check(std::uint64_t id, const Token& token, Access access,
                                            std::uint64_t addr, std::uint64_t len,
                                            std::uint64_t conn) {
  Verdict v;
  Entry* entry = find(id);
  if (entry == nullptr || !tokens_equal(entry->exposure.token, token)) {
    v.code = ErrorCode::AccessDenied;
    v.message = kNoLiveOperation;
    return v;
  }
  if (!allows(entry->exposure.access, access)) {
    v.code = ErrorCode::AccessDenied;
    v.message = entry->exposure.access == Access::read
                    ? "the operation is readable; it cannot be written"
                    : "the operation is writable; it cannot be read";
    return v;
  }
  if (entry->bound_to != 0 && entry->bound_to != conn) {
    v.code = ErrorCode::AccessDenied;
    v.message = "the operation is claimed by another peer (" + entry->peer + ")";
    return v;
  }
  if (len == 0) {
    v.entry = entry;
    return v;
  }
  // The spans are disjoint: the last one starting at or below addr is the only candidate.
  const auto& spans = entry->spans;
  auto it = std::upper_bound(
      spans.begin(), spans.end(), addr,
      [](std::uint64_t a, const Region& r) { return a < reinterpret_cast<std::uint64_t>(r.ptr); });
  if (it != spans.begin()) {
    const Region& r = *std::prev(it);
    if (range_inside(r, addr, len)) {
      v.entry = entry;
      v.ptr = r.ptr + (addr - reinterpret_cast<std::uint64_t>(r.ptr));
      return v;
    }
  }
  v.code = ErrorCode::AccessDenied;
  v.message = "range of " + std::to_string(len) + " bytes at 0x" + [&] {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%llx", static_cast<unsigned long long>(addr));
    return std::string(buf);
  }() + " is outside the operation's memory";
  return v;
}

bool ExposureTable::claim(Entry& entry, std::uint64_t conn, const std::string& peer) {
  if (entry.bound_to != 0) return false;
  entry.bound_to = conn;
  entry.peer = peer;
  return true;
}

}  // namespace ferry::transport::kit
