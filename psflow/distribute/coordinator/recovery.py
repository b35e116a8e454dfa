"""How the coordinator handles workers that fail: lost, restarted, frozen, late, all gone.

:class:`WorkerState` is the coordinator's view of one worker; :class:`Recovery`
holds the coordinator's reactions to failures (a mixin of
:class:`~psflow.distribute.coordinator.cluster_coordinator.ClusterCoordinator`,
sharing its lock and queue):

* a call that finds the worker unreachable marks it down and re-queues its
  closure; a thread probes it until it answers, then rebuilds its resources;
* a worker that answers with a missing resource restarted: rebuilt at once;
* a probe thread per worker calls GetStatus with a deadline; no answer for the
  health grace marks it down and re-queues what it holds (it may be frozen
  or partitioned, with no socket reset to tell);
* a closure much later than recent ones is re-run on an idle worker (async
  mode); the first result wins;
* no worker reachable for the timeout: the queued closures fail, naming them.
* a closure that fails because its worker cannot reach a PS task (async
  mode) makes the chief probe that task itself: if it answers, the fault is
  the worker's path, not the PS; the closure is re-queued (its pushes carry
  its id, so none is applied twice), the worker is set aside until a check
  run on it reaches every PS task again. If the PS does not answer the chief
  either, the error stays the closure's (a PS failure, as before).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from psflow import errors
from psflow.distribute.coordinator.config import CoordinatorConfig
from psflow.distribute.coordinator.remote_value import RemoteValue
from psflow.distribute.coordinator.stragglers import StepTimes
from psflow.distribute.coordinator.workers import Closure, Worker
from psflow.observability import events

log = logging.getLogger("psflow.coordinator")

#: Seconds the chief waits for a PS task that a worker could not reach (and a
#: worker set aside for its PS path waits for each task, per check).
PS_PATH_PROBE_TIMEOUT = 5.0


def _reach_parameter_servers(timeout: float) -> None:
    """Run on a worker: returns once every PS task of its session answers (each in ``timeout``)."""
    from psflow.distribute.ps import session as session_lib

    for connection in session_lib.current().connections:
        connection.probe(timeout)


class WorkerState:
    """The coordinator's view of one worker."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.up = True
        self.down_since: float | None = None
        self.last_seen = time.monotonic()  # when it last answered a call or a probe
        self.targeted: collections.deque[Closure] = collections.deque()
        self.started = 0  # general closures dispatched (its step clock)
        self.done = 0
        self.closures_run = 0
        self.recovering = False
        self.rebuilding = False
        self.unresponsive = False  # marked down by the health probe, not by a failed call
        self.ps_cut: str | None = None  # a PS task it cannot reach while the chief can
        self.resources_in_flight = 0  # targeted closures sent and not yet answered
        self.running: dict[int, tuple[Closure, float]] = {}  # attempt id -> (closure, start)


