"""``CheckpointManager``: numbered checkpoints in a directory, the newest few kept.

The directory holds ``<name>-<n>/`` checkpoints and a small ``checkpoint``
state file (JSON, replaced atomically) naming the latest and the kept ones.
Saving can be rate-limited by steps (``checkpoint_interval`` with a
``step_counter``) or by time (``checkpoint_interval_seconds``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from typing import Any

from psflow import errors
from psflow.io.files import atomic_write
from psflow.observability import events
from psflow.train.checkpoint import MANIFEST, Checkpoint

STATE_FILE = "checkpoint"


def read_state(directory: str) -> dict[str, Any] | None:
    """The manager's state file of ``directory`` (None when there is none)."""
    try:
        with open(os.path.join(directory, STATE_FILE), "rb") as f:
            state = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise errors.DataLossError(
            f"{os.path.join(directory, STATE_FILE)} is not valid JSON: {e}"
        ) from None
    latest = state.get("latest")
    if latest and not _complete(latest):
        raise errors.DataLossError(
            f"The latest checkpoint {latest} recorded in {directory} is incomplete"
        )
    return state


def _complete(path: str) -> bool:
    """A checkpoint directory with its manifest, or a weights file (both written atomically)."""
    return os.path.isfile(path) or os.path.exists(os.path.join(path, MANIFEST))


def record_latest(path: str) -> None:
    """Names the weights file ``path`` as the latest checkpoint of its directory.

    ``ModelCheckpoint`` calls this after each save, so that
    ``psflow.train.latest_checkpoint(directory)`` finds the newest weights file
    (TensorFlow's ``model.load_weights(tf.train.latest_checkpoint(dir))``).
    The path is recorded absolute: it stays valid from any working directory.
    """
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    state_path = os.path.join(directory, STATE_FILE)
    if path == state_path or os.path.isdir(state_path):
        return  # the name is taken (by these very weights, or a folder): never clobber it
    try:
        state = read_state(directory) or {}
    except errors.DataLossError:  # a state file naming something gone: replace it
        state = {}
    kept = [c for c in state.get("all", []) if c != path and os.path.exists(c)]
    state = {"latest": path, "all": [*kept, path]}
    with atomic_write(state_path) as f:
        f.write(json.dumps(state, indent=1).encode())


