"""ferry: move buffers between workers, one-sided, by the best method both hosts share.

The names and shapes of dynamo.nixl_connect (docs/python-nixl.md says what differs):

    import ferry

    connector = ferry.Connector()
    descriptor = ferry.Descriptor(local_tensor)
    with connector.create_writable(descriptor) as write_op:
        op_metadata = write_op.metadata()
        await send_to_peer(op_metadata.to_json())
        await write_op.wait_for_completion()

and on the peer:

    metadata = ferry.RdmaMetadata.from_json(received)
    with connector.begin_write(ferry.Descriptor(data), metadata) as op:
        await op.wait_for_completion()

Threads: every call may come from any thread; ends of operations reach asyncio through an fd
the asyncio loop watches. Calls that wait (creating passive operations, cancel, close, a
blocking wait) release the GIL. See docs/python.md.
"""

import enum
import json as _json
import operator as _operator
import time as _time

from . import _ferry
from ._aio import hub as _hub
from ._aio import running_loop as _running_loop
from ._aio import wait_fd as _wait_fd
from ._aio import wait_notifier as _wait_notifier
from ._aio import wait_op as _wait_op
from ._descriptor import Descriptor, Device, DeviceKind, as_descriptors as _as_descriptors
from ._errors import (
    AccessDeniedError,
    CancelledError,
    Error,
    ErrorCode,
    InternalError,
    InvalidArgumentError,
    InvalidMetadataError,
    InvalidStateError,
    KindMismatchError,
    NoCommonMethodError,
    PeerLostError,
    ProtocolError,
    SideChannelError,
    SizeMismatchError,
    TimeoutError,
    UnsupportedError,
    WrongThreadError,
    error_class,
)

__all__ = [
    "AccessDeniedError",
    "Attachment",
    "CancelledError",
    "Connector",
    "Descriptor",
    "Device",
    "DeviceKind",
    "Error",
    "ErrorCode",
    "InternalError",
    "InvalidArgumentError",
    "InvalidMetadataError",
    "InvalidStateError",
    "KindMismatchError",
    "Message",
    "MethodInfo",
    "NoCommonMethodError",
    "Operation",
    "OperationKind",
    "OperationStatus",
    "PeerIdentity",
    "PeerLostError",
    "ProtocolError",
    "RdmaMetadata",
    "ReadOperation",
    "ReadableOperation",
    "Region",
    "RegionEvent",
    "RegionMetadata",
    "SideChannelError",
    "SizeMismatchError",
    "Subject",
    "Subscription",
    "TimeoutError",
    "UnsupportedError",
    "WritableOperation",
    "WriteOperation",
    "WrongThreadError",
    "error_class",
    "probe_methods",
]

__version__ = "0.1.0"

RdmaMetadata = _ferry.RdmaMetadata
RegionMetadata = _ferry.RegionMetadata
PeerIdentity = _ferry.PeerIdentity
MethodInfo = _ferry.MethodInfo


class OperationKind(enum.IntEnum):
    """What the active side does to a passive operation's memory (nixl_connect's values)."""

    UNSPECIFIED = 0
    READ = 1
    WRITE = 2


class OperationStatus(enum.IntEnum):
    """The life of an operation. COMPLETE, CANCELLED and ERRORED are final."""

    UNINITIALIZED = 0
    INITIALIZED = 1
    IN_PROGRESS = 2
    COMPLETE = 3
    CANCELLED = 4
    ERRORED = 5


class Subject(str):
    """A NATS subject at which a passive operation or region serves its metadata. Pass it where
    metadata goes (begin_read, begin_write, attach) to pair by subject."""

    __slots__ = ()


# nixl_connect's RdmaMetadata is a pydantic model: its JSON methods work here too.
def _model_validate_json(json_data):
    if isinstance(json_data, (bytes, bytearray)):
        json_data = bytes(json_data).decode()
    return _ferry.RdmaMetadata.from_json(json_data)


RdmaMetadata.model_dump_json = RdmaMetadata.to_json
RdmaMetadata.model_validate_json = staticmethod(_model_validate_json)
RdmaMetadata.__repr__ = lambda md: "RdmaMetadata(%s)" % md.to_json()
RegionMetadata.__repr__ = lambda md: "RegionMetadata(%s)" % md.to_json()


