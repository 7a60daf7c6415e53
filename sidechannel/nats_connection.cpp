// NatsChannel's connection: the connect (at once, or in the background when no server
// answers yet), cnats' connection events, and what the connection tells.
#include <nats/nats.h>

#include <cstdlib>
#include <memory>
#include <string>

#include <ferry/error.hpp>

#include "sidechannel/nats_adapter.hpp"
#include "sidechannel/nats_channel.hpp"
#include "sidechannel/nats_channel_state.hpp"
#include "sidechannel/nats_connect.hpp"
#include "sidechannel/outbox.hpp"

namespace ferry::sidechannel {

namespace {

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
void on_closed(natsConnection* nc, void* closure) {
  const char* text = nullptr;
  natsStatus last = natsConnection_GetLastError(nc, &text);
  std::string why = last == NATS_OK ? "" : natsStatus_GetText(last);
  if (text != nullptr && *text != '\0' && why != text)
    why += (why.empty() ? "" : ": ") + std::string(text);
  post_event(nullptr, closure, SideChannelEvent::closed, why);
  delete static_cast<EventClosure*>(closure);
}
void on_connected(natsConnection* nc, void* closure) {
  post_event(nc, closure, SideChannelEvent::connected, current_url(nc));
}
void on_error(natsConnection*, natsSubscription*, natsStatus err, void* closure) {
  post_event(nullptr, closure, SideChannelEvent::error, natsStatus_GetText(err));
}

}  // namespace

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
  try {
    wire_->nc = nats_connect(opts.get(), o.servers);
    // Told on the loop after this constructor, as a later first connection would be.
    post_event(wire_->nc, events.get(), SideChannelEvent::connected, current_url(wire_->nc));
    // From now on cnats' (on_closed frees it).
    static_cast<void>(events.release());
    status_->set(SideChannelState::connected, current_url(wire_->nc));
    return;
  } catch (const Error& e) {
    // Refused credentials (AccessDenied) are the caller's to fix; a server that is not there
    // yet is waited for.
    if (e.code() != ErrorCode::SideChannel) throw;
    state_->failure = e.message();
  }
  state_->connected = state_->ever_connected = false;
  status_->set(SideChannelState::connecting, state_->failure +
                                                 "; retrying in the background every " +
                                                 std::to_string(o.reconnect_wait.count()) + " ms");
  // A failed connect called nothing back: the same closure serves the retrying connection.
  if (natsStatus s =
          natsOptions_SetRetryOnFailedConnect(opts.get(), true, on_connected, events.get());
      s != NATS_OK)
    throw Error(ErrorCode::SideChannel, "retry on a failed connect: " + status_text(s));
  // On the outbox, so that no thread of ours waits for its first round (up to
  // connect_timeout per server); what is pushed after it (subscriptions, publishes) finds the
  // connection made, and cnats buffers it until the server is there.
  std::shared_ptr<natsOptions> shared(opts.release(), natsOptions_Destroy);
  outbox_->push([this, shared, events = events.release(), servers = state_->servers] {
    natsConnection* nc = nullptr;
    const natsStatus s = natsConnection_Connect(&nc, shared.get());
    if (s == NATS_OK || s == NATS_NOT_YET_CONNECTED) {
      wire_->nc = nc;
      // cnats calls on_connected only for a connection made after this call.
      if (s == NATS_OK) post_event(nc, events, SideChannelEvent::connected, current_url(nc));
      return;
    }
    // Nothing will call back: close the channel's account here.
    post_event(nullptr, events, SideChannelEvent::closed,
               "cannot connect to NATS at " + servers + ": " + status_text(s));
    delete events;
  });
}

void NatsChannel::give_up() {
  if (closing_ || state_->ever_connected) return;
  state_->giving_up = "gave up connecting to NATS at " + state_->servers + " after " +
                      std::to_string(state_->connect_deadline.count()) +
                      " ms (NatsOptions::connect_deadline)";
  // cnats' closed callback then reports it (closed). Close joins the reconnect thread, which
  // may be in a connect attempt: not on the loop. A connection made meanwhile (its event
  // still on its way to the loop) is kept.
  outbox_->push([this] {
    if (wire_->nc != nullptr && natsConnection_Status(wire_->nc) != NATS_CONN_STATUS_CONNECTED)
      natsConnection_Close(wire_->nc);
  });
}

bool NatsChannel::connected() const noexcept { return state_->connected; }

void NatsChannel::learn_connection(const NatsOptions& o) {
  if (!state_->connected) {
    // Not connected yet (and wire_->nc the outbox's to set): the interface that faces the
    // first server, as the connection's socket would have.
    local_ip_ = route_ip(o.servers);
    return;
  }
  state_->max_payload = natsConnection_GetMaxPayload(wire_->nc);
  char* ip = nullptr;
  int port = 0;
  if (natsConnection_GetLocalIPAndPort(wire_->nc, &ip, &port) == NATS_OK && ip != nullptr) {
    local_ip_ = ip;
    free(ip);  // allocated by cnats
  }
}

}  // namespace ferry::sidechannel
