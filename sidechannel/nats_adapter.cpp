#include "sidechannel/nats_adapter.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>

#include "loop/uv_handle.hpp"

namespace ferry::sidechannel {

// One uv_poll handle on one of ferry's duplicates. Heap-allocated; deleted, and its
// descriptor closed, in the uv_close callback: only then has libuv forgotten the number.
struct NatsSocketDriver::Watch {
  uv_poll_t handle{};
  NatsSocketDriver::Core* core = nullptr;
  int fd = -1;                   // ferry's duplicate of cnats' socket
  std::uint64_t generation = 0;  // the attachment it serves
  int events = 0;                // what it polls for now
};

namespace {

using Watch = NatsSocketDriver::Watch;
using Core = NatsSocketDriver::Core;

// Every driver alive in the process, by token. Never destroyed: a cnats thread may still call a
// driver's callback while the process exits.
struct Registry {
  std::mutex mu;
  std::unordered_map<std::uintptr_t, std::weak_ptr<Core>> cores;
  std::uintptr_t next = 1;
};

Registry& registry() {
  static auto* r = new Registry;
  return *r;
}

void on_watch_closed(uv_handle_t* handle) {
  auto* watch = static_cast<Watch*>(handle->data);
  ::close(watch->fd);
  delete watch;
}

}  // namespace

struct NatsSocketDriver::Core {
  // What cnats holds in place of a pointer to this core (see find()).
  std::uintptr_t token = 0;
  uv_loop_t* loop = nullptr;
  loop::Log log;
  // Wakes the loop for changes made on other threads. Sent under mu only, and closed under
  // it by shutdown(), so that no thread sends to a closed handle.
  uv_async_t* wake = nullptr;
  // The thread that runs the loop: the constructor's, refreshed by every loop-side callback.
  std::atomic<std::thread::id> loop_thread{};

  bool in_loop_thread() const { return loop_thread.load() == std::this_thread::get_id(); }

  // What cnats asked for, guarded by mu. Written from cnats' threads and the loop.
  std::mutex mu;
  natsConnection* nc = nullptr;
  std::uint64_t generation = 0;  // counts attachments
  // The latest attachment's duplicate while no handle polls it yet; -1 once the loop has
  // handed it to a Watch (which then owns it) or closed it.
  int fd = -1;
  bool want_read = false;
  bool want_write = false;
  bool detached = false;
  bool shut = false;  // shutdown() ran: cnats must not call any more
  // Loop thread only (also under mu, since apply() runs under it): the handle that polls
  // the current or a superseded attachment.
  Watch* watch = nullptr;

  // Makes libuv do what cnats asked for. Loop thread, mu held. False when the latest
  // attachment could not be polled (the reason is logged).
  bool apply();
  // After a change (mu held): applies it at once on the loop thread, or wakes the loop.
  natsStatus changed();

  static void on_wake(uv_async_t* handle);
  static void on_poll(uv_poll_t* handle, int status, int events);

  // The core that `token` names, or null once its driver has shut down. cnats may call the
  // driver after natsConnection_Close has returned: when another thread (the reconnect thread
  // giving up after max_reconnect, the side channel's worker giving up a first connect) is
  // inside cnats' own close, Close returns at once, and that thread calls detach only after it
  // has let go of the connection's lock, by which time the driver may be gone. So cnats gets a
  // token, never a pointer, and a callback for a token whose driver has shut down does nothing.
  static std::shared_ptr<Core> find(void* token);

