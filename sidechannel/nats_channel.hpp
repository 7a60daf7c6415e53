#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include <ferry/options.hpp>

#include "loop/event_loop.hpp"
#include "loop/uv_handle.hpp"
#include "sidechannel/message.hpp"

namespace ferry::sidechannel {

using loop::EventLoop;

/// Why a subject cannot be used ("has an empty token"), or none when it can: no wildcards, no
/// empty tokens, no whitespace or control characters, at most 1024 characters.
std::optional<std::string> subject_problem(std::string_view subject);

/// Whether `subject` is a reply inbox of the form NatsChannel::request() builds under
/// `prefix`: "<prefix>.inbox.<id>.r<n>", the id 16 lowercase hex digits (a connector's id),
/// n 1 to 16 lowercase hex digits without a leading zero.
bool is_reply_inbox(std::string_view prefix, std::string_view subject);

class AnswerLimit;
class NatsSocketDriver;
class Outbox;

/// The connection's state for any thread (Connector::side_channel_state()): written on the
/// loop as the connection's events arrive, read anywhere without waiting for the loop.
class StatusBoard {
 public:
  SideChannelStatus get() const {
    std::lock_guard lock(mu_);
    return value_;
  }
  void set(SideChannelState state, std::string detail) {
    std::lock_guard lock(mu_);
    value_ = {state, std::move(detail)};
  }
  /// The connection came back after it was lost.
  void reconnected() noexcept { reconnects_.fetch_add(1, std::memory_order_relaxed); }
  std::uint64_t reconnects() const noexcept { return reconnects_.load(std::memory_order_relaxed); }

 private:
  mutable std::mutex mu_;
  SideChannelStatus value_;
  std::atomic<std::uint64_t> reconnects_{0};
};

/// A NATS connection whose socket is driven by a connector's loop (NatsSocketDriver, ferry's
/// side of cnats' event-loop contract).
///
/// Threads: every method runs on the loop thread. cnats delivers messages and connection
/// events on threads of its own; they are handed to the loop and handlers run there. Calls
/// that take cnats' connection lock (publish, subscribe, unsubscribe) run on the channel's
/// Outbox, a thread of its own, in order, because cnats holds that lock while a reconnect
/// attempt connects, which may take up to connect_timeout: the loop, which moves every
/// transfer, must not wait for it.
class NatsChannel {
 public:
  /// Connects, on the loop thread: cnats attaches the socket from the thread that connects,
  /// so this blocks the loop for the handshake (at most options.connect_timeout per server).
  /// Throws Error(AccessDenied) when a server refuses the credentials, Error(SideChannel) for
  /// options cnats refuses. When no server can be reached, the channel is made anyway and
  /// connects in the background (cnats' retry on a failed connect, started from the Outbox):
  /// subscriptions and publishes wait in cnats' reconnect buffer until it is connected,
  /// confirmations' deadlines do not run, and `connected` is reported (status(), on_event)
  /// once it is. options.connect_deadline, when set, bounds that: then it gives up, closed.
  NatsChannel(EventLoop& loop, const NatsOptions& options, std::string client_id);
  /// Closes at once; loop thread. Publishes still buffered by cnats are lost, and cnats may
  /// wait up to 500 ms for them: use close() instead when the loop can keep running.
  ~NatsChannel();

  /// Closes in two phases so that nothing published so far is lost and the loop is never
  /// blocked: the loop keeps running while a final flush (at most 500 ms) sends what cnats has
  /// buffered; a loop turn after it, the connection is closed and the channel deleted. The
  /// loop must keep running until then (an owned loop does; an embedded one needs a few more
  /// turns, as for any closing libuv handle). Loop thread.
  static void close(std::unique_ptr<NatsChannel> channel);
  NatsChannel(const NatsChannel&) = delete;
  NatsChannel& operator=(const NatsChannel&) = delete;

  /// Called on the loop once a subscription is in place at the server (`error` empty), or
  /// could not be made or confirmed (`error` says why). Called once at most, and not at all
  /// once the channel is closing.
  using Registered = std::function<void(const std::string& error)>;

  /// Subscribes to `subject`, which may be a pattern (pattern_problem(), subjects.hpp);
  /// `handler` runs on the loop for each message until unsubscribe(). `queue` may be empty.
  /// Returns an id for unsubscribe(). `registered`, when given, hears when the server has the
  /// subscription: a request published after that reaches the handler. (The server handles a
  /// connection's messages in order, so a message this connection sends to itself after the
  /// SUB comes back only once the SUB is in place; nothing blocks.)
  ///
  /// A confirmation has a deadline of request_timeout, counted while the connection is up:
  /// after a reconnect every pending confirmation is sent again (behind the SUBs cnats sends
  /// again) and its deadline starts over; while the connection is down the deadlines wait
  /// (cnats sends the buffered SUB and confirmation once it is back). A confirmation still
  /// missing at its deadline, the connection up, is an error ("the NATS server did not
  /// confirm ..."); so is a connection that cnats closes for good, and an unsubscribe() before
  /// the confirmation (then reported after the current loop callback). With `registered`,
  /// throws Error(Internal), subscribing nothing, when no random id can be drawn for the
  /// confirmation (the kernel's random source fails).
  std::uint64_t subscribe(const std::string& subject, const std::string& queue,
                          MessageHandler handler, Registered registered = {}) {
    return subscribe_impl(subject, queue, std::move(handler), std::move(registered), {});
  }
  /// Serves requests at `subject` with `answer`'s reply, which runs on a cnats delivery
  /// thread, not the loop: a metadata request is answered without two thread hops (to the
  /// loop, and from it to the publishing worker). `answer` must be thread-safe and quick; it
  /// gets the request's data. Requests whose reply subject is not one of request()'s inboxes
  /// are not answered (as respond() does), nor are those beyond the subscription's limit of
  /// answers (NatsOptions::answer_burst, answers_per_second; AnswerLimit): their reply inbox
  /// may be anyone's. `registered` as for subscribe(). Until the server
  /// has processed an unsubscribe() it may still route requests here, and `answer` still
  /// answers them: it must know what to say once its subject is no longer served
  /// (`last_words` do not apply).
  using Answer = std::function<std::string(const std::string& request)>;
  std::uint64_t serve(const std::string& subject, Answer answer, Registered registered = {});
  /// After it returns, the handler is not called again. With `last_words`, requests that the
  /// server still routes to the subscription until it has processed the unsubscription are
  /// answered with them.
  void unsubscribe(std::uint64_t id, std::string last_words = {});
  void publish(const std::string& subject, std::string data, const std::string& reply = {});

