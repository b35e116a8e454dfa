"""A bounded, thread-safe timeline of cluster events (worker lost, PS restored, checkpoint...).

Library code announces what happened with :func:`publish`; nothing is recorded
unless a process installed an :class:`EventLog` (the chief does when its
dashboard is on), so the call costs one lookup otherwise.  The hook is
process-wide on purpose: events come from places (a Keras callback, the
coordinator's dispatch threads) that the user's program builds, not the
entrypoint, and threading a log through them would change public signatures.

Example:
    >>> log = EventLog(capacity=2)
    >>> previous = install(log)
    >>> publish(EventKind.CHECKPOINT_WRITTEN, "chief", "wrote ckpt-1")
    >>> [e.kind.value for e in log.events()]
    ['checkpoint_written']
    >>> _ = install(previous)
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from psflow.errors import InvalidArgumentError

__all__ = ["Event", "EventKind", "EventLog", "install", "installed", "publish"]


class EventKind(enum.Enum):
    """What happened; the value is the name the JSON API uses."""

    WORKER_LOST = "worker_lost"
    WORKER_BACK = "worker_back"
    WORKER_REPLACED = "worker_replaced"
    CLOSURE_REQUEUED = "closure_requeued"
    PS_LOST = "ps_lost"
    PS_BACK = "ps_back"
    PS_RESTORED = "ps_restored"
    CHECKPOINT_WRITTEN = "checkpoint_written"
    TRAINING_STARTED = "training_started"
    EPOCH_END = "epoch_end"
    TRAINING_ENDED = "training_ended"
    TASK_EXITED = "task_exited"  # the launcher saw a task's process end (its status, signal)
    MEMBERSHIP_CHANGED = "membership_changed"  # a multi-worker group's generation moved on


@dataclasses.dataclass(frozen=True)
class Event:
    """One event: when (epoch seconds), what, which task, a sentence, and numbers."""

    seq: int
    time: float
    kind: EventKind
    task: str
    message: str
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """The event as the ``/api/cluster`` ``events`` entries show it."""
        return {
            "seq": self.seq,
            "time": self.time,
            "kind": self.kind.value,
            "task": self.task,
            "message": self.message,
            "data": dict(self.data),
        }


class EventLog:
    """The last ``capacity`` events, oldest first, plus a count of every kind ever seen.

    Raises:
        InvalidArgumentError: ``capacity`` is not a positive integer.
    """

    def __init__(self, capacity: int = 500) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise InvalidArgumentError(f"capacity {capacity!r} must be an integer >= 1")
        self._events: deque[Event] = deque(maxlen=capacity)
        self._counts: dict[tuple[EventKind, str], int] = {}
        self._seq = 0
        self._lock = threading.Lock()

    def record(
        self, kind: EventKind, task: str, message: str, data: Mapping[str, Any] | None = None
    ) -> Event:
        """Appends an event (the oldest drops out when full) and returns it."""
        if not isinstance(kind, EventKind):
            raise InvalidArgumentError(f"kind {kind!r} is not an EventKind")
        with self._lock:
            self._seq += 1
            event = Event(self._seq, time.time(), kind, task, message, dict(data or {}))
            self._events.append(event)
            key = (kind, task)
            self._counts[key] = self._counts.get(key, 0) + 1
        return event

    def events(self, after: int = 0) -> list[Event]:
        """Events with ``seq > after``, oldest first."""
        with self._lock:
            return [e for e in self._events if e.seq > after]

    def count(self, kind: EventKind, task: str | None = None) -> int:
        """How many ``kind`` events were recorded (for ``task``, or for all tasks)."""
        with self._lock:
            return sum(n for (k, t), n in self._counts.items() if k is kind and task in (None, t))


_installed: EventLog | None = None


def install(log: EventLog | None) -> EventLog | None:
    """Makes ``log`` receive :func:`publish` calls in this process; returns the previous one."""
    global _installed
    previous, _installed = _installed, log
    return previous


def installed() -> EventLog | None:
    """The log :func:`publish` writes to, or None."""
    return _installed


def publish(
    kind: EventKind, task: str, message: str, data: Mapping[str, Any] | None = None
) -> None:
    """Records an event in the installed log; does nothing when none is installed."""
    log = _installed
    if log is not None:
        log.record(kind, task, message, data)
