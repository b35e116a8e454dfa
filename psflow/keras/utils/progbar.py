"""Keras's progress bar: ``2/2 [==============================] - 0s 3ms/step - loss: 15.2345``.

On a terminal the bar redraws in place; otherwise (a pipe, a log file) it
prints one line when the target is reached, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from psflow import settings


def _is_interactive(stream: TextIO) -> bool:
    if settings.current().plain_progbar:
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) or "ipykernel" in sys.modules


def format_value(value: float) -> str:
    """Keras's rule: four decimals, or scientific notation for tiny values."""
    return f" {value:.4f}" if abs(value) > 1e-3 or value == 0 else f" {value:.4e}"


def format_time_per_unit(seconds: float, unit: str = "step") -> str:
    """``3ms/step`` style: whole seconds, milliseconds or microseconds."""
    if seconds >= 1 or seconds == 0:
        return f"{seconds:.0f}s/{unit}"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.0f}ms/{unit}"
    return f"{seconds * 1e6:.0f}us/{unit}"


class Progbar:
    """A progress bar for ``target`` steps (``None`` when unknown).

    Args:
        target: total steps, or None.
        width: bar width in characters.
        verbose: 1 for the bar, 2 for one line at the end.
        stream: where to write (stdout).
    """

    def __init__(
        self,
        target: int | None,
        width: int = 30,
        verbose: int = 1,
        stream: TextIO | None = None,
        unit_name: str = "step",
    ) -> None:
        self.target = target
        self.width = width
        self.verbose = verbose
        self.stream = stream or sys.stdout
        self.unit_name = unit_name
        self._interactive = _is_interactive(self.stream) and verbose == 1
        self._start = time.monotonic()
        self._last_len = 0
        self._seen = 0
        self._done = False

    def update(
        self,
        current: int,
        values: list[tuple[str, Any]] | None = None,
        finalize: bool | None = None,
    ) -> None:
        """Shows progress at step ``current`` with ``values`` (name, number) pairs."""
        if finalize is None:
            finalize = self.target is not None and current >= self.target
        self._seen = current
        if not self.verbose or self._done:
            return
        if not (self._interactive or finalize):
            return
        now = time.monotonic()
        elapsed = now - self._start
        per_unit = elapsed / current if current else 0.0
        tail = ""
        if self.verbose == 2:
            # Keras 2: ``2/2 - 0s - loss: 15.2345 - 6ms/epoch - 3ms/step``
            line = f"{current}/{self.target}" if self.target else f"{current}"
            line += f" - {elapsed:.0f}s"
            tail = (
                f" - {format_time_per_unit(elapsed, 'epoch')}"
                f" - {format_time_per_unit(per_unit, self.unit_name)}"
            )
        else:
            line = self._bar(current)
            if finalize:
                line += f" - {elapsed:.0f}s {format_time_per_unit(per_unit, self.unit_name)}"
            elif self.target:
                eta = per_unit * (self.target - current)
                line += f" - ETA: {eta:.0f}s"
            else:
                line += f" - {format_time_per_unit(per_unit, self.unit_name)}"
        for name, value in values or []:
            line += f" - {name}:{format_value(float(value))}"
        line += tail
        if self._interactive and not finalize:
            pad = max(self._last_len - len(line), 0)
            self.stream.write("\r" + line + " " * pad)
            self._last_len = len(line)
        else:
            prefix = "\r" if self._interactive else ""
            pad = max(self._last_len - len(line), 0) if self._interactive else 0
            self.stream.write(prefix + line + " " * pad + "\n")
            self._done = True
        self.stream.flush()

    def _bar(self, current: int) -> str:
        if not self.target:
            return f"{current:7d}/Unknown"
        digits = len(str(self.target))
        head = f"{current:{digits}d}/{self.target} ["
        filled = int(self.width * min(current, self.target) / self.target)
        bar = "=" * max(filled - 1, 0)
        if current < self.target:
            bar += ">" if filled else ""
        elif filled:
            bar += "="
        return head + bar + "." * (self.width - len(bar)) + "]"
