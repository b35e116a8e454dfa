"""Keras ``fit``/``evaluate``/``predict`` under ParameterServerStrategy: steps as closures.

Each epoch builds a dataset and an iterator on every worker; each worker reads
its own shard (arrays: every N-th example after a shared per-epoch shuffle;
datasets: every N-th batch). The chief schedules one closure per step through
the coordinator and keeps going until every worker's shard is exhausted, so a
finite dataset needs no ``steps_per_epoch`` (TensorFlow requires one).

Workers send back their metrics' state after each step and the chief merges
it, so the loss and metrics of an epoch cover every worker's batches. In
``sync`` mode each step is one batch from every worker; the epoch then has as
many steps as the smallest shard has full batches.
"""

from __future__ import annotations

import collections
import contextlib
import math
from typing import Any

import numpy as np

from psflow import errors
from psflow.framework.tensor import Tensor
from psflow.keras.engine import data_adapter


class _ArrayShards:
    """A picklable ``make(worker, epoch)`` of per-worker batch iterables over in-memory arrays."""

    def __init__(self, source: data_adapter.ArrayBatches, num_workers: int, seed: int) -> None:
        self.x, self.y, self.sw = source.x, source.y, source.sample_weight
        self.n = source.num_examples
        self.batch_size = source.batch_size
        self.shuffle = source.shuffle
        self.num_workers = num_workers
        self.seed = seed

    def indices(self, worker: int, epoch: int) -> np.ndarray:
        """The examples ``worker`` reads in ``epoch``, in order."""
        order = (
            np.random.default_rng([self.seed, epoch]).permutation(self.n)
            if self.shuffle
            else np.arange(self.n)
        )
        return order[worker :: self.num_workers]

    def batches_per_worker(self) -> list[int]:
        """Batches each worker's shard yields."""
        return [
            math.ceil(len(range(w, self.n, self.num_workers)) / self.batch_size)
            for w in range(self.num_workers)
        ]

    def __call__(self, worker: int, epoch: int) -> Any:
        from psflow.util import nest

        idx = self.indices(worker, epoch)
        bs = self.batch_size

        def batches() -> Any:
            for start in range(0, len(idx), bs):
                sel = idx[start : start + bs]

                def take(a: Any, sel: Any = sel) -> Tensor:
                    return Tensor._wrap(a[sel])

                parts = [nest.map_structure(take, self.x)]
                if self.y is not None:
                    parts.append(nest.map_structure(take, self.y))
                if self.sw is not None:
                    parts.append(nest.map_structure(take, self.sw))
                yield tuple(parts) if len(parts) > 1 else (parts[0],)

        return batches()


class _DatasetShards:
    """A picklable ``make(worker, epoch)``: every N-th batch of a dataset."""

    def __init__(self, dataset: Any, num_workers: int) -> None:
        self.dataset = dataset
        self.num_workers = num_workers

    def __call__(self, worker: int, epoch: int) -> Any:
        ds = self.dataset.shard(self.num_workers, worker) if self.num_workers > 1 else self.dataset
        return iter(ds)


def _worker_index() -> int:
    from psflow.distribute.ps import session as session_lib

    task = session_lib.current().task
    return int(task.rsplit(":", 1)[1]) if task.startswith("worker:") else 0


class _StepProgram:
    """What a step closure runs on a worker: one train/test step and the metrics' state."""

    def __init__(self, model: Any, kind: str, in_process: bool) -> None:
        self.model = model
        self.kind = kind
        self.in_process = in_process

    def __call__(self, iterator: Any, learning_rate: float | None = None) -> Any:
        model = self.model
        try:
            batch = next(iterator)
        except (StopIteration, errors.OutOfRangeError):
            return (_worker_index(), None, False)
        if learning_rate is not None and model.optimizer is not None:
            model.optimizer.learning_rate = learning_rate
        if not self.in_process:
            model.reset_metrics()
        step = model.train_step if self.kind == "train" else model.test_step
        model.distribute_strategy.run(step, args=(batch,))
        states = None if self.in_process else [m.get_state() for m in model.metrics]
        return (_worker_index(), states, True)


def _predict_batch(model: Any, x: Any) -> Any:
    y = model.distribute_strategy.run(model.predict_step, args=((x,),))
    from psflow.util import nest

    return nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, y)


