"""The data plane's door: what a peer gets before it has authenticated.

Next to nothing.  A connection that has not finished its HELLO (and its TLS
handshake, when TLS is on) holds a socket, one short-lived thread and at most
:data:`~.auth.HELLO_LIMIT` bytes, and only until ``hello_timeout`` seconds
after it was accepted: an absolute deadline, however its bytes trickle in.
Such connections have budgets of their own, apart from the limit on
authenticated connections: ``max_pending`` in all and ``max_pending_per_host``
from one address.  When a budget is full, the *oldest* waiting handshake is
closed to make room for the new one rather than the new one refused, so a
flood of silent sockets can delay a legitimate client by no more than its own
handshake takes (a round trip), and can never lock it out.

:class:`Refusals` logs refused connections at most once per interval: the
first at once, the rest as a count with their reasons.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

__all__ = ["Door", "Refusals"]


class Door:
    """The handshakes under way, their budgets and their deadlines.

    Args:
        max_pending: handshakes under way at once, from every address.
        max_pending_per_host: handshakes under way at once from one address.
        hello_timeout: seconds from accept by which a handshake must be done.
    """

    def __init__(self, *, max_pending: int, max_pending_per_host: int, hello_timeout: float):
        self.max_pending = max(1, max_pending)
        self.max_pending_per_host = max(1, min(max_pending_per_host, self.max_pending))
        self.hello_timeout = hello_timeout
        self._lock = threading.Lock()
        # connection -> (host, deadline), oldest first
        self._pending: collections.OrderedDict[Any, tuple[str, float]] = collections.OrderedDict()
        self._per_host: collections.Counter[str] = collections.Counter()

    def enter(self, conn: Any, host: str) -> tuple[float, list[Any]]:
        """Lets ``conn`` (from ``host``) start its handshake.

        Returns:
            Its deadline (``time.monotonic()``) and the older handshakes to close
            now to keep both budgets (they are already forgotten here).
        """
        deadline = time.monotonic() + self.hello_timeout
        evicted = []
        with self._lock:
            if self._per_host[host] >= self.max_pending_per_host:
                oldest = next(c for c, (h, _) in self._pending.items() if h == host)
                evicted.append(oldest)
                self._forget(oldest)
            if len(self._pending) >= self.max_pending:
                oldest = next(iter(self._pending))
                evicted.append(oldest)
                self._forget(oldest)
            self._pending[conn] = (host, deadline)
            self._per_host[host] += 1
        return deadline, evicted

    def leave(self, conn: Any) -> bool:
        """``conn``'s handshake ended (welcomed, refused or failed); False if it was
        already evicted or expired."""
        with self._lock:
            return self._forget(conn)

    def expired(self, now: float | None = None) -> list[Any]:
        """The handshakes past their deadline (forgotten here: close them)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            late = [c for c, (_, deadline) in self._pending.items() if deadline <= now]
            for conn in late:
                self._forget(conn)
        return late

    @property
    def pending(self) -> int:
        """Handshakes under way."""
        with self._lock:
            return len(self._pending)

    def waiting(self) -> list[Any]:
        """The handshakes under way (for a stop to shut them down)."""
        with self._lock:
            return list(self._pending)

    def _forget(self, conn: Any) -> bool:
        entry = self._pending.pop(conn, None)
        if entry is None:
            return False
        self._per_host[entry[0]] -= 1
        if self._per_host[entry[0]] <= 0:
            del self._per_host[entry[0]]
        return True


class Refusals:
    """A warning per refused connection, at most one line per ``interval`` seconds.

    The first refusal of a quiet period is logged at once; later ones are
    counted and reported, with their reasons and number of addresses, by the
    next line (:meth:`refused` or :meth:`flush` once the interval has passed).
    """

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._log = logger
        self.interval = interval
        self._lock = threading.Lock()
        self._next = 0.0
        self._reasons: collections.Counter[str] = collections.Counter()
        self._hosts: set[str] = set()

    def refused(self, peer: str, why: str, reason: str) -> None:
        """Records a refused connection from ``peer``: ``why`` in words, ``reason`` a key."""
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._reasons[reason] += 1
                self._hosts.add(peer.rsplit(":", 1)[0])
                return
            summary = self._take_summary()
            self._next = now + self.interval
        self._log.warning("data plane refused %s: %s%s", peer, why, summary)

    def flush(self) -> None:
        """Reports the refusals counted since the last line, once the interval passed."""
        now = time.monotonic()
        with self._lock:
            if now < self._next or not self._reasons:
                return
            summary = self._take_summary()
            self._next = now + self.interval
        self._log.warning("data plane refused connections%s", summary)

    def _take_summary(self) -> str:
        if not self._reasons:
            return ""
        n = sum(self._reasons.values())
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self._reasons.items()))
        summary = (
            f" (and {n} more refused from {len(self._hosts)} address(es) in the last "
            f"{self.interval:g} s: {reasons})"
        )
        self._reasons.clear()
        self._hosts.clear()
        return summary