  /// Answers `request` (a message a subscription handler received) with `data`, only if its
  /// reply subject is a reply inbox that request() builds under this channel's prefix
  /// (is_reply_inbox). Anything else is dropped with a warning in the connector's log (at most
  /// one every 10 s): whoever may publish to a served subject must not be able to make this
  /// connection publish the answer, a credential, to a subject of its choosing. A request
  /// without a reply subject is dropped silently.
  void respond(const Message& request, std::string data);

  /// Requests open at once, at most; beyond it the oldest open request is dropped (its
  /// handler is never called), so that a caller that never cancels, asking subjects nobody
  /// answers, cannot grow the table without bound.
  static constexpr std::size_t kMaxOpenRequests = 16384;

  /// Publishes a request whose first answer (or the server's no-responders notice) goes to
  /// `handler`, once; unless more than kMaxOpenRequests requests are open, in which case the
  /// oldest is dropped unanswered. Returns an id for cancel_request(). Throws
  /// Error(Internal), publishing nothing, when no random id can be drawn (the kernel's random
  /// source fails).
  std::uint64_t request(const std::string& subject, std::string data, MessageHandler handler);
  /// After it returns, the request's handler is not called.
  void cancel_request(std::uint64_t id);

  /// Requests open (neither answered, cancelled nor dropped) and subscriptions waiting for
  /// their confirmation. Loop thread; for tests and diagnostics.
  std::size_t open_requests() const noexcept;
  std::size_t pending_confirmations() const noexcept;

  /// "<prefix>.<suffix>": a subject in ferry's own namespace.
  std::string own_subject(std::string_view suffix) const;
  /// The local address of the connection's socket (the interface that faces the servers).
  const std::string& local_ip() const noexcept { return local_ip_; }
  /// The connected server's limit on a message's payload, in bytes; before the first
  /// connection, kAssumedMaxPayload (nats-server's default).
  std::int64_t max_payload() const noexcept;
  static constexpr std::int64_t kAssumedMaxPayload = 1 << 20;
  /// Whether the connection is up now. Loop thread.
  bool connected() const noexcept;
  /// Where the connection stands, for any thread.
  std::shared_ptr<StatusBoard> status() const noexcept { return status_; }

  /// Loop-side state, shared weakly with cnats' callbacks (defined in the .cpp).
  struct State;

 private:
  struct Wire;  // cnats' connection and the subscriptions made on it (defined in the .cpp)

  // The constructor's steps after the state: the connection, then the loop's handles, then
  // what the connection tells.
  void connect(const NatsOptions& options);
  void make_handles();
  void learn_connection(const NatsOptions& options);
  // Connecting in the background (see the constructor): the deadline that ends it.
  void give_up();

  std::uint64_t subscribe_impl(const std::string& subject, const std::string& queue,
                               MessageHandler handler, Registered registered, Answer direct);

  // Confirmations' deadlines (see subscribe()).
  void arm_confirm_timer();
  void expire_confirms();
  void reconfirm();
  void fail_confirms(const std::string& why);
  void note_refused_reply(const Message& request);

  EventLoop& loop_;
  const loop::Log log_;  // the connector's, for any thread
  std::shared_ptr<State> state_;
  std::unique_ptr<NatsSocketDriver> driver_;
  std::unique_ptr<Outbox> outbox_;
  std::unique_ptr<Wire> wire_;
  std::shared_ptr<AnswerLimit> answer_limit_;  // serve()'s answers (NatsOptions::answer_burst)
  std::string local_ip_;
  std::uint64_t inbox_sub_ = 0;
  // The two-phase close: the worker's final flush wakes closer_; finisher_ runs a loop turn
  // later, when the loop has written what that flush queued.
  loop::Async closer_;
  loop::Timer finisher_;
  loop::Timer confirm_timer_;  // the earliest confirmation deadline
  loop::Timer connect_timer_;  // NatsOptions::connect_deadline, while connecting
  std::shared_ptr<StatusBoard> status_ = std::make_shared<StatusBoard>();
  bool closing_ = false;
  // respond()'s rate-limited note.
  std::chrono::steady_clock::time_point refused_noted_{};
  std::uint64_t refused_unnoted_ = 0;
};

}  // namespace ferry::sidechannel
