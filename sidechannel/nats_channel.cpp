#include "sidechannel/nats_channel.hpp"

#include <nats/nats.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <unordered_map>
#include <vector>

#include <ferry/error.hpp>

#include "loop/ids.hpp"
#include "sidechannel/inbox.hpp"
#include "sidechannel/nats_adapter.hpp"
#include "sidechannel/nats_connect.hpp"
#include "sidechannel/outbox.hpp"
#include "sidechannel/subjects.hpp"

namespace ferry::sidechannel {

std::optional<std::string> subject_problem(std::string_view subject) {
  if (subject.empty()) return "is empty";
  if (subject.size() > 1024) return "is longer than 1024 characters";
  std::size_t start = 0;
  for (;;) {
    std::size_t dot = subject.find('.', start);
    std::string_view token =
        subject.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start);
    if (token.empty()) return "has an empty token";
    if (token.find_first_of("*>") != std::string_view::npos) return "contains a wildcard";
    for (char c : token)
      if (static_cast<unsigned char>(c) <= ' ' || c == 0x7f)
        return "contains whitespace or a control character";
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  return std::nullopt;
}

bool is_reply_inbox(std::string_view prefix, std::string_view subject) {
  // "<prefix>.inbox.<16 hex>.r<1..16 hex>", exactly as request() writes it.
  constexpr std::string_view kInbox = ".inbox.";
  if (subject.size() <= prefix.size() + kInbox.size() ||
      subject.substr(0, prefix.size()) != prefix ||
      subject.substr(prefix.size(), kInbox.size()) != kInbox)
    return false;
  std::string_view rest = subject.substr(prefix.size() + kInbox.size());
  if (rest.size() < 16 + 3 || rest.size() > 16 + 2 + 16) return false;
  std::string_view id = rest.substr(0, 16);
  std::string_view n = rest.substr(18);
  return loop::is_lower_hex(id) && rest[16] == '.' && rest[17] == 'r' && loop::is_lower_hex(n) &&
         n[0] != '0';
}

// Loop-side state. Shared with cnats callbacks through weak references, so that a message
// that arrives while the channel closes finds nothing instead of a dangling pointer.
struct NatsChannel::State {
  using Clock = Inbox::Clock;

  State(EventLoop& loop, const NatsOptions& o, const std::string& client_id)
      : poster(loop.poster()),
        prefix(o.prefix.empty() ? "ferry" : o.prefix),
        inbox(prefix + ".inbox." + client_id, kMaxOpenRequests, loop.log()),
        on_event(o.on_event),
        request_timeout(o.request_timeout) {
    if (auto why = subject_problem(inbox.subject()))
      throw Error(ErrorCode::InvalidArgument, "NATS prefix '" + prefix + "' " + *why);
  }

