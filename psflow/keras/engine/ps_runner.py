"""Keras ``fit``/``evaluate``/``predict`` under ParameterServerStrategy: steps as closures.

The chief hands out the data (see :mod:`psflow.keras.engine.ps_batches`): each
step closure carries the batch it trains, the optimizer's schedule and the step it
trains at, so a closure re-run elsewhere (its worker died, froze or is late)
trains the same batch once, and a schedule gives the same per-step learning
rates as in one process. Results are consumed as they complete, from any
worker; the epoch ends when its batches are done, wherever they ran. A finite
dataset needs no ``steps_per_epoch`` (TensorFlow requires one). A dataset
function (``DatasetCreator``, a ``dataset_fn``, ``distribute_datasets_from_function``)
does, as in TensorFlow: every worker builds its own pipeline from it.

Workers send back their metrics' state after each step and the chief merges
it, so the loss and metrics of an epoch cover every worker's batches. In
``sync`` mode each step is one batch from every worker: the epoch has a
multiple of the worker count of full batches.
"""

from __future__ import annotations

import contextlib
import math
import queue
from typing import Any

from psflow import errors
from psflow.keras.engine import data_adapter, ps_batches
from psflow.keras.engine.runner import Runner


class _StepProgram:
    """What a step closure runs on a worker: one train/test step on its batch, and the metrics."""

    def __init__(self, model: Any, kind: str, in_process: bool) -> None:
        self.model = model
        self.kind = kind
        self.in_process = in_process

    def __call__(
        self,
        reader: Any,
        batch: ps_batches.Batch | tuple[ps_batches.Batch | None, ...] | None,
        step: int | None = None,
        schedule: Any = None,
    ) -> Any:
        if isinstance(batch, tuple):  # steps_per_execution batches, one after another
            return self._several(reader, batch, step, schedule)
        model = self.model
        data = None if batch is None else reader.read(batch)
        if data is None:
            return (batch, None, False)
        if not self.in_process:
            model.reset_metrics()
        self._step(data, step, schedule)
        states = None if self.in_process else [m.get_state() for m in model.metrics]
        return (batch, states, True)

    def _several(
        self,
        reader: Any,
        batches: tuple[ps_batches.Batch | None, ...],
        step: int | None,
        schedule: Any,
    ) -> Any:
        """Trains ``batches`` in order, batch ``j`` at step ``step + j``; returns
        ``(batches, metric states of all of them, which ran)``.  Each one's push has
        its own exactly-once id (the closure's, counted), so a re-run of the closure
        applies every batch once, however far its first run got."""
        model = self.model
        if not self.in_process:
            model.reset_metrics()
        ran = []
        for j, batch in enumerate(batches):
            data = None if batch is None else reader.read(batch)
            ran.append(data is not None)
            if data is not None:
                self._step(data, None if step is None else step + j, schedule)
        states = None if self.in_process or not any(ran) else [m.get_state() for m in model.metrics]
        return (batches, states, tuple(ran))

    def _step(self, data: Any, step: int | None, schedule: Any) -> None:
        """One train or test step on ``data``, the optimizer at ``step``."""
        model = self.model
        if step is not None and model.optimizer is not None:
            # This closure's own step, and the chief's schedule as it is now (a callback may
            # have set a new rate): the worker's optimizer evaluates the rate at that step,
            # so a re-run or an out-of-order step trains as it would have in one process.
            model.optimizer.learning_rate = schedule
            model.optimizer.iterations = step
        step_fn = model.train_step if self.kind == "train" else model.test_step
        strategy = model.distribute_strategy
        strategy.run(step_fn, args=(_for_local_replicas(data),))


def _for_local_replicas(data: Any) -> Any:
    """The batch split over this worker's devices when it has several (as its datasets are)."""
    from psflow.distribute.parameter_server_strategy import _for_local_replicas as split

    return next(iter(split([data])))


def _predict_batch(model: Any, x: Any) -> Any:
    y = model.distribute_strategy.run(model.predict_step, args=((x,),))
    from psflow.util import nest

    return nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, y)


_OTHER_PASSES = 1 << 40
"""Where the numbers of passes that are no fit epoch start (they seed no training shuffle)."""


