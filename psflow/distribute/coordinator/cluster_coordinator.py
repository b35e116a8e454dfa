"""``ClusterCoordinator``: schedules closures on workers and collects their results.

The chief queues closures; a dispatcher thread per worker takes the next
closure, runs it on its worker and fills the closure's :class:`RemoteValue`.
In async mode each remote worker has two dispatchers, so the next closure is
already waiting on the worker (which runs one at a time) when the current one
ends: no round trip between steps (``PSFLOW_CLOSURES_IN_FLIGHT=1`` turns that
off; sync and bounded modes, which count steps per closure, keep one).
Semantics follow TensorFlow's coordinator:

* the first error a closure raises is raised once, by the next ``schedule``,
  ``join`` or ``done``, and the closures still queued are cancelled;
* a closure whose worker is lost (unreachable) is re-queued and runs on
  another worker; when the worker comes back in its slot, the session's
  datasets and iterators are rebuilt there and it is used again;
* with bounded staleness ``k``, no worker starts a step more than ``k`` steps
  ahead of the slowest live worker.

Example:
    >>> import psflow as pf
    >>> strategy = pf.distribute.ParameterServerStrategy()
    >>> coordinator = pf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    >>> coordinator.schedule(lambda: 2 + 3).fetch()
    5
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from psflow import errors
from psflow.distribute.coordinator import closure as closure_lib
from psflow.distribute.coordinator.remote_value import PerWorkerValues, RemoteValue
from psflow.distribute.coordinator.workers import Closure, Worker
from psflow.observability import events
from psflow.util import nest

log = logging.getLogger("psflow.coordinator")

_alive: weakref.WeakSet = weakref.WeakSet()


def shutdown_all() -> None:
    """Shuts down every coordinator of this process (tests and interpreter exit use it)."""
    for coordinator in list(_alive):
        coordinator.shutdown()


def _env_int(name: str, default: int) -> int:
    """A positive integer from the environment (``default`` when unset).

    Raises:
        InvalidArgumentError: set, but not an integer >= 1.
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise errors.InvalidArgumentError(f"{name} must be an integer, got {raw!r}") from None
    if value < 1:
        raise errors.InvalidArgumentError(f"{name} must be >= 1, got {raw!r}")
    return value


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise errors.InvalidArgumentError(f"{name} must be a number, got {raw!r}") from None


