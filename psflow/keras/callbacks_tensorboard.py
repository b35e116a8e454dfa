"""``TensorBoard``: scalars of ``fit`` as event files that TensorBoard reads.

The events are written through :class:`psflow.summary.event_writer.EventWriter`
(the ``tensorboard`` package's own ``EventFileWriter``, which ``psflow.summary``
writes through too) as TensorFlow 2 scalar summaries, so TensorBoard shows them
as Keras's would.
The package is optional (``pip install psflow[tensorboard]``); it is
imported when the callback is created, with a clear error when missing.

Only the process running ``fit`` writes: under ParameterServerStrategy that
is the chief (workers run closures, never callbacks), under
MirroredStrategy the one process, under MultiWorkerMirroredStrategy the
chief alone (``strategy.extended.should_save_summary``), TensorFlow's rule. Values are the aggregated logs ``fit``
already gathered, so every strategy writes the same curves.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from psflow import errors
from psflow.keras.callbacks_base import Callback
from psflow.summary import event_writer


def _writer_library() -> Any:
    try:
        event_writer.library()
        from tensorboard.plugins.scalar import summary_v2
    except (ImportError, errors.FailedPreconditionError) as e:
        raise errors.FailedPreconditionError(
            "The TensorBoard callback needs the 'tensorboard' package: "
            "pip install 'psflow[tensorboard]' (or pip install tensorboard)"
        ) from e
    return summary_v2


class TensorBoard(Callback):
    """Writes the logs of ``fit`` for TensorBoard (Keras's ``keras.callbacks.TensorBoard``).

    Training scalars go to ``<log_dir>/train``, validation ones (the ``val_``
    logs, prefix dropped) to ``<log_dir>/validation``, tagged ``epoch_<name>``
    at each epoch's index. With ``update_freq=N`` the running training logs are
    also written every N batches as ``batch_<name>``, at the global batch index.

    Example:
        >>> import psflow as pf
        >>> cb = pf.keras.callbacks.TensorBoard(log_dir="/tmp/logs", update_freq=10)

    Args:
        log_dir: the directory for the event files.
        update_freq: ``"epoch"`` or a number of batches.
        write_steps_per_second: also write ``epoch_steps_per_second``.

    Raises:
        FailedPreconditionError: the ``tensorboard`` package is not installed.
        InvalidArgumentError: ``update_freq`` is neither ``"epoch"``/``"batch"``
            nor a positive integer.
    """

    def __init__(
        self,
        log_dir: Any = "logs",
        histogram_freq: int = 0,
        write_graph: bool = True,
        write_images: bool = False,
        write_steps_per_second: bool = False,
        update_freq: Any = "epoch",
        profile_batch: Any = 0,
        embeddings_freq: int = 0,
        embeddings_metadata: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self._summary = _writer_library()
        if update_freq == "batch":
            update_freq = 1
        if update_freq != "epoch" and (
            isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1
        ):
            raise errors.InvalidArgumentError(
                f"TensorBoard: update_freq must be 'epoch', 'batch' or an int >= 1, got "
                f"{update_freq!r}"
            )
        if histogram_freq or embeddings_freq or write_images or profile_batch:
            raise errors.UnimplementedError(
                "TensorBoard: only scalars are written (histogram_freq, embeddings_freq, "
                "write_images and profile_batch must stay off)"
            )
        self.log_dir = os.fspath(log_dir)
        self.update_freq = update_freq
        self.write_steps_per_second = write_steps_per_second
        self._writers: dict[str, Any] = {}
        self._train_step = 0
        self._epoch_start = 0.0
        self._epoch_steps = 0

    def _writer(self, kind: str) -> Any:
        writer = self._writers.get(kind)
        if writer is None:
            writer = event_writer.EventWriter(os.path.join(self.log_dir, kind))
            self._writers[kind] = writer
        return writer

    def _write(self, kind: str, prefix: str, logs: dict[str, Any], step: int) -> None:
        if not self.model.distribute_strategy.extended.should_save_summary:
            return  # another worker of a multi-worker job: the chief writes the same curves
        values = []
        for name, value in logs.items():
            try:
                scalar = float(np.asarray(value))
            except (TypeError, ValueError):
                continue  # not a scalar (Keras skips those too)
            summary = self._summary.scalar_pb(f"{prefix}{name}", np.float32(scalar))
            values.extend(summary.value)
        if not values:
            return
        self._writer(kind).write(values, step)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._train_step = 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch_start = time.monotonic()
        self._epoch_steps = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._train_step += 1
        self._epoch_steps += 1
        if self.update_freq != "epoch" and self._train_step % self.update_freq == 0:
            self._write("train", "batch_", dict(logs or {}), self._train_step)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs = dict(logs or {})
        train = {k: v for k, v in logs.items() if not k.startswith("val_")}
        if self.write_steps_per_second:
            elapsed = max(time.monotonic() - self._epoch_start, 1e-9)
            train["steps_per_second"] = self._epoch_steps / elapsed
        self._write("train", "epoch_", train, epoch)
        val = {k[len("val_") :]: v for k, v in logs.items() if k.startswith("val_")}
        self._write("validation", "epoch_", val, epoch)
        for writer in self._writers.values():
            writer.flush()

    def on_train_end(self, logs: dict | None = None) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
