"""``psflow.summary.experimental``: the thread's default step (TensorFlow's ``set_step``)."""

from __future__ import annotations

from typing import Any

from psflow.summary.writer import STATE, as_step


def set_step(step: Any) -> None:
    """Sets the default step of summary ops in this thread (None clears it).

    Raises:
        InvalidArgumentError: ``step`` is not an integer scalar.
    """
    STATE.step = None if step is None else as_step(step)


def get_step() -> int | None:
    """The default step of this thread, or None."""
    return STATE.step
