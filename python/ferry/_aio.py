"""asyncio without polling: ends of operations come from ferry's loop thread through a queue
and an eventfd that the asyncio loop watches (one per asyncio loop), never through the GIL on
ferry's loop thread."""

import asyncio
import weakref

from . import _ferry

COMPLETE = 3  # OperationStatus.COMPLETE

_hubs = weakref.WeakKeyDictionary()


class _Hub:
    """The futures of one asyncio loop waiting for operations, by key."""

    __slots__ = ("_queue", "_waiting", "_next", "__weakref__")

    def __init__(self, loop):
        self._queue = _ferry.Completions()
        self._waiting = {}
        self._next = 0
        loop.add_reader(self._queue.fd, self._drain)

    def slot(self, loop):
        """A future and the key under which the loop thread will resolve it (through
        self.queue): an operation's end, or a request's (subject, reply, data). A caller that
        stops waiting calls forget(key)."""
        fut = loop.create_future()
        key = self._next
        self._next += 1
        self._waiting[key] = fut
        return fut, key

    def forget(self, key):
        self._waiting.pop(key, None)

    @property
    def queue(self):
        return self._queue

    def _drain(self):
        for key, status, error, message in self._queue.drain():
            fut = self._waiting.pop(key, None)
            if fut is None or fut.done():
                continue  # its awaiter was cancelled: the operation goes on without it
            if message is not None:
                fut.set_result(message)
            elif status == COMPLETE:
                fut.set_result(True)
            else:
                fut.set_exception(error)


_last = (None, None)  # (loop, hub) of the last call: one loop per thread is the common case


def hub(loop):
    global _last
    if _last[0] is loop:
        return _last[1]
    h = _hubs.get(loop)
    if h is None:
        h = _hubs[loop] = _Hub(loop)
    _last = (loop, h)
    return h


def running_loop():
    """The running asyncio loop of this thread, or None."""
    return asyncio._get_running_loop()


async def wait_op(loop, wrapper, timeout):
    """Waits for the end of `wrapper`'s operation on `loop` (see Operation.wait_for_completion).
    A coroutine, as nixl_connect's is, so that asyncio.create_task() takes it.

    One registration per operation and loop, shared by every waiter: waits that time out leave
    nothing behind but that one entry, until the operation ends; a wait whose task is cancelled
    drops it (the C++ callback it registered stays until the operation ends, and finds no one).
    """
    op = wrapper._op
    status = op.status
    if status >= COMPLETE:  # already ended: no round trip through the queue
        if status == COMPLETE:
            return True
        raise op.error
    h = hub(loop)
    fut, key = wrapper._fut, wrapper._fut_loop
    if fut is None or key is None or key[0] is not loop or fut.cancelled():
        fut, k = h.slot(loop)
        op.watch(h.queue, k)
        key = (loop, k)
        wrapper._fut, wrapper._fut_loop = fut, key
    if timeout is None:
        # Awaited directly (the fast path): a cancelled task cancels `fut` too; its entry goes,
        # and the next wait registers again.
        try:
            return await fut
        finally:
            if fut.cancelled():
                h.forget(key[1])
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout)
    except asyncio.TimeoutError:
        if fut.done():  # the operation's own error (ferry.TimeoutError is a TimeoutError too)
            return fut.result()
        return False


async def wait_notifier(loop, notifier):
    """Waits until `notifier` (a _ferry.Notifier) is signalled."""
    await wait_fd(loop, notifier.fd)


_fd_waiters = {}  # (loop, fd) -> futures waiting for that fd: one reader each, shared


async def wait_fd(loop, fd):
    """Waits until `fd` (an eventfd the loop thread signals) is readable. Any number of tasks may
    wait for one fd: all wake."""
    key = (loop, fd)
    fut = loop.create_future()
    waiters = _fd_waiters.get(key)
    if waiters is None:
        waiters = _fd_waiters[key] = []

        def ready():
            woken = _fd_waiters.pop(key, [])
            loop.remove_reader(fd)
            for w in woken:
                if not w.done():
                    w.set_result(None)

        loop.add_reader(fd, ready)
    waiters.append(fut)
    try:
        await fut
    finally:
        if fut.cancelled() or not fut.done():
            left = _fd_waiters.get(key)
            if left is not None and fut in left:
                left.remove(fut)
                if not left:
                    del _fd_waiters[key]
                    loop.remove_reader(fd)
