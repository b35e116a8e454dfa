"""The summary ops: ``scalar``, ``histogram``, ``text`` into the default writer, and ``flush``.

Each returns True when it wrote and False when there is no default writer
(or recording is off), as in TensorFlow; the values are TensorBoard's own
protos (``scalar_pb``, ``histogram_pb``, ``text_pb``), so TensorBoard shows
them as TensorFlow's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from psflow import errors
from psflow.summary.writer import STATE, SummaryWriter, as_step


def _host(data: Any) -> np.ndarray:
    return np.asarray(data.numpy() if hasattr(data, "numpy") else data)


def should_record_summaries() -> bool:
    """Whether a summary op would write now: a default writer, and recording on."""
    record = STATE.record
    return STATE.writer is not None and bool(record() if callable(record) else record)


@contextlib.contextmanager
def record_if(condition: Any) -> Iterator[None]:
    """Records summaries in the block only when ``condition`` (a bool or a callable) holds."""
    previous = STATE.record
    STATE.record = condition
    try:
        yield
    finally:
        STATE.record = previous


def _step(step: Any) -> int:
    if step is not None:
        return as_step(step)
    if STATE.step is None:
        raise errors.InvalidArgumentError(
            "No step set for the summary: pass step=, enter writer.as_default(step=...), or "
            "call psflow.summary.experimental.set_step(step)"
        )
    return STATE.step


def _write(make: Any, step: Any) -> bool:
    writer = STATE.writer
    if writer is None:
        return False
    writer.write(make().value, _step(step))
    return True


def scalar(name: str, data: Any, step: Any = None, description: str | None = None) -> bool:
    """Writes a scalar (TensorFlow's ``tf.summary.scalar``).

    Raises:
        InvalidArgumentError: ``data`` is not a real scalar, or no step is set.
    """
    if not should_record_summaries():  # nothing to write: tensorboard is not needed
        return False
    from tensorboard.plugins.scalar import summary_v2

    value = _host(data)
    if value.ndim != 0 or value.dtype.kind not in "fiub":
        raise errors.InvalidArgumentError(
            f"summary.scalar {name!r}: data must be a real scalar, got {data!r:.200}"
        )
    return _write(lambda: summary_v2.scalar_pb(name, value.astype(np.float32), description), step)


def histogram(
    name: str,
    data: Any,
    step: Any = None,
    buckets: int | None = None,
    description: str | None = None,
) -> bool:
    """Writes the histogram of ``data``'s values (TensorFlow's ``tf.summary.histogram``; 30
    buckets by default).

    Raises:
        InvalidArgumentError: non-numeric data, or no step is set.
    """
    if not should_record_summaries():
        return False
    from tensorboard.plugins.histogram import summary_v2

    value = _host(data)
    if value.dtype.kind not in "fiub":
        raise errors.InvalidArgumentError(
            f"summary.histogram {name!r}: data must be numeric, got elements of type {value.dtype}"
        )
    values = value.astype(np.float64)
    return _write(lambda: summary_v2.histogram_pb(name, values, buckets, description), step)


def text(name: str, data: Any, step: Any = None, description: str | None = None) -> bool:
    """Writes text, a string or a string tensor of any shape (TensorFlow's ``tf.summary.text``).

    Raises:
        InvalidArgumentError: ``data`` is not text, or no step is set.
    """
    if not should_record_summaries():
        return False
    from tensorboard.plugins.text import summary_v2

    value = _host(data)
    if value.dtype.kind not in "USO":
        raise errors.InvalidArgumentError(
            f"summary.text {name!r}: data must be text, got elements of type {value.dtype}"
        )
    return _write(lambda: summary_v2.text_pb(name, value.astype(object), description), step)


def flush(writer: SummaryWriter | None = None, name: str | None = None) -> None:
    """Writes ``writer``'s (by default the default writer's) pending events to disk."""
    del name
    target = writer if writer is not None else STATE.writer
    if target is not None:
        target.flush()
