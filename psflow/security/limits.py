"""Resource limits of psflow servers: what one caller may make a server hold.

Exceeding a limit is a :class:`~psflow.errors.ResourceExhaustedError`
(RESOURCE_EXHAUSTED on the wire) naming the limit, its flag and the value
that exceeded it, raised before anything changes.  The error's ``reason``
(``tensor_too_large``, ``too_many_variables``, ``too_many_streams``,
``closure_too_large``) labels the rejection in the metrics.

Example:
    >>> gate = StreamGate(1)
    >>> with gate.admit():
    ...     try:
    ...         with gate.admit():
    ...             pass
    ...     except ResourceExhaustedError as e:
    ...         print(e.reason)
    too_many_streams
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

from psflow.errors import InvalidArgumentError, ResourceExhaustedError

__all__ = [
    "DEFAULT_MAX_CLOSURE_BYTES",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_MAX_STREAMS",
    "DEFAULT_MAX_STREAMS_PER_CLIENT",
    "DEFAULT_MAX_SYNC_CONTRIBUTORS",
    "DEFAULT_MAX_VARIABLES",
    "DEFAULT_SESSION_TTL",
    "DEFAULT_STREAM_IDLE_TIMEOUT",
    "PSLimits",
    "StreamGate",
    "WorkerLimits",
    "limit_exceeded",
]

DEFAULT_MAX_VARIABLES = 1_000_000
DEFAULT_MAX_STREAMS = 64
DEFAULT_MAX_STREAMS_PER_CLIENT = 32  # half the default slots: one process, one connection
DEFAULT_STREAM_IDLE_TIMEOUT = 30.0
DEFAULT_MAX_SYNC_CONTRIBUTORS = 1024
DEFAULT_MAX_CLOSURE_BYTES = 1 << 30
DEFAULT_MAX_SESSIONS = 256
DEFAULT_SESSION_TTL = 3600.0


def limit_exceeded(
    reason: str, what: str, value: int, limit: int, flag: str
) -> ResourceExhaustedError:
    """The error for ``value`` above ``limit`` (``what`` names the quantity).

    Example:
        >>> str(limit_exceeded("x", "a tensor of 10 bytes", 10, 8, "--max-tensor-bytes"))
        'a tensor of 10 bytes exceeds the limit --max-tensor-bytes=8'
    """
    error = ResourceExhaustedError(f"{what} exceeds the limit {flag}={limit}")
    error.reason = reason
    error.value = value
    error.limit = limit
    return error


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")


def _check_seconds(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
        raise InvalidArgumentError(f"{name} must be a positive number of seconds, got {value!r}")


@dataclasses.dataclass(frozen=True)
class PSLimits:
    """Limits of a parameter server.

    Attributes:
        max_tensor_bytes: the largest variable or pushed tensor (None: half the
            machine's memory, the store's default).
        max_variables: variables one PS task holds.
        max_streams: RPCs of the ParameterServer service running at once.
        max_streams_per_client: of those, RPCs one client connection may run.
        stream_idle_timeout: seconds a streaming call may go without a message
            before it is cancelled (its slot freed).
        max_sync_contributors: the largest ``num_required`` of a sync step
            (the cluster's worker count, where the PS knows it).
    """

    max_tensor_bytes: int | None = None
    max_variables: int = DEFAULT_MAX_VARIABLES
    max_streams: int = DEFAULT_MAX_STREAMS
    max_streams_per_client: int = DEFAULT_MAX_STREAMS_PER_CLIENT
    stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT
    max_sync_contributors: int = DEFAULT_MAX_SYNC_CONTRIBUTORS

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if field.name == "stream_idle_timeout":
                _check_seconds(field.name, self.stream_idle_timeout)
            else:
                _check_positive(field.name, getattr(self, field.name))


@dataclasses.dataclass(frozen=True)
class WorkerLimits:
    """Limits of a worker.

    Attributes:
        max_closure_bytes: function plus arguments of one RunClosure request.
        max_sessions: coordinator sessions kept (least recently used dropped first).
        session_ttl: seconds an unused session is kept.
    """

    max_closure_bytes: int = DEFAULT_MAX_CLOSURE_BYTES
    max_sessions: int = DEFAULT_MAX_SESSIONS
    session_ttl: float = DEFAULT_SESSION_TTL

    def __post_init__(self) -> None:
        _check_positive("max_closure_bytes", self.max_closure_bytes)
        _check_positive("max_sessions", self.max_sessions)
        _check_seconds("session_ttl", self.session_ttl)


class StreamGate:
    """Counts calls in progress and refuses the one above ``limit`` (in all) or
    above ``per_client`` (from one client), so one client cannot take every slot.

    Args:
        limit: calls allowed at once.
        flag: the option that sets it (named in the error).
        per_client: calls one client may have at once (None: ``limit``).
    """

    def __init__(
        self, limit: int, flag: str = "--max-streams", per_client: int | None = None
    ) -> None:
        _check_positive("limit", limit)
        _check_positive("per_client", per_client)
        self.limit = limit
        self.flag = flag
        self.per_client = per_client or limit
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self.active = 0
        self._by_client: dict[str, int] = {}

    @contextlib.contextmanager
    def admit(self, client: str = "", wait: float = 0.0) -> Iterator[None]:
        """Holds one slot for the ``with`` block.

        Args:
            client: who calls (the per-client count).
            wait: seconds to wait for a slot when all are taken (0: refuse at once).

        Raises:
            ResourceExhaustedError: ``limit`` calls are already in progress, or
                ``per_client`` of ``client``'s.
        """
        self.acquire(client, wait)
        try:
            yield
        finally:
            self.release(client)

    def acquire(self, client: str = "", wait: float = 0.0) -> None:
        """Takes one slot (as :meth:`admit`, for callers that pair it with :meth:`release`
        themselves: a server's per-call path, where a generator costs more than the gate).

        Raises:
            ResourceExhaustedError: as :meth:`admit`.
        """
        with self._lock:
            if wait > 0:
                self._released.wait_for(lambda: self.active < self.limit, timeout=wait)
            if self.active >= self.limit:
                raise limit_exceeded(
                    "too_many_streams",
                    f"{self.active + 1} concurrent calls",
                    self.active + 1,
                    self.limit,
                    self.flag,
                )
            mine = self._by_client.get(client, 0)
            if mine >= self.per_client:
                raise limit_exceeded(
                    "too_many_streams_per_client",
                    f"{mine + 1} concurrent calls from one client",
                    mine + 1,
                    self.per_client,
                    f"{self.flag}-per-client",
                )
            self.active += 1
            self._by_client[client] = mine + 1

    def release(self, client: str = "") -> None:
        """Gives back a slot taken by :meth:`acquire` for ``client``."""
        with self._lock:
            self.active -= 1
            self._released.notify()
            left = self._by_client[client] - 1
            if left:
                self._by_client[client] = left
            else:
                del self._by_client[client]
