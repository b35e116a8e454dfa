"""How one training (or evaluation) step runs: the seam between Keras and the strategies.

``fit`` asks the active strategy for a runner (``strategy.extended._keras_runner``);
the default runs steps in this process, in the strategy's replica context.
MirroredStrategy splits each batch across its replicas, and
ParameterServerStrategy schedules steps on workers through the coordinator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from psflow import backend, errors


class LocalRunner:
    """Runs each step here, through ``strategy.run`` (one replica by default)."""

    def __init__(self, model: Any, strategy: Any) -> None:
        self.model = model
        self.strategy = strategy

    def _steps(
        self,
        source: Any,
        steps: int | None,
        step_fn: Callable[[Any], Any],
        on_begin: Callable[[int], None],
        on_end: Callable[[int, dict], None],
    ) -> int:
        it: Iterator = iter(source)
        step = 0
        while steps is None or step < steps:
            try:
                batch = next(it)
            except StopIteration:
                if steps is not None and step == 0:
                    raise errors.OutOfRangeError(
                        "Your input ran out of data; make sure the dataset can generate at least "
                        f"steps_per_epoch * epochs batches (steps_per_epoch={steps})"
                    ) from None
                break
            except errors.OutOfRangeError:
                break
            on_begin(step)  # only once a batch exists: no begin hook without its end
            step_fn(batch)
            on_end(step, self.model._current_logs())
            step += 1
            if self.model.stop_training:
                break
        return step

    def train_epoch(self, source: Any, steps: int | None, callbacks: Any) -> int:
        """Runs one epoch of training steps; returns how many ran."""
        return self._steps(
            source,
            steps,
            lambda batch: self.strategy.run(self.model.train_step, args=(batch,)),
            callbacks.on_train_batch_begin,
            callbacks.on_train_batch_end,
        )

    def test_epoch(self, source: Any, steps: int | None, callbacks: Any) -> int:
        """Runs evaluation steps over the source; returns how many ran."""
        return self._steps(
            source,
            steps,
            lambda batch: self.strategy.run(self.model.test_step, args=(batch,)),
            callbacks.on_test_batch_begin,
            callbacks.on_test_batch_end,
        )

    def predict(self, source: Any, steps: int | None, callbacks: Any) -> list[Any]:
        """Runs prediction steps; returns the host arrays of every batch's predictions."""
        outputs: list[Any] = []

        def step_fn(batch: Any) -> None:
            y = self.strategy.run(self.model.predict_step, args=(batch,))
            outputs.append(_host(y))

        self._steps(
            source,
            steps,
            step_fn,
            callbacks.on_predict_batch_begin,
            lambda s, logs: callbacks.on_predict_batch_end(s, {}),
        )
        return outputs


def _host(value: Any) -> Any:
    from psflow.util import nest

    return nest.map_structure(
        lambda v: backend.to_numpy(v._array()) if hasattr(v, "_array") else v, value
    )