class Recovery:
    """The failure handling of the coordinator (see the module docstring).

    It works on the coordinator's state, under the coordinator's lock:
    """

    _cond: threading.Condition
    _queue: collections.deque[Closure]
    _states: list[WorkerState]
    _config: CoordinatorConfig
    _closed: bool
    _ids: Iterator[int]
    _resources: list[tuple[str, int, Callable[..., Any], tuple]]
    _step_times: StepTimes
    _strategy: Any
    _session_id: str
    _functions: Any
    _async: bool
    speculative_runs: int

    def _check_all_down(self) -> None:
        """Fails the queued closures when no worker has answered for too long."""
        if not self._queue or any(s.up for s in self._states):
            return
        since = max(s.down_since or time.monotonic() for s in self._states)
        timeout = self._config.worker_unavailable_timeout
        if time.monotonic() - since > timeout:
            self._fail(errors.WorkerUnavailableError(self._no_worker_message(timeout)))

    def _no_worker_message(self, timeout: float) -> str:
        """Why no worker could be used (hold ``_cond``): lost, silent, or cut off from a PS."""
        queued = f"giving up with {len(self._queue)} closures queued"
        cut = [s for s in self._states if s.ps_cut is not None]
        if len(cut) == len(self._states):
            # the chief probed each PS task a worker could not reach, and it answered: the
            # fault is the workers' paths to the PS, not the workers nor the PS
            paths = ", ".join(f"{s.worker.task} cannot reach {s.ps_cut}" for s in cut)
            reached = ", ".join(sorted({str(s.ps_cut) for s in cut}))
            return (
                f"No worker could reach the parameter servers for {timeout:g}s while the chief "
                f"reaches {reached}: {paths} (each set aside until a check run on it reaches "
                f"every PS task); {queued}"
            )
        reasons = []
        for s in self._states:
            if s.ps_cut is not None:
                reasons.append(f"{s.worker.task} set aside: cannot reach {s.ps_cut}")
            elif s.unresponsive:
                reasons.append(f"{s.worker.task} answers no health probe")
            else:
                reasons.append(f"{s.worker.task} unreachable")
        return f"No worker reachable for {timeout:g}s (lost: {'; '.join(reasons)}); {queued}"

    def _requeue(self, state: WorkerState, closure: Closure) -> None:
        """Queues ``closure`` again unless it finished, waits already or still runs elsewhere."""
        events.publish(events.EventKind.CLOSURE_REQUEUED, state.worker.task, "closure re-queued")
        with self._cond:
            if closure.resource_key is not None:
                state.targeted.appendleft(closure)
            elif not (closure.finished or closure.queued or closure.running):
                state.started -= 1
                closure.queued = True
                self._queue.appendleft(closure)
            self._cond.notify_all()

    def _mark_down(self, state: WorkerState) -> None:
        with self._cond:
            if state.up:
                state.up = False
                state.down_since = time.monotonic()
            self._cond.notify_all()

    def _worker_lost(self, state: WorkerState, closure: Closure) -> None:
        self._mark_down(state)
        with self._cond:
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

    def _worker_restarted(self, state: WorkerState, closure: Closure) -> None:
        self._requeue(state, closure)
        self._mark_down(state)
        with self._cond:
            if state.rebuilding:  # the other dispatcher found it first and rebuilds
                return
            state.rebuilding = True
        try:
            self._rebuild(state)
        finally:
            with self._cond:
                state.rebuilding = False
                self._cond.notify_all()

    def _recover(self, state: WorkerState) -> None:
        """Probes a lost worker until it answers again, then rebuilds its resources."""
        try:
            while not self._closed:
                if state.worker.healthy(timeout=2.0):
                    self._rebuild(state)
                    return
                time.sleep(0.5)
        finally:
            state.recovering = False

    def _probe(self, state: WorkerState) -> None:
        """Health-checks one worker (GetStatus, with a deadline) for as long as the coordinator runs.

        A worker that leaves probes unanswered for the grace is marked down and the
        closures it holds run elsewhere; when it answers again it is used again.
        """
        cfg = self._config
        probe_timeout = max(min(cfg.health_grace / 2, 2.0), 0.05)
        while not self._closed:
            answered = state.worker.healthy(timeout=probe_timeout)
            now = time.monotonic()
            orphans: list[Closure] = []
            with self._cond:
                if answered:
                    state.last_seen = now
                    # a worker set aside for its PS path comes back when that path
                    # answers (_await_ps_path), not when it answers the chief
                    if state.unresponsive and not state.recovering and state.ps_cut is None:
                        log.info("%s answers again; using it again", state.worker.task)
                        state.unresponsive = False
                        state.up = True
                        state.down_since = None
                        self._cond.notify_all()
                elif state.up and now - state.last_seen > cfg.health_grace:
                    log.warning(
                        "%s has not answered for %.1fs; its closures run elsewhere",
                        state.worker.task,
                        now - state.last_seen,
                    )
                    state.unresponsive = True
                    state.up = False
                    state.down_since = now
                    orphans = [c for c, _ in state.running.values() if c.resource_key is None]
                    self._cond.notify_all()
            for closure in orphans:
                with self._cond:
                    if closure.finished or closure.queued:
                        continue
                    closure.queued = True
                    self._queue.appendleft(closure)
                    self._cond.notify_all()
                # announced like a failed call's re-queue (the dashboard counts these)
                events.publish(
                    events.EventKind.CLOSURE_REQUEUED, state.worker.task, "closure re-queued"
                )
            with self._cond:
                self._cond.wait_for(lambda: self._closed, timeout=cfg.health_interval)

    def _ps_path_fault(self, state: WorkerState, error: BaseException) -> str | None:
        """The PS task ``error`` says ``state``'s worker could not reach, if the chief reaches it.

        None: not a PS-unreachable error of a remote worker, or the task does not
        answer the chief either within ``PS_PATH_PROBE_TIMEOUT`` (a PS failure).
        """
        if not state.worker.probed or isinstance(error, errors.WorkerUnavailableError):
            return None
        if not isinstance(error, (errors.UnavailableError, errors.DeadlineExceededError)):
            return None
        task = error.task or ""
        connections = [c for c in self._strategy._session.connections if c.task == task]
        if not task.startswith("ps:") or not connections:
            return None
        try:
            connections[0].probe(PS_PATH_PROBE_TIMEOUT)
        except errors.OpError as e:
            log.warning("%s does not answer the chief either (%s): a PS failure", task, e)
            return None
        return task

    def _worker_cut_from_ps(self, state: WorkerState, closure: Closure, ps_task: str) -> None:
        """Re-queues ``closure`` and sets the worker aside until it reaches the PS tasks again."""
        log.warning(
            "%s cannot reach %s, which answers the chief; closure %d runs elsewhere",
            state.worker.task,
            ps_task,
            closure.closure_id,
        )
        with self._cond:
            start_check = state.ps_cut is None  # both dispatchers may see the fault
            state.ps_cut = ps_task
        self._mark_down(state)
        self._requeue(state, closure)
        if start_check:
            threading.Thread(
                target=self._await_ps_path,
                args=(state,),
                name=f"ps-path-{state.worker.task}",
                daemon=True,
            ).start()

    def _await_ps_path(self, state: WorkerState) -> None:
        """Runs a check on the worker until it reaches every PS task; then uses it again.

        Each check is bounded (``PS_PATH_PROBE_TIMEOUT`` per PS task), and the
        loop ends with the coordinator.
        """
        tasks = len(self._strategy._session.connections)
        while not self._closed:
            check = Closure(
                next(self._ids),
                _reach_parameter_servers,
                (PS_PATH_PROBE_TIMEOUT,),
                {},
                RemoteValue(0, "ps-path"),
            )
            try:
                state.worker.run(
                    self._session_id,
                    check,
                    self._functions,
                    timeout=PS_PATH_PROBE_TIMEOUT * tasks + 5.0,
                )
            except Exception as e:  # the path (or the worker) still fails: check again
                log.debug("%s still cannot reach the PS tasks: %s", state.worker.task, e)
            else:
                with self._cond:
                    state.ps_cut = None
                    if not (state.unresponsive or state.recovering):
                        state.up = True
                        state.down_since = None
                        state.last_seen = time.monotonic()
                    self._cond.notify_all()
                log.info("%s reaches the PS tasks again; using it again", state.worker.task)
                return
            with self._cond:
                self._cond.wait_for(lambda: self._closed, timeout=self._config.health_interval)

    def _watch_stragglers(self) -> None:
        """Re-runs a late closure on an idle worker (async mode); the first result wins.

        The re-run has the closure's id, so its pushes carry the same request ids and
        the parameter servers apply only the first of the two.
        """
        while not self._closed:
            threshold = self._step_times.threshold()
            if threshold is not None:
                now = time.monotonic()
                with self._cond:
                    idle = any(s.up and not s.running for s in self._states)
                    if idle and not self._queue:
                        for s in self._states:
                            for closure, started in list(s.running.values()):
                                if (
                                    closure.resource_key is None
                                    and not (closure.finished or closure.queued)
                                    and closure.speculable
                                    and not closure.speculated
                                    and now - started > threshold
                                ):
                                    log.info(
                                        "closure %d on %s is late (%.1fs > %.1fs); re-running it",
                                        closure.closure_id,
                                        s.worker.task,
                                        now - started,
                                        threshold,
                                    )
                                    closure.speculated = True
                                    closure.queued = True
                                    self._queue.appendleft(closure)
                                    self.speculative_runs += 1
                        self._cond.notify_all()
            with self._cond:
                self._cond.wait_for(lambda: self._closed, timeout=0.2)

    def _rebuild(self, state: WorkerState) -> None:
        """Re-creates this session's datasets and iterators on a (restarted) worker."""
        state.worker.forget_functions()
        with self._cond:
            specs = [r for r in self._resources if r[1] == state.worker.index]
            # a resource still waiting to be built keeps its value: what is built from it
            # (an iterator from its dataset) waits on that value, not on a new one
            waiting = {c.resource_key: c.remote_value for c in state.targeted if c.resource_key}
            rebuilt = collections.deque(
                Closure(
                    next(self._ids),
                    fn,
                    args,
                    {},
                    waiting.get(key) or RemoteValue(0, key),
                    resource_key=key,
                )
                for key, _, fn, args in specs
            )
            # resources first, in creation order, then whatever was waiting for this worker
            pending = [c for c in state.targeted if c.resource_key not in {k for k, *_ in specs}]
            state.targeted = collections.deque([*rebuilt, *pending])
            state.up = True
            state.unresponsive = False
            state.down_since = None
            state.last_seen = time.monotonic()
            self._cond.notify_all()
        log.info("%s is back; rebuilt %d resources", state.worker.task, len(specs))
