#pragma once
// NatsChannel's insides, shared by its two sources: nats_channel.cpp (subscriptions,
// publishes, requests) and nats_connection.cpp (the connection and its events).

#include <nats/nats.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <ferry/error.hpp>

#include "sidechannel/inbox.hpp"
#include "sidechannel/nats_channel.hpp"

namespace ferry::sidechannel {

// Loop-side state. Shared with cnats callbacks through weak references, so that a message
// that arrives while the channel closes finds nothing instead of a dangling pointer.
struct NatsChannel::State {
  using Clock = Inbox::Clock;

  State(EventLoop& loop, const NatsOptions& o, const std::string& client_id)
      : poster(loop.poster()),
        prefix(o.prefix.empty() ? "ferry" : o.prefix),
        inbox(prefix + ".inbox." + client_id, kMaxOpenRequests, loop.log()),
        on_event(o.on_event),
        request_timeout(o.request_timeout),
        connect_deadline(o.connect_deadline) {
    for (const auto& url : o.servers) servers += (servers.empty() ? "" : ", ") + url;
    if (auto why = subject_problem(inbox.subject()))
      throw Error(ErrorCode::InvalidArgument, "NATS prefix '" + prefix + "' " + *why);
  }

  EventLoop::Poster poster;
  std::string prefix;
  // Loop thread only, as everything below but max_payload.
  Inbox inbox;  // "<prefix>.inbox.<client id>": open requests, awaited confirmations
  std::function<void(SideChannelEvent, const std::string&)> on_event;
  std::chrono::milliseconds request_timeout{1000};
  std::chrono::milliseconds connect_deadline{0};
  NatsChannel* owner = nullptr;  // null once the channel is closing
  std::unordered_map<std::uint64_t, MessageHandler> subs;
  std::uint64_t next_sub = 1;
  // As the connection's events tell (loop side).
  bool connected = true;
  bool ever_connected = true;
  std::shared_ptr<StatusBoard> board;
  std::string servers;  // "url, url": for people
  // While connecting in the background: why the constructor's attempt failed, and why the
  // channel gave up, if it did (give_up()).
  std::string failure;
  std::string giving_up;

  // Written by cnats' callback thread, read by the loop.
  std::atomic<std::int64_t> max_payload{0};

  void deliver(std::uint64_t sub, const Message& m) {
    auto it = subs.find(sub);
    if (it == subs.end()) return;
    // Copy: the handler may unsubscribe itself.
    MessageHandler handler = it->second;
    handler(m);
  }
  void on_connection_event(SideChannelEvent event, const std::string& detail,
                           std::int64_t new_max_payload) {
    // Once the channel is closing, the connector says where it stands.
    const bool mine = owner != nullptr;
    switch (event) {
      case SideChannelEvent::connected: {
        const bool was = connected;
        connected = ever_connected = true;
        if (new_max_payload > 0) max_payload = new_max_payload;
        if (mine) board->set(SideChannelState::connected, detail);
        if (mine && !was) owner->reconfirm();
        break;
      }
      case SideChannelEvent::disconnected:
        connected = false;
        if (mine)
          board->set(SideChannelState::reconnecting,
                     "lost the connection to NATS at " + servers + "; reconnecting");
        break;
      case SideChannelEvent::reconnected:
        connected = true;
        if (new_max_payload > 0) max_payload = new_max_payload;
        if (mine) board->set(SideChannelState::connected, detail);
        if (mine) board->reconnected();
        if (mine) owner->reconfirm();
        break;
      case SideChannelEvent::closed:
        // cnats gave up (or was told to close): nothing pending will ever be confirmed.
        connected = false;
        if (mine) board->set(SideChannelState::closed, closed_text(detail));
        if (mine) owner->fail_confirms("the NATS connection is closed");
        break;
      case SideChannelEvent::error:
        break;
    }
    if (on_event) on_event(event, detail);
  }
  std::string closed_text(const std::string& last_error) const {
    if (ever_connected)
      return "the connection to NATS at " + servers + " is closed" +
             (last_error.empty() ? "" : ": " + last_error);
    return (giving_up.empty() ? "gave up connecting to NATS at " + servers +
                                    " after NatsOptions::max_reconnect rounds"
                              : giving_up) +
           ": " + failure;
  }
  // The channel is closing: handlers die first, so that messages still arriving find
  // nothing.
  void forget() noexcept {
    owner = nullptr;
    subs.clear();
    inbox.clear();
  }
};

// cnats' connection, set by the constructor, and the subscriptions made on it, which belong to
// the outbox's thread.
struct NatsChannel::Wire {
  natsConnection* nc = nullptr;
  std::unordered_map<std::uint64_t, natsSubscription*> subs;
  std::vector<natsSubscription*> draining;
};

}  // namespace ferry::sidechannel
