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
#include "sidechannel/answer_limit.hpp"
#include "sidechannel/inbox.hpp"
#include "sidechannel/nats_adapter.hpp"
#include "sidechannel/nats_channel_state.hpp"
#include "sidechannel/nats_connect.hpp"
#include "sidechannel/outbox.hpp"
#include "sidechannel/subjects.hpp"

namespace ferry::sidechannel {

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
  std::shared_ptr<AnswerLimit> limit;  // the channel's, shared by everything it serves
  std::string limit_key;               // this subscription's bucket in it
};

// A request to a served subject, answered at once from cnats' delivery thread. Anything else
// sent there (no reply subject, or one that is not a request() inbox) goes unanswered.
void answer_directly(natsConnection* nc, natsMsg* msg, const SubClosure& c) {
  const char* reply = natsMsg_GetReply(msg);
  if (reply == nullptr || !is_reply_inbox(c.prefix, reply)) return;
  // The reply inbox may be anyone's (NATS does not say who published): what a flood can make
  // this connection publish there is bounded per served subscription.
  if (!c.limit->admit(c.limit_key)) {
    if (auto refused = c.limit->note_due())
      c.log.warning(std::string("nats: answering requests at '") + natsMsg_GetSubject(msg) +
                    "' no faster than NatsOptions::answers_per_second allows; " +
                    std::to_string(*refused) + " request(s) at served subjects left unanswered");
    return;
  }
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

}  // namespace

NatsChannel::NatsChannel(EventLoop& loop, const NatsOptions& o, std::string client_id)
    : loop_(loop),
      log_(loop.log()),
      state_(std::make_shared<State>(loop, o, client_id)),
      driver_(std::make_unique<NatsSocketDriver>(loop.uv(), loop.log())),
      outbox_(std::make_unique<Outbox>()),
      wire_(std::make_unique<Wire>()),
      answer_limit_(std::make_shared<AnswerLimit>(o.answer_burst, o.answers_per_second)) {
  state_->board = status_;
  connect(o);
  make_handles();
  learn_connection(o);
  state_->owner = this;
  // Answers to this connector's requests and confirmations arrive at "<inbox>.*".
  inbox_sub_ = subscribe(state_->inbox.subject() + ".*", {}, nullptr);
  if (!state_->connected && o.connect_deadline.count() > 0)
    uv_timer_start(
        connect_timer_.get(), [](uv_timer_t* t) { static_cast<NatsChannel*>(t->data)->give_up(); },
        static_cast<std::uint64_t>(o.connect_deadline.count()), 0);
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
  connect_timer_ = loop::Timer::timer(loop_.uv(), this);
  // Only a close in progress keeps the loop alive (close() refs the first two).
  uv_unref(reinterpret_cast<uv_handle_t*>(closer_.get()));
  uv_unref(reinterpret_cast<uv_handle_t*>(finisher_.get()));
  uv_unref(reinterpret_cast<uv_handle_t*>(confirm_timer_.get()));
  uv_unref(reinterpret_cast<uv_handle_t*>(connect_timer_.get()));
}

NatsChannel::~NatsChannel() {
  state_->forget();
  state_.reset();
  outbox_->stop();
  // On the loop thread: the driver applies cnats' stop-polling and detach at once here.
  // Once Close has returned (it joins cnats' reconnect thread), the driver closes what it
  // still holds. A thread of cnats' that was closing the connection itself (it gave up
  // reconnecting) may still call the driver after this: the driver then ignores it.
  if (wire_->nc != nullptr) natsConnection_Close(wire_->nc);
  driver_->shutdown();
  for (auto& [id, sub] : wire_->subs) natsSubscription_Destroy(sub);
  for (natsSubscription* sub : wire_->draining) natsSubscription_Destroy(sub);
  if (wire_->nc != nullptr) natsConnection_Destroy(wire_->nc);
  // closer_, finisher_ and confirm_timer_ close themselves.
}

void NatsChannel::close(std::unique_ptr<NatsChannel> channel) {
  NatsChannel* self = channel.release();
  self->closing_ = true;
  const bool connected = self->state_->connected;
  self->state_->forget();
  uv_timer_stop(self->confirm_timer_.get());
  uv_timer_stop(self->connect_timer_.get());
  uv_ref(reinterpret_cast<uv_handle_t*>(self->closer_.get()));
  uv_ref(reinterpret_cast<uv_handle_t*>(self->finisher_.get()));
  // The flush runs on the worker while the loop, free, writes what cnats buffered and reads
  // the PONG; then the worker wakes the loop to finish.
  self->outbox_->push([self, connected] {
    // A connection that is down could only wait the flush out.
    if (connected && self->wire_->nc != nullptr) natsConnection_FlushTimeout(self->wire_->nc, 500);
    uv_async_send(self->closer_.get());
  });
  self->outbox_->finish();
}

std::string NatsChannel::own_subject(std::string_view suffix) const {
  return state_->prefix + "." + std::string(suffix);
}

std::int64_t NatsChannel::max_payload() const noexcept {
  const std::int64_t known = state_->max_payload;
  return known > 0 ? known : kAssumedMaxPayload;
}

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
  auto* closure = new SubClosure{state_, loop_.poster(),    id,
                                 inbox,  std::move(direct), state_->prefix,
                                 log_,   answer_limit_,     subject + "#" + std::to_string(id)};
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
