#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <unordered_map>
#include <utility>

namespace ferry::transport::kit {

/// Requests awaiting an answer, each bound to the connection it went out on: an answer counts
/// only from there, so that one peer can never answer what was asked of another. The ids are
/// this table's own, never reused. `Entry` is what the method keeps per request.
///
/// `on_count(conn, delta)` hears each request added (+1) and gone (-1) per connection: the
/// connection's watchdog waits for its peer while answers are due. Loop thread only.
template <class Entry>
class PendingRequests {
 public:
  using Count = std::function<void(std::uint64_t conn, int delta)>;

  explicit PendingRequests(Count on_count = {}) : on_count_(std::move(on_count)) {}

  /// A fresh request id on `conn`.
  std::uint64_t add(std::uint64_t conn, Entry entry) {
    const std::uint64_t req = next_++;
    items_.emplace(req, Item{conn, std::move(entry)});
    if (on_count_) on_count_(conn, +1);
    return req;
  }
  /// The request `req` if it went out on `conn`; null otherwise (unknown, answered, or another
  /// connection's).
  Entry* find(std::uint64_t req, std::uint64_t conn) {
    auto it = items_.find(req);
    return it == items_.end() || it->second.conn != conn ? nullptr : &it->second.entry;
  }
  /// Takes the answered request `req` out, if it went out on `conn`.
  std::optional<Entry> take(std::uint64_t req, std::uint64_t conn) {
    auto it = items_.find(req);
    if (it == items_.end() || it->second.conn != conn) return std::nullopt;
    std::optional<Entry> out(std::move(it->second.entry));
    erase(it);
    return out;
  }
  /// Forgets request `req` (no answer will count). No effect if unknown.
  void forget(std::uint64_t req) {
    if (auto it = items_.find(req); it != items_.end()) erase(it);
  }
  /// Forgets every request for which `pred(entry)` holds.
  template <class Pred>
  void forget_if(Pred pred) {
    for (auto it = items_.begin(); it != items_.end();)
      it = pred(it->second.entry) ? erase(it) : std::next(it);
  }
  /// Connection `conn` is gone: its requests with it (without counting: it has no watchdog
  /// any more).
  void drop_connection(std::uint64_t conn) {
    std::erase_if(items_, [conn](const auto& kv) { return kv.second.conn == conn; });
  }
  void clear() { items_.clear(); }
  bool empty() const noexcept { return items_.empty(); }
  std::size_t size() const noexcept { return items_.size(); }

 private:
  struct Item {
    std::uint64_t conn = 0;
    Entry entry;
  };
  using Map = std::unordered_map<std::uint64_t, Item>;
  typename Map::iterator erase(typename Map::iterator it) {
    const std::uint64_t conn = it->second.conn;
    auto next = items_.erase(it);
    if (on_count_) on_count_(conn, -1);
    return next;
  }

  Count on_count_;
  Map items_;
  std::uint64_t next_ = 1;
};

}  // namespace ferry::transport::kit
