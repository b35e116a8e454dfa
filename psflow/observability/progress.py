"""Training progress as the chief's dashboard shows it: loss per step, epoch logs, speed, ETA.

``Model.fit`` reports to the installed :class:`TrainingProgress` through a
callback (``psflow.keras.callbacks.ProgressPublisher``) when one is installed;
a custom training loop can call :meth:`TrainingProgress.step` itself.  The
recorder keeps a bounded series: when it fills up, every other point is
dropped, so a long run still plots from its first step at half the resolution.

Keras's batch logs are running means over the epoch so far, which plot as a
saw-tooth that restarts at every epoch. For every loss the recorder also keeps
the step's own value, ``batch_<name>``, derived from two successive means:
``batch_k = k * mean_k - (k - 1) * mean_(k-1)`` for the k-th step of an epoch
(exact when the epoch's batches weigh the same, as all but a smaller last one
do; that one's value is approximate). The page plots these.

Example:
    >>> p = TrainingProgress(max_points=4, clock=iter(range(100)).__next__)
    >>> p.train_begin(epochs=2, steps_per_epoch=3)
    >>> for i in range(3):
    ...     p.step(0, i, {"loss": 1.0 / (i + 1)})
    >>> p.epoch_end(0, {"loss": 0.6})
    >>> s = p.snapshot()
    >>> s["global_step"], s["epoch"], [pt["step"] for pt in s["steps"]]
    (3, 1, [1, 2, 3])
    >>> [round(pt["batch_loss"], 4) for pt in s["steps"]]  # means 1, 1/2, 1/3
    [1.0, 0.0, 0.0]
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from psflow.errors import InvalidArgumentError

from . import events

__all__ = ["TrainingProgress", "install", "installed"]

_SPEED_WINDOW = 20
"""Steps/s is measured over the last this many steps: current speed, not the run's average."""


def _scalars(logs: Mapping[str, Any] | None) -> dict[str, float]:
    """The finite-or-not float values of ``logs`` (non-numbers dropped; NaN kept as None)."""
    out: dict[str, float] = {}
    for k, v in (logs or {}).items():
        try:
            out[str(k)] = float(v)
        except (TypeError, ValueError):
            continue
    return out


def _json_number(x: float) -> float | None:
    return x if math.isfinite(x) else None


