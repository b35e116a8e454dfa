"""``SummaryWriter``: where ``psflow.summary`` ops write, and the default writer and step.

As in TensorFlow, the default writer and the default step belong to the
thread: ``with writer.as_default(step=...)`` sets both for its block and
restores the previous ones after, and ``experimental.set_step`` sets the step
alone. Under ParameterServerStrategy the chief's thread writes; a closure on a
worker sees no default writer and its summary calls return False.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from psflow import errors
from psflow.summary.event_writer import EventWriter


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.writer: SummaryWriter | None = None
        self.step: int | None = None
        self.record: Any = True


STATE = _ThreadState()


def as_step(step: Any) -> int:
    """``step`` (an int, a scalar tensor or variable) as a Python int.

    Raises:
        InvalidArgumentError: it is not an integer scalar, quoting it.
    """
    import numpy as np

    value = np.asarray(step.numpy() if hasattr(step, "numpy") else step)
    if value.ndim != 0 or value.dtype.kind not in "iu":
        raise errors.InvalidArgumentError(f"A summary step must be an integer scalar, got {step!r}")
    return int(value)


class SummaryWriter:
    """Writes summaries to an event file in ``logdir`` (TensorFlow's ``tf.summary.SummaryWriter``).

    Make one with :func:`create_file_writer`; it writes once it is the default
    writer (``as_default`` or ``set_as_default``).
    """

    def __init__(
        self, logdir: Any, max_queue: int = 10, flush_secs: float = 120, suffix: str = ""
    ) -> None:
        self.logdir = os.fspath(logdir)
        self._args = (max_queue, flush_secs, suffix)
        self._events: EventWriter | None = None
        self._closed = False
        self.init()

    def init(self) -> None:
        """Opens the event file (done at creation; reopens a new file after :meth:`close`)."""
        if self._events is None:
            self._events = EventWriter(self.logdir, *self._args)
            self._closed = False

    def write(self, values: Any, step: int) -> None:
        """One event of summary ``values`` at ``step``.

        Raises:
            FailedPreconditionError: the writer was closed, naming its directory.
        """
        if self._events is None:
            raise errors.FailedPreconditionError(
                f"The summary writer for {self.logdir!r} is closed (call init() to reopen it)"
            )
        self._events.write(values, step)

    @contextlib.contextmanager
    def as_default(self, step: Any = None) -> Iterator[SummaryWriter]:
        """Makes this the thread's default writer (and ``step`` its default step) in the block.

        Example:
            >>> import psflow as pf
            >>> writer = pf.summary.create_file_writer("/tmp/logs")  # doctest: +SKIP
            >>> with writer.as_default(step=3):  # doctest: +SKIP
            ...     pf.summary.scalar("loss", 0.25)
            True
        """
        previous = (STATE.writer, STATE.step)
        STATE.writer = self
        if step is not None:
            STATE.step = as_step(step)
        try:
            yield self
        finally:
            if STATE.writer is self:
                self.flush()
            STATE.writer, restored_step = previous
            if step is not None:
                STATE.step = restored_step

    def set_as_default(self, step: Any = None) -> None:
        """Makes this the thread's default writer from now on (and ``step`` the default step)."""
        STATE.writer = self
        if step is not None:
            STATE.step = as_step(step)

    def flush(self) -> None:
        """Writes pending events to disk."""
        if self._events is not None:
            self._events.flush()

    def close(self) -> None:
        """Flushes and closes the event file; writing afterwards raises."""
        if self._events is not None:
            self._events.close()
            self._events = None
        self._closed = True


class _NoopWriter(SummaryWriter):
    """A writer that writes nothing (``create_noop_writer``)."""

    def __init__(self) -> None:
        self.logdir = ""
        self._events = None
        self._closed = False

    def init(self) -> None:
        """Nothing to open."""

    def write(self, values: Any, step: int) -> None:
        """Drops the values."""


def create_file_writer(
    logdir: Any,
    max_queue: int | None = None,
    flush_millis: int | None = None,
    filename_suffix: str | None = None,
    name: str | None = None,
    experimental_trackable: bool = False,
) -> SummaryWriter:
    """A writer of a new event file in ``logdir`` (TensorFlow's ``tf.summary.create_file_writer``).

    ``max_queue`` events (default 10) are queued, and flushed at least every
    ``flush_millis`` (default 120000).

    Raises:
        FailedPreconditionError: the optional ``tensorboard`` package is missing.
    """
    del name, experimental_trackable
    return SummaryWriter(
        logdir,
        10 if max_queue is None else int(max_queue),
        120.0 if flush_millis is None else flush_millis / 1000.0,
        filename_suffix or "",
    )


def create_noop_writer() -> SummaryWriter:
    """A writer that writes nothing, for code that always enters a writer."""
    return _NoopWriter()
