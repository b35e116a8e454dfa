"""psflow's typed errors, named and coded as TensorFlow's ``tf.errors``.

Every error carries a canonical status code (the gRPC one of the same name) and,
where a remote task is involved, the task that failed (``"ps:1"``).  The
conversion to and from a gRPC status happens only at the edges: servers call
:func:`to_grpc_code`, clients call :func:`from_grpc`.

Errors caused by a caller's bad input also derive from the matching Python
built-in (``ValueError``, ``KeyError``, ``TimeoutError``...), so code written
against plain Python keeps working.

Example:
    >>> import psflow as pf
    >>> try:
    ...     pf.constant([1, 2]) + pf.constant([1, 2, 3])
    ... except pf.errors.InvalidArgumentError as e:
    ...     print(e.code.name)
    INVALID_ARGUMENT
"""

from __future__ import annotations

import enum
import typing


class Code(enum.IntEnum):
    """Canonical status codes; the values are gRPC's."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class OpError(Exception):
    """Base of every psflow error: a message, a status code and the failing task.

    Args:
        message: what went wrong, quoting the offending value.
        task: the task that failed (``"ps:0"``, ``"worker:1"``), if remote.
    """

    code: Code = Code.UNKNOWN

    def __init__(self, message: str, task: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.task = task

    def __str__(self) -> str:
        if self.task:
            return f"{self.message} (task {self.task})"
        return self.message

    def __reduce__(self):
        return (type(self), (self.message, self.task))


PsflowError = OpError


class CancelledError(OpError):
    """An operation was cancelled, typically because an earlier one failed."""

    code = Code.CANCELLED


class UnknownError(OpError):
    """An error that fits no other code (e.g. an exception inside a closure)."""

    code = Code.UNKNOWN


class InvalidArgumentError(OpError, ValueError):
    """A caller passed a bad value: wrong shape or dtype, malformed data."""

    code = Code.INVALID_ARGUMENT


class DeadlineExceededError(OpError, TimeoutError):
    """A call or a wait ran out of its time."""

    code = Code.DEADLINE_EXCEEDED


class NotFoundError(OpError, KeyError):
    """A named thing (variable, checkpoint, task) does not exist."""

    code = Code.NOT_FOUND

    def __str__(self) -> str:  # KeyError would quote the message
        return OpError.__str__(self)


class AlreadyExistsError(OpError):
    """Something was created twice with conflicting specifications."""

    code = Code.ALREADY_EXISTS


class PermissionDeniedError(OpError):
    """The caller is known but not allowed to do this."""

    code = Code.PERMISSION_DENIED


class UnauthenticatedError(OpError):
    """The caller presented no valid credentials."""

    code = Code.UNAUTHENTICATED


class ResourceExhaustedError(OpError):
    """A configured limit (tensor size, variable count, streams) was exceeded."""

    code = Code.RESOURCE_EXHAUSTED


class FailedPreconditionError(OpError):
    """The system is not in a state that allows the operation."""

    code = Code.FAILED_PRECONDITION


class CheckpointMismatchError(FailedPreconditionError, AssertionError):
    """A restored checkpoint and the objects it was restored into do not match
    (yet): values still waiting for their objects, or objects given none.

    An ``AssertionError`` too, as TensorFlow's ``assert_consumed()`` raises.
    """


class AbortedError(OpError):
    """The operation was aborted, e.g. a contribution for a step already applied."""

    code = Code.ABORTED


class MovedError(FailedPreconditionError):
    """A parameter server no longer holds a variable: it moved to another task.

    Like a cluster database's redirect, it names where the variable went, so
    the caller can refresh its placement map and resend.  At the wire it is a
    FAILED_PRECONDITION status whose trailing metadata (:meth:`metadata`)
    carries the fields below.

    Args:
        key: the variable that moved.
        owner: the task index (in job ``ps``) that holds it now.
        address: that task's ``host:port``.
        version: the placement-map version the move belongs to.
    """

    reason = "moved"

    def __init__(
        self,
        message: str,
        task: str | None = None,
        *,
        key: str = "",
        owner: int = -1,
        address: str = "",
        version: int = -1,
    ) -> None:
        super().__init__(message, task)
        self.key = key
        self.owner = owner
        self.address = address
        self.version = version

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The trailing metadata a server answers with (keys prefixed ``psflow-moved-``)."""
        return (
            (MOVED_KEY, self.key),
            (MOVED_OWNER, str(self.owner)),
            (MOVED_ADDRESS, self.address),
            (MOVED_VERSION, str(self.version)),
        )

    @classmethod
    def from_metadata(
        cls, message: str, metadata: object, task: str | None = None
    ) -> MovedError | None:
        """The error a status's trailing ``metadata`` describes (None: not a redirect)."""
        fields = {k: v for k, v in (metadata or ()) if str(k).startswith("psflow-moved-")}
        if MOVED_OWNER not in fields:
            return None
        try:
            owner, version = int(fields[MOVED_OWNER]), int(fields.get(MOVED_VERSION, -1))
        except ValueError:
            return None
        return cls(
            message,
            task,
            key=str(fields.get(MOVED_KEY, "")),
            owner=owner,
            address=str(fields.get(MOVED_ADDRESS, "")),
            version=version,
        )

    def __reduce__(self):
        return (_moved, (self.message, self.task, self.key, self.owner, self.address, self.version))


