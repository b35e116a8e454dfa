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
    "DEFAULT_MAX_STREAMS",
    "DEFAULT_MAX_VARIABLES",
    "PSLimits",
    "StreamGate",
    "WorkerLimits",
    "limit_exceeded",
]

DEFAULT_MAX_VARIABLES = 1_000_000
DEFAULT_MAX_STREAMS = 64
DEFAULT_MAX_CLOSURE_BYTES = 1 << 30


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


@dataclasses.dataclass(frozen=True)
class PSLimits:
    """Limits of a parameter server.

    Attributes:
        max_tensor_bytes: the largest variable or pushed tensor (None: half the
            machine's memory, the store's default).
        max_variables: variables one PS task holds.
        max_streams: RPCs of the ParameterServer service running at once.
    """

    max_tensor_bytes: int | None = None
    max_variables: int = DEFAULT_MAX_VARIABLES
    max_streams: int = DEFAULT_MAX_STREAMS

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _check_positive(field.name, getattr(self, field.name))


@dataclasses.dataclass(frozen=True)
class WorkerLimits:
    """Limits of a worker.

    Attributes:
        max_closure_bytes: function plus arguments of one RunClosure request.
    """

    max_closure_bytes: int = DEFAULT_MAX_CLOSURE_BYTES

    def __post_init__(self) -> None:
        _check_positive("max_closure_bytes", self.max_closure_bytes)


class StreamGate:
    """Counts calls in progress and refuses the one above ``limit``.

    Args:
        limit: calls allowed at once.
        flag: the option that sets it (named in the error).
    """

    def __init__(self, limit: int, flag: str = "--max-streams") -> None:
        _check_positive("limit", limit)
        self.limit = limit
        self.flag = flag
        self._lock = threading.Lock()
        self.active = 0

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """Holds one slot for the ``with`` block.

        Raises:
            ResourceExhaustedError: ``limit`` calls are already in progress.
        """
        with self._lock:
            if self.active >= self.limit:
                raise limit_exceeded(
                    "too_many_streams",
                    f"{self.active + 1} concurrent calls",
                    self.active + 1,
                    self.limit,
                    self.flag,
                )
            self.active += 1
        try:
            yield
        finally:
            with self._lock:
                self.active -= 1
