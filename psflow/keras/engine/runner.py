"""How one training (or evaluation) step runs: the seam between Keras and the strategies.

``fit`` asks the active strategy for a runner (``strategy.extended.keras_runner``);
the default runs steps in this process, in the strategy's replica context.
MirroredStrategy splits each batch across its replicas, and
ParameterServerStrategy schedules steps on workers through the coordinator.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from psflow import backend, errors
from psflow.distribute.protocols import Readable


class Runner(abc.ABC):
    """What ``fit``, ``evaluate`` and ``predict`` need from a strategy's way of running steps."""

    #: whether :meth:`wait_for_parameter_servers` can wait out a lost PS task
    recovers_from_ps_loss: ClassVar[bool] = False

    def prepare(self, source: Any) -> Any:
        """The batches as this runner consumes them (as they are by default)."""
        return source

    def steps_estimate(self, source: Any) -> int | None:
        """Steps of an epoch, when known (for the progress bar)."""
        return getattr(source, "steps", None)  # a public attribute some sources have

    def first_epoch(self, initial_epoch: int) -> int:
        """The epoch ``fit`` starts at (``initial_epoch``, unless the strategy knows better)."""
        return initial_epoch

    @abc.abstractmethod
    def train_epoch(
        self,
        source: Any,
        steps: int | None,
        callbacks: Any,
        epoch: int | None = None,
        first_step: int = 0,
    ) -> int:
        """Trains one epoch; returns the steps trained.

        ``epoch`` numbers it (its batch order may depend on it); ``first_step``
        batches of it are done already (a resumed backup) and are skipped.
        """

    @abc.abstractmethod
    def test_epoch(self, source: Any, steps: int | None, callbacks: Any) -> int:
        """Evaluates one epoch; returns the steps run."""

    @abc.abstractmethod
    def predict(self, source: Any, steps: int | None, callbacks: Any) -> list[Any]:
        """Predictions, one entry per step."""

    def wait_for_parameter_servers(self, config: Any = None) -> None:
        """After a PS loss: returns once the PS tasks serve again.

        Raises:
            FailedPreconditionError: this runner has no parameter servers to wait for.
        """
        raise errors.FailedPreconditionError(
            f"{type(self).__name__} trains without parameter servers"
        )


class LocalRunner(Runner):
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
        first_step: int = 0,
    ) -> int:
        it: Iterator = iter(source)
        step = skipped = 0
        for _ in range(first_step):  # done before a restart: skipped, as TensorFlow does
            if next(it, None) is None:
                break
            step = skipped = skipped + 1
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
        return step - skipped

    def train_epoch(
        self,
        source: Any,
        steps: int | None,
        callbacks: Any,
        epoch: int | None = None,
        first_step: int = 0,
    ) -> int:
        """Runs one epoch of training steps (after ``first_step`` done ones); returns how many ran."""
        return self._steps(
            source,
            steps,
            lambda batch: self.strategy.run(self.model.train_step, args=(_on_device(batch),)),
            callbacks.on_train_batch_begin,
            callbacks.on_train_batch_end,
            first_step,
        )

    def test_epoch(self, source: Any, steps: int | None, callbacks: Any) -> int:
        """Runs evaluation steps over the source; returns how many ran."""
        return self._steps(
            source,
            steps,
            lambda batch: self.strategy.run(self.model.test_step, args=(_on_device(batch),)),
            callbacks.on_test_batch_begin,
            callbacks.on_test_batch_end,
        )

    def predict(self, source: Any, steps: int | None, callbacks: Any) -> list[Any]:
        """Runs prediction steps; returns the host arrays of every batch's predictions."""
        outputs: list[Any] = []

        def step_fn(batch: Any) -> None:
            y = self.strategy.run(self.model.predict_step, args=(_on_device(batch),))
            outputs.append(_host(y))

        self._steps(
            source,
            steps,
            step_fn,
            callbacks.on_predict_batch_begin,
            lambda s, logs: callbacks.on_predict_batch_end(s, {}),
        )
        return outputs


def _on_device(batch: Any) -> Any:
    """The batch on the step's device, so that an overridden ``train_step`` gets it there too."""
    from psflow.keras.engine import data_adapter

    return data_adapter.on_device(batch)