  // cnats' callbacks (natsEvLoop_*).
  static natsStatus attach(void** user_data, void* loop, natsConnection* nc, natsSock socket);
  static natsStatus read(void* user_data, bool add);
  static natsStatus write(void* user_data, bool add);
  static natsStatus detach(void* user_data);
};

bool NatsSocketDriver::Core::apply() {
  // A handle that polls a superseded attachment (cnats reconnected, or closed): close it.
  // Its descriptor is ferry's, still open until the close callback, so libuv's removal of
  // that number from epoll can only hit this handle's own registration.
  if (watch != nullptr && (detached || watch->generation != generation)) {
    uv_close(reinterpret_cast<uv_handle_t*>(&watch->handle), on_watch_closed);
    watch = nullptr;
  }
  if (detached && fd >= 0) {
    ::close(fd);  // never polled: no libuv structure knows this number
    fd = -1;
  }
  if (watch == nullptr && fd >= 0) {
    auto* w = new Watch;
    w->core = this;
    w->fd = fd;
    w->generation = generation;
    w->handle.data = w;
    fd = -1;
    if (int rc = uv_poll_init(loop, &w->handle, w->fd); rc != 0) {
      log.error(std::string("nats: cannot poll the socket to the NATS server: ") + uv_strerror(rc));
      ::close(w->fd);
      delete w;
      return false;
    }
    watch = w;
  }
  if (watch == nullptr) return true;
  const int events = (want_read ? UV_READABLE : 0) | (want_write ? UV_WRITABLE : 0);
  if (events == watch->events) return true;
  int rc = events != 0 ? uv_poll_start(&watch->handle, events, &Core::on_poll)
                       : uv_poll_stop(&watch->handle);
  if (rc != 0) {
    log.error(std::string("nats: cannot poll the socket to the NATS server: ") + uv_strerror(rc));
    return false;
  }
  watch->events = events;
  return true;
}

natsStatus NatsSocketDriver::Core::changed() {
  if (in_loop_thread()) return apply() ? NATS_OK : NATS_ERR;
  // Another thread: libuv is not thread-safe. uv_async_send coalesces wake-ups, and one
  // serves every change made before it runs, since the loop applies the latest state.
  return uv_async_send(wake) == 0 ? NATS_OK : NATS_ERR;
}

void NatsSocketDriver::Core::on_wake(uv_async_t* handle) {
  auto* self = static_cast<Core*>(handle->data);
  self->loop_thread.store(std::this_thread::get_id());
  natsConnection* failed = nullptr;
  {
    std::lock_guard lock(self->mu);
    if (self->shut) return;
    if (!self->apply()) failed = self->nc;
  }
  // A reconnect whose socket cannot be polled would leave the connection silent forever:
  // close it, so that its users hear of it (closed event), as cnats' own adapter does. Never
  // expected (uv_poll_init on a fresh descriptor fails only without memory). Outside mu:
  // closing calls back into read/write/detach.
  if (failed != nullptr) natsConnection_Close(failed);
}

void NatsSocketDriver::Core::on_poll(uv_poll_t* handle, int status, int events) {
  auto* w = static_cast<Watch*>(handle->data);
  Core* self = w->core;
  self->loop_thread.store(std::this_thread::get_id());
  natsConnection* nc = nullptr;
  bool reading = false;
  {
    std::lock_guard lock(self->mu);
    // An event for an attachment cnats has given up, whose replacement (or detach) the loop
    // has not applied yet: apply it now and leave the event alone (the old socket is cnats'
    // no more).
    if (self->watch != w || self->detached || w->generation != self->generation) {
      if (!self->shut) self->apply();
      return;
    }
    nc = self->nc;
    reading = self->want_read;
  }
  // The driver's mutex is not held here: processing calls back into read/write/detach, from
  // this thread. The Watch outlives this callback even if that closes it (it is deleted in
  // the close callback, a later phase of the loop), and so does the core (the driver is
  // destroyed on the loop after shutdown(), never from inside cnats).
  if (status < 0) {
    // EPOLLERR (the server reset the connection; status is UV_EBADF). libuv has stopped the
    // handle itself, without a word: note it, or apply() would believe it still polls and
    // never start it again. Then read, as for a readable socket: cnats sees the reset only
    // after it has read what arrived before it, one buffer per call, so the handle is started
    // again until cnats has seen the error and given up this attachment. Otherwise a reset
    // that comes behind more than one buffer of data (as under a flood of requests) leaves the
    // connection neither read nor written, until cnats' pings give up on it minutes later.
    {
      std::lock_guard lock(self->mu);
      w->events = 0;
    }
    natsConnection_ProcessReadEvent(nc);
    std::lock_guard lock(self->mu);
    if (!self->shut && self->watch == w) self->apply();
    return;
  }
  if ((events & UV_READABLE) != 0 && reading) natsConnection_ProcessReadEvent(nc);
  if ((events & UV_WRITABLE) == 0) return;
  {
    std::lock_guard lock(self->mu);
    if (self->watch != w || self->detached || !self->want_write) return;
  }
  natsConnection_ProcessWriteEvent(nc);
}

std::shared_ptr<NatsSocketDriver::Core> NatsSocketDriver::Core::find(void* token) {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  auto it = r.cores.find(reinterpret_cast<std::uintptr_t>(token));
  return it != r.cores.end() ? it->second.lock() : nullptr;
}

natsStatus NatsSocketDriver::Core::attach(void** user_data, void* loop, natsConnection* nc,
                                          natsSock socket) {
  std::shared_ptr<Core> self = find(loop);
  if (!self) return NATS_ILLEGAL_STATE;  // the driver has shut down
  // cnats holds the connection's lock and `socket` is open: duplicate it now. The duplicate
  // is ferry's, whatever cnats later does with its own number.
  int dup = ::fcntl(socket, F_DUPFD_CLOEXEC, 0);
  if (dup < 0) {
    self->log.error(std::string("nats: cannot duplicate the socket to the NATS server: ") +
                    std::strerror(errno));
    return NATS_SYS_ERROR;
  }
  std::lock_guard lock(self->mu);
  if (self->shut) {
    ::close(dup);
    return NATS_ILLEGAL_STATE;
  }
  // An earlier attachment the loop never got to poll (two reconnects before it woke up).
  if (self->fd >= 0) ::close(self->fd);
  self->fd = dup;
  self->nc = nc;
  ++self->generation;
  self->detached = false;
  self->want_read = true;
  // want_write is left as it was: cnats clears it itself before a reconnect, and keeps
  // believing in a write it asked for across a failed one.
  *user_data = loop;  // the token again
  return self->changed();
}

natsStatus NatsSocketDriver::Core::read(void* user_data, bool add) {
  std::shared_ptr<Core> self = find(user_data);
  if (!self) return NATS_OK;  // the driver has shut down
  std::lock_guard lock(self->mu);
  if (self->shut) return NATS_OK;
  self->want_read = add;
  return self->changed();
}

natsStatus NatsSocketDriver::Core::write(void* user_data, bool add) {
  std::shared_ptr<Core> self = find(user_data);
  if (!self) return NATS_OK;  // the driver has shut down
  std::lock_guard lock(self->mu);
  if (self->shut) return NATS_OK;
  self->want_write = add;
  return self->changed();
}

natsStatus NatsSocketDriver::Core::detach(void* user_data) {
  std::shared_ptr<Core> self = find(user_data);
  if (!self) return NATS_OK;  // the driver has shut down
  std::lock_guard lock(self->mu);
  if (self->shut) return NATS_OK;
  self->detached = true;
  self->want_read = self->want_write = false;
  return self->changed();
}

NatsSocketDriver::NatsSocketDriver(uv_loop_t* loop, loop::Log log)
    : core_(std::make_shared<Core>()) {
  {
    Registry& r = registry();
    std::lock_guard lock(r.mu);
    core_->token = r.next++;
    r.cores.emplace(core_->token, core_);
  }
  core_->loop = loop;
  core_->log = std::move(log);
  core_->loop_thread.store(std::this_thread::get_id());
  core_->wake = new uv_async_t{};
  uv_async_init(loop, core_->wake, &Core::on_wake);
  core_->wake->data = core_.get();
  // The wake-up handle alone does not keep the loop running: what needs the loop keeps it
  // (the socket's poll handle while attached, the side channel's close handles while it
  // closes).
  uv_unref(reinterpret_cast<uv_handle_t*>(core_->wake));
}

NatsSocketDriver::~NatsSocketDriver() { shutdown(); }

NatsSocketDriver::Callbacks NatsSocketDriver::callbacks() const {
  // The loop argument cnats hands back to attach is the core's token.
  return {reinterpret_cast<void*>(core_->token), &Core::attach, &Core::read, &Core::write,
          &Core::detach};
}

natsStatus NatsSocketDriver::install(natsOptions* opts) {
  const Callbacks c = callbacks();
  return natsOptions_SetEventLoop(opts, c.loop, c.attach, c.read, c.write, c.detach);
}

void NatsSocketDriver::shutdown() {
  {
    // From now on cnats' callbacks find nothing (one already running holds the core).
    Registry& r = registry();
    std::lock_guard lock(r.mu);
    r.cores.erase(core_->token);
  }
  std::lock_guard lock(core_->mu);
  if (core_->shut) return;
  core_->detached = true;
  core_->want_read = core_->want_write = false;
  core_->apply();
  core_->shut = true;
  core_->nc = nullptr;
  loop::close_and_delete(core_->wake);
  core_->wake = nullptr;
}

}  // namespace ferry::sidechannel
