#pragma once

#include <uv.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>

#include <ferry/options.hpp>

#include "loop/uv_handle.hpp"

namespace ferry::transport::kit {

/// The bounds a listener puts on the peers it accepts before they prove anything (ferry's
/// ListenerOptions): at most max_connections accepted at once, and of those at most
/// max_unclaimed that have claimed nothing, each for at most unclaimed_timeout. An unclaimed
/// peer is cheap to the listener: nothing is sized by what it says before it presents a live
/// token.
///
/// At the unclaimed bound, room for a new peer is made by evicting one that claimed nothing,
/// the one that has shown least progress: the oldest that has sent nothing at all, else the
/// oldest that only said HELLO. A peer making progress (claiming, within a round trip of its
/// HELLO) is thereby the last to go, and a claimed one never goes for room.
///
/// The sweep timer runs only while unclaimed peers exist: an idle listener costs no wakeups.
/// Loop thread only.
class Admission {
 public:
  /// Closes peer `id` for `why` (the listener tells it, then frees it at once); Admission has
  /// forgotten it already.
  using Evict = std::function<void(std::uint64_t id, const std::string& why)>;

  Admission(uv_loop_t* loop, const ListenerOptions& bounds, Evict evict);
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  /// Room for one more peer: evicts an unclaimed one when at the bound. False when the
  /// listener is full (max_connections): refuse the new one.
  bool admit();
  /// A peer accepted after admit().
  void accepted(std::uint64_t id);
  /// The peer said something well formed (its HELLO): it moves behind the silent ones.
  void heard(std::uint64_t id);
  /// The peer presented a live token: it is bound by nothing here any more but the total.
  void claimed(std::uint64_t id);
  /// The peer is gone.
  void closed(std::uint64_t id);
  /// Stops the sweep; nothing is evicted after this.
  void stop();

  std::size_t connections() const noexcept { return members_.size(); }
  std::size_t unclaimed() const noexcept { return opened_.size(); }
  std::size_t max_connections() const noexcept { return max_connections_; }

 private:
  void arm();
  void sweep();

  ListenerOptions bounds_;
  std::size_t max_connections_;  ///< bounds_.max_connections, within the descriptor limit
  Evict evict_;
  std::set<std::uint64_t> members_;  ///< every peer accepted and not yet closed
  std::map<std::uint64_t, std::chrono::steady_clock::time_point> opened_;  ///< unclaimed
  std::set<std::uint64_t> silent_;   ///< unclaimed and never heard, oldest (smallest id) first
  std::set<std::uint64_t> greeted_;  ///< unclaimed, heard
  loop::Timer sweep_;
};

}  // namespace ferry::transport::kit
