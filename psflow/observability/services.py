"""The metrics of psflow's two servers, named once here so dashboards can rely on them.

:class:`PSMetrics` (parameter server) and :class:`WorkerMetrics` (worker) own
their metric families in a :class:`~psflow.observability.metrics.Registry`;
the servicers call their ``record_*`` methods, and values another object
already counts (the variable store's counters) are read at scrape time.
Every series carries the ``task`` label.

PS (``psflow_ps_*``): ``rpcs_total{method,code}``, ``rpc_seconds{method}``,
``push_bytes_total{variable}``, ``push_seconds{variable}``,
``pull_bytes_total{variable}``, ``pull_seconds{variable}``,
``rejected_total{reason}``, ``staleness`` (versions), ``step`` (highest
synchronous step pushed), ``client_last_push_timestamp_seconds{client}``,
``updates_applied_total{variable}``, ``pushes_applied_total``,
``pushes_duplicate_total``, ``sync_steps_applied_total``, ``variables``,
``variable_bytes``, ``active_streams``.

Worker (``psflow_worker_*``): ``closures_total{outcome}``, ``closure_seconds``,
``closure_bytes_total``, ``step``, ``last_closure_timestamp_seconds``,
``rejected_total{reason}``, ``rpcs_total{method,code}``, ``sessions``.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .metrics import Family, Registry

__all__ = ["MAX_CLIENT_SERIES", "STALENESS_BUCKETS", "PSMetrics", "WorkerMetrics"]

MAX_CLIENT_SERIES = 256  # clients with a last-push series (least recently seen dropped)

STALENESS_BUCKETS: tuple[float, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256)


class PSMetrics:
    """Metrics of one parameter-server task.

    Args:
        registry: where the families live.
        task: the task name (``"ps:0"``), the ``task`` label.
        store_stats: returns the store's counters (``VariableStore.stats_snapshot``
            plus ``applied_by_variable``), read at scrape time.
        active_streams: returns the calls in progress, read at scrape time.
    """

    def __init__(
        self,
        registry: Registry,
        task: str,
        *,
        store_stats: Callable[[], Mapping[str, Any]] | None = None,
        active_streams: Callable[[], int] | None = None,
    ) -> None:
        self.registry = registry
        self.task = task
        r = registry
        self.rpcs = r.counter(
            "psflow_ps_rpcs_total", "RPCs answered, by code.", ["task", "method", "code"]
        )
        self.rpc_seconds = r.histogram(
            "psflow_ps_rpc_seconds", "RPC latency on the server.", ["task", "method"]
        )
        self.push_bytes = r.counter(
            "psflow_ps_push_bytes_total",
            "Gradient bytes pushed and accepted.",
            ["task", "variable"],
        )
        self.push_seconds = r.histogram(
            "psflow_ps_push_seconds",
            "Latency of the pushes carrying a variable.",
            ["task", "variable"],
        )
        self.pull_bytes = r.counter(
            "psflow_ps_pull_bytes_total", "Bytes pulled.", ["task", "variable"]
        )
        self.pull_seconds = r.histogram(
            "psflow_ps_pull_seconds",
            "Latency of the pulls reading a variable.",
            ["task", "variable"],
        )
        self.rejected = r.counter(
            "psflow_ps_rejected_total", "Requests rejected, by reason.", ["task", "reason"]
        )
        self.staleness = r.histogram(
            "psflow_ps_staleness",
            "Versions a variable moved between a gradient's base and its application.",
            ["task"],
            buckets=STALENESS_BUCKETS,
        )
        self.step = r.gauge("psflow_ps_step", "Highest synchronous step pushed.", ["task"])
        self.last_push = r.gauge(
            "psflow_ps_client_last_push_timestamp_seconds",
            "When each client (worker) last pushed, seconds since the epoch.",
            ["task", "client"],
        )
        self._store_stats = store_stats
        self._active_streams = active_streams
        self._clients: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._clients_lock = threading.Lock()
        r.add_collector(self._collect)

    def watch_streams(self, active_streams: Callable[[], int]) -> None:
        """Reads the calls in progress from ``active_streams`` at scrape time."""
        self._active_streams = active_streams

    # -- recording (called by the servicer) -------------------------------------------
    def record_rpc(self, method: str, code: str, seconds: float) -> None:
        """One answered RPC."""
        self.rpcs.labels(self.task, method, code).inc()
        self.rpc_seconds.labels(self.task, method).observe(seconds)

    def record_rejection(self, reason: str) -> None:
        """One rejected request (bad input, a limit, missing credentials)."""
        self.rejected.labels(self.task, reason).inc()

    def record_push_seen(self, client_id: str, step: int | None) -> None:
        """An accepted push from ``client_id``.

        Only the :data:`MAX_CLIENT_SERIES` most recent clients keep a series (the
        least recently seen one is dropped), so client ids cannot grow the metrics.
        """
        with self._clients_lock:
            self._clients[client_id] = None
            self._clients.move_to_end(client_id)
            evicted = []
            while len(self._clients) > MAX_CLIENT_SERIES:
                evicted.append(self._clients.popitem(last=False)[0])
            self.last_push.labels(self.task, client_id).set(time.time())
            for old in evicted:
                self.last_push.remove(self.task, old)
        if step is not None:
            self.step.labels(self.task).set_max(step)

    def record_push(
        self, sizes: Sequence[tuple[str, int]], seconds: float, staleness: Iterable[int]
    ) -> None:
        """An accepted push: ``(variable, bytes)`` per gradient, its latency and staleness."""
        for name, nbytes in sizes:
            self.push_bytes.labels(self.task, name).inc(nbytes)
            self.push_seconds.labels(self.task, name).observe(seconds)
        hist = self.staleness.labels(self.task)
        for s in staleness:
            if s >= 0:
                hist.observe(s)

    def record_pull(self, sizes: Sequence[tuple[str, int]], seconds: float) -> None:
        """A served pull: ``(variable, bytes)`` per tensor and its latency."""
        for name, nbytes in sizes:
            self.pull_bytes.labels(self.task, name).inc(nbytes)
            self.pull_seconds.labels(self.task, name).observe(seconds)

    # -- scrape time ------------------------------------------------------------------
    def _collect(self) -> list[Family]:
        task = {"task": self.task}
        families = []
        if self._active_streams is not None:
            families.append(
                Family(
                    "psflow_ps_active_streams",
                    "gauge",
                    "ParameterServer calls in progress.",
                    [("psflow_ps_active_streams", task, self._active_streams())],
                )
            )
        if self._store_stats is None:
            return families
        s = self._store_stats()
        simple = [
            ("psflow_ps_pushes_applied_total", "counter", "Pushes applied.", "pushes_applied"),
            (
                "psflow_ps_pushes_duplicate_total",
                "counter",
                "Retried pushes answered from memory (applied once).",
                "pushes_duplicate",
            ),
            (
                "psflow_ps_sync_steps_applied_total",
                "counter",
                "Synchronous steps applied.",
                "sync_steps_applied",
            ),
            ("psflow_ps_pulls_total", "counter", "Pulls served.", "pulls"),
            ("psflow_ps_variables", "gauge", "Variables held.", "num_variables"),
            ("psflow_ps_variable_bytes", "gauge", "Bytes of variables held.", "variable_bytes"),
        ]
        for name, kind, help_text, key in simple:
            if key in s:
                families.append(Family(name, kind, help_text, [(name, task, s[key])]))
        applied = s.get("applied_by_variable")
        if applied is not None:
            name = "psflow_ps_updates_applied_total"
            families.append(
                Family(
                    name,
                    "counter",
                    "Gradient updates applied to each variable (asynchronous pushes).",
                    [(name, {**task, "variable": v}, n) for v, n in sorted(applied.items())],
                )
            )
        return families


class WorkerMetrics:
    """Metrics of one worker task.

    Args:
        registry: where the families live.
        task: the task name (``"worker:0"``), the ``task`` label.
        sessions: returns the number of coordinator sessions, read at scrape time.
    """

    def __init__(
        self, registry: Registry, task: str, *, sessions: Callable[[], int] | None = None
    ) -> None:
        self.registry = registry
        self.task = task
        r = registry
        self.closures = r.counter(
            "psflow_worker_closures_total", "Closures handled, by outcome.", ["task", "outcome"]
        )
        self.closure_seconds = r.histogram(
            "psflow_worker_closure_seconds", "Time to run a closure on the worker.", ["task"]
        )
        self.closure_bytes = r.counter(
            "psflow_worker_closure_bytes_total", "Function and argument bytes received.", ["task"]
        )
        self.step = r.gauge("psflow_worker_step", "Step of the last closure run.", ["task"])
        self.last_closure = r.gauge(
            "psflow_worker_last_closure_timestamp_seconds",
            "When the last closure finished, seconds since the epoch.",
            ["task"],
        )
        self.rejected = r.counter(
            "psflow_worker_rejected_total", "Requests rejected, by reason.", ["task", "reason"]
        )
        self.rpcs = r.counter(
            "psflow_worker_rpcs_total", "RPCs answered, by code.", ["task", "method", "code"]
        )
        self._sessions = sessions
        r.add_collector(self._collect)

    def record_rpc(self, method: str, code: str) -> None:
        """One answered RPC."""
        self.rpcs.labels(self.task, method, code).inc()

    def record_rejection(self, reason: str) -> None:
        """One rejected request."""
        self.rejected.labels(self.task, reason).inc()

    def record_closure(self, outcome: str, seconds: float, nbytes: int, step: int) -> None:
        """A closure handled: ``outcome`` is ok, error, function_missing or missing_resource."""
        self.closures.labels(self.task, outcome).inc()
        self.closure_seconds.labels(self.task).observe(seconds)
        self.closure_bytes.labels(self.task).inc(nbytes)
        if step:
            self.step.labels(self.task).set(step)
        self.last_closure.labels(self.task).set(time.time())

    def _collect(self) -> list[Family]:
        if self._sessions is None:
            return []
        name = "psflow_worker_sessions"
        return [
            Family(
                name,
                "gauge",
                "Coordinator sessions with state here.",
                [(name, {"task": self.task}, self._sessions())],
            )
        ]
