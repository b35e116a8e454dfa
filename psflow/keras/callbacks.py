"""Training callbacks (Keras's ``keras.callbacks``).

The base class and the list that calls the hooks are in
:mod:`psflow.keras.callbacks_base`; callbacks with modules of their own
(:mod:`.callbacks_plateau`, :mod:`.callbacks_tensorboard`) build on that base
and are re-exported here, so nothing depends on the order of imports.
"""

from __future__ import annotations

import csv
import inspect
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from psflow import errors
from psflow.keras.callbacks_base import Callback, CallbackList
from psflow.keras.callbacks_plateau import ReduceLROnPlateau
from psflow.keras.callbacks_tensorboard import TensorBoard
from psflow.keras.utils.progbar import Progbar
from psflow.train.manager import record_latest

__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "History",
    "LambdaCallback",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "ProgbarLogger",
    "ProgressPublisher",
    "ReduceLROnPlateau",
    "TensorBoard",
    "TerminateOnNaN",
]


class History(Callback):
    """Records every epoch's logs: ``history.history["loss"]`` is a list per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[float]] = {}
        self.epoch: list[int] = []

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.epoch = []

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.epoch.append(epoch)
        for k, v in (logs or {}).items():
            self.history.setdefault(k, []).append(v)


class ProgbarLogger(Callback):
    """Prints ``Epoch i/n`` and a progress bar per epoch (Keras 2's format)."""

    def __init__(self) -> None:
        super().__init__()
        self._bar: Progbar | None = None
        self._seen = 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        verbose, epochs = self.params.get("verbose", 1), self.params.get("epochs", 1)
        if verbose and epochs > 1:
            print(f"Epoch {epoch + 1}/{epochs}", flush=True)
        self._bar = Progbar(self.params.get("steps"), verbose=verbose)
        self._seen = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._seen = batch + 1
        if self._bar is not None and self._bar._interactive:
            self._bar.update(self._seen, list((logs or {}).items()), finalize=False)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._bar is not None:
            if self._bar.target is None:
                self._bar.target = self._seen
            self._bar.update(self._seen, list((logs or {}).items()), finalize=True)

    def on_test_begin(self, logs: dict | None = None) -> None:
        if self.params.get("_evaluate_alone"):
            self._bar = Progbar(self.params.get("steps"), verbose=self.params.get("verbose", 1))
            self._seen = 0

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.params.get("_evaluate_alone"):
            self.on_train_batch_end(batch, logs)

    def on_test_end(self, logs: dict | None = None) -> None:
        if self.params.get("_evaluate_alone") and self._bar is not None:
            if self._bar.target is None:
                self._bar.target = self._seen
            self._bar.update(self._seen, list((logs or {}).items()), finalize=True)

    # predict: one bar over its batches, no logs (Keras's line: "2/2 [====] - 0s 3ms/step")
    def on_predict_begin(self, logs: dict | None = None) -> None:
        self._bar = Progbar(self.params.get("steps"), verbose=self.params.get("verbose", 1))
        self._seen = 0

    def on_predict_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._seen = batch + 1
        if self._bar is not None and self._bar._interactive:
            self._bar.update(self._seen, finalize=False)

    def on_predict_end(self, logs: dict | None = None) -> None:
        if self._bar is not None:
            if self._bar.target is None:
                self._bar.target = self._seen
            self._bar.update(self._seen, finalize=True)


class ProgressPublisher(Callback):
    """Reports ``fit``'s steps and epochs to a ``psflow.observability.progress.TrainingProgress``.

    ``fit`` adds one by itself when the process installed a recorder (the
    chief does when its dashboard is on); pass one explicitly to record a
    particular run.
    """

    def __init__(self, progress: Any) -> None:
        super().__init__()
        self.progress = progress
        self._epoch = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.progress.train_begin(self.params.get("epochs"), self.params.get("steps"))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.progress.step(self._epoch, batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.progress.epoch_end(epoch, logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        self.progress.train_end()


def _improved(monitor: str, mode: str, current: float, best: float, min_delta: float) -> bool:
    if mode == "auto":
        mode = (
            "max"
            if ("acc" in monitor or monitor.startswith("fmeasure") or "auc" in monitor)
            else "min"
        )
    if mode == "min":
        return current < best - min_delta
    return current > best + min_delta


def _initial_best(monitor: str, mode: str) -> float:
    if mode == "auto":
        mode = "max" if ("acc" in monitor or "auc" in monitor) else "min"
    return math.inf if mode == "min" else -math.inf


class EarlyStopping(Callback):
    """Stops training when ``monitor`` stops improving for ``patience`` epochs."""

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0.0,
        patience: int = 0,
        verbose: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
    ) -> None:
        super().__init__()
        if mode not in ("auto", "min", "max"):
            raise errors.InvalidArgumentError(
                f"EarlyStopping: mode must be auto, min or max, got {mode!r}"
            )
        self.monitor, self.min_delta, self.patience = monitor, abs(min_delta), patience
        self.mode, self.baseline, self.restore_best_weights = mode, baseline, restore_best_weights
        self.start_from_epoch, self.verbose = start_from_epoch, verbose
        self.stopped_epoch = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.wait = 0
        self.stopped_epoch = 0
        self.best = (
            _initial_best(self.monitor, self.mode) if self.baseline is None else self.baseline
        )
        self.best_weights = None
        self.best_epoch = 0

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        current = (logs or {}).get(self.monitor)
        if current is None or epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:
            self.best_weights = self.model.get_weights()
        self.wait += 1
        if _improved(self.monitor, self.mode, current, self.best, self.min_delta):
            self.best, self.best_epoch, self.wait = current, epoch, 0
            if self.restore_best_weights:
                self.best_weights = self.model.get_weights()
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.stopped_epoch and self.verbose:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping", flush=True)
        if self.restore_best_weights and self.best_weights is not None and self.stopped_epoch:
            self.model.set_weights(self.best_weights)


class ModelCheckpoint(Callback):
    """Saves the model's weights (``save_weights_only``) after epochs, optionally only the best.

    ``filepath`` may hold ``{epoch}`` and log names, e.g. ``"ckpt-{epoch:02d}.weights.h5"``;
    files are written in psflow's weights format (safetensors) whatever the suffix.
    """

    def __init__(
        self,
        filepath: str,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = True,
        mode: str = "auto",
        save_freq: Any = "epoch",
        initial_value_threshold: float | None = None,
    ) -> None:
        super().__init__()
        if save_freq != "epoch" and not isinstance(save_freq, int):
            raise errors.InvalidArgumentError(
                f"ModelCheckpoint: save_freq must be 'epoch' or an int, got {save_freq!r}"
            )
        self.filepath, self.monitor, self.verbose = os.fspath(filepath), monitor, verbose
        self.save_best_only, self.mode, self.save_freq = save_best_only, mode, save_freq
        self.best = (
            initial_value_threshold
            if initial_value_threshold is not None
            else _initial_best(monitor, mode)
        )
        self._batches = 0  # batches since the last save (with an integer save_freq)
        self._last_batch = -1  # the index of the last batch seen

    def _save(self, epoch: int, logs: dict | None) -> None:
        if not self.model.distribute_strategy.extended.should_checkpoint:
            return  # a multi-worker job: the chief (worker 0) writes; its weights are the same
        logs = logs or {}
        path = self.filepath.format(epoch=epoch + 1, **logs)
        if self.save_best_only:
            current = logs.get(self.monitor)
            if current is None or not _improved(self.monitor, self.mode, current, self.best, 0.0):
                return
            self.best = current
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.model.save_weights(path)
        # named in the directory's state file: psflow.train.latest_checkpoint(dir) finds it
        record_latest(path)
        if self.verbose:
            print(f"Epoch {epoch + 1}: saving model to {path}", flush=True)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if isinstance(self.save_freq, int):
            # counted by index, as Keras does: one call may end an execution of several batches
            added = batch + 1 if batch <= self._last_batch else batch - self._last_batch
            self._last_batch = batch
            self._batches += added
            if self._batches >= self.save_freq:
                self._batches = 0
                self._save(self._epoch, logs)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch, logs)


class CSVLogger(Callback):
    """Appends (or writes) every epoch's logs as a CSV row."""

    def __init__(self, filename: str, separator: str = ",", append: bool = False) -> None:
        super().__init__()
        self.filename, self.sep, self.append = os.fspath(filename), separator, append
        self._file: Any = None
        self._writer: Any = None
        self._keys: list[str] | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        exists = (
            self.append and os.path.exists(self.filename) and os.path.getsize(self.filename) > 0
        )
        self._file = open(self.filename, "a" if self.append else "w", newline="")  # noqa: SIM115
        self._header_written = exists
        self._keys = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs = logs or {}
        if self._keys is None:
            self._keys = sorted(logs)
            self._writer = csv.DictWriter(
                self._file, fieldnames=["epoch", *self._keys], delimiter=self.sep
            )
            if not self._header_written:
                self._writer.writeheader()
        row = {"epoch": epoch, **{k: logs.get(k, "NA") for k in self._keys}}
        self._writer.writerow(row)
        self._file.flush()

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class LambdaCallback(Callback):
    """Callbacks from plain functions: ``LambdaCallback(on_epoch_end=lambda epoch, logs: ...)``."""

    def __init__(
        self,
        on_epoch_begin: Callable | None = None,
        on_epoch_end: Callable | None = None,
        on_train_begin: Callable | None = None,
        on_train_end: Callable | None = None,
        on_train_batch_begin: Callable | None = None,
        on_train_batch_end: Callable | None = None,
        **kwargs: Callable,
    ) -> None:
        super().__init__()
        hooks = {
            "on_epoch_begin": on_epoch_begin,
            "on_epoch_end": on_epoch_end,
            "on_train_begin": on_train_begin,
            "on_train_end": on_train_end,
            "on_train_batch_begin": on_train_batch_begin or kwargs.pop("on_batch_begin", None),
            "on_train_batch_end": on_train_batch_end or kwargs.pop("on_batch_end", None),
            **kwargs,
        }
        for name, fn in hooks.items():
            if fn is None:
                continue
            if not hasattr(Callback, name):
                raise errors.InvalidArgumentError(f"LambdaCallback: unknown hook {name!r}")
            setattr(self, name, fn)


class TerminateOnNaN(Callback):
    """Stops training when the loss becomes NaN or infinite."""

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        loss = (logs or {}).get("loss")
        if loss is not None and not np.isfinite(loss):
            print(f"Batch {batch}: Invalid loss, terminating training", flush=True)
            self.model.stop_training = True


class LearningRateScheduler(Callback):
    """Sets the optimizer's learning rate to ``schedule(epoch, lr)`` at each epoch's start.

    ``schedule`` may also take the epoch alone (``decay(epoch)``, as in
    TensorFlow's distributed-training tutorial); which form it has is read from
    its signature once, so a ``TypeError`` raised inside it is never mistaken
    for the other form.
    """

    def __init__(self, schedule: Callable[..., float], verbose: int = 0) -> None:
        super().__init__()
        self.schedule, self.verbose = schedule, verbose
        self._takes_lr = _accepts_two_positional(schedule)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self._takes_lr:
            lr = float(self.schedule(epoch, float(self.model.optimizer.learning_rate)))
        else:
            lr = float(self.schedule(epoch))
        self.model.optimizer.learning_rate = lr
        if self.verbose:
            print(
                f"Epoch {epoch + 1}: LearningRateScheduler setting learning rate to {lr}.",
                flush=True,
            )


def _accepts_two_positional(fn: Callable[..., Any]) -> bool:
    """Whether ``fn(a, b)`` binds; callables without a signature get the two-argument form."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(0, 0.0)
    except TypeError:
        return False
    return True


class BackupAndRestore(Callback):
    """Fault tolerance for ``fit`` (TensorFlow's ``BackupAndRestore``).

    Saves the model, its optimizer and where training stands to ``backup_dir``
    at the end of every epoch (or every ``save_freq`` batches). When ``fit``
    starts and a backup exists — the chief was restarted — it restores it and
    continues where the backup was taken: with the next epoch, or, with an
    integer ``save_freq``, after the last batch backed up within its epoch (as
    TensorFlow does), so ``fit(epochs=E)`` completes E epochs in total. Each
    epoch's batches come in the same order however often the chief restarted,
    so with one worker and one closure in flight (``PSFLOW_CLOSURES_IN_FLIGHT=1``:
    closures then run in the order they are scheduled) a resumed ``fit`` ends
    with the weights of an uninterrupted one, bit for bit; with several workers
    (or two closures in flight, the default) the order in which closures apply
    is not deterministic, in an uninterrupted run too, and what is reproduced
    is the state at the backup and the batches each epoch trains. Under a
    ParameterServerStrategy a backup every ``save_freq`` batches holds exactly
    those batches: the steps in flight finish first and no later one starts
    before it is written (the pipeline drains once per backup). Under a ParameterServerStrategy it
    also lets ``fit`` survive a lost parameter server: once the PS task is back,
    every PS rolls back to the last backup and training resumes from there.
    With ``delete_checkpoint`` the backup is removed when training completes.
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: Any = "epoch",
        delete_checkpoint: bool = True,
        save_before_preemption: bool = False,
    ) -> None:
        super().__init__()
        if not backup_dir:
            raise errors.InvalidArgumentError("BackupAndRestore needs a backup_dir")
        if save_freq != "epoch" and not (
            isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0
        ):
            raise errors.InvalidArgumentError(
                f"save_freq must be 'epoch' or a positive int, got {save_freq!r}"
            )
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self._manager: Any = None
        self._epoch = 0
        self._batches = 0  # training steps since the first fit began (restored with a backup)
        self._epoch_base = 0  # self._batches when batch 0 of the current epoch began
        self.initial_step = 0
        """Batches of the restored epoch the last restore found done already."""

    def _ensure_manager(self) -> Any:
        if self._manager is None:
            from psflow.train import Checkpoint, CheckpointManager

            ckpt = Checkpoint(model=self.model)
            self._manager = CheckpointManager(
                ckpt, self.backup_dir, max_to_keep=2, checkpoint_name="backup"
            )
        return self._manager

    def restore(self) -> int | None:
        """Restores the latest backup; returns the epoch to continue with (None: no
        backup) and sets :attr:`initial_step`, the batches of it done already."""
        manager = self._ensure_manager()
        latest = manager.latest_checkpoint
        if latest is None:
            return None
        status = manager._checkpoint.restore(latest)
        self.initial_step = int(status.scalars.get("step_in_epoch", 0))
        self._batches = int(status.scalars.get("batches", 0))
        return int(status.scalars.get("next_epoch", 0))

    def save(self, next_epoch: int, step_in_epoch: int = 0) -> str | None:
        """Backs up the model with where training continues: ``step_in_epoch``
        batches of epoch ``next_epoch`` are done.  In a multi-worker job only
        the chief (worker 0) writes: every worker holds the same state."""
        if not self.model.distribute_strategy.extended.should_checkpoint:
            return None
        return self._ensure_manager().save(
            check_interval=False,
            extra={
                "next_epoch": int(next_epoch),
                "step_in_epoch": int(step_in_epoch),
                "batches": int(self._batches),
            },
        )

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        # a resumed epoch's first batch is numbered initial_step (its earlier ones are done)
        self._epoch_base = self._batches - self.initial_step
        self.initial_step = 0

    def settle_after(self, batch: int) -> bool:
        """True at each ``save_freq``-th batch: the backup must hold it and nothing after."""
        return (
            isinstance(self.save_freq, int) and (self._epoch_base + batch + 1) % self.save_freq == 0
        )

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        before, self._batches = self._batches, self._epoch_base + batch + 1
        # a multiple of save_freq reached: exactly, or within an execution of several batches
        if isinstance(self.save_freq, int) and before // self.save_freq < (
            self._batches // self.save_freq
        ):
            self.save(self._epoch, batch + 1)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.save_freq == "epoch":
            self.save(epoch + 1)

    def on_train_end(self, logs: dict | None = None) -> None:
        if not self.model.distribute_strategy.extended.should_checkpoint:
            return  # the chief removes the backup it wrote
        if self.delete_checkpoint:  # only reached when fit completes
            import shutil

            shutil.rmtree(self.backup_dir, ignore_errors=True)
            self._manager = None
