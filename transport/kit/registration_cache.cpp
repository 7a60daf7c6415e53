#include "transport/kit/registration_cache.hpp"

#include <algorithm>
#include <vector>

#include <ferry/error.hpp>

namespace ferry::transport::kit {

RegistrationCache::RegistrationCache(RegisterFn register_fn, std::size_t max_idle)
    : register_fn_(std::move(register_fn)), max_idle_(max_idle) {}

std::shared_ptr<const Registration> RegistrationCache::find(std::uint64_t addr,
                                                            std::uint64_t len) const {
  auto it = index_.upper_bound(addr);
  if (it == index_.begin()) return nullptr;
  --it;
  return it->second.reg->covers(addr, len) ? it->second.reg : nullptr;
}

std::shared_ptr<const Registration> RegistrationCache::acquire(const Region& region) {
  const auto addr = reinterpret_cast<std::uint64_t>(region.ptr);
  if (region.ptr == nullptr || region.size == 0 ||
      region.size > UINT64_MAX - addr)  // real memory never wraps; a bad caller might
    throw Error(ErrorCode::InvalidArgument, "cannot register an empty or wrapping range");
  ++clock_;
  if (auto hit = find(addr, region.size); hit && hit->kind == region.kind) {
    index_[hit->base].last_use = clock_;
    return hit;
  }
  // Every cached range that overlaps or touches [addr, end) joins the new registration.
  std::uint64_t lo = addr;
  std::uint64_t hi = addr + region.size;
  auto first = index_.upper_bound(addr);
  if (first != index_.begin() &&
      std::prev(first)->second.reg->base + std::prev(first)->second.reg->size >= addr)
    --first;
  auto last = first;
  while (last != index_.end() && last->first <= hi && last->second.reg->kind == region.kind) {
    lo = std::min(lo, last->second.reg->base);
    hi = std::max(hi, last->second.reg->base + last->second.reg->size);
    ++last;
  }
  auto reg = std::make_shared<Registration>();
  reg->base = lo;
  reg->size = hi - lo;
  reg->kind = region.kind;
  reg->handle = register_fn_
                    ? register_fn_(Region{reinterpret_cast<std::byte*>(lo), hi - lo, region.kind})
                    : nullptr;
  ++registered_;
  // Only once the method accepted it do the merged ranges leave the index.
  index_.erase(first, last);
  index_[lo] = Slot{reg, clock_};
  // Trimming scans the whole index. While it is small, at once; once it is large (many
  // registrations held: an operation of a thousand pages, say), only when it has grown by half
  // since the last trim, so that the scans cost O(1) per registration, not O(n).
  if (index_.size() > max_idle_ &&
      (index_.size() <= max_idle_ + kTrimAlways || index_.size() >= next_trim_)) {
    trim();
    next_trim_ = index_.size() + index_.size() / 2 + 1;
  }
  return reg;
}

void RegistrationCache::invalidate(const Region& region) {
  const auto addr = reinterpret_cast<std::uint64_t>(region.ptr);
  const std::uint64_t end = addr + region.size;
  std::erase_if(index_, [&](const auto& kv) {
    const Registration& r = *kv.second.reg;
    return r.base < end && addr < r.base + r.size;
  });
}

void RegistrationCache::trim() {
  // Registrations nobody holds (only the index does) are idle; keep the newest max_idle_.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> idle;  // last_use, base
  for (const auto& [base, slot] : index_)
    if (slot.reg.use_count() == 1) idle.emplace_back(slot.last_use, base);
  if (idle.size() <= max_idle_) return;
  std::sort(idle.begin(), idle.end());
  for (std::size_t i = 0; i < idle.size() - max_idle_; ++i) index_.erase(idle[i].second);
}

}  // namespace ferry::transport::kit
