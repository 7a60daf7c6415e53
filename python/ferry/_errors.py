"""ferry's errors as Python exceptions: one base, ferry.Error, and a subclass per ErrorCode."""

import builtins
import enum

from . import _ferry


class ErrorCode(enum.IntEnum):
    """The one set of error codes ferry reports (the C++ ferry::ErrorCode, same values)."""

    INVALID_ARGUMENT = 1
    INVALID_METADATA = 2
    KIND_MISMATCH = 3
    SIZE_MISMATCH = 4
    NO_COMMON_METHOD = 5
    ACCESS_DENIED = 6
    TIMEOUT = 7
    CANCELLED = 8
    PEER_LOST = 9
    PROTOCOL_ERROR = 10
    WRONG_THREAD = 11
    INVALID_STATE = 12
    UNSUPPORTED = 13
    SIDE_CHANNEL = 14
    INTERNAL = 15


class Error(Exception):
    """What ferry raises, and what a failed operation carries (op.error).

    Attributes:
        code: the ErrorCode.
        message: the message without the code (as C++'s Error::message()).
        field: for INVALID_METADATA, the JSON path of the offending field; else "".
        retryable: whether retrying the same request may help (a timeout, a lost peer that may
            come back), as opposed to a request that is wrong and will stay wrong.

    str(error) reads "<Code>: <message>", as C++'s what() does.
    """

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message="", *, code=None, field="", retryable=None, what=None):
        if code is not None:
            self.code = ErrorCode(code)
        self.message = message
        self.field = field
        self.retryable = (
            _ferry.is_retryable(int(self.code)) if retryable is None else bool(retryable)
        )
        if what is None:  # as C++'s what(): "<Code>: [<field>: ]<message>"
            what = "%s: %s%s" % (_ferry.error_code_name(int(self.code)),
                                 field + ": " if field else "", message)
        self._what = what
        super().__init__(what)

    def __str__(self):
        return self._what

    def __reduce__(self):
        return (
            _rebuild,
            (int(self.code), self.message, self.field, self.retryable, self._what),
        )


def _rebuild(code, message, field, retryable, what):
    return _make(code, message, field, retryable, what)


class InvalidArgumentError(Error, ValueError):
    """Bad input at the call: an empty buffer, a wrong type, a bad device string."""

    code = ErrorCode.INVALID_ARGUMENT


class InvalidMetadataError(Error, ValueError):
    """Metadata failed validation; `field` names the offending field."""

    code = ErrorCode.INVALID_METADATA


class KindMismatchError(Error):
    """A readable pairs with a read, a writable with a write; anything else is this."""

    code = ErrorCode.KIND_MISMATCH


class SizeMismatchError(Error):
    """The two sides' descriptor lists hold different byte totals."""

    code = ErrorCode.SIZE_MISMATCH


class NoCommonMethodError(Error):
    """The peer offers no transfer method this connector has."""

    code = ErrorCode.NO_COMMON_METHOD


class AccessDeniedError(Error, PermissionError):
    """The peer refused: unknown, dead or wrong token, kind or range."""

    code = ErrorCode.ACCESS_DENIED


class TimeoutError(Error, builtins.TimeoutError):  # noqa: A001 (ferry.TimeoutError on purpose)
    """A deadline passed. Also a builtins.TimeoutError."""

    code = ErrorCode.TIMEOUT


class CancelledError(Error):
    """Cancelled locally, by the peer, or by the connector's close.

    Not asyncio.CancelledError: a cancelled ferry operation is an outcome, not a cancellation
    of the task that awaits it.
    """

    code = ErrorCode.CANCELLED


class PeerLostError(Error, ConnectionError):
    """The peer could not be reached, or its connection dropped."""

    code = ErrorCode.PEER_LOST


class ProtocolError(Error):
    """A malformed or unexpected frame or message."""

    code = ErrorCode.PROTOCOL_ERROR


class WrongThreadError(Error):
    """A blocking call on the connector's loop thread (it would deadlock)."""

    code = ErrorCode.WRONG_THREAD


class InvalidStateError(Error):
    """The call does not fit the object's state (a closed connector, an empty handle)."""

    code = ErrorCode.INVALID_STATE


class UnsupportedError(Error):
    """This build or host lacks the feature (CUDA memory, say)."""

    code = ErrorCode.UNSUPPORTED


class SideChannelError(Error):
    """The NATS side channel failed: connect, auth, payload limit."""

    code = ErrorCode.SIDE_CHANNEL


class InternalError(Error):
    """A system failure ferry did not expect."""

    code = ErrorCode.INTERNAL


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        InvalidMetadataError,
        KindMismatchError,
        SizeMismatchError,
        NoCommonMethodError,
        AccessDeniedError,
        TimeoutError,
        CancelledError,
        PeerLostError,
        ProtocolError,
        WrongThreadError,
        InvalidStateError,
        UnsupportedError,
        SideChannelError,
        InternalError,
    )
}


def _make(code, message, field, retryable, what):
    cls = _BY_CODE.get(code, Error)
    return cls(message, code=code, field=field, retryable=retryable, what=what)


def error_class(code):
    """The ferry.Error subclass for an ErrorCode."""
    return _BY_CODE[ErrorCode(code)]


_ferry.set_error_factory(_make)