def _host(value: Any) -> Any:
    from psflow.util import nest

    return nest.map_structure(
        lambda v: backend.to_numpy(v._array()) if isinstance(v, Readable) else v, value
    )


class _SplitBatches:
    """Global batches from ``source``, each split across the strategy's replicas."""

    def __init__(self, source: Any, devices: list[Any]) -> None:
        self.source = source
        self.devices = devices

    @property
    def steps(self) -> int | None:
        return getattr(self.source, "steps", None)

    def __iter__(self) -> Iterator[Any]:
        from psflow.distribute import input_lib

        for batch in self.source:
            yield input_lib._unwrap_single(input_lib.split_element(batch, self.devices))

    def peek(self) -> Any:
        return self.source.peek()


class MirroredRunner(LocalRunner):
    """Splits every global batch across the replicas and runs them in step."""

    def prepare(self, source: Any) -> Any:
        """Distributes a source of global batches unless it is distributed already."""
        from psflow.keras.engine import data_adapter

        if data_adapter.is_distributed(getattr(source, "dataset", None)):
            return source
        return _SplitBatches(source, list(self.strategy._devices))

    def _run(self, fn: Any, batch: Any) -> Any:
        from psflow.distribute.values import PerReplica
        from psflow.keras.engine import data_adapter
        from psflow.util import nest

        x = data_adapter.unpack_x_y_sample_weight(batch)[0]
        leaf = next((v for v in nest.flatten(x) if isinstance(v, PerReplica)), None)
        if leaf is not None:  # the global batch: every replica's share added up
            self.model._global_batch_size = sum(
                int(v.shape[0]) if len(v.shape) else 1 for v in leaf.values
            )
        else:
            self.model._global_batch_size = None
        try:
            return self.strategy.run(fn, args=(batch,))
        finally:
            self.model._global_batch_size = None

    def train_epoch(
        self,
        source: Any,
        steps: int | None,
        callbacks: Any,
        epoch: int | None = None,
        first_step: int = 0,
    ) -> int:
        return self._steps(
            source,
            steps,
            lambda b: self._run(self.model.train_step, b),
            callbacks.on_train_batch_begin,
            callbacks.on_train_batch_end,
            first_step,
        )

    def test_epoch(self, source: Any, steps: int | None, callbacks: Any) -> int:
        return self._steps(
            source,
            steps,
            lambda b: self._run(self.model.test_step, b),
            callbacks.on_test_batch_begin,
            callbacks.on_test_batch_end,
        )

    def predict(self, source: Any, steps: int | None, callbacks: Any) -> list[Any]:
        from psflow.distribute.values import PerReplica

        outputs: list[Any] = []

        def gather(leaf: Any) -> Any:
            import numpy as np

            parts = leaf.values if isinstance(leaf, PerReplica) else (leaf,)
            hosts = [_host(p) for p in parts]
            return np.concatenate(hosts, axis=0) if len(hosts) > 1 else hosts[0]

        def step_fn(batch: Any) -> None:
            from psflow.util import nest

            y = self._run(self.model.predict_step, batch)
            # one PerReplica per output (a model with several outputs gives a structure of them)
            outputs.append(nest.map_structure(gather, y))

        self._steps(
            source,
            steps,
            step_fn,
            callbacks.on_predict_batch_begin,
            lambda s, logs: callbacks.on_predict_batch_end(s, {}),
        )
        return outputs


def runner_for(model: Any, strategy: Any) -> LocalRunner:
    """The runner for ``strategy``: a strategy may provide ``extended.keras_runner(model)``."""
    provided = strategy.extended.keras_runner(model)
    if provided is not None:
        return provided
    from psflow.distribute.mirrored_strategy import MirroredStrategy
    from psflow.distribute.parameter_server_strategy import ParameterServerStrategy

    if isinstance(strategy, ParameterServerStrategy):
        from psflow.keras.engine.ps_runner import PSRunner

        return PSRunner(model, strategy)
    if isinstance(strategy, MirroredStrategy) and strategy.num_replicas_in_sync > 1:
        return MirroredRunner(model, strategy)
    return LocalRunner(model, strategy)