class PSRunner:
    """Runs Keras steps as closures on the strategy's workers."""

    def __init__(self, model: Any, strategy: Any) -> None:
        from psflow.distribute.coordinator import ClusterCoordinator

        self.model = model
        self.strategy = strategy
        self.coordinator = ClusterCoordinator(strategy)
        self.num_workers = self.coordinator.num_workers
        self.in_process = strategy.extended.embedded
        self._epoch = 0
        self._programs: dict[tuple[int, str], _StepProgram] = {}
        self._makers: dict[int, Any] = {}

    def prepare(self, source: Any) -> Any:
        """Nothing to do here: sharding happens per worker, per epoch."""
        return source

    def steps_estimate(self, source: Any) -> int | None:
        """Steps of an epoch over every worker's shard, when known (for the progress bar)."""
        if self.strategy.mode == "sync":
            try:
                return self._steps_for_sync(self._maker(source), None)
            except errors.InvalidArgumentError:
                return None
        return steps_per_epoch_estimate(source, self.num_workers)

    def _maker(self, source: Any) -> Any:
        key = id(source)
        maker = self._makers.get(key)
        if maker is None:
            if isinstance(source, data_adapter.ArrayBatches):
                from psflow import random as random_lib

                seed = int(random_lib.new_generator().integers(0, 2**31 - 1))
                maker = _ArrayShards(source, self.num_workers, seed)
            elif isinstance(source, data_adapter.DatasetBatches) and hasattr(
                source.dataset, "shard"
            ):
                maker = _DatasetShards(source.dataset, self.num_workers)
            else:
                raise errors.InvalidArgumentError(
                    "ParameterServerStrategy fit needs arrays or a psflow.data.Dataset, got "
                    f"{type(getattr(source, 'dataset', source)).__name__}"
                )
            self._makers[key] = maker
        return maker

    def _steps_for_sync(self, maker: Any, steps: int | None) -> int | None:
        if self.strategy.mode != "sync":
            return steps
        if steps is not None:
            return steps * self.num_workers
        if isinstance(maker, _ArrayShards):
            full = [
                len(range(w, maker.n, maker.num_workers)) // maker.batch_size
                for w in range(self.num_workers)
            ]
            return min(full) * self.num_workers
        card = int(maker.dataset.cardinality())
        if card < 0:
            raise errors.InvalidArgumentError(
                "Synchronous fit on a dataset of unknown size needs steps_per_epoch"
            )
        return (card // self.num_workers) * self.num_workers

    def _iterators(self, maker: Any) -> Any:
        epoch = self._epoch
        self._epoch += 1
        datasets = self.coordinator.create_per_worker_dataset(
            lambda ctx, _m=maker, _e=epoch: _m(ctx.input_pipeline_id, _e)
        )
        return iter(datasets)

    def _program(self, kind: str) -> _StepProgram:
        key = (id(self.model), kind)
        program = self._programs.get(key)
        if program is None:
            program = _StepProgram(self.model, kind, self.in_process)
            self._programs[key] = program
        return program

    def _run(self, kind: str, source: Any, steps: int | None, on_begin: Any, on_end: Any) -> int:
        maker = self._maker(source)
        total = self._steps_for_sync(maker, steps)
        iterators = self._iterators(maker)
        program = self._program(kind)
        pending: collections.deque = collections.deque()
        exhausted: set[int] = set()
        scheduled = done = 0
        window = 2 * self.num_workers
        model = self.model
        while True:
            while (
                len(pending) < window
                and len(exhausted) < self.num_workers
                and (total is None or scheduled < total)
            ):
                on_begin(scheduled)
                lr = (
                    model.optimizer.learning_rate
                    if (kind == "train" and model.optimizer is not None)
                    else None
                )
                pending.append(self.coordinator.schedule(program, args=(iterators, lr)))
                scheduled += 1
            if not pending:
                break
            try:
                worker, states, ran = pending.popleft().get()
            except Exception:
                self.coordinator.join()  # raises the first error: the cause of the others
                raise
            if not ran:
                exhausted.add(worker)
                continue
            if states is not None:
                for metric, state in zip(model.metrics, states):
                    metric.merge_state(state)
            on_end(done, model._current_logs())
            done += 1
            if model.stop_training:
                break
        self.coordinator.join()
        return done

    def wait_for_parameter_servers(self, config: Any = None) -> None:
        """After a PS loss: wait for every PS task to answer, then for in-flight closures to end.

        The whole wait is bounded by ``config.ps_timeout`` (a
        :class:`psflow.distribute.ps.recovery.RecoveryConfig`; by default the
        environment's, ``PSFLOW_PS_RECOVERY_TIMEOUT``, 300 s; closures get at
        least one second) and logs which task it waits for every few seconds.

        Raises:
            PSUnavailableError: a PS task did not come back in time (names it).
        """
        import time

        from psflow.distribute.ps.recovery import RecoveryConfig

        config = config or RecoveryConfig.from_environ()
        deadline = time.monotonic() + config.ps_timeout
        # the PS tasks first: closures stuck retrying against the lost task must not eat
        # the time it has to come back
        self.strategy._session.wait_ready(
            config.ps_timeout,
            probe_timeout=config.probe_timeout,
            progress_every=config.progress_every,
        )
        left = deadline - time.monotonic()
        with contextlib.suppress(Exception):  # the closures that hit the lost PS: this failure
            self.coordinator.join(timeout=max(left, 1.0))

    def train_epoch(self, source: Any, steps: int | None, callbacks: Any) -> int:
        """One epoch of closures; returns the steps that ran."""
        return self._run(
            "train", source, steps, callbacks.on_train_batch_begin, callbacks.on_train_batch_end
        )

    def test_epoch(self, source: Any, steps: int | None, callbacks: Any) -> int:
        """Evaluation over every worker's shard."""
        return self._run(
            "test", source, steps, callbacks.on_test_batch_begin, callbacks.on_test_batch_end
        )

    def predict(self, source: Any, steps: int | None, callbacks: Any) -> list[Any]:
        """Predictions batch by batch, scheduled in order and gathered in order."""
        values = []
        for i, batch in enumerate(source):
            if steps is not None and i >= steps:
                break
            x, _, _ = data_adapter.unpack_x_y_sample_weight(batch)
            values.append(self.coordinator.schedule(_predict_batch, args=(self.model, x)))
        outputs = []
        for i, rv in enumerate(values):
            outputs.append(rv.get())
            callbacks.on_predict_batch_end(i, {})
        return outputs


def steps_per_epoch_estimate(source: Any, num_workers: int) -> int | None:
    """Batches an epoch takes across all workers, when known."""
    if isinstance(source, data_adapter.ArrayBatches):
        n, bs = source.num_examples, source.batch_size
        return sum(math.ceil(len(range(w, n, num_workers)) / bs) for w in range(num_workers))
    return getattr(source, "steps", None)
