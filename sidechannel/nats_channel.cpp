#include "sidechannel/nats_channel.hpp"
#include "loop/ids.hpp"
#include "loop/uv_handle.hpp"
#include "sidechannel/nats_adapter.hpp"
#include "sidechannel/nats_connect.hpp"
#include "sidechannel/outbox.hpp"

#include <fcntl.h>
#include <nats/nats.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <list>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace ferry::sidechannel {

std::string subject_problem(std::string_view subject) {
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
  return {};
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

namespace {

std::atomic<RandomSource> random_source{&::getrandom};

// 64 random bits from /dev/urandom, or failing that from whatever differs between processes
// and runs: for the fallback ids below, obtained once per process.
std::uint64_t process_seed() {
  std::uint64_t seed = 0;
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    if (::read(fd, &seed, sizeof seed) != static_cast<ssize_t>(sizeof seed)) seed = 0;
    ::close(fd);
  }
  if (seed == 0) {
    int local = 0;
    seed = static_cast<std::uint64_t>(
               std::chrono::high_resolution_clock::now().time_since_epoch().count()) ^
           (static_cast<std::uint64_t>(::getpid()) << 32) ^
           reinterpret_cast<std::uintptr_t>(&local) ^
           std::hash<std::thread::id>{}(std::this_thread::get_id());
  }
  return seed;
}

// splitmix64's finalizer: a bijection of 64-bit values, so distinct counters give distinct
// ids.
std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// An id when the random source keeps failing: a process-wide counter mixed with a seed
// obtained once. Unique within the process (no value repeats before 2^64 ids), but only as
// hard to guess as the seed; said once on stderr.
std::uint64_t fallback_id() {
  static const std::uint64_t seed = process_seed();
  static std::atomic<std::uint64_t> counter{0};
  static std::once_flag warned;
  std::call_once(warned, [] {
    std::fprintf(stderr,
                 "ferry: getrandom() keeps failing; NATS reply subjects use a counter mixed with "
                 "a per-process seed instead\n");
  });
  return mix(seed + 0x9e3779b97f4a7c15ULL * ++counter);
}

}  // namespace

RandomSource set_random_source_for_testing(RandomSource source) {
  return random_source.exchange(source != nullptr ? source : &::getrandom);
}

// Loop-side state. Shared with cnats callbacks through weak references, so that a message
// that arrives while the channel closes finds nothing instead of a dangling pointer.
struct NatsChannel::State {
  using Clock = std::chrono::steady_clock;

  EventLoop::Poster poster;
  std::string prefix;
  std::string inbox;  // "<prefix>.inbox.<client id>"
  std::function<void(SideChannelEvent, const std::string&)> on_event;
  std::chrono::milliseconds request_timeout{1000};
  NatsChannel* owner = nullptr;  // null once the channel is closing