class _WorkerState:
    """The coordinator's view of one worker."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.up = True
        self.down_since: float | None = None
        self.targeted: collections.deque[Closure] = collections.deque()
        self.started = 0  # general closures dispatched (its step clock)
        self.done = 0
        self.closures_run = 0
        self.recovering = False
        self.rebuilding = False
        self.resources_in_flight = 0  # targeted closures sent and not yet answered


class ClusterCoordinator:
    """Schedules functions on the workers of a ParameterServerStrategy (``tf.distribute``'s).

    Creating a second coordinator for the same strategy returns the first.

    Raises:
        TypeError: ``strategy`` is not a ParameterServerStrategy.
    """

    def __new__(cls, strategy: Any) -> ClusterCoordinator:
        existing = getattr(getattr(strategy, "extended", None), "_coordinator", None)
        if existing is not None:
            return existing
        return super().__new__(cls)

    def __init__(self, strategy: Any) -> None:
        if getattr(self, "_initialized", False):
            return
        from psflow.distribute.parameter_server_strategy import ParameterServerStrategy

        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(
                f"ClusterCoordinator needs a ParameterServerStrategy, got {type(strategy).__name__}"
            )
        self._strategy = strategy
        self._session_id = uuid.uuid4().hex
        self._functions = closure_lib.FunctionCache()
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._queue: collections.deque[Closure] = collections.deque()
        self._inflight = 0
        self._error: BaseException | None = None
        self._closed = False
        self._resources: list[tuple[str, int, Callable[..., Any], tuple]] = []
        self._staleness = strategy.extended.staleness
        self._unavailable_timeout = _env_float("PSFLOW_WORKER_UNAVAILABLE_TIMEOUT", 600.0)
        # In async mode a worker that runs closures one at a time itself gets the next
        # closure while it runs the current one, so it never waits for the round trip.
        # Sync and bounded modes count steps per closure: one at a time there.
        depth = 1 if strategy.mode != "async" else _env_int("PSFLOW_CLOSURES_IN_FLIGHT", 2)
        self._states = [_WorkerState(w) for w in strategy.extended._make_workers()]
        self._threads = [
            threading.Thread(
                target=self._dispatch,
                args=(s, slot > 0),
                name=f"coordinator-{s.worker.task}" + (f"-{slot}" if slot else ""),
                daemon=True,
            )
            for s in self._states
            for slot in range(min(depth, s.worker.max_in_flight))
        ]
        strategy.extended._coordinator = self
        self._initialized = True
        _alive.add(self)
        for t in self._threads:
            t.start()

    # -- public API ------------------------------------------------------------------
    @property
    def strategy(self) -> Any:
        """The strategy this coordinator schedules for."""
        return self._strategy

    @property
    def num_workers(self) -> int:
        """Worker tasks."""
        return len(self._states)

    def schedule(self, fn: Callable[..., Any], args: Any = None, kwargs: Any = None) -> RemoteValue:
        """Queues ``fn(*args, **kwargs)`` for a worker; returns its :class:`RemoteValue`.

        Raises:
            TypeError: ``fn`` is not callable.
            The first error of an earlier closure, if one is pending (then cleared).
        """
        if not callable(fn):
            raise TypeError(f"schedule expects a callable, got {type(fn).__name__}: {fn!r}")
        if args is not None and not isinstance(args, (tuple, list)):
            raise TypeError(f"schedule's args must be a tuple or list, got {type(args).__name__}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"schedule's kwargs must be a dict, got {type(kwargs).__name__}")
        self._raise_pending_error()
        closure_id = next(self._ids)
        rv = RemoteValue(closure_id, getattr(fn, "__name__", ""))
        closure = Closure(closure_id, fn, tuple(args or ()), dict(kwargs or {}), rv)
        with self._cond:
            if self._closed:
                raise errors.FailedPreconditionError("The coordinator is shut down")
            self._queue.append(closure)
            self._cond.notify_all()
        return rv

    def join(self, timeout: float | None = None) -> None:
        """Waits until every scheduled closure has finished.

        Raises:
            The first error a closure raised (once), after cancelling the rest.
            DeadlineExceededError: ``timeout`` passed first; the message names the
                workers still busy or down.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (
                self._queue or self._inflight or any(s.targeted for s in self._states)
            ) and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise errors.DeadlineExceededError(
                        f"join timed out after {timeout}s: {len(self._queue)} queued, {self._inflight} running; "
                        f"{self._stall_report()}"
                    )
                self._cond.wait(left if left is not None else 1.0)
        self._raise_pending_error()

    def done(self) -> bool:
        """Whether every scheduled closure has finished (raises a pending error)."""
        self._raise_pending_error()
        with self._cond:
            return not (self._queue or self._inflight or any(s.targeted for s in self._states))

    def fetch(self, val: Any) -> Any:
        """Waits for remote values in a structure and returns their NumPy values."""
        if isinstance(val, RemoteValue):
            return val.fetch()
        if isinstance(val, PerWorkerValues):
            return tuple(self.fetch(v) for v in val.values)
        return nest.map_structure(lambda v: v.fetch() if isinstance(v, RemoteValue) else v, val)

    def create_per_worker_dataset(self, dataset_fn: Any) -> PerWorkerValues:
        """Builds a dataset on every worker from ``dataset_fn`` (or a dataset, or a distributed one).

        ``dataset_fn`` may take an ``InputContext`` (worker index and count) so
        each worker reads its own shard.
        """
        make = self._strategy.extended._dataset_factory(dataset_fn, self.num_workers)
        return self._per_worker_resource("ds", lambda w: (make, (w,)), kind="dataset")

    def _create_per_worker_iterators(self, datasets: PerWorkerValues) -> PerWorkerValues:
        return self._per_worker_resource(
            "it", lambda w: (_make_iterator, (datasets.values[w],)), kind="iterator"
        )

    def _per_worker_resource(
        self, prefix: str, spec: Callable[[int], tuple], kind: str
    ) -> PerWorkerValues:
        values = []
        n = next(self._ids)
        for s in self._states:
            fn, args = spec(s.worker.index)
            key = f"{prefix}-{n}-w{s.worker.index}"
            self._resources.append((key, s.worker.index, fn, args))
            values.append(self._schedule_on(s, fn, args, key))
        result_cls = _PerWorkerIterator if kind == "iterator" else PerWorkerValues
        return result_cls(tuple(values), self, kind)

    def _schedule_on(
        self, state: _WorkerState, fn: Callable[..., Any], args: tuple, resource_key: str | None
    ) -> RemoteValue:
        closure_id = next(self._ids)
        rv = RemoteValue(closure_id, resource_key or "")
        with self._cond:
            state.targeted.append(Closure(closure_id, fn, args, {}, rv, resource_key=resource_key))
            self._cond.notify_all()
        return rv

    def shutdown(self) -> None:
        """Stops the dispatchers and ends the session on every worker."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=10)
        for s in self._states:
            s.worker.end_session(self._session_id)
            s.worker.close()

    # -- errors ----------------------------------------------------------------------
    def _raise_pending_error(self) -> None:
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _fail(self, error: BaseException) -> None:
        """Records the first error and cancels everything still queued (TF's semantics)."""
        with self._cond:
            if self._error is None:
                self._error = error
            cancelled = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for c in cancelled:
            c.remote_value._set_error(
                errors.CancelledError(
                    f"Closure {c.closure_id} was cancelled because an earlier closure failed"
                )
            )

    def _stall_report(self) -> str:
        parts = []
        for s in self._states:
            state = "down" if not s.up else "up"
            parts.append(f"{s.worker.task}: {state}, {s.done} steps done")
        return "; ".join(parts)

    # -- dispatching -------------------------------------------------------------------
    def _may_start(self, state: _WorkerState) -> bool:
        if self._staleness is None:
            return True
        live = [s.done for s in self._states if s.up]
        slowest = min(live) if live else state.done
        return state.started - slowest < self._staleness + 1

    def _take(self, state: _WorkerState, extra: bool = False) -> Closure | None:
        """The next closure for ``state``'s worker; None once shut down.

        An ``extra`` dispatcher (a second closure in flight) takes general closures
        only, and none while the worker's resources are being (re)built, since those
        must exist before any closure that uses them runs.
        """
        with self._cond:
            while True:
                if self._closed:
                    return None
                if state.up and not (
                    extra and (state.targeted or state.resources_in_flight or state.rebuilding)
                ):
                    if state.targeted and not extra:
                        closure = state.targeted.popleft()
                        state.resources_in_flight += 1
                        self._inflight += 1
                        return closure
                    if self._queue and self._may_start(state):
                        closure = self._queue.popleft()
                        state.started += 1
                        closure.step = state.started
                        self._inflight += 1
                        return closure
                self._check_all_down()
                self._cond.wait(1.0)

    def _check_all_down(self) -> None:
        """Fails the queued closures when no worker has answered for too long."""
        if not self._queue or any(s.up for s in self._states):
            return
        since = min(s.down_since or time.monotonic() for s in self._states)
        if time.monotonic() - since > self._unavailable_timeout:
            tasks = ", ".join(s.worker.task for s in self._states)
            self._fail(
                errors.WorkerUnavailableError(
                    f"No worker reachable for {self._unavailable_timeout:.0f}s ({tasks}); giving up"
                )
            )

    def _dispatch(self, state: _WorkerState, extra: bool = False) -> None:
        while True:
            closure = self._take(state, extra)
            if closure is None:
                return
            try:
                value = state.worker.run(self._session_id, closure, self._functions)
            except errors.WorkerUnavailableError as e:
                log.warning(
                    "%s lost (%s); re-queuing closure %d", state.worker.task, e, closure.closure_id
                )
                self._worker_lost(state, closure)
            except closure_lib.MissingResourceError:
                self._worker_restarted(state, closure)
            except BaseException as e:  # the closure's own error
                if isinstance(e, StopIteration):  # its iterator ran out: TF's OutOfRangeError
                    end = errors.OutOfRangeError(
                        f"End of sequence: closure {closure.closure_id} exhausted its iterator",
                        task=state.worker.task,
                    )
                    end.__cause__ = e
                    e = end
                closure.remote_value._set_error(e)
                if closure.resource_key is None:
                    with self._cond:
                        state.done += 1
                self._fail(e)
            else:
                closure.remote_value._set_value(value)
                with self._cond:
                    state.closures_run += 1
                    if closure.resource_key is None:
                        state.done += 1
            finally:
                with self._cond:
                    self._inflight -= 1
                    if closure.resource_key is not None:
                        state.resources_in_flight -= 1
                    self._cond.notify_all()

    def _requeue(self, state: _WorkerState, closure: Closure) -> None:
        events.publish(events.EventKind.CLOSURE_REQUEUED, state.worker.task, "closure re-queued")
        with self._cond:
            if closure.resource_key is not None:
                state.targeted.appendleft(closure)
            else:
                state.started -= 1
                self._queue.appendleft(closure)
            self._cond.notify_all()

    def _worker_lost(self, state: _WorkerState, closure: Closure) -> None:
        with self._cond:
            state.up = False
            state.down_since = time.monotonic()
            start_recovery = not state.recovering  # both dispatchers may see the loss
            state.recovering = True
        self._requeue(state, closure)
        if start_recovery:
            threading.Thread(
                target=self._recover,
                args=(state,),
                name=f"recover-{state.worker.task}",
                daemon=True,
            ).start()

    def _worker_restarted(self, state: _WorkerState, closure: Closure) -> None:
        self._requeue(state, closure)
        with self._cond:
            state.up = False
            state.down_since = time.monotonic()
            if state.rebuilding:  # the other dispatcher found it first and rebuilds
                return
            state.rebuilding = True
        try:
            self._rebuild(state)
        finally:
            with self._cond:
                state.rebuilding = False
                self._cond.notify_all()

    def _recover(self, state: _WorkerState) -> None:
        """Probes a lost worker until it answers again, then rebuilds its resources."""
        try:
            while not self._closed:
                if state.worker.healthy(timeout=2.0):
                    self._rebuild(state)
                    return
                time.sleep(0.5)
        finally:
            state.recovering = False

    def _rebuild(self, state: _WorkerState) -> None:
        """Re-creates this session's datasets and iterators on a (restarted) worker."""
        forget = getattr(state.worker, "forget_functions", None)
        if forget is not None:
            forget()
        with self._cond:
            specs = [r for r in self._resources if r[1] == state.worker.index]
            rebuilt = collections.deque(
                Closure(next(self._ids), fn, args, {}, RemoteValue(0, key), resource_key=key)
                for key, _, fn, args in specs
            )
            # resources first, in creation order, then whatever was waiting for this worker
            pending = [c for c in state.targeted if c.resource_key not in {k for k, *_ in specs}]
            state.targeted = collections.deque([*rebuilt, *pending])
            state.up = True
            state.down_since = None
            self._cond.notify_all()
        log.info("%s is back; rebuilt %d resources", state.worker.task, len(specs))

    def __repr__(self) -> str:
        return f"ClusterCoordinator(workers={self.num_workers})"


def _make_iterator(dataset: Any) -> Any:
    return iter(dataset)


class _PerWorkerIterator(PerWorkerValues):
    """``iter(per_worker_dataset)``: one iterator per worker."""
