#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <ferry/error.hpp>

namespace ferry {

namespace detail {
struct SubscriptionState;
}

/// A NATS message, as the application's own messaging sees it (Connector::subscribe,
/// Connector::request; docs/sidechannel.md, "Messaging"). A value type.
struct Message {
  std::string subject;  ///< where it was published (the concrete subject, never a wildcard)
  std::string reply;    ///< where an answer goes (Connector::respond); empty: none asked for
  std::string data;     ///< the payload, any bytes
};

/// Called on the connector's loop thread for each message of a subscription, in the order the
/// server delivered them. `message` is valid during the call only. It must not block: it runs
/// on the loop that moves every transfer of its connector. It may call the connector (respond,
/// publish, subscribe, unsubscribe this or another subscription, start operations); those calls
/// run inline.
using MessageHandler = std::function<void(const Message& message)>;

/// Called once, on the connector's loop thread, with the answer to Connector::request: `reply`
/// set and `error` null, or `reply` null and `error` saying why there is none: Timeout (naming
/// the subject), PeerLost (nobody subscribes to the subject: the server said "no responders"),
/// Cancelled (the connector was closed). Both are valid during the call only. Must not block.
using ReplyHandler = std::function<void(const Message* reply, const Error* error)>;

/// Settings of Connector::subscribe.
struct SubscribeOptions {
  /// A queue group: each message goes to one member of the group, of all the subscriptions (of
  /// any connection) to the subject that name it. Empty: none (every subscription gets every
  /// message). A name of 1 to 1024 characters without wildcards, whitespace or empty tokens.
  std::string queue;
};

/// A subscription made by Connector::subscribe. Move-only.
///
/// Destructor: unsubscribes (see unsubscribe()).
class Subscription {
 public:
  /// An empty handle: active() is false, unsubscribe() does nothing, subject() is empty.
  Subscription() noexcept;
  Subscription(Subscription&&) noexcept;
  /// Unsubscribes from what this handle held (as the destructor does), then takes `other`'s.
  Subscription& operator=(Subscription&& other) noexcept;
  Subscription(const Subscription&) = delete;
  Subscription& operator=(const Subscription&) = delete;
  ~Subscription();

  /// False for an empty handle. Any thread.
  explicit operator bool() const noexcept { return state_ != nullptr; }

  /// Ends the subscription. When it returns, the handler is not called again, and no call of
  /// it is running on another thread (off the loop thread it waits for the loop, as every call
  /// does; in the handler itself, the current call goes on). Messages the server had already
  /// routed here are dropped. No effect on a subscription that has ended. Any thread; never
  /// throws.
  void unsubscribe() noexcept;
  /// Until unsubscribe(), the connector's end, or the server's refusal (error() says which).
  /// Any thread.
  bool active() const noexcept;
  /// The subject (or pattern) subscribed to; empty for an empty handle. Any thread.
  const std::string& subject() const noexcept;
  /// The queue group; empty: none. Any thread.
  const std::string& queue() const noexcept;
  /// Why the subscription ended, when not by unsubscribe(): SideChannel (cnats refused it or
  /// the server did not confirm it; only a subscription made on the loop thread, which does
  /// not wait for the server, can end so after the call), Cancelled (the connector was closed).
  /// Empty otherwise. Any thread.
  std::optional<Error> error() const;

 private:
  friend class Connector;
  explicit Subscription(std::shared_ptr<detail::SubscriptionState> state) noexcept;
  std::shared_ptr<detail::SubscriptionState> state_;
};

}  // namespace ferry