def probe_methods(transports=None):
    """The transfer methods of this build, best first, and whether a connector would offer each
    here (and why not)."""
    return _ferry.probe_methods(list(transports or []))


def _seconds(value, what):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError("%s is a number of seconds, not %r" % (what, value))
    return float(value)


def _remote(value, cls):
    """RdmaMetadata / RegionMetadata from what a caller passes, or a Subject."""
    if isinstance(value, (cls, Subject)):
        return value
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode()
    if isinstance(value, str):
        if value.lstrip().startswith("{"):
            return cls.from_json(value)
        raise InvalidArgumentError(
            "a plain string is neither metadata nor a subject: pass %s JSON, or "
            "ferry.Subject(%r) to pair by subject" % (cls.__name__, value)
        )
    if isinstance(value, dict):
        return cls.from_json(_json.dumps(value))
    to_json = getattr(value, "model_dump_json", None) or getattr(value, "to_json", None)
    if to_json is not None:
        return cls.from_json(to_json())
    raise InvalidArgumentError("expected %s or ferry.Subject, got %s" % (cls.__name__, type(value).__name__))


def _is_remote(value):
    return isinstance(value, (RdmaMetadata, Subject, dict)) or (
        isinstance(value, str) and value.lstrip().startswith("{")
    )


class _Scoped:
    """`with` and `async with` for a handle: leaving the block ends it (`_end`)."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._end()
        return False

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self._end()
        return False


class Operation(_Scoped):
    """What every operation offers. Made by a Connector; not constructed directly.

    An operation is a context manager (`with` and `async with`): leaving the block cancels it
    unless it completed. Dropping the last reference cancels it as well, and waits until no
    transport touches its memory; only then are its buffers let go.
    """

    __slots__ = ("_op", "_descriptors", "_fut", "_fut_loop", "__weakref__")

    def __init__(self, *args, **kwargs):
        raise TypeError("operations are made by a Connector (create_readable, begin_read, ...)")

    @classmethod
    def _wrap(cls, op, descriptors):
        self = object.__new__(cls)
        self._op = op
        self._descriptors = descriptors
        self._fut = self._fut_loop = None  # the asyncio wait shared by this operation's waiters
        return self

    @property
    def status(self):
        """The current OperationStatus; never blocks."""
        return OperationStatus(self._op.status)

    @property
    def kind(self):
        return OperationKind(self._op.kind)

    @property
    def operation_kind(self):
        return self.kind

    @property
    def id(self):
        """The operation's id at this connector (16 hex digits)."""
        return self._op.id

    @property
    def method(self):
        """The method that moves (or moved) the bytes ("tcp", "cma", ...); "" until chosen."""
        return self._op.method

    @property
    def peer(self):
        """The peer (a PeerIdentity) once known; None before."""
        return self._op.peer

    @property
    def error(self):
        """Why it was cancelled or errored (a ferry.Error, not raised); None otherwise."""
        return self._op.error

    @property
    def descriptors(self):
        """The local descriptors, as given."""
        return list(self._descriptors)

    @property
    def is_complete(self):
        return self._op.status == OperationStatus.COMPLETE

    def cancel(self):
        """Stops the operation. When it returns, no transport touches its memory again; a
        passive operation's token is dead (a late peer gets AccessDeniedError) and the peer of
        a started transfer is told. No effect on an ended operation. Releases the GIL."""
        self._op.cancel()

    def wait(self, timeout=None):
        """Blocks (GIL released) until the operation ends or `timeout` seconds pass, and returns
        its OperationStatus then. Never raises the operation's error (see .error)."""
        return OperationStatus(self._op.wait(_seconds(timeout, "timeout")))

    def wait_for_completion(self, timeout=None):
        """Waits until the operation ends.

        In a coroutine (a running asyncio loop in this thread) it returns an awaitable:
        `await op.wait_for_completion()`. Outside one it blocks, releasing the GIL.
        Either way the result is True once complete, False when `timeout` seconds passed first
        (the operation goes on: its own deadline is the `timeout` it was created with), and the
        operation's ferry.Error is raised when it was cancelled or errored.

        Cancelling the task that awaits leaves the operation running: the handle (or its `with`
        block) decides its life.
        """
        if timeout is not None:
            timeout = _seconds(timeout, "timeout")
        loop = _running_loop()
        if loop is not None:
            return _wait_op(loop, self, timeout)
        status = self._op.wait(timeout)
        if status == OperationStatus.COMPLETE:
            return True
        if status >= OperationStatus.CANCELLED:
            raise self._op.error
        return False

    def release(self):
        """Cancels the operation unless it ended, waits until no transport touches its memory,
        and lets go of its buffers; the handle then reports UNINITIALIZED (its id and kind
        stay). Idempotent."""
        self._op.release()
        self._descriptors = ()

    def _end(self):
        if self._op.status != OperationStatus.COMPLETE:
            self._op.cancel()

    def __await__(self):
        # nixl_connect's create_* and begin_* are coroutines: `await connector.begin_read(...)`
        # gives the operation here too.
        if False:  # pragma: no cover (makes this a generator)
            yield
        return self

    def __repr__(self):
        return "<%s %s %s>" % (type(self).__name__, self._op.id, self.status.name.lower())


