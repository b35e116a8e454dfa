"""The cluster's state as text: a per-role table redrawn in place on a terminal, log lines otherwise.

``psflow local --status`` uses it.  On a TTY, :class:`StatusView` keeps a small
table at the bottom of the screen: before anything else is written to the
terminal (a role's output, a log line) the table is erased, and it is drawn
again on the next refresh, so the roles' output scrolls above it unbroken.
Elsewhere (a pipe, a file, CI) it writes one plain line per refresh interval.

Example:
    >>> doc = {"ps": [{"task": "ps:0", "state": "up", "variables": 2, "variable_bytes": 4096,
    ...                "pushes_per_second": 12.0, "pulls_per_second": None}],
    ...        "workers": [{"task": "worker:0", "state": "lost", "closures_run": 7,
    ...                     "closures_failed": 0, "heartbeat_age_seconds": 3.2}]}
    >>> print(status_line(doc))
    ps:0 up 2 vars 4.0KiB 12 push/s | worker:0 LOST 7 closures 0 failed
    >>> print("\\n".join(status_table(doc, {"chief": "running"})))
    role      state    detail
    ps:0      up       2 vars 4.0KiB, 12 push/s, - pull/s
    worker:0  LOST     7 closures, 0 failed, heartbeat 3s ago
    chief     running
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

__all__ = ["EraseBeforeWrite", "StatusView", "status_line", "status_table"]

_ERASE_LINE = "\r\x1b[K"
_UP = "\x1b[1A"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GiB"  # pragma: no cover - the loop returns


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _state(task: Mapping[str, Any]) -> str:
    # LOST in capitals: the one state a reader scanning the table must not miss.
    return "LOST" if task["state"] == "lost" else task["state"]


def status_line(doc: Mapping[str, Any]) -> str:
    """One line for a log: every task's state and its main counter."""
    parts = [
        f"{p['task']} {_state(p)} {p['variables']} vars {_bytes(p['variable_bytes'])} "
        f"{_rate(p['pushes_per_second'])} push/s"
        for p in doc["ps"]
    ]
    parts += [
        f"{w['task']} {_state(w)} {w['closures_run']} closures {w['closures_failed']} failed"
        for w in doc["workers"]
    ]
    return " | ".join(parts)


def status_table(doc: Mapping[str, Any], processes: Mapping[str, str] | None = None) -> list[str]:
    """The table's lines: a header, one row per PS and worker, then ``processes`` (role -> state)."""
    rows = [("role", "state", "detail")]
    for p in doc["ps"]:
        detail = (
            f"{p['variables']} vars {_bytes(p['variable_bytes'])}, "
            f"{_rate(p['pushes_per_second'])} push/s, {_rate(p['pulls_per_second'])} pull/s"
        )
        rows.append((p["task"], _state(p), detail))
    for w in doc["workers"]:
        age = w.get("heartbeat_age_seconds")
        heartbeat = "never" if age is None else f"{age:.0f}s ago"
        detail = (
            f"{w['closures_run']} closures, {w['closures_failed']} failed, heartbeat {heartbeat}"
        )
        rows.append((w["task"], _state(w), detail))
    for role, state in (processes or {}).items():
        rows.append((role, state, ""))
    width = max(len(r[0]) for r in rows) + 2
    return [f"{r[0]:<{width}}{r[1]:<9}{r[2]}".rstrip() for r in rows]


class StatusView:
    """Shows :func:`status_table` in place on a TTY, or :func:`status_line` as log lines.

    Args:
        stream: where to draw (the terminal; usually stderr).
        snapshot: returns the ``/api/cluster`` document.
        processes: returns role -> process state for rows the probes do not cover.
        interval: seconds between refreshes.
        tty: draw in place (default: whether ``stream`` is a terminal).
        clock: monotonic seconds (injectable in tests).
    """

    def __init__(
        self,
        stream: TextIO,
        snapshot: Callable[[], Mapping[str, Any]],
        processes: Callable[[], Mapping[str, str]] | None = None,
        *,
        interval: float = 1.0,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = stream
        self._snapshot = snapshot
        self._processes = processes or dict
        self._interval = interval
        self.tty = stream.isatty() if tty is None else tty
        self._clock = clock
        self._next = clock()
        self._drawn = 0  # table lines on screen
        self._lock = threading.RLock()

    def erase(self) -> None:
        """Removes the table from the screen (before someone else writes there)."""
        with self._lock:
            if self._drawn:
                self._stream.write(_ERASE_LINE + (_UP + _ERASE_LINE) * (self._drawn - 1))
                self._stream.flush()
                self._drawn = 0

    def refresh(self, force: bool = False) -> None:
        """Redraws (TTY) or logs a line when the interval has passed, or now with ``force``."""
        now = self._clock()
        with self._lock:
            if not force and now < self._next and (self._drawn or not self.tty):
                return
            self._next = now + self._interval
            doc = self._snapshot()
            if self.tty:
                lines = status_table(doc, self._processes())
                self.erase()
                self._stream.write("\n".join(lines))
                self._drawn = len(lines)
            else:
                self._stream.write(f"[local] status: {status_line(doc)}\n")
            self._stream.flush()

    def write_above(self, stream: TextIO, text: str) -> int:
        """Erases the table, then writes ``text`` to ``stream`` (no redraw can interleave)."""
        with self._lock:
            self.erase()
            return stream.write(text)


class EraseBeforeWrite:
    """A text stream that erases ``view``'s table before each write to ``stream``."""

    def __init__(self, stream: TextIO, view: StatusView) -> None:
        self._stream = stream
        self._view = view

    def write(self, text: str) -> int:
        """Erases the table, then writes ``text``."""
        return self._view.write_above(self._stream, text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