class CheckpointManager:
    """Saves numbered checkpoints and deletes all but the newest ``max_to_keep``.

    Args:
        checkpoint: the :class:`Checkpoint` to save.
        directory: where checkpoints go (created if missing).
        max_to_keep: how many to keep (None: all).
        checkpoint_name: the prefix of checkpoint directories.
        step_counter: a variable (or callable) giving the training step.
        checkpoint_interval: save at most every this many steps (needs ``step_counter``).
        checkpoint_interval_seconds: save at most every this many seconds.
        init_fn: called by :meth:`restore_or_initialize` when there is nothing to restore.

    Raises:
        InvalidArgumentError: a non-positive ``max_to_keep`` or interval, or an
            interval in steps without a step counter.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str,
        max_to_keep: int | None = 5,
        keep_checkpoint_every_n_hours: float | None = None,
        checkpoint_name: str = "ckpt",
        step_counter: Any = None,
        checkpoint_interval: int | None = None,
        init_fn: Callable[[], Any] | None = None,
        *,
        checkpoint_interval_seconds: float | None = None,
    ) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise errors.InvalidArgumentError(
                f"max_to_keep must be >= 1 or None, got {max_to_keep}"
            )
        if checkpoint_interval is not None:
            if checkpoint_interval < 1:
                raise errors.InvalidArgumentError(
                    f"checkpoint_interval must be >= 1, got {checkpoint_interval}"
                )
            if step_counter is None:
                raise errors.InvalidArgumentError("checkpoint_interval needs a step_counter")
        if checkpoint_interval_seconds is not None and checkpoint_interval_seconds <= 0:
            raise errors.InvalidArgumentError(
                f"checkpoint_interval_seconds must be > 0, got {checkpoint_interval_seconds}"
            )
        self._checkpoint = checkpoint
        self._directory = os.fspath(directory)
        self._max_to_keep = max_to_keep
        self._name = checkpoint_name
        self._step_counter = step_counter
        self._interval = checkpoint_interval
        self._interval_seconds = checkpoint_interval_seconds
        self._init_fn = init_fn
        self._last_step: int | None = None
        self._last_time: float | None = None
        os.makedirs(self._directory, exist_ok=True)
        state = read_state(self._directory) or {}
        self._checkpoints: list[str] = [
            c for c in state.get("all", []) if os.path.exists(os.path.join(c, MANIFEST))
        ]
        numbers = [self._number(c) for c in self._checkpoints]
        checkpoint.save_counter = max(
            [n for n in numbers if n is not None] or [int(checkpoint.save_counter)]
        )

    @staticmethod
    def _number(path: str) -> int | None:
        m = re.search(r"-(\d+)$", path)
        return int(m.group(1)) if m else None

    @property
    def directory(self) -> str:
        """Where the checkpoints are."""
        return self._directory

    @property
    def checkpoints(self) -> list[str]:
        """Kept checkpoints, oldest first."""
        return list(self._checkpoints)

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint, or None."""
        return self._checkpoints[-1] if self._checkpoints else None

    @property
    def checkpoint_interval(self) -> int | None:
        """The interval in steps, if any."""
        return self._interval

    def _current_step(self) -> int | None:
        counter = self._step_counter
        if counter is None:
            return None
        value = counter() if callable(counter) else counter
        return int(value.numpy()) if hasattr(value, "numpy") else int(value)

    def save(
        self,
        checkpoint_number: int | None = None,
        check_interval: bool = True,
        *,
        extra: dict[str, Any] | None = None,
    ) -> str | None:
        """Saves a checkpoint (unless an interval says it is too soon); returns its path or None."""
        step = self._current_step()
        now = time.monotonic()
        if check_interval:
            if (
                self._interval is not None
                and self._last_step is not None
                and step is not None
                and step - self._last_step < self._interval
            ):
                return None
            if (
                self._interval_seconds is not None
                and self._last_time is not None
                and now - self._last_time < self._interval_seconds
            ):
                return None
        if checkpoint_number is None:
            checkpoint_number = (
                step
                if step is not None and self._interval is not None
                else int(self._checkpoint.save_counter) + 1
            )
        path = os.path.join(self._directory, f"{self._name}-{int(checkpoint_number)}")
        self._checkpoint.save_counter = int(checkpoint_number)
        self._checkpoint.write(path, step=step, extra=extra)
        self._last_step, self._last_time = step, now
        self._checkpoints = [c for c in self._checkpoints if c != path] + [path]
        stale = []
        if self._max_to_keep is not None and len(self._checkpoints) > self._max_to_keep:
            stale = self._checkpoints[: -self._max_to_keep]
            self._checkpoints = self._checkpoints[-self._max_to_keep :]
        self._write_state()
        for old in stale:  # after the state file no longer names them
            shutil.rmtree(old, ignore_errors=True)
        events.publish(
            events.EventKind.CHECKPOINT_WRITTEN, "chief", f"checkpoint {path}", {"step": step}
        )
        return path

    def _write_state(self) -> None:
        state = {"latest": self.latest_checkpoint, "all": self._checkpoints}
        with atomic_write(os.path.join(self._directory, STATE_FILE)) as f:
            f.write(json.dumps(state, indent=1).encode())

    def restore_or_initialize(self) -> str | None:
        """Restores the latest checkpoint if there is one (returns its path), else runs ``init_fn``."""
        latest = self.latest_checkpoint
        if latest is not None:
            self._checkpoint.restore(latest)
            return latest
        if self._init_fn is not None:
            self._init_fn()
        return None
