"""One event file of TensorBoard summaries, written by the ``tensorboard`` package's writer.

``EventFileWriter`` is TensorBoard's own (PyTorch's ``SummaryWriter`` uses it
too): it names the file ``events.out.tfevents.*``, writes the version record
first and queues events on a thread. Both ``psflow.summary`` and the Keras
``TensorBoard`` callback write through :class:`EventWriter`, so their files
are the same kind. The package is optional (``pip install psflow[tensorboard]``)
and imported when a writer is made.
"""

from __future__ import annotations

import os
import time
from typing import Any

from psflow import errors


def library() -> tuple[Any, Any]:
    """``(EventFileWriter, event_pb2)`` from the ``tensorboard`` package.

    Raises:
        FailedPreconditionError: ``tensorboard`` is not installed (says how to install it).
    """
    try:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError as e:
        raise errors.FailedPreconditionError(
            "Writing TensorBoard summaries needs the 'tensorboard' package: "
            "pip install 'psflow[tensorboard]' (or pip install tensorboard)"
        ) from e
    return EventFileWriter, event_pb2


class EventWriter:
    """Appends summary events to one new event file in ``logdir`` (created if missing).

    Example:
        >>> from tensorboard.plugins.scalar import summary_v2  # doctest: +SKIP
        >>> w = EventWriter("/tmp/logs")  # doctest: +SKIP
        >>> w.write(summary_v2.scalar_pb("loss", 0.5).value, step=1)  # doctest: +SKIP

    Raises:
        FailedPreconditionError: ``tensorboard`` is not installed.
    """

    def __init__(
        self, logdir: Any, max_queue: int = 10, flush_secs: float = 120, suffix: str = ""
    ) -> None:
        writer_cls, self._event_pb2 = library()
        self.logdir = os.fspath(logdir)
        os.makedirs(self.logdir, exist_ok=True)
        self._writer = writer_cls(self.logdir, max_queue, flush_secs, suffix)

    def write(self, values: Any, step: int) -> None:
        """One event at ``step`` holding the summary ``values`` (``Summary.Value`` protos)."""
        event = self._event_pb2.Event(wall_time=time.time(), step=int(step))
        event.summary.value.extend(values)
        self._writer.add_event(event)

    def flush(self) -> None:
        """Writes the queued events to disk."""
        self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the file."""
        self._writer.close()
