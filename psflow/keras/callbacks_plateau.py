"""``ReduceLROnPlateau``: lowers the learning rate when a metric stops improving."""

from __future__ import annotations

import math
from typing import Any

from psflow import errors
from psflow.keras.callbacks_base import Callback


class ReduceLROnPlateau(Callback):
    """Multiplies the learning rate by ``factor`` after ``patience`` epochs without improvement.

    As TensorFlow documents it: an epoch improves on the best value when
    ``monitor`` is lower by more than ``min_delta`` (higher, in ``"max"`` mode;
    ``"auto"`` picks max for accuracies). After a reduction, ``cooldown``
    epochs pass before counting resumes; the rate never goes below ``min_lr``.
    The rate in effect is added to the epoch's logs as ``learning_rate``.

    Example:
        >>> import psflow as pf
        >>> cb = pf.keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=2)

    Raises:
        InvalidArgumentError: ``factor`` >= 1, or an unknown ``mode``.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        factor: float = 0.1,
        patience: int = 10,
        verbose: int = 0,
        mode: str = "auto",
        min_delta: float = 1e-4,
        cooldown: int = 0,
        min_lr: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if float(factor) >= 1.0:
            raise errors.InvalidArgumentError(
                f"ReduceLROnPlateau does not support a factor >= 1.0, got {factor!r}"
            )
        if mode not in ("auto", "min", "max"):
            raise errors.InvalidArgumentError(
                f"ReduceLROnPlateau: mode must be auto, min or max, got {mode!r}"
            )
        if "epsilon" in kwargs:  # the old name of min_delta
            min_delta = kwargs.pop("epsilon")
        if kwargs:
            raise TypeError(f"ReduceLROnPlateau got unexpected arguments {sorted(kwargs)}")
        self.monitor, self.factor, self.patience = monitor, float(factor), int(patience)
        self.verbose, self.min_delta = verbose, float(min_delta)
        self.cooldown, self.min_lr = int(cooldown), float(min_lr)
        self.mode = ("max" if "acc" in monitor else "min") if mode == "auto" else mode
        self._reset()

    def _reset(self) -> None:
        self.best = math.inf if self.mode == "min" else -math.inf
        self.wait = 0
        self.cooldown_counter = 0

    def _improved(self, current: float) -> bool:
        if self.mode == "min":
            return current < self.best - self.min_delta
        return current > self.best + self.min_delta

    def in_cooldown(self) -> bool:
        """Whether reductions are paused after the last one."""
        return self.cooldown_counter > 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._reset()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs = logs if logs is not None else {}
        optimizer = self.model.optimizer
        logs["learning_rate"] = float(optimizer.learning_rate)
        current = logs.get(self.monitor)
        if current is None:
            return  # Keras warns and does nothing when the metric is absent
        if self.in_cooldown():
            self.cooldown_counter -= 1
            self.wait = 0
        if self._improved(float(current)):
            self.best = float(current)
            self.wait = 0
        elif not self.in_cooldown():
            self.wait += 1
            if self.wait >= self.patience:
                old_lr = float(optimizer.learning_rate)
                if old_lr > self.min_lr:
                    new_lr = max(old_lr * self.factor, self.min_lr)
                    optimizer.learning_rate = new_lr
                    if self.verbose:
                        print(
                            f"Epoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to "
                            f"{new_lr}.",
                            flush=True,
                        )
                    self.cooldown_counter = self.cooldown
                    self.wait = 0
