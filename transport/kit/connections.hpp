#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "transport/context.hpp"
#include "transport/kit/lifetime.hpp"

namespace ferry::transport::kit {

/// A transport's connections of one kind, owned here by id. A connection that closes may still
/// be on the stack (its handler is being called): bury() takes it out at once and destroys it
/// after the current loop callback. Loop thread only.
template <class C>
class ConnectionSet {
 public:
  explicit ConnectionSet(Defer defer) : defer_(std::move(defer)) {}
  ConnectionSet(const ConnectionSet&) = delete;
  ConnectionSet& operator=(const ConnectionSet&) = delete;

  C* add(std::uint64_t id, std::unique_ptr<C> c) {
    C* raw = c.get();
    items_[id] = std::move(c);
    return raw;
  }
  C* find(std::uint64_t id) const {
    auto it = items_.find(id);
    return it == items_.end() ? nullptr : it->second.get();
  }
  /// Takes `id` out; it is destroyed after the current callback.
  void bury(std::uint64_t id) {
    auto it = items_.find(id);
    if (it == items_.end()) return;
    graveyard_.push_back(std::move(it->second));
    items_.erase(it);
    if (graveyard_.size() == 1) life_.defer(defer_, [this] { graveyard_.clear(); });
  }
  /// Every connection, for a pass that may bury some.
  std::vector<C*> all() const {
    std::vector<C*> out;
    out.reserve(items_.size());
    for (const auto& [id, c] : items_) out.push_back(c.get());
    return out;
  }
  /// Destroys every connection now, calling `last(c)` on each first.
  template <class F>
  void clear(F&& last) {
    for (auto& [id, c] : items_) last(*c);
    items_.clear();
    graveyard_.clear();
    life_.renew();
  }
  std::size_t size() const noexcept { return items_.size(); }

 private:
  Defer defer_;
  Lifetime life_;
  std::unordered_map<std::uint64_t, std::unique_ptr<C>> items_;
  std::vector<std::unique_ptr<C>> graveyard_;
};

}  // namespace ferry::transport::kit