MOVED_KEY = "psflow-moved-key"
MOVED_OWNER = "psflow-moved-owner"
MOVED_ADDRESS = "psflow-moved-address"
MOVED_VERSION = "psflow-moved-version"


def _moved(message, task, key, owner, address, version) -> MovedError:
    return MovedError(message, task, key=key, owner=owner, address=address, version=version)


class OutOfRangeError(OpError, IndexError):
    """An iterator was exhausted or an index was out of range."""

    code = Code.OUT_OF_RANGE


class UnimplementedError(OpError, NotImplementedError):
    """The operation is not implemented or not supported."""

    code = Code.UNIMPLEMENTED


class InternalError(OpError):
    """An invariant of psflow itself was broken."""

    code = Code.INTERNAL


class UnavailableError(OpError, ConnectionError):
    """A task cannot be reached right now; the call may be retried."""

    code = Code.UNAVAILABLE


class PSUnavailableError(UnavailableError):
    """A parameter-server task is lost and automatic recovery is off."""


class WorkerUnavailableError(UnavailableError):
    """A worker task cannot be reached."""


class DataLossError(OpError):
    """Stored data is corrupt or truncated (e.g. a checkpoint checksum mismatch)."""

    code = Code.DATA_LOSS


_BY_CODE: dict[Code, type[OpError]] = {
    cls.code: cls
    for cls in (
        CancelledError,
        UnknownError,
        InvalidArgumentError,
        DeadlineExceededError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        UnauthenticatedError,
        ResourceExhaustedError,
        FailedPreconditionError,
        AbortedError,
        OutOfRangeError,
        UnimplementedError,
        InternalError,
        UnavailableError,
        DataLossError,
    )
}


def error_class(code: Code | int) -> type[OpError]:
    """Returns the psflow error class for a canonical status code."""
    return _BY_CODE.get(Code(int(code)), UnknownError)


def to_grpc_code(error: BaseException):
    """Returns the ``grpc.StatusCode`` a server should answer ``error`` with."""
    import grpc

    code = error.code if isinstance(error, OpError) else Code.UNKNOWN
    return grpc.StatusCode[code.name]


MAX_DETAILS_CHARS = 4096
"""A status's message is cut to this many characters: gRPC refuses details beyond its
metadata limit (8 KB by default), and an error quoting a caller's text must still
reach the caller."""


class Status(typing.NamedTuple):
    """What a server edge answers for a typed error (gRPC and the data plane alike)."""

    code: Code
    details: str  # the message, cut to MAX_DETAILS_CHARS and valid UTF-8
    metadata: tuple[tuple[str, str], ...]  # trailing metadata: a MovedError's redirect


def status_of(error: OpError) -> Status:
    """The status an edge answers ``error`` with (the one translation of errors to statuses)."""
    message = error.message
    if len(message) > MAX_DETAILS_CHARS:
        message = f"{message[:MAX_DETAILS_CHARS]}... ({len(message)} chars)"
    details = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return Status(error.code, details, error.metadata() if isinstance(error, MovedError) else ())


def from_grpc(rpc_error, task: str | None = None) -> OpError:
    """Converts a ``grpc.RpcError`` into the psflow error of the same code."""
    status = rpc_error.code()
    details = rpc_error.details() or status.name
    moved = MovedError.from_metadata(details, _trailing(rpc_error), task)
    if moved is not None:
        return moved
    cls = error_class(status.value[0])
    return cls(details, task=task)


def _trailing(rpc_error) -> object:
    """A status's trailing metadata (empty when the error carries none)."""
    try:
        return rpc_error.trailing_metadata() or ()
    except (AttributeError, TypeError):  # a bare RpcError raised before any call
        return ()