  // Loop thread only.
  std::unordered_map<std::uint64_t, MessageHandler> subs;
  // Keyed by random ids: the reply subjects are visible on the wire, and an answer to a
  // request must not be forgeable by guessing the next one. `order` lists them oldest first,
  // for the cap (kMaxOpenRequests).
  struct OpenRequest {
    MessageHandler handler;
    std::list<std::uint64_t>::iterator in_order;
  };
  std::unordered_map<std::uint64_t, OpenRequest> requests;
  std::list<std::uint64_t> order;
  bool noted_cap = false;
  // A subscription waiting for its confirmation (see subscribe()).
  struct Confirm {
    Registered done;
    std::string subject;  // the one subscribed to, for errors
    std::string inbox;    // where the confirmation goes: "<inbox>.c<id>"
    std::uint64_t sub = 0;
    Clock::time_point deadline;
  };
  std::unordered_map<std::uint64_t, Confirm> confirms;
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
  void answer(const Message& m) {
    // Inbox subjects end in "r<id>" (an answer to a request) or "c<id>" (a subscription
    // confirmed: see subscribe()), the id in hex.
    auto dot = m.subject.rfind('.');
    if (dot == std::string::npos || dot + 2 > m.subject.size()) return;
    const char kind = m.subject[dot + 1];
    std::uint64_t id = std::strtoull(m.subject.c_str() + dot + 2, nullptr, 16);
    if (kind == 'c') {
      if (Registered done = take_confirm(id)) done({});
      return;
    }
    if (kind != 'r') return;
    auto it = requests.find(id);
    if (it == requests.end()) return;  // answered already, cancelled or dropped
    MessageHandler handler = std::move(it->second.handler);
    order.erase(it->second.in_order);
    requests.erase(it);
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
  Registered take_confirm(std::uint64_t id) {
    auto it = confirms.find(id);
    if (it == confirms.end()) return {};
    Registered done = std::move(it->second.done);
    confirms.erase(it);
    return done;
  }
  void add_request(std::uint64_t id, MessageHandler handler) {
    if (requests.size() >= kMaxOpenRequests) {
      // The oldest is the likeliest to have been forgotten by its caller; a caller that
      // still waits asks again (the connector does every request_timeout).
      requests.erase(order.front());
      order.pop_front();
      if (!noted_cap) {
        noted_cap = true;
        std::fprintf(stderr,
                     "ferry: more than %zu NATS requests are open; dropping the oldest "
                     "unanswered ones (does a subscriber hold a subject without answering?)\n",
                     kMaxOpenRequests);
      }
    }
    order.push_back(id);
    requests.emplace(id, OpenRequest{std::move(handler), std::prev(order.end())});
  }
  void drop_request(std::uint64_t id) {
    auto it = requests.find(id);
    if (it == requests.end()) return;
    order.erase(it->second.in_order);
    requests.erase(it);
  }
  // A fresh non-zero id that `taken` does not know. getrandom is tried a few times (it fails
  // when interrupted, or where a kernel or a seccomp filter refuses it); then the
  // counter-based fallback, whose ids never repeat, so the loop ends within taken's size + 1
  // turns.
  template <class Taken>
  static std::uint64_t random_id(const Taken& taken) {
    for (int attempt = 0; attempt < 4; ++attempt) {
      std::uint64_t id = 0;
      if (random_source.load()(&id, sizeof id, 0) == static_cast<ssize_t>(sizeof id) && id != 0 &&
          !taken(id))
        return id;
    }
    for (;;)
      if (std::uint64_t id = fallback_id(); id != 0 && !taken(id)) return id;
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
  // serve(): answered here, on the delivery thread (both fixed before the subscription).
  NatsChannel::Answer direct;
  std::string prefix;
};

void on_message(natsConnection* nc, natsSubscription*, natsMsg* msg, void* closure) {
  auto* c = static_cast<SubClosure*>(closure);
  if (c->direct) {
    // A request to a served subject: answered at once, from this thread. Anything else sent
    // there (no reply subject, or one that is not a request() inbox) goes unanswered.
    const char* reply = natsMsg_GetReply(msg);
    if (reply != nullptr && is_reply_inbox(c->prefix, reply)) {
      const char* data = natsMsg_GetData(msg);
      const std::string request(data != nullptr ? data : "",
                                static_cast<std::size_t>(natsMsg_GetDataLength(msg)));
      std::string answer;
      try {
        answer = c->direct(request);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "ferry: answering a request at %s: %s\n", natsMsg_GetSubject(msg),
                     e.what());
      }
      if (!answer.empty() && natsConnection_Publish(nc, reply, answer.data(),
                                                    static_cast<int>(answer.size())) != NATS_OK)
        std::fprintf(stderr, "ferry: NATS publish to %s failed\n", reply);
    }
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
      s->answer(m);
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
      state_(std::make_shared<State>()),
      outbox_(std::make_unique<Outbox>()),
      wire_(std::make_unique<Wire>()) {
  state_->poster = loop.poster();
  state_->prefix = o.prefix.empty() ? "ferry" : o.prefix;
  state_->inbox = state_->prefix + ".inbox." + client_id;
  state_->on_event = o.on_event;
  state_->request_timeout = o.request_timeout;
  if (auto why = subject_problem(state_->inbox); !why.empty())
    throw Error(ErrorCode::InvalidArgument, "NATS prefix '" + state_->prefix + "' " + why);

  NatsOptionsPtr opts = nats_options(o);
  // The socket is polled by the loop through ferry's driver (see nats_adapter.hpp). The
  // connect below attaches it from here, the loop thread, so it is polled at once.
  driver_ = std::make_unique<NatsSocketDriver>(loop.uv(), loop.log());
  if (natsStatus s = driver_->install(opts.get()); s != NATS_OK)
    throw Error(ErrorCode::SideChannel, "event loop: " + status_text(s));
  auto* events = new EventClosure{state_, loop.poster()};
  natsOptions_SetDisconnectedCB(opts.get(), on_disconnected, events);
  natsOptions_SetReconnectedCB(opts.get(), on_reconnected, events);
  natsOptions_SetClosedCB(opts.get(), on_closed, events);
  natsOptions_SetErrorHandler(opts.get(), on_error, events);

  natsConnection* nc = nullptr;
  try {
    nc = nats_connect(opts.get(), o.servers);
  } catch (...) {
    delete events;  // a failed connect calls back nothing
    throw;
  }
  wire_->nc = nc;
  closer_ = loop::Async::async(
      loop.uv(),
      [](uv_async_t* h) {
        auto* self = static_cast<NatsChannel*>(h->data);
        uv_timer_start(
            self->finisher_.get(), [](uv_timer_t* t) { delete static_cast<NatsChannel*>(t->data); },
            0, 0);
      },
      this);
  finisher_ = loop::Timer::timer(loop.uv(), this);
  confirm_timer_ = loop::Timer::timer(loop.uv(), this);
  // Only a close in progress keeps the loop alive (close() refs the first two).
  uv_unref(reinterpret_cast<uv_handle_t*>(closer_.get()));
  uv_unref(reinterpret_cast<uv_handle_t*>(finisher_.get()));
  uv_unref(reinterpret_cast<uv_handle_t*>(confirm_timer_.get()));
  state_->owner = this;
  state_->max_payload = natsConnection_GetMaxPayload(nc);
  char* ip = nullptr;
  int port = 0;
  if (natsConnection_GetLocalIPAndPort(nc, &ip, &port) == NATS_OK && ip != nullptr) {
    local_ip_ = ip;
    free(ip);  // allocated by cnats
  }

  // Answers to this connector's requests arrive at "<inbox>.<n>".
  inbox_sub_ = subscribe(state_->inbox + ".*", {}, nullptr);
}

NatsChannel::~NatsChannel() {
  // Handlers die first, so that messages arriving during the close find nothing.
  state_->owner = nullptr;
  state_->subs.clear();
  state_->requests.clear();
  state_->order.clear();
  state_->confirms.clear();
  state_.reset();
  natsConnection* nc = wire_->nc;
  outbox_->stop();
  // On the loop thread: the driver applies cnats' stop-polling and detach at once here.
  // Once Close has returned (it joins cnats' reconnect thread), cnats calls the driver no
  // more, and the driver closes what it still holds.
  natsConnection_Close(nc);
  driver_->shutdown();
  for (auto& [id, sub] : wire_->subs) natsSubscription_Destroy(sub);
  for (natsSubscription* sub : wire_->draining) natsSubscription_Destroy(sub);
  natsConnection_Destroy(nc);
  // closer_, finisher_ and confirm_timer_ close themselves.
}

void NatsChannel::close(std::unique_ptr<NatsChannel> channel) {
  NatsChannel* self = channel.release();
  self->closing_ = true;
  self->state_->owner = nullptr;
  self->state_->subs.clear();
  self->state_->requests.clear();
  self->state_->order.clear();
  self->state_->confirms.clear();
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
  const bool inbox = !handler;  // our own "<inbox>.*", the one wildcard subscription
  if (auto why = inbox ? std::string() : subject_problem(subject); closing_ || !why.empty()) {
    if (registered) registered(closing_ ? "the side channel is closing" : "subject " + why);
    return id;
  }
  if (handler) state_->subs.emplace(id, std::move(handler));
  std::string confirm;
  std::uint64_t confirm_id = 0;
  if (registered) {
    confirm_id =
        State::random_id([this](std::uint64_t c) { return state_->confirms.count(c) != 0; });
    char token[24];
    std::snprintf(token, sizeof token, ".c%llx", static_cast<unsigned long long>(confirm_id));
    confirm = state_->inbox + token;
    state_->confirms.emplace(confirm_id,
                             State::Confirm{std::move(registered), subject, confirm, id,
                                            State::Clock::now() + state_->request_timeout});
    arm_confirm_timer();
  }
  auto* closure =
      new SubClosure{state_, loop_.poster(), id, inbox, std::move(direct), state_->prefix};
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
            if (Registered done = st->take_confirm(confirm_id)) done(why);
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
  for (auto it = state_->confirms.begin(); it != state_->confirms.end(); ++it) {
    if (it->second.sub != id) continue;
    Registered done = std::move(it->second.done);
    state_->confirms.erase(it);
    loop_.defer([done = std::move(done)] {
      done("unsubscribed before the NATS server confirmed the subscription");
    });
    break;
  }
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
      closing_ || !why.empty() || (!reply.empty() && !subject_problem(reply).empty())) {
    if (!closing_)
      std::fprintf(stderr, "ferry: not publishing to '%s': subject %s\n", subject.c_str(),
                   why.empty() ? "has a bad reply subject" : why.c_str());
    return;
  }
  outbox_->push([this, subject, data = std::move(data), reply] {
    natsStatus s = reply.empty()
                       ? natsConnection_Publish(wire_->nc, subject.c_str(), data.data(),
                                                static_cast<int>(data.size()))
                       : natsConnection_PublishRequest(wire_->nc, subject.c_str(), reply.c_str(),
                                                       data.data(), static_cast<int>(data.size()));
    if (s != NATS_OK)
      std::fprintf(stderr, "ferry: NATS publish to %s failed: %s\n", subject.c_str(),
                   natsStatus_GetText(s));
  });
}

std::uint64_t NatsChannel::request(const std::string& subject, std::string data,
                                   MessageHandler handler) {
  const std::uint64_t id =
      State::random_id([this](std::uint64_t r) { return state_->requests.count(r) != 0; });
  state_->add_request(id, std::move(handler));
  char token[24];
  std::snprintf(token, sizeof token, ".r%llx", static_cast<unsigned long long>(id));
  publish(subject, std::move(data), state_->inbox + token);
  return id;
}

void NatsChannel::cancel_request(std::uint64_t id) { state_->drop_request(id); }

std::size_t NatsChannel::open_requests() const noexcept { return state_->requests.size(); }

std::size_t NatsChannel::pending_confirmations() const noexcept { return state_->confirms.size(); }

void NatsChannel::respond(const Message& request, std::string data) {
  if (request.reply.empty() || closing_) return;
  if (!is_reply_inbox(state_->prefix, request.reply)) {
    note_refused_reply(request);
    return;
  }
  publish(request.reply, std::move(data));
}

void NatsChannel::note_refused_reply(const Message& request) {
  // At most one line every 10 s: the requester controls how often this happens.
  const auto now = std::chrono::steady_clock::now();
  if (refused_noted_ != std::chrono::steady_clock::time_point{} &&
      now - refused_noted_ < std::chrono::seconds(10)) {
    ++refused_unnoted_;
    return;
  }
  // Subjects come from the network: print them only when they hold nothing but printable
  // characters (subject_problem refuses control characters), and not too much of them.
  auto printable = [](const std::string& subject) {
    if (!subject_problem(subject).empty()) return std::string("<malformed>");
    return subject.size() > 200 ? subject.substr(0, 200) + "..." : subject;
  };
  std::string also;
  if (refused_unnoted_ > 0)
    also = " (and " + std::to_string(refused_unnoted_) + " more since the last note)";
  std::fprintf(stderr,
               "ferry: not answering a request at '%s': its reply subject '%s' is not a ferry "
               "reply inbox%s\n",
               printable(request.subject).c_str(), printable(request.reply).c_str(), also.c_str());
  refused_noted_ = now;
  refused_unnoted_ = 0;
}

void NatsChannel::arm_confirm_timer() {
  if (closing_ || state_->confirms.empty() || !state_->connected) {
    uv_timer_stop(confirm_timer_.get());
    return;
  }
  auto earliest = State::Clock::time_point::max();
  for (const auto& [id, c] : state_->confirms) earliest = std::min(earliest, c.deadline);
  auto wait = std::chrono::ceil<std::chrono::milliseconds>(earliest - State::Clock::now());
  uv_timer_start(
      confirm_timer_.get(),
      [](uv_timer_t* t) { static_cast<NatsChannel*>(t->data)->expire_confirms(); },
      static_cast<std::uint64_t>(std::max<std::int64_t>(wait.count(), 0)), 0);
}

void NatsChannel::expire_confirms() {
  // While the connection is down the deadlines wait; reconfirm() starts them over.
  if (closing_ || !state_->connected) return;
  const auto now = State::Clock::now();
  std::vector<std::pair<Registered, std::string>> expired;
  for (auto it = state_->confirms.begin(); it != state_->confirms.end();) {
    if (it->second.deadline > now) {
      ++it;
      continue;
    }
    expired.emplace_back(std::move(it->second.done),
                         "the NATS server did not confirm the subscription to '" +
                             it->second.subject + "' within " +
                             std::to_string(state_->request_timeout.count()) + " ms");
    it = state_->confirms.erase(it);
  }
  arm_confirm_timer();
  // Last: a callback may subscribe or unsubscribe.
  for (auto& [done, why] : expired) done(why);
}

void NatsChannel::reconfirm() {
  // A confirmation may have been lost with the old connection (sent, never echoed). cnats
  // has sent every SUB again before it reports the reconnect; a new confirmation behind
  // them comes back once they are in place.
  if (closing_) return;
  const auto deadline = State::Clock::now() + state_->request_timeout;
  for (auto& [id, c] : state_->confirms) {
    c.deadline = deadline;
    outbox_->push(
        [this, inbox = c.inbox] { natsConnection_Publish(wire_->nc, inbox.c_str(), nullptr, 0); });
  }
  arm_confirm_timer();
}

void NatsChannel::fail_confirms(const std::string& why) {
  std::vector<Registered> failed;
  for (auto& [id, c] : state_->confirms) failed.push_back(std::move(c.done));
  state_->confirms.clear();
  uv_timer_stop(confirm_timer_.get());
  for (auto& done : failed) done(why);
}

}  // namespace ferry::sidechannel
