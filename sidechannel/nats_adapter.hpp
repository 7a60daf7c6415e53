#pragma once

#include <nats/nats.h>
#include <uv.h>

#include <memory>

#include "loop/log.hpp"

namespace ferry::sidechannel {

/// Drives one cnats connection's socket from a connector's libuv loop: ferry's own side of
/// cnats' event-loop contract (natsOptions_SetEventLoop: attach, read, write, detach), in place
/// of the libuv adapter that cnats ships.
///
/// Why ferry owns this. cnats calls `attach` with its socket after every (re)connect and
/// close()s that socket itself when the connection drops, while the adapter may still hold a
/// uv_poll handle on the same number and close that handle later, on the loop. If the number
/// was reused in between (a TCP connection of ferry's accepted or connected on the same loop),
/// closing the stale handle removes the new owner's descriptor from the loop's epoll set, and
/// that connection is never read again. Here the loop never polls cnats' own descriptor: each
/// attach polls a duplicate (F_DUPFD_CLOEXEC) that belongs to ferry and is closed only in the
/// uv_close callback of the handle that watched it, on the loop. cnats' close() of its own
/// number then frees nothing that a live uv_poll watches, and the duplicate's number cannot be
/// reused while libuv still knows it. (The duplicate keeps the socket's file description open
/// for at most one loop turn after cnats closed its number; cnats shuts a dropped socket down
/// before closing it, so the server sees the close at once.)
///
/// Threads. cnats calls attach on the thread that (re)connects: the constructor's (the loop
/// thread) for the first connect, its reconnect thread afterwards; read and write from any
/// thread that writes or fails the connection (the loop, the side channel's worker, cnats'
/// reconnect and timer threads), always holding the connection's lock; detach from the thread
/// that closes it. Every callback only records what cnats asked for, under a mutex, and libuv
/// is touched on the loop thread alone: at once when the callback runs there, else after the
/// loop is woken through the driver's own uv_async (not the EventLoop's, which closes before
/// the side channel's final flush has been written). The loop applies the latest recorded
/// state (which attachment, which events), so callbacks that arrive together are applied in
/// one go, in the right order. Lock order: cnats' connection lock, then the driver's mutex;
/// the driver never calls into cnats while holding its mutex.
class NatsSocketDriver {
 public:
  /// On the thread that runs `loop` (or while it does not run); that thread is the loop
  /// thread from then on, as seen by the driver's loop-side callbacks. `log` hears of a socket
  /// that cannot be polled.
  NatsSocketDriver(uv_loop_t* loop, loop::Log log);
  /// Loop thread. Does what shutdown() does if it has not been called.
  ~NatsSocketDriver();
  NatsSocketDriver(const NatsSocketDriver&) = delete;
  NatsSocketDriver& operator=(const NatsSocketDriver&) = delete;

  /// What install() hands to natsOptions_SetEventLoop. `loop` is a token naming this driver,
  /// not a pointer to it: a callback that comes after shutdown() (below) finds no driver and
  /// does nothing (attach fails with NATS_ILLEGAL_STATE, the others return NATS_OK).
  struct Callbacks {
    void* loop;
    natsEvLoop_Attach attach;
    natsEvLoop_ReadAddRemove read;
    natsEvLoop_WriteAddRemove write;
    natsEvLoop_Detach detach;
  };
  Callbacks callbacks() const;

  /// Makes connections created with `opts` use this driver until shutdown().
  natsStatus install(natsOptions* opts);

  /// Loop thread, after natsConnection_Close has returned: stops polling, closes ferry's
  /// duplicates and the wake-up handle. Idempotent. cnats may still call the driver after
  /// that (Close returns at once while another thread is inside cnats' own close, and that
  /// thread calls detach after letting go of the connection's lock): such calls find no
  /// driver and do nothing, whether or not the driver still exists.
  void shutdown();

  struct Core;   // defined in the .cpp
  struct Watch;  // defined in the .cpp

 private:
  // Shared with the callbacks that are running (they hold it while they run).
  std::shared_ptr<Core> core_;
};

}  // namespace ferry::sidechannel
