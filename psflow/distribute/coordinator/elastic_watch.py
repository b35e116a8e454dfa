"""``ClusterWatch``: the chief resizes the parameter servers when the cluster's view changes.

A thread polls the strategy's cluster resolver every ``interval`` seconds.
When the number of ``ps`` tasks it lists differs from the number the job runs
on, it calls ``coordinator.resize_parameter_servers(n)`` (which fences at a
step boundary, moves shards, drains removed tasks) and logs one line with the
:class:`ResizeReport`::

    resized PS 2 -> 3: moved 12 shards, 4.1 MB, pause 0.21 s

Rules:

* one resize per change of the listed count: a count that stays the same is
  not resized again, a change back is a new change;
* never below 1 (a view listing no parameter server is logged and ignored),
  never above what the resolver lists (the listed count *is* the target);
* a resize that fails (a new task not reachable yet, a deadline) is logged
  and tried again after a back-off that doubles up to ``max_backoff``, as
  long as the view still asks for it;
* a resolver whose view can change implements
  :class:`~psflow.distribute.cluster_resolver.RefreshableResolver`: the watch
  calls ``refresh()`` before reading ``cluster_spec()``, so the resize reads
  the same view.  A fixed resolver (``TF_CONFIG``) never triggers a resize.

Two ways to run it:

* **in a thread** (:meth:`ClusterWatch.start`, or ``with ClusterWatch(...)``):
  the watch polls and resizes by itself while the program trains.  In async
  and bounded-staleness mode the coordinator moves variables in fenced batches
  while closures keep running, so training pauses only where it touches a
  variable being handed over; in sync mode the coordinator holds ``schedule``
  at the next step boundary, lets the closures in flight finish, moves the
  variables and lets ``schedule`` go on (the whole move is the pause);
* **at step boundaries** (any mode): the training loop calls
  :meth:`ClusterWatch.at_step_boundary` after ``coordinator.join()``; it polls
  at most once per ``interval`` and resizes in the calling thread.

Example (the chief of ``psflow local --ps-max 3 --ps 2``; ``examples/elastic_train.py``)::

    resolver = pf.distribute.cluster_resolver.ClusterFileResolver.from_environment()
    strategy = pf.distribute.ParameterServerStrategy(resolver)
    coordinator = pf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    watch = ClusterWatch(coordinator, interval=0.5)
    for epoch in range(epochs):
        for _ in range(steps_per_epoch):
            coordinator.schedule(step_fn, args=(iterator,))
        coordinator.join()
        watch.at_step_boundary()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from psflow.distribute.cluster_resolver.refreshable import RefreshableResolver
from psflow.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    OpError,
)
from psflow.transport.core import RetryPolicy

log = logging.getLogger("psflow.coordinator.elastic")

PS_JOB = "ps"
MIN_INTERVAL = 0.01
MAX_INTERVAL = 60.0


@runtime_checkable
class Resizable(Protocol):
    """What the watch resizes: a ``ClusterCoordinator`` (or a ``ParameterServerStrategy``)."""

    def resize_parameter_servers(self, num_ps: int, *, timeout: float = 300.0) -> Any:
        """Moves every shard to tasks ``0..num_ps-1`` of the resolver's view; returns a report."""
        ...


def describe_resize(report: Any) -> str:
    """The one log line for a resize report.

    Example:
        >>> import types
        >>> describe_resize(types.SimpleNamespace(old_num_ps=2, new_num_ps=3, shards_moved=12,
        ...     bytes_moved=4_100_000, longest_fence_seconds=0.214, seconds=1.5))
        'resized PS 2 -> 3: moved 12 shards, 4.1 MB, pause 0.21 s (1.50 s in all)'
    """
    return (
        f"resized PS {report.old_num_ps} -> {report.new_num_ps}: moved {report.shards_moved} "
        f"shards, {report.bytes_moved / 1e6:.1f} MB, pause {report.longest_fence_seconds:.2f} s "
        f"({report.seconds:.2f} s in all)"
    )


