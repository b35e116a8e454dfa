"""A call started without waiting for it, and the fan-out's one failure rule.

:class:`Started` is the one type for "a call sent whose reply is read later"
in every client (the data plane's sent frames, :class:`~psflow.transport.PSClient`'s
started pushes and pulls, the table client's shard calls, the session's
fan-out); :func:`gather` reads a fan-out's calls under one rule.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from psflow.errors import InvalidArgumentError

__all__ = ["Started", "gather", "settle"]

K = TypeVar("K")


class Started:
    """A call started without waiting for it: :meth:`result` gives its value once.

    ``read()`` makes or finishes the call in the thread that asks for the
    result (it reads a reply sent already, waits for a pool's future, or does
    the whole call); ``on_cancel()`` gives up what was sent.

    Example:
        >>> Started.done(3).result()
        3
        >>> Started(lambda: 2).then(lambda v: v * 10).result()
        20
    """

    __slots__ = ("_on_cancel", "_read", "_what")

    def __init__(
        self,
        read: Callable[[], Any],
        on_cancel: Callable[[], None] | None = None,
        what: str = "call",
    ) -> None:
        self._read, self._on_cancel, self._what = read, on_cancel, what

    @classmethod
    def done(cls, value: Any) -> Started:
        """A call complete already: its result is ``value``."""
        return cls(lambda: value)

    @classmethod
    def pooled(cls, future: concurrent.futures.Future, what: str = "call") -> Started:
        """A call running on a thread pool (cancelled there if not begun yet)."""
        return cls(future.result, future.cancel, what)

    def result(self) -> Any:
        """The value (once).

        Raises:
            InvalidArgumentError: read or given up already.
            OpError: the call failed (its typed error).
        """
        read, self._read, self._on_cancel = self._read, None, None
        if read is None:
            raise InvalidArgumentError(f"the reply of {self._what} was read or given up already")
        return read()

    def cancel(self) -> None:
        """Gives up on the reply (a push sent may still be applied); idempotent."""
        on_cancel, self._read, self._on_cancel = self._on_cancel, None, None
        if on_cancel is not None:
            on_cancel()

    def _take(self) -> tuple[Callable[[], Any], Callable[[], None] | None]:
        """This call's read and cancel hooks, handed over: it is spent."""
        read, on_cancel = self._read, self._on_cancel
        if read is None:
            raise InvalidArgumentError(f"the reply of {self._what} was read or given up already")
        self._read, self._on_cancel = None, None
        return read, on_cancel

    def then(self, fn: Callable[[Any], Any]) -> Started:
        """This call as one whose result is ``fn`` of its value (this one is spent)."""
        read, on_cancel = self._take()
        return Started(lambda: fn(read()), on_cancel, self._what)

    def recover(self, errors: type | tuple[type, ...], fn: Callable[[Any], Any]) -> Started:
        """This call as one whose result is ``fn(error)`` where it raised one of
        ``errors`` (this one is spent)."""
        read, on_cancel = self._take()

        def recovering() -> Any:
            try:
                return read()
            except errors as e:
                return fn(e)

        return Started(recovering, on_cancel, self._what)


def gather(calls: Mapping[K, Started]) -> dict[K, Any]:
    """Every call's result, read in order; the fan-out's one failure rule.

    **Every call runs to its end before an error propagates, and the error is
    the first in the calls' order.**  Nothing is cancelled: a push given up
    after it was sent may still be applied, so cancelling would leave its
    outcome unknown to a caller about to retry the whole fan-out.  Waiting
    costs at most one deadline and leaves every task's outcome settled (a
    retry with the same exactly-once ids is then answered from the PS's
    record), and the error raised names the task that failed, never a
    cancellation it caused.
    """
    out: dict[K, Any] = {}
    error: BaseException | None = None
    for key, call in calls.items():
        try:
            out[key] = call.result()
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error
    return out


def settle(calls: Iterable[Started]) -> None:
    """Lets every call run to its end, their errors dropped: under :func:`gather`'s
    rule, a caller about to raise an error of its own (starting the next call
    failed) first lets the calls it started finish."""
    for call in calls:
        with contextlib.suppress(Exception):
            call.result()
