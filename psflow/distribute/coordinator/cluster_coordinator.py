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
  ahead of the slowest live worker;
* the queue is bounded (``schedule`` blocks while it is full), as TensorFlow's is.

Beyond TensorFlow's (knobs in :class:`CoordinatorConfig`):

* a probe thread per worker calls its GetStatus with a deadline; a worker that
  stops answering (frozen, partitioned) is treated as lost after a grace, its
  closures re-run elsewhere, without waiting for the kernel to reset a socket;
* in async mode a closure running much longer than recent ones is re-run on an
  idle worker; the first result wins. Both runs carry the closure's id, from
  which the workers derive their push ids, so the parameter servers apply the
  closure's updates once;
* with no worker reachable for ``worker_unavailable_timeout`` seconds, the
  queued closures fail with a ``WorkerUnavailableError`` naming the workers;
* in async mode a closure that fails because its worker cannot reach a PS
  task, which the chief itself reaches, is re-queued and the worker set aside
  until its path to the PS heals (TensorFlow treats it as a PS failure).

Example:
    >>> import psflow as pf
    >>> strategy = pf.distribute.ParameterServerStrategy()
    >>> coordinator = pf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    >>> coordinator.schedule(lambda: 2 + 3).fetch()
    5
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from psflow import errors
from psflow.distribute.coordinator import closure as closure_lib
from psflow.distribute.coordinator.config import CoordinatorConfig
from psflow.distribute.coordinator.recovery import Recovery, WorkerState
from psflow.distribute.coordinator.remote_value import PerWorkerValues, RemoteValue
from psflow.distribute.coordinator.stragglers import StepTimes
from psflow.distribute.coordinator.workers import Closure
from psflow.distribute.ps import session as session_lib
from psflow.util import nest

log = logging.getLogger("psflow.coordinator")

# How often a dispatcher waiting for a closure's per-worker inputs checks its worker is up.
_INPUT_POLL_SECONDS = 0.5

_alive: weakref.WeakSet = weakref.WeakSet()


def shutdown_all() -> None:
    """Shuts down every coordinator of this process (tests and interpreter exit use it)."""
    for coordinator in list(_alive):
        coordinator.shutdown()


