#pragma once

#include <uv.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "loop/uv_handle.hpp"
#include "transport/context.hpp"
#include "transport/kit/lifetime.hpp"

namespace ferry::transport::kit {

/// A transport's links (its connections to peers, as the active side) by peer address, shared
/// by every transfer toward that peer. `L` says whether it may take new transfers (usable()),
/// whether anything uses it (idle()), and closes without calling back (close()).
///
/// Idle links are kept for reuse, but not without bound: at most kMaxIdle, the least recently
/// used beyond that closed, and none idle for longer than kIdleTimeout. The idle timer runs
/// only while idle links exist. Links are destroyed after the current loop callback (they may
/// be on the stack). Loop thread only.
template <class L>
class LinkPool {
 public:
  static constexpr std::size_t kMaxIdle = 64;
  static constexpr std::chrono::seconds kIdleTimeout{60};

  LinkPool(uv_loop_t* loop, Defer defer)
      : defer_(std::move(defer)), timer_(loop::Timer::timer(loop, this)) {}
  ~LinkPool() { close(); }
  LinkPool(const LinkPool&) = delete;
  LinkPool& operator=(const LinkPool&) = delete;

  /// The usable link to `address`, or null. One that is not usable any more (closing after a
  /// protocol error) leaves the pool's index: idle, it goes at once; else it lives on for the
  /// transfers it carries, until its connection closes (remove()).
  L* find(const std::string& address) {
    auto it = by_address_.find(address);
    if (it == by_address_.end()) return nullptr;
    if (it->second->usable()) return it->second;
    L* stale = it->second;
    by_address_.erase(it);
    if (stale->idle()) close_link(stale);
    return nullptr;
  }
  /// `link` serves `address` from now on (an older one there is let go as find() does).
  L* add(const std::string& address, std::unique_ptr<L> link) {
    if (find(address) != nullptr) let_go(address);
    L* raw = link.get();
    owned_[raw] = std::move(link);
    by_address_[address] = raw;
    return raw;
  }
  /// `link` is gone (its connection closed): destroyed after the current callback.
  void remove(L* link) {
    std::erase_if(by_address_, [link](const auto& kv) { return kv.second == link; });
    bury(link);
  }
  /// Whatever used `link` let go of it: if it is idle now, it waits for reuse (within the
  /// bounds above), or goes at once when it serves no address any more.
  void released(L* link) {
    if (!link->idle() || owned_.count(link) == 0) return;
    if (!indexed(link)) {
      close_link(link);
      return;
    }
    idle_.remove(link);
    idle_.push_back(link);
    link->idle_since = std::chrono::steady_clock::now();
    while (idle_.size() > kMaxIdle) close_link(idle_.front());
    if (idle_.size() == 1) arm();
  }
  /// `link` is in use again.
  void used(L* link) { idle_.remove(link); }
  /// Closes every link, without calling back.
  void close() {
    timer_.reset();
    idle_.clear();
    for (auto& [raw, link] : owned_) link->close();
    owned_.clear();
    by_address_.clear();
    graveyard_.clear();
    life_.renew();
  }
  /// Links the pool holds (indexed by address or not).
  std::size_t size() const noexcept { return owned_.size(); }

 private:
  bool indexed(L* link) const {
    for (const auto& [address, l] : by_address_)
      if (l == link) return true;
    return false;
  }
  void let_go(const std::string& address) {
    auto it = by_address_.find(address);
    if (it == by_address_.end()) return;
    L* old = it->second;
    by_address_.erase(it);
    if (old->idle()) close_link(old);
  }
  void bury(L* link) {
    idle_.remove(link);
    auto it = owned_.find(link);
    if (it == owned_.end()) return;
    graveyard_.push_back(std::move(it->second));
    owned_.erase(it);
    if (graveyard_.size() == 1) life_.defer(defer_, [this] { graveyard_.clear(); });
  }
  void close_link(L* link) {
    std::erase_if(by_address_, [link](const auto& kv) { return kv.second == link; });
    link->close();
    bury(link);
  }
  void arm() {
    if (!timer_ || idle_.empty()) return;
    const auto due = idle_.front()->idle_since + kIdleTimeout - std::chrono::steady_clock::now();
    const auto ms = std::max<std::int64_t>(
        1, std::chrono::duration_cast<std::chrono::milliseconds>(due).count());
    uv_timer_start(
        timer_.get(),
        [](uv_timer_t* t) {
          if (t->data != nullptr) static_cast<LinkPool*>(t->data)->sweep();
        },
        static_cast<std::uint64_t>(ms), 0);
  }
  void sweep() {
    const auto cutoff = std::chrono::steady_clock::now() - kIdleTimeout;
    while (!idle_.empty() && idle_.front()->idle_since <= cutoff) close_link(idle_.front());
    arm();
  }

  Defer defer_;
  Lifetime life_;
  std::unordered_map<L*, std::unique_ptr<L>> owned_;
  std::unordered_map<std::string, L*> by_address_;
  std::list<L*> idle_;  ///< least recently used first
  std::vector<std::unique_ptr<L>> graveyard_;
  loop::Timer timer_;
};

}  // namespace ferry::transport::kit
