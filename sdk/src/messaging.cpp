// The application's messaging on the side channel's connection: Connector::subscribe,
// publish, respond and request, and the Subscription handle. Arguments are checked on the
// calling thread; the channel is touched on the loop only.
#include "sdk/src/messaging.hpp"

#include <future>
#include <vector>

#include <ferry/connector.hpp>

#include "loop/ids.hpp"
#include "loop/log.hpp"
#include "sdk/src/core.hpp"
#include "sidechannel/nats_channel.hpp"
#include "sidechannel/subjects.hpp"

namespace ferry {

namespace detail {

namespace {

const Error& closed_error() {
  static const Error closed(ErrorCode::Cancelled, "the connector was closed");
  return closed;
}

void require_side_channel(const Core& core) {
  if (!core.has_nats)
    throw Error(ErrorCode::InvalidState,
                "messaging needs the NATS side channel (NatsOptions::servers or FERRY_NATS_URL)");
  core.require_open_side_channel("messaging");
}

// The channel, on the loop thread; InvalidState once the connector is closed.
sidechannel::NatsChannel& channel(Core& core) {
  if (core.closed || !core.nats) throw Error(ErrorCode::InvalidState, "the connector is closed");
  return *core.nats;
}

// A subject to publish to: no wildcards, not in ferry's namespace. `what` names it.
void check_target(std::string_view subject, const std::string& prefix, const char* what) {
  const std::string s(subject);
  if (auto why = sidechannel::subject_problem(s))
    throw Error(ErrorCode::InvalidArgument,
                std::string(what) + " '" + loop::sanitized_utf8(s) + "' " + *why);
  if (sidechannel::reaches_namespace(s, prefix))
    throw Error(ErrorCode::InvalidArgument,
                std::string(what) + " '" + s + "' is in ferry's own namespace '" + prefix +
                    ".' (NatsOptions::prefix): ferry's control messages live there");
}

// Loop thread: throws when `data` cannot go in one message of the connected server.
void check_size(sidechannel::NatsChannel& nats, std::size_t size, const std::string& subject) {
  const std::int64_t limit = nats.max_payload();
  if (limit > 0 && size > static_cast<std::uint64_t>(limit))
    throw Error(ErrorCode::SideChannel, "the message to '" + subject + "' holds " +
                                            std::to_string(size) +
                                            " bytes, more than the NATS server's max_payload of " +
                                            std::to_string(limit) + " bytes");
}

// Loop thread: ends request `key` with `reply` or `error`, calling its handler once.
void finish_request(Core& core, std::uint64_t key, const Message* reply, const Error* error) {
  auto it = core.requests.find(key);
  if (it == core.requests.end()) return;
  std::shared_ptr<PendingRequest> r = std::move(it->second);
  core.requests.erase(it);
  if (error != nullptr && core.nats) core.nats->cancel_request(r->channel_id);
  ReplyHandler on_reply = std::move(r->on_reply);
  r.reset();  // its timer closes
  loop::guarded(core.loop->log(), "a request's reply handler", [&] { on_reply(reply, error); });
}

void on_request_deadline(uv_timer_t* timer) {
  auto* r = static_cast<PendingRequest*>(timer->data);
  Core& core = *r->core;
  const Error timeout(ErrorCode::Timeout, "no reply to the request at '" + r->subject +
                                              "' within " + std::to_string(r->timeout.count()) +
                                              " ms");
  finish_request(core, r->key, nullptr, &timeout);  // destroys *r
}

// Loop thread: publishes the request and arms its deadline.
void start_request(Core& core, const std::string& subject, std::string data,
                   std::chrono::milliseconds timeout, ReplyHandler on_reply) {
  sidechannel::NatsChannel& nats = channel(core);
  check_size(nats, data.size(), subject);
  auto r = std::make_shared<PendingRequest>();
  r->core = &core;
  r->key = core.next_id();
  r->subject = subject;
  r->timeout = timeout;
  r->on_reply = std::move(on_reply);
  std::weak_ptr<Core> weak = core.shared_from_this();
  r->channel_id =
      nats.request(subject, std::move(data), [weak, key = r->key](const sidechannel::Message& m) {
        auto c = weak.lock();
        if (!c) return;
        if (m.no_responders) {
          auto it = c->requests.find(key);
          if (it == c->requests.end()) return;
          const Error nobody(ErrorCode::PeerLost, "no responders at '" + it->second->subject +
                                                      "': nobody subscribes to it");
          finish_request(*c, key, nullptr, &nobody);
          return;
        }
        const Message reply{m.subject, m.reply, m.data};
        finish_request(*c, key, &reply, nullptr);
      });
  r->deadline = loop::Timer::timer(core.loop->uv(), r.get());
  uv_timer_start(r->deadline.get(), on_request_deadline,
                 static_cast<std::uint64_t>(timeout.count()), 0);
  core.requests.emplace(r->key, std::move(r));
}

}  // namespace

SubscriptionState::SubscriptionState(std::shared_ptr<Core> c, std::uint64_t i, std::string s,
                                     std::string q)
    : core(std::move(c)), id(i), subject(std::move(s)), queue(std::move(q)) {}

void SubscriptionState::start(MessageHandler h) {
  sidechannel::NatsChannel& nats = channel(*core);
  handler = std::make_shared<const MessageHandler>(std::move(h));
  std::weak_ptr<SubscriptionState> weak = shared_from_this();
  channel_id = nats.subscribe(
      subject, queue,
      [weak](const sidechannel::Message& m) {
        auto self = weak.lock();
        if (!self || !self->active.load()) return;
        std::shared_ptr<const MessageHandler> keep = self->handler;  // it may unsubscribe
        const Message message{m.subject, m.reply, m.data};
        loop::guarded(self->core->loop->log(), "a subscription's handler",
                      [&] { (*keep)(message); });
      },
      [weak](const std::string& refusal) {
        auto self = weak.lock();
        if (!self || self->ended) return;
        if (refusal.empty()) {
          if (self->confirming) self->confirming->set_value(std::nullopt);
          self->confirming.reset();
          return;
        }
        // Refused or never confirmed: nothing will arrive. Ended after the channel's own
        // callback, which is in the middle of telling.
        self->core->loop->defer([self, refusal] {
          self->end(
              Error(ErrorCode::SideChannel, "subscribing to '" + self->subject + "': " + refusal));
        });
      });
  core->subscriptions[id] = weak;
}

void SubscriptionState::end(const std::optional<Error>& why) {
  if (ended) return;
  ended = true;
  active = false;
  if (why) {
    std::lock_guard lock(mu);
    error = why;
  }
  if (channel_id != 0 && core->nats) core->nats->unsubscribe(channel_id);
  channel_id = 0;
  core->subscriptions.erase(id);
  if (confirming) confirming->set_value(why);
  confirming.reset();
  handler.reset();  // the application's captures go here, on the loop thread
}

void end_messaging(Core& core) noexcept {
  std::vector<std::shared_ptr<SubscriptionState>> subscribed;
  for (auto& [id, weak] : core.subscriptions)
    if (auto s = weak.lock()) subscribed.push_back(std::move(s));
  for (auto& s : subscribed) s->end(closed_error());
  core.subscriptions.clear();
  std::vector<std::uint64_t> open;
  for (auto& [key, r] : core.requests) open.push_back(key);
  for (std::uint64_t key : open) finish_request(core, key, nullptr, &closed_error());
}

}  // namespace detail

Subscription::Subscription() noexcept = default;
Subscription::Subscription(std::shared_ptr<detail::SubscriptionState> state) noexcept
    : state_(std::move(state)) {}
Subscription::Subscription(Subscription&&) noexcept = default;
Subscription& Subscription::operator=(Subscription&& other) noexcept {
  if (this != &other) {
    unsubscribe();
    state_ = std::move(other.state_);
  }
  return *this;
}
Subscription::~Subscription() { unsubscribe(); }

void Subscription::unsubscribe() noexcept {
  if (!state_) return;
  detail::SubscriptionState& s = *state_;
  // At once: a delivery already queued on the loop finds it off. Then the loop call: when it
  // returns, no handler call that started before is still running there.
  s.active = false;
  try {
    s.core->loop->call([&s] { s.end(std::nullopt); });
  } catch (...) {
    // The loop is closed: its shutdown ended the subscription, and runs nothing any more.
  }
}

bool Subscription::active() const noexcept { return state_ && state_->active.load(); }

const std::string& Subscription::subject() const noexcept {
  static const std::string none;
  return state_ ? state_->subject : none;
}

const std::string& Subscription::queue() const noexcept {
  static const std::string none;
  return state_ ? state_->queue : none;
}

std::optional<Error> Subscription::error() const {
  if (!state_) return std::nullopt;
  std::lock_guard lock(state_->mu);
  return state_->error;
}

Subscription Connector::subscribe(std::string subject, MessageHandler handler,
                                  SubscribeOptions options) {
  detail::Core& c = core();
  if (auto why = sidechannel::pattern_problem(subject))
    throw Error(ErrorCode::InvalidArgument,
                "subject '" + loop::sanitized_utf8(subject) + "' " + *why);
  if (!options.queue.empty())
    if (auto why = sidechannel::subject_problem(options.queue))
      throw Error(ErrorCode::InvalidArgument,
                  "queue group '" + loop::sanitized_utf8(options.queue) + "' " + *why);
  if (!handler) throw Error(ErrorCode::InvalidArgument, "subscribe: the handler is empty");
  detail::require_side_channel(c);
  if (sidechannel::reaches_namespace(subject, c.nats_prefix))
    throw Error(ErrorCode::InvalidArgument,
                "subject '" + subject + "' reaches into ferry's own namespace '" + c.nats_prefix +
                    ".' (NatsOptions::prefix): ferry's control messages live there");
  auto state = std::make_shared<detail::SubscriptionState>(
      c.shared_from_this(), c.next_id(), std::move(subject), std::move(options.queue));
  auto confirmed = state->confirming->get_future();
  c.loop->call([&] { state->start(std::move(handler)); });
  Subscription out(state);
  // On the loop thread the confirmation can only come after this call: do not wait.
  // Nor while the side channel is not connected: the subscription is in place, and the
  // server gets it once the connection is (back).
  if (c.loop->in_loop_thread() || c.nats_status->get().state != SideChannelState::connected)
    return out;
  // The channel's own deadline is request_timeout (while connected); past it and a margin,
  // the connection is down: give up rather than wait for it.
  const auto limit = c.options.nats.request_timeout + std::chrono::milliseconds(500);
  if (confirmed.wait_for(limit) != std::future_status::ready) {
    out.unsubscribe();
    throw Error(ErrorCode::SideChannel, "the NATS server did not confirm the subscription to '" +
                                            state->subject + "' within " +
                                            std::to_string(limit.count()) + " ms");
  }
  if (std::optional<Error> error = confirmed.get()) throw *error;
  return out;
}

void Connector::publish(std::string_view subject, std::string_view data, std::string_view reply) {
  detail::Core& c = core();
  detail::check_target(subject, c.nats_prefix, "subject");
  if (!reply.empty()) detail::check_target(reply, c.nats_prefix, "reply subject");
  detail::require_side_channel(c);
  c.loop->call([&] {
    sidechannel::NatsChannel& nats = detail::channel(c);
    const std::string to(subject);
    detail::check_size(nats, data.size(), to);
    nats.publish(to, std::string(data), std::string(reply));
  });
}

void Connector::respond(const Message& request, std::string_view data) {
  detail::Core& c = core();
  if (request.reply.empty())
    throw Error(ErrorCode::InvalidArgument, "the message at '" +
                                                loop::sanitized_utf8(request.subject) +
                                                "' asks for no reply (its reply subject is empty)");
  if (auto why = sidechannel::subject_problem(request.reply))
    throw Error(ErrorCode::InvalidArgument,
                "reply subject '" + loop::sanitized_utf8(request.reply) + "' " + *why);
  detail::require_side_channel(c);
  // Another ferry connector's request() waits at its inbox in ferry's namespace; nothing else
  // there may be published to, whoever sent the request.
  if (sidechannel::reaches_namespace(request.reply, c.nats_prefix) &&
      !sidechannel::is_reply_inbox(c.nats_prefix, request.reply))
    throw Error(ErrorCode::InvalidArgument,
                "reply subject '" + request.reply + "' is in ferry's own namespace '" +
                    c.nats_prefix + ".' and is not a request inbox: not answering there");
  c.loop->call([&] {
    sidechannel::NatsChannel& nats = detail::channel(c);
    detail::check_size(nats, data.size(), request.reply);
    nats.publish(request.reply, std::string(data));
  });
}

void Connector::request(std::string subject, std::string data, std::chrono::milliseconds timeout,
                        ReplyHandler on_reply) {
  detail::Core& c = core();
  detail::check_target(subject, c.nats_prefix, "subject");
  if (timeout.count() <= 0)
    throw Error(ErrorCode::InvalidArgument, "request: the timeout must be positive");
  if (!on_reply) throw Error(ErrorCode::InvalidArgument, "request: the reply handler is empty");
  detail::require_side_channel(c);
  c.loop->call(
      [&] { detail::start_request(c, subject, std::move(data), timeout, std::move(on_reply)); });
}

Message Connector::request(std::string subject, std::string data,
                           std::chrono::milliseconds timeout) {
  detail::Core& c = core();
  if (!c.loop->may_block())
    throw Error(ErrorCode::WrongThread,
                "a blocking request on the connector's loop thread would deadlock: pass a "
                "ReplyHandler");
  auto answer = std::make_shared<std::promise<Message>>();
  auto future = answer->get_future();
  request(std::move(subject), std::move(data), timeout,
          [answer](const Message* reply, const Error* error) {
            if (reply != nullptr)
              answer->set_value(*reply);
            else
              answer->set_exception(std::make_exception_ptr(*error));
          });
  return future.get();
}

}  // namespace ferry