class _Passive(Operation):
    __slots__ = ()

    def metadata(self, hex_encode=False):
        """What the peer needs (RdmaMetadata; pass it as .to_json()). hex_encode is accepted for
        nixl_connect's signature and changes nothing: ferry's metadata is JSON text."""
        return self._op.metadata()


class ReadableOperation(_Passive):
    """Exposes local memory for one peer to read; complete once the peer has read all of it."""

    __slots__ = ()


class WritableOperation(_Passive):
    """Exposes local memory for one peer to write; complete once all its bytes are in."""

    __slots__ = ()


class ReadOperation(Operation):
    """Reads a peer's readable operation (or region ranges) into local memory."""

    __slots__ = ()


class WriteOperation(Operation):
    """Writes local memory into a peer's writable operation (or region ranges)."""

    __slots__ = ()


class RegionEvent:
    """What a region's owner learns, in order: type is "attached", "transfer", "detached" or
    "ended"; a transfer has kind, ranges, blocks, tag, status and error."""

    __slots__ = (
        "type", "attachment", "peer", "peer_id", "method", "kind", "ranges", "blocks", "tag",
        "status", "error",
    )

    def __init__(self, d):
        self.type = d["type"]
        self.attachment = d["attachment"]
        self.peer = d["peer"]
        self.peer_id = d["peer_id"]
        self.method = d["method"]
        self.kind = OperationKind(d["kind"])
        self.ranges = d["ranges"]
        self.blocks = d["blocks"]
        self.tag = d["tag"]
        self.status = OperationStatus(d["status"])
        self.error = d["error"]

    def __repr__(self):
        if self.type == "transfer":
            return "RegionEvent(transfer %s %s tag=%r %s)" % (
                self.kind.name.lower(), self.blocks or self.ranges, self.tag,
                self.status.name.lower(),
            )
        return "RegionEvent(%s %s)" % (self.type, self.peer)


class Region(_Scoped):
    """Memory exposed once for any number of peers, until closed (docs/regions.md). Made by
    Connector.create_region. A context manager (`with`, `async with`) that closes it."""

    __slots__ = ("_r", "_descriptors", "_ended", "__weakref__")

    def __init__(self, *args, **kwargs):
        raise TypeError("regions are made by Connector.create_region")

    @classmethod
    def _wrap(cls, r, descriptors):
        self = object.__new__(cls)
        self._r = r
        self._descriptors = descriptors
        self._ended = False  # the "ended" event was taken: no event comes after it
        return self

    def metadata(self):
        """What peers need to attach (RegionMetadata; pass it as .to_json())."""
        return self._r.metadata()

    @property
    def id(self):
        return self._r.id

    @property
    def is_open(self):
        return self._r.is_open

    @property
    def error(self):
        """Why it ended (CancelledError for close(), TimeoutError for its deadline)."""
        return self._r.error

    @property
    def events_dropped(self):
        return self._r.events_dropped

    def peers(self):
        """The peers attached now: dicts of attachment, peer, peer_id, method, access."""
        return self._r.peers()

    def revoke(self, who):
        """Ends one peer's access (an attachment id or a peer's connector id); returns how many
        attachments it ended. When it returns, that peer touches the memory no more."""
        return self._r.revoke(who)

    def close(self):
        """Ends the region: when it returns, no peer touches the memory again. Idempotent."""
        self._r.close()

    def next_event(self, timeout=0):
        """The next RegionEvent, waiting up to `timeout` seconds (GIL released); None if none."""
        d = self._r.next_event(_seconds(timeout, "timeout"))
        if d is None:
            return None
        event = RegionEvent(d)
        if event.type == "ended":
            self._ended = True
        return event

    def events(self):
        """The region's events as an async iterator, ending after the "ended" event:
        `async for event in region.events(): ...`"""
        return self._aevents()

    async def _aevents(self):
        loop = _running_loop()
        notifier = self._r.notifier
        while not self._ended:
            notifier.clear()  # before looking: an event queued after this wakes the wait below
            event = self.next_event(0)
            if event is None:
                await _wait_notifier(loop, notifier)
                continue
            yield event

    def _end(self):
        self.close()

    def __await__(self):
        if False:  # pragma: no cover
            yield
        return self


