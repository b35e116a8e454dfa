"""Cancelling streaming calls that stop moving.

A streamed push holds one of the server's ``--max-streams`` slots (and a
thread) from its first message to its last; a client that sends a header and
then nothing would hold it forever.  :class:`IdleWatch` gives every watched
call an idle timeout: each message received (or sent) restarts its clock, and
a call whose clock runs out is cancelled, which wakes the handler blocked on
the next message and frees the slot.  When every slot is taken, the call idle
the longest (over a second) is cancelled at once to admit a new one
(:meth:`IdleWatch.evict_idlest`), so idle streams from many connections cannot
lock others out until the timeout.

One watchdog thread serves all calls; it runs only while calls are watched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["IdleWatch", "Watched", "touching"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Watched:
    """One watched call: when it last moved, and whether the watch cancelled it."""

    cancel: Callable[[], None]
    last: float = dataclasses.field(default_factory=time.monotonic)
    expired: bool = False
    done: bool = False  # its messages are all through: no longer subject to the timeout

    def touch(self) -> None:
        """The call moved (a message arrived or left): restart its clock."""
        self.last = time.monotonic()

    def finish(self) -> None:
        """The call's stream is complete; what it does next is bounded elsewhere."""
        self.done = True


class IdleWatch:
    """Cancels watched calls idle for longer than ``timeout`` seconds.

    Args:
        timeout: the longest a watched call may go without a message.
        on_expire: called (outside any lock) with the call's label when one is cancelled.
    """

    def __init__(self, timeout: float, on_expire: Callable[[str], None] | None = None) -> None:
        if not timeout > 0:
            raise ValueError(f"idle timeout must be > 0, got {timeout!r}")
        self.timeout = float(timeout)
        self._on_expire = on_expire
        self._calls: dict[int, tuple[str, Watched]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self, label: str, cancel: Callable[[], None]) -> Iterator[Watched]:
        """Watches a call for the ``with`` block; ``cancel`` ends it when idle too long."""
        entry = Watched(cancel)
        key = next(self._ids)
        with self._lock:
            self._calls[key] = (label, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ps-idle-watch", daemon=True)
                self._thread.start()
        try:
            yield entry
        finally:
            with self._lock:
                self._calls.pop(key, None)

    def evict_idlest(self, min_idle: float) -> bool:
        """Cancels the call idle the longest, if it has been idle over ``min_idle`` seconds.

        Used when every slot is taken: a call that stopped moving yields its
        slot to one that wants to move.  Returns whether a call was cancelled.
        """
        now = time.monotonic()
        with self._lock:
            candidates = [
                (entry.last, label, entry)
                for label, entry in self._calls.values()
                if not (entry.expired or entry.done) and now - entry.last > min_idle
            ]
            if not candidates:
                return False
            _, label, entry = min(candidates, key=lambda c: c[0])
            entry.expired = True
        log.info("%s idle for %.1fs, its slot needed: cancelled", label, now - entry.last)
        self._expire(label, entry)
        return True

    def _expire(self, label: str, entry: Watched) -> None:
        try:
            entry.cancel()
        except Exception:  # the call ended meanwhile
            log.debug("cancelling %s failed", label, exc_info=True)
        if self._on_expire is not None:
            self._on_expire(label)

    def _run(self) -> None:
        # Wakes a few times per timeout; exits once nothing is watched (the next
        # watched call starts it again), so an idle server has no thread spinning.
        tick = min(self.timeout / 4, 1.0)
        while True:
            time.sleep(tick)
            now = time.monotonic()
            with self._lock:
                if not self._calls:
                    self._thread = None
                    return
                stale = [
                    (label, entry)
                    for label, entry in self._calls.values()
                    if not (entry.expired or entry.done) and now - entry.last > self.timeout
                ]
                for _, entry in stale:
                    entry.expired = True
            for label, entry in stale:
                log.info("%s idle for over %.1fs: cancelled", label, self.timeout)
                self._expire(label, entry)


def touching(messages: Iterable[Any], entry: Watched) -> Iterator[Any]:
    """Yields ``messages``, restarting ``entry``'s clock after each one; finishes
    ``entry`` once they are exhausted (a sync push may then wait for its step)."""
    for message in messages:
        entry.touch()
        yield message
    entry.finish()