  EventLoop::Poster poster;
  std::string prefix;
  // Loop thread only, as everything below but max_payload.
  Inbox inbox;  // "<prefix>.inbox.<client id>": open requests, awaited confirmations
  std::function<void(SideChannelEvent, const std::string&)> on_event;
  std::chrono::milliseconds request_timeout{1000};
  NatsChannel* owner = nullptr;  // null once the channel is closing
  std::unordered_map<std::uint64_t, MessageHandler> subs;
  std::uint64_t next_sub = 1;
  // As the connection's events tell (loop side).
  bool connected = true;

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
    switch (event) {
      case SideChannelEvent::disconnected:
        connected = false;
        break;
      case SideChannelEvent::reconnected:
        connected = true;
        if (new_max_payload > 0) max_payload = new_max_payload;
        if (owner != nullptr) owner->reconfirm();
        break;
      case SideChannelEvent::closed:
        // cnats gave up (or was told to close): nothing pending will ever be confirmed.
        connected = false;
        if (owner != nullptr) owner->fail_confirms("the NATS connection is closed");
        break;
      case SideChannelEvent::error:
        break;
    }
    if (on_event) on_event(event, detail);
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

namespace {

// What a cnats subscription calls back with: enough to find the handler on the loop.
struct SubClosure {
  std::weak_ptr<NatsChannel::State> state;  // NOLINT: State is private but complete here
  EventLoop::Poster poster;
  std::uint64_t id = 0;
  bool inbox = false;
  // serve(): answered here, on the delivery thread (all three fixed before the subscription).
  NatsChannel::Answer direct;
  std::string prefix;
  loop::Log log;
};

// A request to a served subject, answered at once from cnats' delivery thread. Anything else
// sent there (no reply subject, or one that is not a request() inbox) goes unanswered.
void answer_directly(natsConnection* nc, natsMsg* msg, const SubClosure& c) {
  const char* reply = natsMsg_GetReply(msg);
  if (reply == nullptr || !is_reply_inbox(c.prefix, reply)) return;
  const char* data = natsMsg_GetData(msg);
  const std::string request(data != nullptr ? data : "",
                            static_cast<std::size_t>(natsMsg_GetDataLength(msg)));
  std::string answer;
  try {
    answer = c.direct(request);
  } catch (const std::exception& e) {
    c.log.error(std::string("nats: answering a request at '") + natsMsg_GetSubject(msg) +
                "' failed: " + e.what());
  }
  if (answer.empty()) return;
  if (natsStatus s =
          natsConnection_Publish(nc, reply, answer.data(), static_cast<int>(answer.size()));
      s != NATS_OK)
    c.log.warning(std::string("nats: publishing the answer to a request at '") +
                  natsMsg_GetSubject(msg) + "' failed: " + status_text(s));
}

void on_message(natsConnection* nc, natsSubscription*, natsMsg* msg, void* closure) {
  auto* c = static_cast<SubClosure*>(closure);
  if (c->direct) {
    answer_directly(nc, msg, *c);
    natsMsg_Destroy(msg);
    return;
  }
  Message m;
  m.subject = natsMsg_GetSubject(msg);
  if (const char* reply = natsMsg_GetReply(msg)) m.reply = reply;
  if (const char* data = natsMsg_GetData(msg))
    m.data.assign(data, static_cast<std::size_t>(natsMsg_GetDataLength(msg)));
  m.no_responders = natsMsg_IsNoResponders(msg);
  natsMsg_Destroy(msg);
  c->poster.post([state = c->state, id = c->id, inbox = c->inbox, m = std::move(m)] {
    auto s = state.lock();
    if (!s) return;
    if (inbox)
      s->inbox.deliver(m);
    else
      s->deliver(id, m);
  });
}

// cnats calls this once no more messages of the subscription will be delivered.
void on_sub_complete(void* closure) {
  // cnats is done with the subscription: every message it will ever deliver for it has been
  // delivered (for a drained one, those the server sent before it processed the UNSUB). Only
  // now may a handler kept for those go.
  auto* c = static_cast<SubClosure*>(closure);
  c->poster.post([state = c->state, id = c->id] {
    if (auto st = state.lock()) st->subs.erase(id);
  });
  delete c;
}

// What cnats' connection events call back with. Freed by the closed event, the last one
// cnats delivers for a connection (or by the constructor when the connect fails).
struct EventClosure {
  std::weak_ptr<NatsChannel::State> state;
  EventLoop::Poster poster;
};

void post_event(natsConnection* nc, void* closure, SideChannelEvent event, std::string detail) {
  auto* c = static_cast<EventClosure*>(closure);
  std::int64_t max_payload = nc != nullptr ? natsConnection_GetMaxPayload(nc) : 0;
  c->poster.post([state = c->state, event, detail = std::move(detail), max_payload] {
    if (auto s = state.lock()) s->on_connection_event(event, detail, max_payload);
  });
}

std::string current_url(natsConnection* nc) {
  char buf[512] = {};
  if (natsConnection_GetConnectedUrl(nc, buf, sizeof buf) == NATS_OK) return buf;
  return "the NATS server";
}

void on_disconnected(natsConnection* nc, void* closure) {
  post_event(nc, closure, SideChannelEvent::disconnected, "lost the connection to NATS");
}
void on_reconnected(natsConnection* nc, void* closure) {
  post_event(nc, closure, SideChannelEvent::reconnected, current_url(nc));
}
void on_closed(natsConnection*, void* closure) {
  post_event(nullptr, closure, SideChannelEvent::closed, "the NATS connection is closed");
  delete static_cast<EventClosure*>(closure);
}
void on_error(natsConnection*, natsSubscription*, natsStatus err, void* closure) {
  post_event(nullptr, closure, SideChannelEvent::error, natsStatus_GetText(err));
}

}  // namespace

NatsChannel::NatsChannel(EventLoop& loop, const NatsOptions& o, std::string client_id)
    : loop_(loop),
      log_(loop.log()),
      state_(std::make_shared<State>(loop, o, client_id)),
      driver_(std::make_unique<NatsSocketDriver>(loop.uv(), loop.log())),
      outbox_(std::make_unique<Outbox>()),
      wire_(std::make_unique<Wire>()) {
  connect(o);
  make_handles();
  learn_connection();
  state_->owner = this;
  // Answers to this connector's requests and confirmations arrive at "<inbox>.*".
  inbox_sub_ = subscribe(state_->inbox.subject() + ".*", {}, nullptr);
}

void NatsChannel::connect(const NatsOptions& o) {
  NatsOptionsPtr opts = nats_options(o);
  // The socket is polled by the loop through ferry's driver (see nats_adapter.hpp). The
  // connect below attaches it from here, the loop thread, so it is polled at once.
  if (natsStatus s = driver_->install(opts.get()); s != NATS_OK)
    throw Error(ErrorCode::SideChannel, "event loop: " + status_text(s));
  auto events = std::make_unique<EventClosure>(EventClosure{state_, loop_.poster()});
  natsOptions_SetDisconnectedCB(opts.get(), on_disconnected, events.get());
  natsOptions_SetReconnectedCB(opts.get(), on_reconnected, events.get());
  natsOptions_SetClosedCB(opts.get(), on_closed, events.get());
  natsOptions_SetErrorHandler(opts.get(), on_error, events.get());
  wire_->nc = nats_connect(opts.get(), o.servers);
  // From now on cnats' (on_closed frees it); a failed connect calls back nothing, and
  // `events` frees it then.
  static_cast<void>(events.release());
}

void NatsChannel::make_handles() {
  closer_ = loop::Async::async(
      loop_.uv(),
      [](uv_async_t* h) {
        auto* self = static_cast<NatsChannel*>(h->data);
        uv_timer_start(
            self->finisher_.get(), [](uv_timer_t* t) { delete static_cast<NatsChannel*>(t->data); },
            0, 0);
      },
      this);
  finisher_ = loop::Timer::timer(loop_.uv(), this);
  confirm_timer_ = loop::Timer::timer(loop_.uv(), this);
  // Only a close in progress keeps the loop alive (close() refs the first two).
  uv_unref(reinterpret_cast<uv_handle_t*>(closer_.get()));
  uv_unref(reinterpret_cast<uv_handle_t*>(finisher_.get()));
  uv_unref(reinterpret_cast<uv_handle_t*>(confirm_timer_.get()));
}

void NatsChannel::learn_connection() {
  state_->max_payload = natsConnection_GetMaxPayload(wire_->nc);
  char* ip = nullptr;
  int port = 0;
  if (natsConnection_GetLocalIPAndPort(wire_->nc, &ip, &port) == NATS_OK && ip != nullptr) {
    local_ip_ = ip;
    free(ip);  // allocated by cnats
  }
}

NatsChannel::~NatsChannel() {
  state_->forget();
  state_.reset();
  outbox_->stop();
  // On the loop thread: the driver applies cnats' stop-polling and detach at once here.
  // Once Close has returned (it joins cnats' reconnect thread), cnats calls the driver no
  // more, and the driver closes what it still holds.
  natsConnection_Close(wire_->nc);
  driver_->shutdown();
  for (auto& [id, sub] : wire_->subs) natsSubscription_Destroy(sub);
  for (natsSubscription* sub : wire_->draining) natsSubscription_Destroy(sub);
  natsConnection_Destroy(wire_->nc);
  // closer_, finisher_ and confirm_timer_ close themselves.
}

void NatsChannel::close(std::unique_ptr<NatsChannel> channel) {
  NatsChannel* self = channel.release();
  self->closing_ = true;
  self->state_->forget();
  uv_timer_stop(self->confirm_timer_.get());
  uv_ref(reinterpret_cast<uv_handle_t*>(self->closer_.get()));
  uv_ref(reinterpret_cast<uv_handle_t*>(self->finisher_.get()));
  // The flush runs on the worker while the loop, free, writes what cnats buffered and reads
  // the PONG; then the worker wakes the loop to finish.
  self->outbox_->push([self] {
    natsConnection_FlushTimeout(self->wire_->nc, 500);
    uv_async_send(self->closer_.get());
  });
  self->outbox_->finish();
}

std::string NatsChannel::own_subject(std::string_view suffix) const {
  return state_->prefix + "." + std::string(suffix);
}

std::int64_t NatsChannel::max_payload() const noexcept { return state_->max_payload; }

std::uint64_t NatsChannel::serve(const std::string& subject, Answer answer, Registered registered) {
  // The loop's handler serves only when a drain replaces it with last words (unsubscribe).
  return subscribe_impl(
      subject, {}, [](const Message&) {}, std::move(registered), std::move(answer));
}

std::uint64_t NatsChannel::subscribe_impl(const std::string& subject, const std::string& queue,
                                          MessageHandler handler, Registered registered,
                                          Answer direct) {
  const std::uint64_t id = state_->next_sub++;
  const bool inbox = !handler;  // our own "<inbox>.*"
  // A served subject is literal; a subscription may be a pattern (the application's).
  if (auto why = inbox    ? std::nullopt
                 : direct ? subject_problem(subject)
                          : pattern_problem(subject);
      closing_ || why) {
    if (registered) registered(closing_ ? "the side channel is closing" : "subject " + *why);
    return id;
  }
  std::string confirm;
  std::uint64_t confirm_id = 0;
  if (registered) {
    // First: drawing its id may throw, and then nothing has changed.
    confirm_id = state_->inbox.await_confirm(std::move(registered), subject, id,
                                             State::Clock::now() + state_->request_timeout);
    confirm = state_->inbox.confirm_subject(confirm_id);
    arm_confirm_timer();
  }
  if (handler) state_->subs.emplace(id, std::move(handler));
  auto* closure =
      new SubClosure{state_, loop_.poster(), id, inbox, std::move(direct), state_->prefix, log_};
  auto poster = loop_.poster();
  std::weak_ptr<State> weak = state_;
  outbox_->push([this, id, subject, queue, closure, confirm, confirm_id, poster, weak] {
    natsSubscription* sub = nullptr;
    natsStatus s =
        queue.empty()
            ? natsConnection_Subscribe(&sub, wire_->nc, subject.c_str(), on_message, closure)
            : natsConnection_QueueSubscribe(&sub, wire_->nc, subject.c_str(), queue.c_str(),
                                            on_message, closure);
    if (s != NATS_OK) {
      delete closure;
      std::string why = std::string("cannot subscribe to ") + subject + ": " + status_text(s);
      // Tell whoever waits for the subscription, on the loop.
      if (!confirm.empty())
        poster.post([weak, confirm_id, why] {
          if (auto st = weak.lock())
            if (Registered done = st->inbox.take_confirm(confirm_id)) done(why);
        });
      return;
    }
    natsSubscription_SetOnCompleteCB(sub, on_sub_complete, closure);
    wire_->subs[id] = sub;
    // Behind the SUB on the same connection: when this comes back to our inbox, the server
    // has the subscription.
    if (!confirm.empty()) natsConnection_Publish(wire_->nc, confirm.c_str(), nullptr, 0);
  });
  return id;
}

void NatsChannel::unsubscribe(std::uint64_t id, std::string last_words) {
  // A confirmation still awaited would otherwise wait for a subscription that is gone. Told
  // after the current callback: the caller may be in the middle of ending what waits.
  if (Registered done = state_->inbox.take_confirm_of(id))
    loop_.defer([done = std::move(done)] {
      done("unsubscribed before the NATS server confirmed the subscription");
    });
  const bool drain = !last_words.empty() && !closing_;
  if (!drain) {
    state_->subs.erase(id);
  } else {
    // Until the server has processed the UNSUB it still routes requests here: answer them
    // with `last_words` instead of leaving the asker waiting for its request_timeout. The
    // subscription is drained, not dropped (cnats would discard at once what the server still
    // sends), and the handler goes when cnats says the drain is complete (on_sub_complete).
    state_->subs[id] = [this, words = std::move(last_words)](const Message& m) {
      if (!m.reply.empty()) respond(m, words);
    };
  }
  outbox_->push([this, id, drain, poster = loop_.poster(), weak = std::weak_ptr<State>(state_)] {
    // Drained subscriptions are destroyed once cnats has closed them.
    std::erase_if(wire_->draining, [](natsSubscription* sub) {
      if (natsSubscription_IsValid(sub)) return false;
      natsSubscription_Destroy(sub);
      return true;
    });
    auto it = wire_->subs.find(id);
    if (it == wire_->subs.end()) {
      // Never subscribed (cnats refused it): no drain will end the kept handler.
      if (drain)
        poster.post([weak, id] {
          if (auto st = weak.lock()) st->subs.erase(id);
        });
      return;
    }
    if (drain && natsSubscription_Drain(it->second) == NATS_OK) {
      wire_->draining.push_back(it->second);
    } else {
      natsSubscription_Unsubscribe(it->second);
      natsSubscription_Destroy(it->second);
    }
    wire_->subs.erase(it);
  });
}

void NatsChannel::publish(const std::string& subject, std::string data, const std::string& reply) {
  // A subject that came from a peer's message must not smuggle protocol in.
  if (auto why = subject_problem(subject);
      closing_ || why || (!reply.empty() && subject_problem(reply))) {
    if (!closing_)
      log_.warning("nats: not publishing to '" + subject + "': subject " +
                   why.value_or("has a bad reply subject"));
    return;
  }
  outbox_->push([this, subject, data = std::move(data), reply] {
    natsStatus s = reply.empty()
                       ? natsConnection_Publish(wire_->nc, subject.c_str(), data.data(),
                                                static_cast<int>(data.size()))
                       : natsConnection_PublishRequest(wire_->nc, subject.c_str(), reply.c_str(),
                                                       data.data(), static_cast<int>(data.size()));
    if (s != NATS_OK)
      log_.warning("nats: publishing to '" + subject + "' failed: " + status_text(s));
  });
}

std::uint64_t NatsChannel::request(const std::string& subject, std::string data,
                                   MessageHandler handler) {
  const std::uint64_t id = state_->inbox.open_request(std::move(handler));
  publish(subject, std::move(data), state_->inbox.request_subject(id));
  return id;
}

void NatsChannel::cancel_request(std::uint64_t id) { state_->inbox.drop_request(id); }

std::size_t NatsChannel::open_requests() const noexcept { return state_->inbox.open_requests(); }

std::size_t NatsChannel::pending_confirmations() const noexcept {
  return state_->inbox.pending_confirmations();
}

void NatsChannel::respond(const Message& request, std::string data) {
  if (request.reply.empty() || closing_) return;
  if (!is_reply_inbox(state_->prefix, request.reply)) {
    note_refused_reply(request);
    return;
  }
  publish(request.reply, std::move(data));
}

void NatsChannel::note_refused_reply(const Message& request) {
  // At most one note every 10 s: the requester controls how often this happens.
  const auto now = std::chrono::steady_clock::now();
  if (refused_noted_ != std::chrono::steady_clock::time_point{} &&
      now - refused_noted_ < std::chrono::seconds(10)) {
    ++refused_unnoted_;
    return;
  }
  // Subjects come from the network: show them only when they hold nothing but printable
  // characters (subject_problem refuses control characters), and not too much of them.
  auto printable = [](const std::string& subject) {
    if (subject_problem(subject)) return std::string("<malformed>");
    return subject.size() > 200 ? subject.substr(0, 200) + "..." : subject;
  };
  std::string also;
  if (refused_unnoted_ > 0)
    also = " (and " + std::to_string(refused_unnoted_) + " more since the last note)";
  log_.warning("nats: not answering a request at '" + printable(request.subject) +
               "': its reply subject '" + printable(request.reply) +
               "' is not a ferry reply inbox" + also);
  refused_noted_ = now;
  refused_unnoted_ = 0;
}

void NatsChannel::arm_confirm_timer() {
  const auto earliest = state_->inbox.earliest_deadline();
  if (closing_ || !earliest || !state_->connected) {
    uv_timer_stop(confirm_timer_.get());
    return;
  }
  auto wait = std::chrono::ceil<std::chrono::milliseconds>(*earliest - State::Clock::now());
  uv_timer_start(
      confirm_timer_.get(),
      [](uv_timer_t* t) {
        auto* self = static_cast<NatsChannel*>(t->data);
        // The waiters are the caller's callbacks: none may unwind through libuv.
        loop::guarded(self->log_, "nats: subscription confirmation deadline",
                      [self] { self->expire_confirms(); });
      },
      static_cast<std::uint64_t>(std::max<std::int64_t>(wait.count(), 0)), 0);
}

void NatsChannel::expire_confirms() {
  // While the connection is down the deadlines wait; reconfirm() starts them over.
  if (closing_ || !state_->connected) return;
  auto expired = state_->inbox.take_expired(State::Clock::now(), state_->request_timeout);
  arm_confirm_timer();
  // Last: a callback may subscribe or unsubscribe.
  for (auto& [done, why] : expired) done(why);
}

void NatsChannel::reconfirm() {
  // A confirmation may have been lost with the old connection (sent, never echoed). cnats
  // has sent every SUB again before it reports the reconnect; a new confirmation behind
  // them comes back once they are in place.
  if (closing_) return;
  for (std::string& confirm :
       state_->inbox.restart_confirms(State::Clock::now() + state_->request_timeout))
    outbox_->push([this, confirm = std::move(confirm)] {
      natsConnection_Publish(wire_->nc, confirm.c_str(), nullptr, 0);
    });
  arm_confirm_timer();
}

void NatsChannel::fail_confirms(const std::string& why) {
  std::vector<Registered> failed = state_->inbox.take_all_confirms();
  uv_timer_stop(confirm_timer_.get());
  for (auto& done : failed) done(why);
}

}  // namespace ferry::sidechannel