def _ranges(remote):
    out = []
    for r in remote:
        try:
            offset, length = r
            offset, length = _operator.index(offset), _operator.index(length)
        except (TypeError, ValueError):
            offset = length = -1
        if offset < 0 or length < 0:
            raise InvalidArgumentError(
                "a region range is (offset, length), two ints >= 0, not %r" % (r,))
        out.append((offset, length))
    return out


class Attachment(_Scoped):
    """One peer's attachment to a region: attached once, then any number of transfers, each an
    operation. Transfers may start before it is attached: they wait for it. A context manager
    that detaches."""

    __slots__ = ("_a", "__weakref__")

    def __init__(self, *args, **kwargs):
        raise TypeError("attachments are made by Connector.attach")

    @classmethod
    def _wrap(cls, a):
        self = object.__new__(cls)
        self._a = a
        return self

    def metadata(self):
        return self._a.metadata()

    @property
    def state(self):
        """"attaching", "attached" or "detached"."""
        return self._a.state

    @property
    def method(self):
        return self._a.method

    @property
    def error(self):
        return self._a.error

    def wait_attached(self):
        """Blocks (GIL released) until attached; raises why it could not attach."""
        self._a.wait_attached()

    def read(self, remote, local, *, tag="", timeout=None):
        """Reads `remote` ranges [(offset, length), ...] of the region into `local`."""
        if not isinstance(remote, list) and _looks_local(remote):
            remote, local = local, remote
        descs = _as_descriptors(local)
        return ReadOperation._wrap(
            self._a.read(_ranges(remote), [d._d for d in descs], descs, _seconds(timeout, "timeout"), tag),
            descs,
        )

    def write(self, local, remote, *, tag="", timeout=None):
        """Writes `local` into `remote` ranges [(offset, length), ...] of the region."""
        if isinstance(local, list) and local and isinstance(local[0], tuple) and not isinstance(remote, list):
            local, remote = remote, local
        descs = _as_descriptors(local)
        return WriteOperation._wrap(
            self._a.write([d._d for d in descs], descs, _ranges(remote), _seconds(timeout, "timeout"), tag),
            descs,
        )

    def read_blocks(self, blocks, local, *, tag="", timeout=None):
        """Reads blocks (indices) of the region into `local`."""
        descs = _as_descriptors(local)
        return ReadOperation._wrap(
            self._a.read_blocks(list(blocks), [d._d for d in descs], descs, _seconds(timeout, "timeout"), tag),
            descs,
        )

    def write_blocks(self, local, blocks, *, tag="", timeout=None):
        """Writes `local` into blocks (indices) of the region."""
        descs = _as_descriptors(local)
        return WriteOperation._wrap(
            self._a.write_blocks([d._d for d in descs], descs, list(blocks), _seconds(timeout, "timeout"), tag),
            descs,
        )

    def detach(self):
        """Ends the attachment; transfers under way are cancelled. Idempotent."""
        self._a.detach()

    def _end(self):
        self.detach()


def _looks_local(value):
    return not isinstance(value, (list, tuple)) or (
        isinstance(value, tuple) and len(value) == 3
    )


def _data(value, what="data"):
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise InvalidArgumentError("%s is bytes or str, not %s" % (what, type(value).__name__))