def _check_seconds(value: object, what: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise InvalidArgumentError(f"{what} {value!r} must be a number of seconds in {low}..{high}")
    return float(value)


class ClusterWatch:
    """Resizes ``target``'s parameter servers to the count its cluster resolver lists.

    Args:
        target: a ``ClusterCoordinator`` (resizes at a step boundary) or a
            ``ParameterServerStrategy``.
        resolver: the view to watch; default ``target.strategy.cluster_resolver``
            (or ``target.cluster_resolver``).
        interval: seconds between polls.
        resize_timeout: seconds each resize may take.
        max_backoff: the longest wait before retrying a failed resize.
        on_resize: called with each :class:`ResizeReport` after it is logged.

    Raises:
        InvalidArgumentError: ``target`` is neither a coordinator nor a
            parameter-server strategy, there is no resolver, or a number of
            seconds is out of range.
    """

    def __init__(
        self,
        target: Resizable,
        resolver: Any = None,
        *,
        interval: float = 1.0,
        resize_timeout: float = 300.0,
        max_backoff: float = 30.0,
        on_resize: Callable[[Any], None] | None = None,
    ) -> None:
        from psflow.distribute.coordinator.cluster_coordinator import ClusterCoordinator
        from psflow.distribute.parameter_server_strategy import ParameterServerStrategy

        strategy = target.strategy if isinstance(target, ClusterCoordinator) else target
        if not isinstance(strategy, ParameterServerStrategy):
            raise InvalidArgumentError(
                f"{target!r} cannot resize parameter servers: give a ClusterCoordinator or a "
                "ParameterServerStrategy"
            )
        resolver = strategy.cluster_resolver if resolver is None else resolver
        if resolver is None:
            raise InvalidArgumentError(f"{target!r} has no cluster resolver to watch")
        self._target = target
        self._resolver = resolver
        self._interval = _check_seconds(interval, "interval", MIN_INTERVAL, MAX_INTERVAL)
        self._resize_timeout = _check_seconds(resize_timeout, "resize_timeout", 0.001, 86400.0)
        # the clients' one policy: twice the interval after the first failure, doubling
        self._retry = RetryPolicy(
            initial_backoff=2 * self._interval,
            max_backoff=_check_seconds(max_backoff, "max_backoff", self._interval, 3600.0),
            multiplier=2.0,
        )
        self._on_resize = on_resize
        # what the job runs on now; the view may already list another count (then the
        # first poll resizes)
        self._num_ps = len(strategy.placement().addresses)
        self._reports: list[Any] = []
        self._failures = 0
        self._failures_in_row = 0
        self._retry_at = 0.0
        self._last_poll = float("-inf")
        self._last_problem: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one poll at a time (the thread, or a caller)

    @staticmethod
    def _listed(spec: Any) -> int:
        return spec.num_tasks(PS_JOB) if PS_JOB in spec.jobs else 0

    @property
    def num_ps(self) -> int:
        """The parameter servers the job runs on, as of the last successful resize."""
        return self._num_ps

    @property
    def reports(self) -> list[Any]:
        """Every resize report so far, oldest first (a copy)."""
        return list(self._reports)

    @property
    def failures(self) -> int:
        """Resizes that raised (each retried while the view still asks for it)."""
        return self._failures

    def _problem(self, message: str, level: int = logging.WARNING) -> None:
        if message != self._last_problem:  # one line per distinct problem, not one per poll
            log.log(level, message)
            self._last_problem = message

    def poll(self) -> Any:
        """Reads the view once and resizes if its ps count changed; returns the report or None.

        Never raises for a bad view or a failed resize: both are logged (the
        failure is retried by a later poll after the back-off).
        """
        with self._lock:
            return self._poll()

    def at_step_boundary(self) -> Any:
        """Polls if ``interval`` seconds passed since the last poll; returns a report or None.

        Call it from the thread that schedules, between steps (after
        ``coordinator.join()``): the resize then runs with nothing in flight.
        """
        now = time.monotonic()
        if now - self._last_poll < self._interval:
            return None
        return self.poll()

    def _poll(self) -> Any:
        self._last_poll = time.monotonic()
        resolver = self._resolver
        try:
            spec = (
                resolver.refresh()
                if isinstance(resolver, RefreshableResolver)
                else resolver.cluster_spec()
            )
        except OpError as e:
            self._problem(f"cannot read the cluster view, keeping {self._num_ps} PS: {e}")
            return None
        wanted = self._listed(spec)
        if wanted < 1:
            self._problem(f"the cluster view lists no ps task; keeping {self._num_ps} PS")
            return None
        if wanted == self._num_ps:
            self._failures_in_row = 0
            self._retry_at = 0.0
            self._last_problem = None
            return None
        now = time.monotonic()
        if now < self._retry_at:
            return None
        old = self._num_ps
        log.info("the cluster view lists %d PS (job runs on %d): resizing", wanted, old)
        try:
            report = self._target.resize_parameter_servers(wanted, timeout=self._resize_timeout)
        except OpError as e:
            self._failures += 1
            self._failures_in_row += 1
            backoff = self._retry.backoff(self._failures_in_row)
            self._retry_at = time.monotonic() + backoff
            log.error("resizing PS %d -> %d failed (retry in %.1f s): %s", old, wanted, backoff, e)
            return None
        self._num_ps = wanted
        self._failures_in_row = 0
        self._retry_at = 0.0
        self._last_problem = None
        self._reports.append(report)
        log.info("%s", describe_resize(report))
        if self._on_resize is not None:
            self._on_resize(report)
        return report

    # -- the thread ---------------------------------------------------------------------
    def start(self) -> ClusterWatch:
        """Starts polling in a daemon thread; returns self.

        Raises:
            FailedPreconditionError: it was started before.
        """
        if self._thread is not None:
            raise FailedPreconditionError("this ClusterWatch was started already")
        self._thread = threading.Thread(target=self._run, name="psflow-cluster-watch", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.poll()
            except Exception:  # a bug must not kill the watch silently; the job goes on
                log.exception("cluster watch: unexpected error")

    def stop(self, timeout: float | None = None) -> None:
        """Stops polling; waits up to ``timeout`` seconds (default: one resize) for a resize.

        Raises:
            DeadlineExceededError: a resize still runs after ``timeout`` seconds.
        """
        self._stop.set()
        thread = self._thread
        if thread is None:
            return
        wait = self._resize_timeout + self._interval if timeout is None else timeout
        thread.join(wait)
        if thread.is_alive():
            raise DeadlineExceededError(f"the cluster watch still resizes after {wait:.1f} s")

    def __enter__(self) -> ClusterWatch:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ClusterWatch(num_ps={self._num_ps}, resizes={len(self._reports)})"
