"""How one training (or evaluation) step runs: the seam between Keras and the strategies.

``fit`` asks the active strategy for a runner (``strategy.extended.keras_runner``);
the default runs steps in this process, in the strategy's replica context.
MirroredStrategy splits each batch across its replicas, and
ParameterServerStrategy schedules steps on workers through the coordinator.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from psflow import backend, errors
from psflow.distribute.protocols import Readable
from psflow.keras.engine import data_adapter
from psflow.ops import kernel_pool


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
        fn: Callable[[Any], Any],
        on_begin: Callable[[int], None],
        on_end: Callable[[int, dict], None],
        first_step: int = 0,
        collect: Callable[[Any], None] | None = None,
    ) -> int:
        """Runs ``fn`` on the batches of ``source``, ``steps_per_execution`` batches per
        execution (one call into the strategy); the hooks run once per execution, with the
        index of its first batch (begin) and of its last (end), as Keras numbers them.
        ``collect`` receives each batch's result."""
        it: Iterator = iter(source)
        step = skipped = 0
        for _ in range(first_step):  # done before a restart: skipped, as TensorFlow does
            if next(it, None) is None:
                break
            step = skipped = skipped + 1
        per = self._execution_size()
        held: list[Any] = []  # a batch read but left for the next execution (another size)
        exhausted = False
        while not exhausted and (steps is None or step < steps):
            want = per if steps is None else min(per, steps - step)
            batches = held
            held = []
            while len(batches) < want:
                try:
                    batch = next(it)
                except StopIteration:
                    if steps is not None and step == 0 and not batches:
                        raise errors.OutOfRangeError(
                            "Your input ran out of data; make sure the dataset can generate at "
                            f"least steps_per_epoch * epochs batches (steps_per_epoch={steps})"
                        ) from None
                    exhausted = True
                    break
                except errors.OutOfRangeError:
                    exhausted = True
                    break
                if batches and self._execution_key(batch) != self._execution_key(batches[0]):
                    held = [batch]  # one execution runs batches of one global size
                    break
                batches.append(batch)
            if not batches:
                break
            on_begin(step)  # only once a batch exists: no begin hook without its end
            results = self._execute(fn, batches)
            if collect is not None:
                for r in results:
                    collect(r)
            step += len(batches)
            on_end(step - 1, self.model._current_logs())
            if self.model.stop_training:
                break
            exhausted = exhausted and not held
        return step - skipped

    def _execution_size(self) -> int:
        """Batches per execution: the model's ``steps_per_execution``."""
        return self.model._steps_per_execution

    def _execution_key(self, batch: Any) -> Any:
        """Batches of one execution share this value (any batches do by default)."""
        return None

    def _execute(self, fn: Callable[[Any], Any], batches: list[Any]) -> list[Any]:
        """``fn`` on each of ``batches`` in one call into the strategy; the results in order.

        The BLAS is held to one thread for the whole execution, as each of the step's
        products would hold it (:func:`psflow.ops.kernel_pool.blas_held_to_one`): once
        per execution rather than once per product.
        """
        on_device = [data_adapter.on_device(b) for b in batches]
        with kernel_pool.blas_held_to_one():
            return self.strategy.run(functools.partial(_each, fn), args=(on_device,))

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
            self.model.train_step,
            callbacks.on_train_batch_begin,
            callbacks.on_train_batch_end,
            first_step,
        )

    def test_epoch(self, source: Any, steps: int | None, callbacks: Any) -> int:
        """Runs evaluation steps over the source; returns how many ran."""
        return self._steps(
            source,
            steps,
            self.model.test_step,
            callbacks.on_test_batch_begin,
            callbacks.on_test_batch_end,
        )

    def predict(self, source: Any, steps: int | None, callbacks: Any) -> list[Any]:
        """Runs prediction steps; returns the host arrays of every batch's predictions."""
        outputs: list[Any] = []
        self._steps(
            source,
            steps,
            self.model.predict_step,
            callbacks.on_predict_batch_begin,
            lambda s, logs: callbacks.on_predict_batch_end(s, {}),
            collect=lambda y: outputs.append(_host(y)),
        )
        return outputs


def _each(fn: Callable[[Any], Any], batches: list[Any]) -> list[Any]:
    """One execution, inside a replica: ``fn`` on each batch in turn."""
    return [fn(batch) for batch in batches]


def _on_device(batch: Any) -> Any:
    """The batch on the step's device, so that an overridden ``train_step`` gets it there too."""
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

    def _global_batch(self, batch: Any) -> int | None:
        """The global batch of a split batch: every replica's share added up."""
        from psflow.distribute.values import PerReplica
        from psflow.keras.engine import data_adapter
        from psflow.util import nest

        x = data_adapter.unpack_x_y_sample_weight(batch)[0]
        leaf = next((v for v in nest.flatten(x) if isinstance(v, PerReplica)), None)
        if leaf is None:
            return None
        return sum(int(v.shape[0]) if len(v.shape) else 1 for v in leaf.values)

    def _execution_key(self, batch: Any) -> Any:
        # the loss scale is the global batch's: one execution keeps one
        return self._global_batch(batch)

    def _run(self, fn: Any, batch: Any) -> Any:
        self.model._global_batch_size = self._global_batch(batch)
        try:
            return self.strategy.run(fn, args=(batch,))
        finally:
            self.model._global_batch_size = None

    def _execute(self, fn: Callable[[Any], Any], batches: list[Any]) -> list[Any]:
        self.model._global_batch_size = self._global_batch(batches[0])
        try:
            return self.strategy.run(functools.partial(_each, fn), args=(batches,))
        finally:
            self.model._global_batch_size = None

    def predict(self, source: Any, steps: int | None, callbacks: Any) -> list[Any]:
        from psflow.distribute.values import PerReplica
        from psflow.util import nest

        outputs: list[Any] = []

        def gather(leaf: Any) -> Any:
            import numpy as np

            parts = leaf.values if isinstance(leaf, PerReplica) else (leaf,)
            hosts = [_host(p) for p in parts]
            return np.concatenate(hosts, axis=0) if len(hosts) > 1 else hosts[0]

        self._steps(
            source,
            steps,
            self.model.predict_step,
            callbacks.on_predict_batch_begin,
            lambda s, logs: callbacks.on_predict_batch_end(s, {}),
            # one PerReplica per output (a model with several outputs gives a structure of them)
            collect=lambda y: outputs.append(nest.map_structure(gather, y)),
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