class Message:
    """A NATS message of the worker's own (Connector.subscribe, Connector.request): subject,
    reply (where an answer goes; "" for none) and data (bytes). respond(data) answers it."""

    __slots__ = ("subject", "reply", "data", "_connector")

    def __init__(self, subject, reply, data, connector=None):
        self.subject = subject
        self.reply = reply
        self.data = data
        self._connector = connector

    def json(self):
        """data parsed as JSON."""
        return _json.loads(self.data)

    def respond(self, data):
        """Answers this message at its reply subject (Connector.respond)."""
        if self._connector is None:
            raise InvalidStateError("this message came with no connector to answer through")
        self._connector.respond(self, data)

    def __repr__(self):
        return "Message(subject=%r, reply=%r, data=%r)" % (self.subject, self.reply, self.data[:64])


class Subscription(_Scoped):
    """Messages at a subject (Connector.subscribe): an async iterator (`async for msg in sub`),
    or next_message(timeout) to take one without asyncio. Messages wait in a queue of at most
    `max_pending` (the oldest dropped beyond, counted by .dropped). A context manager that
    unsubscribes; when unsubscribe() returns, no message is queued any more."""

    __slots__ = ("_s", "_connector", "_ready", "__weakref__")

    def __init__(self, *args, **kwargs):
        raise TypeError("subscriptions are made by Connector.subscribe")

    @classmethod
    def _wrap(cls, s, connector):
        self = object.__new__(cls)
        self._s = s
        self._connector = connector
        self._ready = []
        return self

    @property
    def subject(self):
        return self._s.subject

    @property
    def queue(self):
        return self._s.queue

    @property
    def active(self):
        return self._s.active

    @property
    def error(self):
        """Why it ended, when not by unsubscribe() (CancelledError at the connector's close)."""
        return self._s.error

    @property
    def dropped(self):
        return self._s.dropped

    def _take(self):
        if not self._ready:
            self._ready = [Message(s, r, d, self._connector) for s, r, d in self._s.take(1024)]
            self._ready.reverse()
        return self._ready.pop() if self._ready else None

    def next_message(self, timeout=None):
        """The next message, waiting up to `timeout` seconds (None: no limit) without the
        GIL held by a poll; None when none came, or the subscription ended."""
        import select

        deadline = None if timeout is None else _time.monotonic() + _seconds(timeout, "timeout")
        poller = select.poll()  # not select(): fds above 1023 are fine
        poller.register(self._s.notifier_fd, select.POLLIN)
        while True:
            self._s.clear()
            msg = self._take()
            if msg is not None or not self._s.active:
                return msg
            left = None if deadline is None else max(0.0, deadline - _time.monotonic())
            if left == 0.0:
                return None
            poller.poll(None if left is None else left * 1000.0)

    def __aiter__(self):
        return self

    async def __anext__(self):
        loop = _running_loop()
        while True:
            self._s.clear()  # before looking: a message queued after this wakes the wait
            msg = self._take()
            if msg is not None:
                return msg
            if not self._s.active:
                raise StopAsyncIteration
            await _wait_fd(loop, self._s.notifier_fd)

    def unsubscribe(self):
        """Ends the subscription (GIL released while it waits for ferry's loop). Idempotent."""
        self._s.unsubscribe()

    def _end(self):
        self.unsubscribe()


async def _request_async(loop, connector, subject, data, timeout):
    hub = _hub(loop)
    fut, key = hub.slot(loop)
    try:
        _ferry.request_async(connector._c, subject, data, timeout, hub.queue, key)
        s, r, d = await fut
    finally:
        if fut.cancelled() or not fut.done():
            fut.cancel()
            hub.forget(key)
    return Message(s, r, d, connector)


