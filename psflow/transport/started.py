"""A call started without waiting for it, and the fan-out's one failure rule.

:class:`Started` is the one type for "a call sent whose reply is read later"
in every client (the data plane's sent frames, :class:`~psflow.transport.PSClient`'s
started pushes and pulls, the table client's shard calls, the session's
fan-out); :func:`fan_out` starts a fan-out's calls and :func:`gather` reads
them under one rule.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from psflow.errors import InvalidArgumentError

__all__ = ["Started", "fan_out", "gather", "settle"]

K = TypeVar("K")
Errors = type[BaseException] | tuple[type[BaseException], ...]


class Started:
    """A call started without waiting for it: :meth:`result` gives its value once.

    ``read()`` makes or finishes the call in the thread that asks for the
    result (it reads a reply sent already, waits for a pool's future, or does
    the whole call); ``on_cancel()`` gives up what was sent.

    Example:
        >>> Started.done(3).result()
        3
        >>> Started(lambda: 2).result()
        2
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
        return self._claim()()

    def _claim(self) -> Callable[[], Any]:
        """The reading function, taken once (for :meth:`result` and its overrides)."""
        read, self._read, self._on_cancel = self._read, None, None
        if read is None:
            raise InvalidArgumentError(f"the reply of {self._what} was read or given up already")
        return read

    def cancel(self) -> None:
        """Gives up on the reply (a push sent may still be applied); idempotent."""
        on_cancel, self._read, self._on_cancel = self._on_cancel, None, None
        if on_cancel is not None:
            on_cancel()


def gather(calls: Mapping[K, Started], as_value: Errors = ()) -> dict[K, Any]:
    """Every call's result, read in order; the fan-out's one failure rule.
    An error of a class in ``as_value`` is that call's result instead (a
    redirect its caller follows), never a failure.

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
        except as_value as e:
            out[key] = e
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


def fan_out(
    starts: Mapping[K, Callable[[], Started | None]],
    work: Mapping[K, Callable[[], Any]],
    pool: concurrent.futures.Executor | None,
) -> dict[K, Started]:
    """One call per key of ``work``, started; read them with :func:`gather`.

    ``starts[k]()``, where given, sends ``k``'s call now and returns it
    started, or None (``work[k]`` makes it then): every such call is sent
    before any reply is read, with no thread hand-off.  The rest run on
    ``pool``, except the first, left to the thread that reads the calls (one
    hand-off fewer); without a pool every one is left to it, one after
    another.  A start that raises lets the calls sent before it finish first.
    """
    calls: dict[K, Started] = {}
    for key, start in starts.items():
        try:
            call = start()
        except BaseException:
            settle(calls.values())  # the ones sent finish first
            raise
        if call is not None:
            calls[key] = call
    rest = [key for key in work if key not in calls]
    made = {
        key: Started(work[key])
        if pool is None or n == 0
        else Started.pooled(pool.submit(work[key]))
        for n, key in enumerate(rest)
    }
    return {**made, **calls}  # the inline one first: read while the pooled ones run
