#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <ferry/messaging.hpp>

#include "loop/uv_handle.hpp"

namespace ferry::detail {

class Core;

/// A subscription of the application's (Connector::subscribe). The handle, the loop's table
/// (Core::subscriptions, weakly) and the channel's handler (weakly) share it.
struct SubscriptionState : std::enable_shared_from_this<SubscriptionState> {
  SubscriptionState(std::shared_ptr<Core> c, std::uint64_t i, std::string s, std::string q);

  /// Loop thread: subscribes at the channel. Throws InvalidState once the connector is closed.
  void start(MessageHandler handler);
  /// Loop thread: ends it (idempotent): no handler call after this, the channel unsubscribed,
  /// the handler destroyed here. `why` is kept for error() and tells a subscribe() still
  /// waiting for the server.
  void end(const std::optional<Error>& why);

  const std::shared_ptr<Core> core;
  const std::uint64_t id;  // key in Core::subscriptions
  const std::string subject;
  const std::string queue;
  /// Any thread: false once ended; the loop checks it before every handler call.
  std::atomic<bool> active{true};

  // Loop thread only.
  std::uint64_t channel_id = 0;
  bool ended = false;
  std::shared_ptr<const MessageHandler> handler;  // shared: a call may end it under itself
  /// Told once: the server has the subscription (empty) or why not. Null once told.
  std::shared_ptr<std::promise<std::optional<Error>>> confirming =
      std::make_shared<std::promise<std::optional<Error>>>();

  mutable std::mutex mu;
  std::optional<Error> error;  // guarded by mu
};

/// A request of the application's (Connector::request) until its answer, deadline or the
/// connector's end. Loop thread only.
struct PendingRequest {
  Core* core = nullptr;
  std::uint64_t key = 0;  // in Core::requests
  std::uint64_t channel_id = 0;
  std::string subject;
  std::chrono::milliseconds timeout{0};
  ReplyHandler on_reply;
  loop::Timer deadline;
};

/// Loop thread, at shutdown: ends every subscription and every pending request (Cancelled).
void end_messaging(Core& core) noexcept;

}  // namespace ferry::detail