class PSRunner(Runner):
    """Runs Keras steps as closures on the strategy's workers."""

    recovers_from_ps_loss = True

    def __init__(self, model: Any, strategy: Any) -> None:
        from psflow.distribute.coordinator import ClusterCoordinator

        self.model = model
        self.strategy = strategy
        self.coordinator = ClusterCoordinator(strategy)
        self.num_workers = self.coordinator.num_workers
        self.in_process = strategy.extended.embedded
        self._epoch = 0
        self._programs: dict[tuple[int, str], _StepProgram] = {}
        # id(source) -> (source, its reader, the reader's copies on the workers); the
        # source is held so that its id cannot be reused by another one
        self._readers: dict[int, tuple[Any, Any, Any]] = {}
        # id(source) -> the plan training on a dataset function continues (see _plan); its
        # source is held in _readers
        self._running: dict[int, Any] = {}

    def prepare(self, source: Any) -> Any:
        """Nothing to do here: batches are handed out per step."""
        return source

    def steps_estimate(self, source: Any) -> int | None:
        """Steps of an epoch, when known (for the progress bar)."""
        if self.strategy.mode == "sync":
            try:
                return self._steps_for_sync(self._reader(source)[0], None)
            except errors.InvalidArgumentError:
                return None
        return steps_per_epoch_estimate(source)

    def _reader(self, source: Any) -> tuple[Any, Any]:
        """The source's worker-side reader, and its copies on the workers (sent once)."""
        key = id(source)
        known = self._readers.get(key)
        if known is not None:
            return known[1], known[2]
        if isinstance(source, data_adapter.FunctionBatches):
            # Each worker builds its own pipeline from the function: nothing built here. A
            # step trains one element, split over the worker's devices like any batch, so
            # the context says one replica: get_per_replica_batch_size(g) is the step's g.
            reader: Any = ps_batches.FunctionReader(source.dataset_fn, self.num_workers, 1)
        elif isinstance(source, data_adapter.ArrayBatches):
            from psflow import random as random_lib

            seed = int(random_lib.new_generator().integers(0, 2**31 - 1))
            reader = ps_batches.ArrayReader(
                source.x,
                source.y,
                source.sample_weight,
                source.batch_size,
                bool(source.shuffle),
                seed,
            )
        elif isinstance(source, data_adapter.DatasetBatches) and hasattr(source.dataset, "shard"):
            reader = ps_batches.DatasetReader(source.dataset, self.num_workers)
        else:
            raise errors.InvalidArgumentError(
                "ParameterServerStrategy fit needs arrays, a psflow.data.Dataset or a dataset "
                "function (DatasetCreator), got "
                f"{type(getattr(source, 'dataset', source)).__name__}"
            )
        on_workers = self.coordinator.put_on_workers(reader)
        self._readers[key] = (source, reader, on_workers)
        return reader, on_workers

    def _steps_for_sync(self, reader: Any, steps: int | None) -> int | None:
        if self.strategy.mode != "sync":
            return steps
        if steps is not None:
            return steps * self.num_workers
        if isinstance(reader, ps_batches.ArrayReader):
            full = reader.n // reader.batch_size
            return (full // self.num_workers) * self.num_workers
        card = int(reader.dataset.cardinality())
        if card < 0:
            raise errors.InvalidArgumentError(
                "Synchronous fit on a dataset of unknown size needs steps_per_epoch"
            )
        return (card // self.num_workers) * self.num_workers

    def _plan(
        self, kind: str, source: Any, reader: Any, epoch: int | None = None, first_step: int = 0
    ) -> Any:
        if kind == "train" and isinstance(source, data_adapter.FunctionBatches):
            # steps_per_epoch over a dataset with no epoch (it repeats): training runs on
            # where the last epoch stopped, as TF's iterator does; evaluation starts over
            plan = self._running.get(id(source))
            if plan is None:
                plan = self._running[id(source)] = self._new_plan(reader)
            return plan
        return self._new_plan(reader, epoch, first_step)

    def _new_plan(self, reader: Any, epoch: int | None = None, first_step: int = 0) -> Any:
        """A plan for one pass; ``epoch`` (fit's, when training) seeds the array
        shuffle, so a restarted chief sees each epoch's batches in the same order."""
        if epoch is None:  # evaluation, a dataset function: numbers no fit epoch takes
            epoch = _OTHER_PASSES + self._epoch
            self._epoch += 1
        if isinstance(reader, ps_batches.ArrayReader):
            return ps_batches.ArrayPlan(epoch, reader.num_batches, first_step)
        return ps_batches.DatasetPlan(epoch, reader.num_shards, first_step)

    def _program(self, kind: str) -> _StepProgram:
        key = (id(self.model), kind)
        program = self._programs.get(key)
        if program is None:
            program = _StepProgram(self.model, kind, self.in_process)
            self._programs[key] = program
        return program

    def _run(
        self,
        kind: str,
        source: Any,
        steps: int | None,
        on_begin: Any,
        on_end: Any,
        epoch: int | None = None,
        first_step: int = 0,
        settle_after: Any = None,
    ) -> int:
        reader, on_workers = self._reader(source)
        total = self._steps_for_sync(reader, steps)
        plan = self._plan(kind, source, reader, epoch, first_step)
        program = self._program(kind)
        completed: queue.SimpleQueue = queue.SimpleQueue()
        sizes: dict[Any, int] = {}  # a pending closure's batches
        model = self.model
        optimizer = model.optimizer if kind == "train" else None
        base_step = int(optimizer.iterations) if optimizer is not None else 0
        # Remote workers train a copy of the optimizer: each closure carries its step and
        # the schedule, which the copy evaluates there. The chief as its own worker trains
        # this very optimizer, which counts its steps and evaluates its schedule itself.
        carry_step = optimizer is not None and not self.in_process
        # Enough closures in flight that a frozen or slow worker holding a few of them
        # does not starve the others; the coordinator bounds its own queue too.
        window = 4 * self.num_workers
        per = self._execution_size()
        pending = scheduled = done = 0
        in_flight = 0  # batches of the closures pending
        # the batches of a resumed epoch done before the restart are not trained again
        # (a dataset function's plan runs on across epochs: it has no "first" to skip to)
        first = 0 if plan is self._running.get(id(source)) else first_step
        if total is not None:
            total = max(0, total - first)
        hold = False  # a callback needs the last scheduled step settled before any other
        while True:
            if hold and not pending:  # it is, and its callbacks ran: go on
                hold = False
            while (
                pending < window
                and not hold
                and not plan.exhausted()
                # steps that trained, or may: a ticket past a shard's end trains nothing and
                # must not take one of the epoch's steps (steps_per_epoch counts trained ones)
                and (total is None or done + in_flight < total)
                and not model.stop_training
            ):
                size = per if total is None else min(per, total - done - in_flight)
                on_begin(first + scheduled)
                hold = settle_after is not None and any(
                    settle_after(first + scheduled + j) for j in range(size)
                )
                step = schedule = None
                if carry_step:
                    step, schedule = base_step + scheduled, optimizer.learning_rate_schedule
                tickets: Any = plan.ticket()
                if per > 1:  # one closure, several batches: see _StepProgram._several
                    tickets = (tickets,)
                    while len(tickets) < size and not plan.exhausted():
                        tickets += (plan.ticket(),)
                rv = self.coordinator.schedule(program, args=(on_workers, tickets, step, schedule))
                rv.add_done_callback(completed.put)
                size = len(tickets) if per > 1 else 1
                sizes[rv] = size
                pending += 1
                in_flight += size
                scheduled += size
            if not pending:
                break
            rv = completed.get()  # every closure completes: with its value, or an error
            pending -= 1
            in_flight -= sizes.pop(rv)
            try:
                batch, states, ran = rv.get()
            except Exception:
                self.coordinator.join()  # raises the first error: the cause of the others
                raise
            batches, ran = (batch, ran) if isinstance(ran, tuple) else ((batch,), (ran,))
            for b, trained in zip(batches, ran):
                if not trained and b is not None:
                    plan.ended(b)
            if not any(ran):
                continue
            if states is not None:
                for metric, state in zip(model.metrics, states):
                    metric.merge_state(state)
            done += sum(ran)
            if carry_step:
                optimizer.iterations = base_step + done
            on_end(first + done - 1, model._current_logs())
        self.coordinator.join()
        if done == 0 and steps is not None and plan.exhausted():
            raise errors.OutOfRangeError(
                "Your input ran out of data: the dataset function's datasets ended before this "
                f"epoch's first step; make sure they yield at least steps * epochs batches "
                f"(steps={steps}), e.g. with repeat()"
            )
        return done

    def _execution_size(self) -> int:
        """Batches per closure: ``steps_per_execution`` in async mode, else 1.

        A sync step is one closure per worker at the parameter servers' barrier and
        a bounded one is counted per closure by the coordinator: there each closure
        stays one batch.
        """
        if self.strategy.mode != "async":
            return 1
        return self.model._steps_per_execution

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

    def train_epoch(
        self,
        source: Any,
        steps: int | None,
        callbacks: Any,
        epoch: int | None = None,
        first_step: int = 0,
    ) -> int:
        """One epoch of closures (array batches from ``first_step`` on); returns the steps that ran."""
        return self._run(
            "train",
            source,
            steps,
            callbacks.on_train_batch_begin,
            callbacks.on_train_batch_end,
            epoch,
            first_step,
            callbacks.settle_after,
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


def steps_per_epoch_estimate(source: Any) -> int | None:
    """Batches an epoch takes across all workers, when known.

    Arrays are cut into global batches by the chief (:class:`ps_batches.ArrayReader`),
    however many workers train them.
    """
    if isinstance(source, data_adapter.ArrayBatches):
        return math.ceil(source.num_examples / source.batch_size)
    return getattr(source, "steps", None)