class Connector(_Scoped):
    """One per worker: owns ferry's event loop thread, the transports and the peer connections,
    and creates every operation.

    Arguments (all optional):
        name: shown in peers' errors and metadata; default "ferry-<pid>".
        nats: None: the servers in FERRY_NATS_URL, if any; False: no side channel (explicit
            metadata still works, subjects do not); a URL, a comma-separated list or a list.
        default_timeout: seconds, deadline of operations that set none (None: no deadline).
        subject_timeout: seconds an operation paired by subject waits to be paired (30).
        peer_timeout: seconds a silent peer connection may stay unanswered (2).
        transports: the methods it may use ("tcp", "cma", "verbs", "cuda_ipc"); default all.
        endpoint_allow: CIDRs a peer's endpoint must lie in before it connects there.
        use_environment: whether FERRY_* variables fill what is left unset.

    close() (or `with`, or the last reference going) cancels every operation that has not
    ended and stops ferry's loop; handles may outlive it.
    """

    __slots__ = ("_c", "__weakref__")

    def __init__(self, name=None, *, nats=None, default_timeout=None, subject_timeout=30.0,
                 peer_timeout=None, transports=None, endpoint_allow=None, use_environment=True,
                 worker_id=None):
        if name is None:
            name = worker_id or ""
        if nats is False:
            servers, use_nats = [], False
        elif nats is None or nats is True:
            servers, use_nats = [], True
        elif isinstance(nats, str):
            servers, use_nats = [nats], True
        else:
            servers, use_nats = list(nats), True
        self._c = _ferry.Connector(
            str(name), servers, use_nats, _seconds(default_timeout, "default_timeout"),
            _seconds(subject_timeout, "subject_timeout") or 0.0,
            _seconds(peer_timeout, "peer_timeout"), transports, endpoint_allow,
            bool(use_environment),
        )

    async def initialize(self):
        """Nothing to do (the connector is ready when constructed); here so that code written
        for nixl_connect's `await connector.initialize()` runs unchanged."""
        return self

    # -- passive operations ------------------------------------------------------------------

    def create_readable(self, local, *, subject=None, timeout=None):
        """Exposes `local` (a Descriptor, a descriptor-like object, or a list) for one peer to
        read. Returns a ReadableOperation; its metadata() goes to the peer, or the peer asks for
        it at `subject`. Also awaitable (nixl_connect: `await connector.create_readable(d)`)."""
        descs = _as_descriptors(local)
        return ReadableOperation._wrap(
            self._c.create_readable([d._d for d in descs], descs, _seconds(timeout, "timeout"), subject or ""),
            descs,
        )

    def create_writable(self, local, *, subject=None, timeout=None):
        """Exposes `local` for one peer to write (not read-only memory). Returns a
        WritableOperation."""
        descs = _as_descriptors(local)
        return WritableOperation._wrap(
            self._c.create_writable([d._d for d in descs], descs, _seconds(timeout, "timeout"), subject or ""),
            descs,
        )

    # -- active operations -------------------------------------------------------------------

    def begin_read(self, remote, local, *, timeout=None):
        """Reads the peer's readable operation into `local`. `remote` is its RdmaMetadata (or
        its JSON), or a ferry.Subject to ask for it there. The two may come in either order.
        Returns a ReadOperation at once (in progress)."""
        if type(remote) is not RdmaMetadata:  # the common case first: metadata in hand
            if not _is_remote(remote) and _is_remote(local):
                remote, local = local, remote
            remote = _remote(remote, RdmaMetadata)
        descs = [local] if type(local) is Descriptor else _as_descriptors(local)
        raw = [d._d for d in descs]
        t = None if timeout is None else _seconds(timeout, "timeout")
        if isinstance(remote, Subject):
            op = self._c.begin_read_subject(str(remote), raw, descs, t)
        else:
            op = self._c.begin_read(remote, raw, descs, t)
        return ReadOperation._wrap(op, descs)

    def begin_write(self, local, remote, *, timeout=None):
        """Writes `local` into the peer's writable operation (`remote`: RdmaMetadata, its JSON,
        or a ferry.Subject; either order). Returns a WriteOperation at once."""
        if type(remote) is not RdmaMetadata:
            if not _is_remote(remote) and _is_remote(local):
                remote, local = local, remote
            remote = _remote(remote, RdmaMetadata)
        descs = [local] if type(local) is Descriptor else _as_descriptors(local)
        raw = [d._d for d in descs]
        t = None if timeout is None else _seconds(timeout, "timeout")
        if isinstance(remote, Subject):
            op = self._c.begin_write_subject(raw, descs, str(remote), t)
        else:
            op = self._c.begin_write(raw, descs, remote, t)
        return WriteOperation._wrap(op, descs)

    # -- regions -----------------------------------------------------------------------------

    def create_region(self, local, *, access="read", block_size=0, subject=None, timeout=None,
                      max_queued_events=65536):
        """Exposes `local` as a region for any number of peers until closed. access: "read",
        "write" or "read_write"; block_size: bytes per block (peers may then name blocks);
        subject: serve the metadata there; timeout: seconds until it ends by itself."""
        descs = _as_descriptors(local)
        return Region._wrap(
            self._c.create_region([d._d for d in descs], descs, str(access), int(block_size),
                                  subject or "", _seconds(timeout, "timeout"),
                                  int(max_queued_events)),
            descs,
        )

    def attach(self, remote, *, access=None, timeout=None):
        """Attaches to a region (`remote`: RegionMetadata, its JSON, or a ferry.Subject).
        Returns an Attachment at once; transfers may start right away."""
        remote = _remote(remote, RegionMetadata)
        t = _seconds(timeout, "timeout")
        if isinstance(remote, Subject):
            return Attachment._wrap(self._c.attach_subject(str(remote), access, t))
        return Attachment._wrap(self._c.attach(remote, access, t))

    # -- messaging on the connector's NATS connection (docs/sidechannel.md, "Messaging") -----

    def subscribe(self, subject, *, queue=None, max_pending=65536):
        """Subscribes to `subject` (wildcards * and > allowed), in queue group `queue` if given.
        Returns a Subscription once the server has it (GIL released meanwhile). Subjects in
        ferry's own namespace are refused (InvalidArgumentError)."""
        return Subscription._wrap(
            _ferry.subscribe(self._c, str(subject), queue or "", int(max_pending)), self)

    def publish(self, subject, data, *, reply=None):
        """Publishes `data` (bytes or str) to `subject`, with `reply` as its reply subject."""
        _ferry.publish(self._c, str(subject), _data(data), reply or "")

    def respond(self, request, data):
        """Answers `request` (a Message a subscription got) with `data` at its reply subject."""
        _ferry.respond(self._c, request.subject, request.reply, _data(data))

    def request(self, subject, data, *, timeout=1.0):
        """Publishes a request and returns the first reply (a Message). In a coroutine it returns
        an awaitable (`reply = await connector.request(...)`); outside one it blocks, GIL
        released. Raises TimeoutError (naming the subject) when no reply came within `timeout`
        seconds, PeerLostError when nobody subscribes to the subject (no responders)."""
        data = _data(data)
        timeout = _seconds(timeout, "timeout")
        loop = _running_loop()
        if loop is not None:
            return _request_async(loop, self, str(subject), data, timeout)
        s, r, d = _ferry.request_blocking(self._c, str(subject), data, timeout)
        return Message(s, r, d, self)

    # -- the connector -----------------------------------------------------------------------

    @property
    def has_side_channel(self):
        return self._c.has_side_channel

    @property
    def side_channel_state(self):
        """(state, detail) of the NATS side channel: state is "none" (no servers configured),
        "connecting" (keeps trying in the background, within NatsOptions' connect deadline),
        "connected", "reconnecting" or "closed" (gave up; detail says why)."""
        return self._c.side_channel_state

    @property
    def identity(self):
        """This connector's PeerIdentity (name, id, host, pid)."""
        return self._c.identity

    @property
    def name(self):
        return self._c.identity.name

    @property
    def closed(self):
        return self._c.closed

    def endpoints(self):
        return self._c.endpoints()

    def methods(self):
        """The methods of this build (MethodInfo), best first, and whether this one offers each."""
        return self._c.methods()

    def stats(self):
        """What its operations came to: a dict (the C++ ConnectorStats' JSON)."""
        return _json.loads(self._c.stats_json())

    def stats_text(self):
        return self._c.stats_text()

    def close(self):
        """Cancels every operation that has not ended, closes all connections and stops ferry's
        loop (GIL released). Idempotent; later calls raise InvalidStateError."""
        self._c.close()

    def _end(self):
        self.close()

    def __repr__(self):
        if self._c.closed:
            return "<ferry.Connector closed>"
        ident = self._c.identity
        return "<ferry.Connector %s id=%s>" % (ident.name, ident.id)
