"""Exactly-once bookkeeping: which request ids were applied, and their replies.

Each client (a ``client_id`` string) gets a window of its most recent request
sequence numbers.  A request id is *new* (apply it), *in progress* (a retry that
raced the original: wait for it), *done* (answer with the stored reply) or *too
old* (older than the window: it cannot be told apart, so it is refused).
Memory is bounded by ``window`` ids per client and ``max_clients`` clients
(least recently seen evicted first).  An evicted client leaves its highest
sequence behind (``max_evicted`` of them, about a hundred bytes each), so a request
it sends late is refused as too old rather than applied a second time: a
closure's push held up by a network partition while thousands of newer closures
(each a client of its own) went through arrives after its re-run's id was
evicted.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import threading
from typing import Any

__all__ = ["DedupWindow", "Entry", "State", "TouchLog"]


class State(enum.Enum):
    """Where a request id stands."""

    NEW = "new"
    IN_PROGRESS = "in_progress"
    DONE = "done"
    TOO_OLD = "too_old"


_LAZY_LOCK = threading.Lock()


class LazyEvent:
    """``threading.Event``'s ``set``/``is_set``/``wait``, its condition made only for a waiter.

    Almost no request id is ever waited for (only a duplicate arriving while
    the original runs waits), and making an Event per push cost more than the
    rest of the dedup bookkeeping of a small push.
    """

    __slots__ = ("_event", "_flag")

    def __init__(self) -> None:
        self._flag = False
        self._event: threading.Event | None = None

    def is_set(self) -> bool:
        """True once :meth:`set` ran."""
        return self._flag

    def set(self) -> None:
        """Sets the flag and wakes whoever waits."""
        with _LAZY_LOCK:
            self._flag = True
            event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until set or ``timeout`` seconds passed; returns the flag."""
        with _LAZY_LOCK:
            if self._flag:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)


@dataclasses.dataclass
class Entry:
    """One remembered request id; ``done`` is set once ``reply`` is final."""

    done: LazyEvent = dataclasses.field(default_factory=LazyEvent)
    reply: Any = None


@dataclasses.dataclass
class _Client:
    entries: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)
    floor: int = -1  # every sequence <= floor was evicted (or never seen)


class DedupWindow:
    """Remembers the last ``window`` request ids of up to ``max_clients`` clients.

    Of up to ``max_evicted`` clients evicted since (default: 16 per client
    kept), it remembers the highest sequence: their older ids are too old.
    """

    def __init__(
        self, window: int = 4096, max_clients: int = 4096, max_evicted: int | None = None
    ) -> None:
        self._window = window
        self._max_clients = max_clients
        self._max_evicted = 16 * max_clients if max_evicted is None else max_evicted
        self._clients: collections.OrderedDict[str, _Client] = collections.OrderedDict()
        # evicted client id -> the highest sequence it had: what it sends again is too old
        self._evicted: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._lock = threading.Lock()

    def begin(self, client_id: str, sequence: int) -> tuple[State, Entry | None]:
        """Looks up (and, if new, reserves) a request id."""
        with self._lock:
            client = self._clients.get(client_id)
            if client is None:
                floor = self._evicted.pop(client_id, -1)
                client = self._clients[client_id] = _Client(floor=floor)
                while len(self._clients) > self._max_clients:
                    self._evict(*self._clients.popitem(last=False))
            else:
                self._clients.move_to_end(client_id)
            entry = client.entries.get(sequence)
            if entry is not None:
                return (State.DONE if entry.done.is_set() else State.IN_PROGRESS), entry
            if sequence <= client.floor:
                return State.TOO_OLD, None
            entry = client.entries[sequence] = Entry()
            while len(client.entries) > self._window:
                old_seq, _ = client.entries.popitem(last=False)
                client.floor = max(client.floor, old_seq)
            return State.NEW, entry

    def _evict(self, client_id: str, client: _Client) -> None:
        """Keeps only the highest sequence of an evicted client (under the lock)."""
        floor = max([client.floor, *client.entries])
        if floor < 0:
            return  # it never had an id reserved: nothing it sends can be a repeat
        self._evicted[client_id] = floor
        while len(self._evicted) > self._max_evicted:
            self._evicted.popitem(last=False)

    def complete(self, client_id: str, sequence: int, entry: Entry, reply: Any) -> None:
        """Records the reply of a request id reserved by :meth:`begin`."""
        entry.reply = reply
        entry.done.set()

    def abandon(self, client_id: str, sequence: int, entry: Entry) -> None:
        """Forgets a reserved id whose request failed without changing state."""
        with self._lock:
            client = self._clients.get(client_id)
            if client is not None and client.entries.get(sequence) is entry:
                del client.entries[sequence]
        entry.reply = None
        entry.done.set()

    def clear(self) -> None:
        """Forgets everything (after a restore rewinds the state)."""
        with self._lock:
            self._clients.clear()
            self._evicted.clear()


class TouchLog:
    """Which variables each applied push touched, for the pushes that move with a shard.

    When a variable moves to another parameter server, the ids of the pushes
    that touched it travel along (:meth:`export`) and are adopted there
    (:meth:`adopt`): a push retried after the move, with the same id, is then
    recognised at the new owner (:meth:`covered`) and not applied twice.
    Bounded: the oldest of more than ``capacity`` ids is forgotten first.
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._capacity = capacity
        self._names: collections.OrderedDict[tuple[str, int], frozenset[str]] = (
            collections.OrderedDict()
        )
        self._adopted: set[tuple[str, int]] = set()
        self._lock = threading.Lock()

    def record(self, request_id: tuple[str, int], names: Any) -> None:
        """Remembers that the push ``request_id`` applied to ``names``."""
        key = (str(request_id[0]), int(request_id[1]))
        with self._lock:
            known = self._names.get(key)
            if known is None:  # the usual case: a new id goes last by itself
                self._names[key] = frozenset(names)
            else:
                self._names[key] = known | frozenset(names)
                self._names.move_to_end(key)
            while len(self._names) > self._capacity:
                old, _ = self._names.popitem(last=False)
                self._adopted.discard(old)

    def export(self, names: Any) -> list[tuple[str, int, tuple[str, ...]]]:
        """``(client_id, sequence, names)`` of every remembered push that touched ``names``."""
        wanted = frozenset(names)
        with self._lock:
            return [
                (c, s, tuple(sorted(touched & wanted)))
                for (c, s), touched in self._names.items()
                if touched & wanted
            ]

    def adopt(self, records: Any) -> None:
        """Takes over records exported by another parameter server."""
        for c, s, names in records:
            self.record((c, s), names)
            with self._lock:
                self._adopted.add((str(c), int(s)))

    def adopted(self, request_id: tuple[str, int]) -> frozenset[str]:
        """The variables an adopted record says ``request_id`` already touched (else empty)."""
        key = (str(request_id[0]), int(request_id[1]))
        with self._lock:
            if key not in self._adopted:
                return frozenset()
            return self._names.get(key, frozenset())

    def forget(self, names: Any) -> None:
        """Drops ``names`` from every record (they left this server)."""
        gone = frozenset(names)
        with self._lock:
            for key in [k for k, v in self._names.items() if v & gone]:
                rest = self._names[key] - gone
                if rest:
                    self._names[key] = rest
                else:
                    del self._names[key]
                    self._adopted.discard(key)

    def clear(self) -> None:
        """Forgets everything (after a restore rewinds the state)."""
        with self._lock:
            self._names.clear()
            self._adopted.clear()
