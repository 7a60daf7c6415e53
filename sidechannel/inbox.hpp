#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "loop/log.hpp"
#include "sidechannel/message.hpp"

namespace ferry::sidechannel {

/// What waits for a message at a channel's own inbox "<prefix>.inbox.<client id>": open
/// requests, whose answers come to "<inbox>.r<id>", and subscriptions waiting for their
/// confirmation at "<inbox>.c<id>" (see NatsChannel::subscribe). The ids are random 64-bit
/// numbers: the subjects are visible on the wire, and an answer must not be forgeable by
/// guessing the next one. Touches no NATS; loop thread only.
class Inbox {
 public:
  using Clock = std::chrono::steady_clock;
  /// Told once whether a subscription was confirmed (`error` empty), or why not.
  using Confirmed = std::function<void(const std::string& error)>;

  /// `subject`: "<prefix>.inbox.<client id>". At most `max_open_requests` requests stay open;
  /// `log` hears when the oldest are dropped.
  Inbox(std::string subject, std::size_t max_open_requests, loop::Log log);

  const std::string& subject() const noexcept { return subject_; }

  /// Opens a request whose answer goes to `handler`, once, and returns its id. With
  /// max_open_requests open already, the oldest is dropped first (its handler is never
  /// called), said once in the log. Throws Error(Internal), and changes nothing, when no
  /// fresh id can be drawn (the kernel's random source fails).
  std::uint64_t open_request(MessageHandler handler);
  /// "<inbox>.r<id>", the id in lowercase hex: where the request's answer goes.
  std::string request_subject(std::uint64_t id) const;
  /// After it returns, the request's handler is not called. An id not open is ignored.
  void drop_request(std::uint64_t id) noexcept;
  std::size_t open_requests() const noexcept { return requests_.size(); }

  /// Waits for the confirmation of the subscription `sub` to `subscribed` (named in errors)
  /// until `deadline`, and returns the wait's id. Throws as open_request().
  std::uint64_t await_confirm(Confirmed done, std::string subscribed, std::uint64_t sub,
                              Clock::time_point deadline);
  /// "<inbox>.c<id>", the id in lowercase hex: what confirms the subscription.
  std::string confirm_subject(std::uint64_t id) const;
  /// Ends the wait `id`, or the wait for the subscription `sub`; returns whom to tell (empty
  /// when nobody waits).
  Confirmed take_confirm(std::uint64_t id);
  Confirmed take_confirm_of(std::uint64_t sub);
  /// Ends every wait whose deadline is not after `now`: whom to tell, and the error ("the NATS
  /// server did not confirm the subscription to '<subject>' within <timeout> ms").
  std::vector<std::pair<Confirmed, std::string>> take_expired(Clock::time_point now,
                                                              std::chrono::milliseconds timeout);
  /// Ends every wait; returns whom to tell.
  std::vector<Confirmed> take_all_confirms();
  /// Moves every deadline to `deadline`; returns the confirmation subjects, to send again.
  std::vector<std::string> restart_confirms(Clock::time_point deadline);
  /// The earliest deadline, while something waits.
  std::optional<Clock::time_point> earliest_deadline() const;
  std::size_t pending_confirmations() const noexcept { return confirms_.size(); }

  /// A message that arrived at "<inbox>.*": an answer goes to its request's handler (which
  /// closes the request), a confirmation to whoever waits for it. Anything else (an id not
  /// open, a subject of another form) is dropped.
  void deliver(const Message& m);

  /// Forgets every request and wait without telling anyone (the channel is closing).
  void clear() noexcept;

 private:
  struct OpenRequest {
    MessageHandler handler;
    std::list<std::uint64_t>::iterator in_order;
  };
  struct Wait {
    Confirmed done;
    std::string subject;  // the one subscribed to, for errors
    std::uint64_t sub = 0;
    Clock::time_point deadline;
  };

  std::string subject_;
  std::size_t max_open_requests_;
  loop::Log log_;
  std::unordered_map<std::uint64_t, OpenRequest> requests_;
  std::list<std::uint64_t> order_;  // the open requests' ids, oldest first, for the cap
  bool noted_cap_ = false;
  std::unordered_map<std::uint64_t, Wait> confirms_;
};

/// Test seam: where the ids come from (loop::random_u64 by default, which throws
/// Error(Internal) when the kernel's random source fails). Returns the previous source;
/// nullptr restores the default. Tests only.
using RandomSource = std::uint64_t (*)();
RandomSource set_random_source_for_testing(RandomSource source);

}  // namespace ferry::sidechannel
