#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include <ferry/connector.hpp>

#include "sidechannel/event_loop.hpp"

namespace ferry::sidechannel {

/// A message as the loop sees it (copied out of cnats).
struct Message {
  std::string subject;
  std::string reply;
  std::string data;
  bool no_responders = false;  ///< the server's answer to a request nobody listens to
};
using MessageHandler = std::function<void(const Message&)>;

/// Why a subject cannot be used, or an empty string when it can: no wildcards, no empty
/// tokens, no whitespace or control characters, at most 1024 characters.
std::string subject_problem(std::string_view subject);

/// A NATS connection whose socket is driven by a connector's loop through cnats' libuv
/// adapter.
///
/// Threads: every method runs on the loop thread. cnats delivers messages and connection
/// events on threads of its own; they are handed to the loop and handlers run there. Calls
/// that take cnats' connection lock (publish, subscribe, unsubscribe) run on a worker thread
/// of this class, in order, because cnats holds that lock while a reconnect attempt
/// connects, which may take up to connect_timeout: the loop, which moves every transfer,
/// must not wait for it.
class NatsChannel {
 public:
  /// Connects, on the loop thread: cnats' libuv adapter requires the first attach there, so
  /// this blocks the loop for the handshake (at most options.connect_timeout). Throws
  /// Error(AccessDenied) when the server refuses the credentials, Error(SideChannel)
  /// otherwise.
  NatsChannel(EventLoop& loop, const NatsOptions& options, std::string client_id);
  /// Closes the connection; loop thread.
  ~NatsChannel();
  NatsChannel(const NatsChannel&) = delete;
  NatsChannel& operator=(const NatsChannel&) = delete;

  /// Subscribes; `handler` runs on the loop for each message until unsubscribe(). `queue`
  /// may be empty. Returns an id for unsubscribe(). `registered`, when given, is called (on
  /// the worker thread) once the server has confirmed the subscription, or has not within
  /// request_timeout: a request published after that reaches the handler.
  std::uint64_t subscribe(const std::string& subject, const std::string& queue,
                          MessageHandler handler, std::function<void()> registered = {});
  /// After it returns, the handler is not called again.
  void unsubscribe(std::uint64_t id);
  void publish(const std::string& subject, std::string data, const std::string& reply = {});

  /// Publishes a request whose first answer (or the server's no-responders notice) goes to
  /// `handler`, once. Returns an id for cancel_request().
  std::uint64_t request(const std::string& subject, std::string data, MessageHandler handler);
  /// After it returns, the request's handler is not called.
  void cancel_request(std::uint64_t id);

  /// "<prefix>.<suffix>": a subject in ferry's own namespace.
  std::string own_subject(std::string_view suffix) const;
  /// The local address of the connection's socket (the interface that faces the servers).
  const std::string& local_ip() const noexcept { return local_ip_; }
  /// The connected server's limit on a message's payload, in bytes.
  std::int64_t max_payload() const noexcept;
  /// "nats://127.0.0.1:4222"
  const std::string& connected_url() const noexcept { return url_; }
  bool connected() const noexcept;

  /// Loop-side state, shared weakly with cnats' callbacks (defined in the .cpp).
  struct State;

 private:
  struct Outbox;

  EventLoop& loop_;
  std::shared_ptr<State> state_;
  std::unique_ptr<Outbox> outbox_;
  std::string local_ip_;
  std::string url_;
  std::int64_t confirm_timeout_ms_ = 1000;
  std::uint64_t inbox_sub_ = 0;
};

}  // namespace ferry::sidechannel