class ClusterCoordinator(Recovery):
    """Schedules functions on the workers of a ParameterServerStrategy (``tf.distribute``'s).

    Creating a second coordinator for the same strategy returns the first.

    Raises:
        TypeError: ``strategy`` is not a ParameterServerStrategy.
    """

    _initialized = False  # set once __init__ ran: a second construction returns the first

    def __new__(cls, strategy: Any) -> ClusterCoordinator:
        from psflow.distribute.parameter_server_strategy import ParameterServerStrategy

        if (
            isinstance(strategy, ParameterServerStrategy)
            and strategy.extended.coordinator is not None
        ):
            return strategy.extended.coordinator
        return super().__new__(cls)

    def __init__(self, strategy: Any) -> None:
        if self._initialized:
            return
        from psflow.distribute.parameter_server_strategy import ParameterServerStrategy

        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(
                f"ClusterCoordinator needs a ParameterServerStrategy, got {type(strategy).__name__}"
            )
        self._strategy = strategy
        self._config = CoordinatorConfig.from_environ()
        self._session_id = uuid.uuid4().hex
        self._functions = closure_lib.FunctionCache()
        self._ids = itertools.count(1)
        self._attempt_ids = itertools.count(1)
        self._cond = threading.Condition()
        self._queue: collections.deque[Closure] = collections.deque()
        self._unfinished = 0  # general closures scheduled and not yet finished
        self._error: BaseException | None = None
        self._closed = False
        # A step-boundary resize (sync mode, embedded) holds ``schedule`` while it drains
        # and moves variables, so it may come from any thread (a ClusterWatch's).
        self._resize_lock = threading.Lock()
        self._fenced = False
        self._resources: list[tuple[str, int, Callable[..., Any], tuple]] = []
        self._staleness = strategy.extended.staleness
        self._async = strategy.mode == "async"
        self._step_times = StepTimes(
            self._config.straggler_factor if self._async else 0.0,
            self._config.straggler_min_seconds,
        )
        self.speculative_runs = 0  # late closures re-run on another worker
        self.scheduled = 0  # closures scheduled (general), for progress and tests
        # In async mode a worker that runs closures one at a time itself gets the next
        # closure while it runs the current one, so it never waits for the round trip.
        # Sync and bounded modes count steps per closure: one at a time there.
        depth = 1 if not self._async else self._config.closures_in_flight
        workers = strategy.extended._make_workers(
            keepalive_time=self._config.keepalive_time,
            keepalive_timeout=self._config.keepalive_timeout,
        )
        self._states = [WorkerState(w) for w in workers]
        self._queue_bound = self._config.queued_per_worker * len(self._states)
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
        # A probe per remote worker: a frozen or partitioned worker is noticed after the
        # grace, not when the kernel finally resets its socket.
        self._threads += [
            threading.Thread(
                target=self._probe, args=(s,), name=f"health-{s.worker.task}", daemon=True
            )
            for s in self._states
            if s.worker.probed
        ]
        self._threads.append(
            threading.Thread(target=self._watch_stragglers, name="stragglers", daemon=True)
        )
        strategy.extended.coordinator = self
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
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        speculable = not any(
            isinstance(x, _PerWorkerIterator) for x in nest.flatten((args, kwargs))
        )
        closure = Closure(closure_id, fn, args, kwargs, rv, queued=True, speculable=speculable)
        deadline = time.monotonic() + self._config.schedule_timeout
        with self._cond:
            self._wait_unfenced(deadline)
            # A bounded queue: with every worker gone, the caller waits here (and then
            # gets the no-worker error) instead of piling up closures nobody runs.
            while len(self._queue) >= self._queue_bound and not self._closed:
                if self._error is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise errors.ResourceExhaustedError(
                        f"schedule waited {self._config.schedule_timeout:.0f}s for room in a queue "
                        f"of {self._queue_bound} closures ({self._stall_report()})"
                    )
                self._check_all_down()
                self._cond.wait(min(left, 1.0))
            if self._closed:
                raise errors.FailedPreconditionError("The coordinator is shut down")
            if self._error is None:
                self._queue.append(closure)
                self._unfinished += 1
                self.scheduled += 1
                self._cond.notify_all()
        if self._error is not None:
            self._raise_pending_error()
        return rv

    def _step_unit(self) -> int:
        """Closures per synchronous step (one per worker); 1 when steps are not shared."""
        return self.num_workers if self._strategy.mode == "sync" else 1

    def _at_boundary(self) -> bool:
        """Whether the closures scheduled so far fill whole steps (hold ``_cond``).

        In sync mode each worker's n-th closure is its step n, which waits for
        every worker's step n: holding ``schedule`` in the middle of a step would
        leave the step's first half waiting for a second half that never comes.
        """
        return self.scheduled % self._step_unit() == 0

    def _wait_unfenced(self, deadline: float) -> None:
        """Holds a ``schedule`` while a step-boundary resize runs (hold ``_cond``).

        A resize asked for mid-step lets the rest of that step through first.

        Raises:
            ResourceExhaustedError: the resize held it past ``schedule_timeout``.
        """
        while self._fenced and self._at_boundary() and not self._closed:
            if self._error is not None:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise errors.ResourceExhaustedError(
                    f"schedule waited {self._config.schedule_timeout:.0f}s for a resize of the "
                    "parameter servers to finish"
                )
            self._cond.wait(min(left, 1.0))

    def _drain_for_resize(self, deadline: float, timeout: float) -> None:
        """Waits for a step boundary with nothing in flight (``schedule`` is held then).

        A pending closure error is left for the thread that schedules (it is
        raised there, by the next ``schedule``/``join``): a watch thread must
        not take it.

        Raises:
            FailedPreconditionError: a closure failed (nothing is moved).
            DeadlineExceededError: no such boundary came within ``timeout``; the
                message says whether a step was left half scheduled.
        """
        with self._cond:
            while (self._busy() or not self._at_boundary()) and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise errors.DeadlineExceededError(
                        f"resize waited {timeout}s for a step boundary: {self.scheduled} "
                        f"closures scheduled ({self._step_unit()} per step), "
                        f"{self._unfinished} unfinished; {self._stall_report()}"
                    )
                self._check_all_down()
                self._cond.wait(min(left, 1.0))
            if self._error is not None:
                raise errors.FailedPreconditionError(
                    f"not resizing the parameter servers: a closure failed ({self._error!r})"
                )

    def _busy(self) -> bool:
        """Closures still to finish: general ones, and resources of workers that are up.

        A worker lost for good keeps its resource closures; they must not hold ``join``.
        """
        return bool(self._unfinished or any(s.targeted and s.up for s in self._states))

    def join(self, timeout: float | None = None) -> None:
        """Waits until every scheduled closure has finished (and a step-boundary resize ended).

        Raises:
            The first error a closure raised (once), after cancelling the rest.
            DeadlineExceededError: ``timeout`` passed first; the message names the
                workers still busy or down.
            WorkerUnavailableError: no worker was reachable for
                ``PSFLOW_WORKER_UNAVAILABLE_TIMEOUT`` seconds; it names them.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            # a step-boundary resize in progress: after join nothing moves any more
            while (self._busy() or self._fenced) and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise errors.DeadlineExceededError(
                        f"join timed out after {timeout}s: {len(self._queue)} queued, "
                        f"{self._unfinished} unfinished; {self._stall_report()}"
                    )
                self._check_all_down()
                self._cond.wait(min(left, 1.0) if left is not None else 1.0)
        self._raise_pending_error()

    def resize_parameter_servers(self, num_ps: int, *, timeout: float = 300.0) -> Any:
        """Resizes the strategy's parameter servers; returns a ``ResizeReport``.

        In sync mode (and with dynamic embedding tables, which move all at
        once) it fences at a step boundary: it waits for every
        scheduled closure (as :meth:`join`), then moves the variables (see
        ``ParameterServerStrategy.resize_parameter_servers``), then scheduling
        goes on. In async and bounded mode training goes on while variables
        move: each batch of variables is fenced only from its copy to its
        release, and a push that meets a fence is retried and redirected to
        the new owner. Either way every worker takes the new placement map
        before a removed task is told to exit. It may be called from any
        thread (a ``ClusterWatch``'s): in sync mode ``schedule`` is held from
        the next step boundary until the resize ends (a ``schedule`` held
        longer than ``schedule_timeout`` raises), and ``join`` waits for it.
        Resizes run one at a time.

        Raises:
            FailedPreconditionError: sync mode, a closure failed (nothing is
                moved; the error itself is raised to the thread that schedules).
            DeadlineExceededError: sync mode, no step boundary within ``timeout``.
            The errors of ``ParameterServerStrategy.resize_parameter_servers``.
        """
        deadline = time.monotonic() + timeout
        # embedded, closures run on this process's session, whose in-process stores do not
        # retry a fenced push: there too the step boundary is the fence; so it is for
        # dynamic tables, which move all at once
        fenced = (
            self._strategy.mode == "sync"
            or self._strategy.extended.embedded
            or bool(self._strategy._session.resize_steps)
        )
        if not self._resize_lock.acquire(timeout=timeout):
            raise errors.DeadlineExceededError(
                f"another resize of the parameter servers ran for more than {timeout}s"
            )
        try:
            if not fenced:
                return self._resize(num_ps, deadline)
            with self._cond:
                self._fenced = True
            try:
                self._drain_for_resize(deadline, timeout)
                return self._resize(num_ps, deadline)
            finally:
                with self._cond:
                    self._fenced = False
                    self._cond.notify_all()
        finally:
            self._resize_lock.release()

    def _resize(self, num_ps: int, deadline: float) -> Any:
        """Moves the variables, telling every worker the new map before any task drains."""
        told: list[PerWorkerValues] = []

        def tell_workers(deadline: float) -> None:
            told.append(self._send_placement())
            self._wait_placed(told[-1], deadline)

        try:
            return self._strategy._resize(
                num_ps, max(deadline - time.monotonic(), 0.001), before_drain=tell_workers
            )
        finally:
            if not told:  # it failed part way: the map still says where each variable is
                self._send_placement()

    def _send_placement(self) -> PerWorkerValues:
        """Has every worker take the strategy's placement map before its next closure.

        Targeted closures go before general ones, and a restarted worker
        rebuilds its resources in order, so it takes the newest map too; its
        cached functions hold handles, which route by the worker session's map.
        """
        placement = self._strategy.placement()
        return self._per_worker_resource(
            "placement", lambda w: (session_lib.adopt_placement, (placement,)), kind="value"
        )

    def _wait_placed(self, told: PerWorkerValues, deadline: float) -> None:
        """Waits until every worker that is up took the map (a down one takes it on return).

        Raises:
            DeadlineExceededError: a worker did not take it by ``deadline``.
            The error of a worker that failed to take it.
        """
        for rv, state in zip(told.values, self._states):
            while not rv.done() and state.up:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise errors.DeadlineExceededError(
                        f"{state.worker.task} did not take the new placement map in time"
                    )
                with contextlib.suppress(errors.DeadlineExceededError):
                    rv.get(timeout=min(left, 0.5))
            if rv.done():
                rv.get(timeout=0)

    def done(self) -> bool:
        """Whether every scheduled closure has finished (raises a pending error)."""
        self._raise_pending_error()
        with self._cond:
            return not self._busy()

    def counters(self) -> dict[str, int]:
        """Closures scheduled, queued, unfinished and speculatively re-run so far."""
        with self._cond:
            return {
                "scheduled": self.scheduled,
                "queued": len(self._queue),
                "unfinished": self._unfinished,
                "speculative_runs": self.speculative_runs,
                "workers_up": sum(s.up for s in self._states),
            }

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

    def put_on_workers(self, value: Any) -> PerWorkerValues:
        """Sends ``value`` to every worker once; a closure given the result gets its worker's copy.

        Each worker keeps its copy (which may hold worker-side state, e.g. open
        readers) for the session; a restarted worker gets it again.
        """
        return self._per_worker_resource("val", lambda w: (_identity, (value,)), kind="value")

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
        self, state: WorkerState, fn: Callable[..., Any], args: tuple, resource_key: str | None
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
        deadline = time.monotonic() + 5.0
        for t in self._threads:  # a dispatcher blocked on a frozen worker ends when its
            t.join(timeout=max(deadline - time.monotonic(), 0.01))  # channel closes below
        for s in self._states:
            if s.up:
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
            cancelled = [c for c in self._queue if not c.finished]
            self._queue.clear()
            for c in cancelled:
                c.queued = False
                if not c.running:
                    c.finished = True
                    self._unfinished -= 1
            self._cond.notify_all()
        for c in cancelled:
            if c.finished:
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
    def _may_start(self, state: WorkerState) -> bool:
        if self._staleness is None:
            return True
        live = [s.done for s in self._states if s.up]
        slowest = min(live) if live else state.done
        return state.started - slowest < self._staleness + 1

    def _take(self, state: WorkerState, extra: bool = False) -> tuple[int, Closure] | None:
        """The next closure for ``state``'s worker and its attempt id; None once shut down.

        An ``extra`` dispatcher (a second closure in flight) takes general closures
        only, and none while the worker's resources are being (re)built, since those
        must exist before any closure that uses them runs.
        """
        with self._cond:
            while True:
                if self._closed:
                    return None
                if state.up and not (
                    extra
                    and (
                        state.targeted
                        or state.resources_in_flight
                        or state.rebuilding
                        or self._another_idle(state)
                    )
                ):
                    if state.targeted and not extra:
                        closure = state.targeted.popleft()
                        state.resources_in_flight += 1
                        return self._start(state, closure)
                    closure = self._next_general(state) if self._may_start(state) else None
                    if closure is not None:
                        state.started += 1
                        closure.step = state.started
                        return self._start(state, closure)
                self._check_all_down()
                self._cond.wait(1.0)

    def _another_idle(self, state: WorkerState) -> bool:
        """Whether a worker other than ``state``'s is up and runs nothing (lock held).

        A second closure in flight is queued behind the one its worker runs; while
        another worker idles, that closure is that worker's to take (its dispatcher
        is woken by the same notify), else two closures scheduled together could run
        one after the other on one worker while the other waits.
        """
        return any(s is not state and s.up and not s.running for s in self._states)

    def _next_general(self, state: WorkerState) -> Closure | None:
        """Takes the first queued closure this worker should run (under the lock).

        Skips re-runs whose first run already won, and a late closure's re-run on the
        worker that still runs the original (it must go to another one).
        """
        while self._queue and self._queue[0].finished:
            self._queue.popleft().queued = False
        mine = {id(c) for c, _ in state.running.values()}
        for i, closure in enumerate(self._queue):
            if closure.finished or id(closure) in mine:
                continue
            del self._queue[i]
            closure.queued = False
            return closure
        return None

    def _start(self, state: WorkerState, closure: Closure) -> tuple[int, Closure]:
        attempt = next(self._attempt_ids)
        closure.running += 1
        if not state.running and self._queue:
            # no longer idle: a second-in-flight dispatcher that left a queued closure
            # to this worker (_another_idle) may take one now
            self._cond.notify_all()
        state.running[attempt] = (closure, time.monotonic())
        return attempt, closure

    def _dispatch(self, state: WorkerState, extra: bool = False) -> None:
        while True:
            taken = self._take(state, extra)
            if taken is None:
                return
            attempt, closure = taken
            if not self._inputs_ready(state, closure):
                self._end_attempt(state, attempt, closure)
                self._requeue(state, closure)
                continue
            try:
                value = state.worker.run(self._session_id, closure, self._functions)
            except errors.WorkerUnavailableError as e:
                self._end_attempt(state, attempt, closure)
                if not self._closed:
                    log.warning(
                        "%s lost (%s); re-queuing closure %d",
                        state.worker.task,
                        e,
                        closure.closure_id,
                    )
                    self._worker_lost(state, closure)
            except closure_lib.MissingResourceError:
                self._end_attempt(state, attempt, closure)
                self._worker_restarted(state, closure)
            except BaseException as e:  # the closure's own error
                # async: a PS its worker cannot reach, which answers the chief, is the
                # worker's fault; sync and bounded steps wait on every worker: not moved
                ps_task = None
                if self._async and self._staleness is None:
                    ps_task = self._ps_path_fault(state, e)
                if ps_task is not None:
                    self._end_attempt(state, attempt, closure)
                    if not self._closed:
                        self._worker_cut_from_ps(state, closure, ps_task)
                    continue
                if isinstance(e, StopIteration):  # its iterator ran out: TF's OutOfRangeError
                    end = errors.OutOfRangeError(
                        f"End of sequence: closure {closure.closure_id} exhausted its iterator",
                        task=state.worker.task,
                    )
                    end.__cause__ = e
                    e = end
                if self._end_attempt(state, attempt, closure, finish=True):
                    closure.remote_value._set_error(e)
                    self._fail(e)
            else:
                if self._end_attempt(state, attempt, closure, finish=True):
                    closure.remote_value._set_value(value)

    def _inputs_ready(self, state: WorkerState, closure: Closure) -> bool:
        """Waits for the per-worker values ``closure`` takes on ``state``'s worker
        (its iterators, built there by targeted closures).  False once that worker
        is down or the coordinator closed before they arrived: the closure then
        goes back to the queue for another worker instead of waiting, unbounded,
        on a worker that may never come back."""
        for value in closure.inputs_on(state.worker.index):
            while not value.ready(_INPUT_POLL_SECONDS):
                if self._closed or not state.up:
                    return False
        return True

    def _end_attempt(
        self, state: WorkerState, attempt: int, closure: Closure, finish: bool = False
    ) -> bool:
        """Books the end of one attempt; with ``finish``, whether its result is the one kept."""
        with self._cond:
            _, started = state.running.pop(attempt)
            closure.running -= 1
            state.last_seen = time.monotonic()
            if closure.resource_key is not None:
                state.resources_in_flight -= 1
            won = finish and not closure.finished
            if won:
                closure.finished = True
                state.closures_run += 1
                if closure.resource_key is None:
                    state.done += 1
                    self._unfinished -= 1
                    self._step_times.record(time.monotonic() - started)
            self._cond.notify_all()
            return won

    def __repr__(self) -> str:
        return f"ClusterCoordinator(workers={self.num_workers})"


def _identity(value: Any) -> Any:
    return value


def _make_iterator(dataset: Any) -> Any:
    return iter(dataset)


class _PerWorkerIterator(PerWorkerValues):
    """``iter(per_worker_dataset)``: one iterator per worker."""