class TrainingProgress:
    """Thread-safe record of one training run (the latest ``train_begin`` starts a new one).

    Args:
        max_points: most step points kept (>= 2); older ones are thinned.
        clock: seconds, monotonic (injectable in tests).

    Raises:
        InvalidArgumentError: ``max_points`` < 2.
    """

    def __init__(self, max_points: int = 2000, clock: Callable[[], float] = time.monotonic):
        if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 2:
            raise InvalidArgumentError(f"max_points {max_points!r} must be an integer >= 2")
        self._max_points = max_points
        self._clock = clock
        self._lock = threading.Lock()
        self._reset(None, None)

    def _reset(self, epochs: int | None, steps_per_epoch: int | None) -> None:
        self._epochs = epochs
        self._steps_per_epoch = steps_per_epoch
        self._state = "idle" if epochs is None else "running"
        self._epoch = 0
        self._step_in_epoch = 0
        self._global_step = 0
        self._points: list[dict[str, Any]] = []
        self._epoch_logs: list[dict[str, Any]] = []
        self._times: list[float] = []
        self._means: dict[str, float] = {}  # the epoch's running losses at the previous step
        self._means_at: tuple[int, int] | None = None  # (epoch, step) they belong to
        self._started = self._clock()

    def train_begin(self, epochs: int | None = None, steps_per_epoch: int | None = None) -> None:
        """A run starts: ``epochs`` and ``steps_per_epoch`` when known (for the ETA)."""
        with self._lock:
            self._reset(epochs, steps_per_epoch)
        events.publish(
            events.EventKind.TRAINING_STARTED,
            "chief",
            f"training started: {epochs if epochs is not None else '?'} epochs",
            {"epochs": epochs, "steps_per_epoch": steps_per_epoch},
        )

    def step(self, epoch: int, step_in_epoch: int, logs: Mapping[str, Any] | None) -> None:
        """Step ``step_in_epoch`` (0-based) of ``epoch`` finished with running ``logs``."""
        now = self._clock()
        values = _scalars(logs)
        with self._lock:
            if self._state == "idle":
                self._state = "running"
            self._epoch = epoch
            self._step_in_epoch = step_in_epoch + 1
            self._global_step += 1
            self._times.append(now)
            del self._times[: -(_SPEED_WINDOW + 1)]
            batch = self._batch_losses(epoch, step_in_epoch, values)
            self._points.append({"step": self._global_step, "epoch": epoch, **values, **batch})
            if len(self._points) > self._max_points:
                self._points = self._points[1::2]  # keep the latest point, halve the rest

    def _batch_losses(
        self, epoch: int, step_in_epoch: int, means: Mapping[str, float]
    ) -> dict[str, float]:
        """``batch_<loss>`` for each loss in ``means`` (running means of the epoch)."""
        k = step_in_epoch + 1
        follows = self._means_at == (epoch, step_in_epoch - 1)
        out = {}
        for key, mean in means.items():
            if "loss" not in key:
                continue
            if k == 1:
                out[f"batch_{key}"] = mean
            elif follows and key in self._means:  # a skipped step leaves a gap instead
                out[f"batch_{key}"] = k * mean - (k - 1) * self._means[key]
        self._means = {key: v for key, v in means.items() if "loss" in key}
        self._means_at = (epoch, step_in_epoch)
        return out

    def epoch_end(self, epoch: int, logs: Mapping[str, Any] | None) -> None:
        """``epoch`` (0-based) finished with ``logs`` (validation metrics too)."""
        values = _scalars(logs)
        with self._lock:
            self._epoch_logs.append({"epoch": epoch, **values})
            self._epoch = epoch + 1
            self._step_in_epoch = 0
            if self._steps_per_epoch is None:
                self._steps_per_epoch = self._global_step // max(len(self._epoch_logs), 1)
        shown = ", ".join(f"{k}={v:.4g}" for k, v in values.items())
        events.publish(
            events.EventKind.EPOCH_END, "chief", f"epoch {epoch + 1} done: {shown}", values
        )

    def train_end(self) -> None:
        """The run finished."""
        with self._lock:
            self._state = "finished"
        events.publish(events.EventKind.TRAINING_ENDED, "chief", "training finished")

    def snapshot(self) -> dict[str, Any]:
        """The ``training`` object of ``/api/cluster`` (see the schema in tests/schemas/)."""
        with self._lock:
            times = list(self._times)
            speed = None
            if len(times) > 1 and self._state == "running":
                # up to now, not to the last step: a stalled run's speed falls towards zero
                span = max(times[-1] - times[0], self._clock() - times[0])
                speed = (len(times) - 1) / span if span > 0 else None
            eta = None
            if self._epochs is not None and self._steps_per_epoch and speed:
                total = self._epochs * self._steps_per_epoch
                done = self._epoch * self._steps_per_epoch + self._step_in_epoch
                eta = max(total - done, 0) / speed if self._state == "running" else 0.0
            return {
                "state": self._state,
                "epoch": self._epoch,
                "epochs": self._epochs,
                "step_in_epoch": self._step_in_epoch,
                "steps_per_epoch": self._steps_per_epoch,
                "global_step": self._global_step,
                "steps_per_second": speed,
                "eta_seconds": eta,
                "elapsed_seconds": self._clock() - self._started,
                "steps": [
                    {k: (_json_number(v) if isinstance(v, float) else v) for k, v in p.items()}
                    for p in self._points
                ],
                "epoch_logs": [
                    {k: (_json_number(v) if isinstance(v, float) else v) for k, v in e.items()}
                    for e in self._epoch_logs
                ],
            }


_installed: TrainingProgress | None = None


def install(progress: TrainingProgress | None) -> TrainingProgress | None:
    """Makes ``Model.fit`` report to ``progress`` in this process; returns the previous one."""
    global _installed
    previous, _installed = _installed, progress
    return previous


def installed() -> TrainingProgress | None:
    """The recorder ``Model.fit`` reports to, or None."""
    return _installed
