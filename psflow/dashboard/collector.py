"""From successive probes to the ``/api/cluster`` document: task states, rates and events.

States (the JSON ``state`` field):

* PS task: ``unknown`` (never answered yet), ``up``, ``lost`` (no answer for
  ``lost_after`` consecutive rounds after it had answered);
* worker: ``unknown``, ``ready`` (answers, ran no closure since the last
  round), ``running`` (ran closures since the last round), ``lost``, and
  ``replaced`` (a different process answers in the slot - another pid or start
  time - and it has not run a closure yet);
* either, under ``psflow local``: ``killed`` or ``exited`` when the launcher
  saw its process die by a signal or exit (``roles.json``, see
  :mod:`psflow.dashboard.job_status`) and it does not answer; its ``exit``
  then says how (``killed by SIGKILL (exit 137)``).

Transitions are recorded in the :class:`~psflow.observability.events.EventLog`
(worker lost, back, replaced; PS lost, back), next to what the training loop
and the coordinator publish there (epochs, checkpoints, re-queued closures).
Rates (pushes/s, pulls/s, bytes/s) are counter differences between two
answers of the same task; after a restart (a counter went down) they are
unknown (None) for one round.

The document's shape is fixed by ``tests/schemas/cluster_api.schema.json``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from psflow.errors import InvalidArgumentError, OpError
from psflow.observability.events import EventKind, EventLog
from psflow.observability.progress import TrainingProgress

from .job_status import JobStatus, apply_job_status, write_json
from .probe import ClusterProbe, TaskAnswer

__all__ = ["API_VERSION", "ClusterMonitor"]

log = logging.getLogger(__name__)

API_VERSION = 1
"""Bumped when a field of ``/api/cluster`` changes meaning or disappears."""

_REASON_CHARS = 300
"""About how much of a probe's error an event's message quotes, cut between words
(all of it is in the event's data, which the page lets one expand)."""


def _shorten(text: str, limit: int = _REASON_CHARS) -> str:
    """``text`` up to ``limit`` characters, cut at a space (never inside an address), ``…`` after."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit)
    return (text[:cut] if cut > 0 else text[:limit]) + " …"


EVENTS_SHOWN = 200
"""The newest events the document carries."""

_RATES = {
    "pushes_per_second": "pushes_applied",
    "pulls_per_second": "pulls",
    "bytes_in_per_second": "bytes_in",
    "bytes_out_per_second": "bytes_out",
}


@dataclasses.dataclass
class _Task:
    """What the monitor remembers about one task between rounds."""

    job: str
    index: int
    address: str
    state: str = "unknown"
    failures: int = 0
    error: str | None = None
    last_seen: float | None = None
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    rates: dict[str, float | None] = dataclasses.field(default_factory=dict)
    incarnation: tuple[int, float] | None = None
    restarts: int = 0
    replaced_pending: bool = False

    @property
    def task(self) -> str:
        return f"{self.job}:{self.index}"


def _rates(before: Mapping[str, Any], after: Mapping[str, Any], dt: float) -> dict:
    out: dict[str, float | None] = {}
    for rate, counter in _RATES.items():
        delta = after.get(counter, 0) - before.get(counter, 0) if before else None
        out[rate] = delta / dt if delta is not None and delta >= 0 and dt > 0 else None
    return out


def _table_json(t: Mapping[str, Any]) -> dict[str, Any]:
    """One table shard of a PS task: rows by tier, hit rate, disk bytes."""
    hits = t["memory_hits"] + t["disk_hits"]
    tiered = t["memory_rows"] or t["disk_rows"]
    return {
        "table": t["table"],
        "rows": t["rows"],
        "memory_rows": t["memory_rows"] if tiered else t["rows"],  # no tier: all in memory
        "disk_rows": t["disk_rows"],
        "hit_rate": 1.0 if hits == 0 else t["memory_hits"] / hits,
        **{k: t[k] for k in ("disk_bytes_read", "disk_bytes_written", "disk_bytes")},
    }


class ClusterMonitor:
    """Probes the cluster every ``interval`` seconds from a daemon thread; :meth:`snapshot` reads.

    Args:
        probe: asks the tasks (closed by :meth:`close`).
        events: where transitions are recorded (and read back for the document).
        progress: the training recorder, or None (the document's ``training`` is idle).
        interval: seconds between rounds.
        lost_after: consecutive unanswered rounds before a task that answered is lost.
        ps_view: the PS addresses the job runs on now, read before every round
            (the parameter servers can be resized); None: the probe's, fixed.
        job_status: what the launcher knows of every task's process (exit
            statuses, the restart policy), read every round; None: no launcher.
        document_path: the latest document is written there after every round
            (and by :meth:`close`), so a launcher can serve it once the chief is gone.

    Raises:
        InvalidArgumentError: ``interval`` <= 0 or ``lost_after`` < 1.
    """

    def __init__(
        self,
        probe: ClusterProbe,
        events: EventLog,
        progress: TrainingProgress | None = None,
        *,
        interval: float = 1.0,
        lost_after: int = 2,
        ps_view: Callable[[], Sequence[str]] | None = None,
        job_status: Callable[[], JobStatus | None] | None = None,
        document_path: str | None = None,
    ) -> None:
        if not interval > 0:
            raise InvalidArgumentError(f"interval {interval!r} must be > 0")
        if isinstance(lost_after, bool) or not isinstance(lost_after, int) or lost_after < 1:
            raise InvalidArgumentError(f"lost_after {lost_after!r} must be an integer >= 1")
        self._probe = probe
        self.events = events
        self._progress = progress or TrainingProgress()
        self._interval = interval
        self._lost_after = lost_after
        self._ps_view = ps_view
        self._job_status = job_status
        self._job: JobStatus | None = None
        self._exits_seen: set[tuple[str, int | None]] = set()
        self._document_path = document_path
        self._started = time.time()
        self._lock = threading.Lock()
        self._tasks = [_Task("ps", i, a) for i, a in enumerate(probe.ps_addresses)]
        self._tasks += [_Task("worker", i, a) for i, a in enumerate(probe.worker_addresses)]
        self._rounds = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- rounds -----------------------------------------------------------------------
    def start(self) -> ClusterMonitor:
        """Starts probing in a daemon thread (once); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="dashboard-monitor", daemon=True
            )
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.probe_once()
                self.write_document()
            except Exception:  # a bug here must not kill the page: log and keep probing
                log.exception("dashboard probe round failed")
            self._stop.wait(max(0.0, self._interval - (time.monotonic() - began)))

    def probe_once(self) -> None:
        """Runs one round now (over the PS tasks the view lists) and folds the answers in."""
        self._follow_view()
        answers = self._probe.round()
        job = self._job_status() if self._job_status is not None else None
        with self._lock:
            tasks = {(t.job, t.index): t for t in self._tasks}
            for answer in answers:  # a subclass may watch tasks the probe does not ask
                self._fold(tasks[answer.job, answer.index], answer)
            self._rounds += 1
            self._job = job
        if job is not None:
            self._record_exits(job)

    def _record_exits(self, job: JobStatus) -> None:
        """One ``task_exited`` event per process the launcher saw end (the chief's own excepted)."""
        for name, role in sorted(job.roles.items()):
            if role.running or name == "chief" or (name, role.pid) in self._exits_seen:
                continue
            self._exits_seen.add((name, role.pid))
            restarts = (
                "; restarts are off (psflow local --restart on-failure restarts it)"
                if job.restart == "never" and role.failed
                else ""
            )
            self.events.record(
                EventKind.TASK_EXITED,
                name,
                f"{name} {role.describe()}{restarts}",
                role.as_json(),
            )

    def write_document(self) -> None:
        """Writes the document to ``document_path`` now (when there is one)."""
        if self._document_path is not None:
            try:
                write_json(self._document_path, self.snapshot())
            except OSError as e:  # the launcher removed its directory: it is going away
                log.debug("cannot write %s: %s", self._document_path, e)

    def _follow_view(self) -> None:
        """Probes the PS tasks the view lists now; a task kept at its address keeps its history."""
        if self._ps_view is None:
            return
        try:
            addresses = list(self._ps_view())
            if addresses == self._probe.ps_addresses:
                return
            self._probe.set_ps_addresses(addresses)
        except (OpError, OSError, ValueError) as e:  # a view being rewritten: the next round
            log.warning("cannot read the parameter servers' view, keeping the last: %s", e)
            return
        with self._lock:
            old = {(t.index, t.address): t for t in self._tasks if t.job == "ps"}
            ps = [old.get((i, a)) or _Task("ps", i, a) for i, a in enumerate(addresses)]
            self._tasks = ps + [t for t in self._tasks if t.job != "ps"]
        log.info("probing %d parameter servers: %s", len(addresses), ", ".join(addresses))

    def _fold(self, task: _Task, answer: TaskAnswer) -> None:
        if not answer.ok:
            task.failures += 1
            task.error = answer.error
            seen = task.last_seen is not None
            if seen and task.failures >= self._lost_after and task.state != "lost":
                task.state = "lost"
                kind = EventKind.PS_LOST if task.job == "ps" else EventKind.WORKER_LOST
                reason = _shorten(answer.error or "")
                self.events.record(
                    kind, task.task, f"{task.task} lost: {reason}", {"error": answer.error}
                )
            return
        values = dict(answer.values or {})
        was_lost = task.state == "lost"
        previous = task.values if task.last_seen is not None else {}
        dt = answer.time - task.last_seen if task.last_seen is not None else 0.0
        task.failures, task.error = 0, None
        if task.job == "ps":
            task.rates = _rates(previous, values, dt)
            task.state = "up"
            if was_lost:
                self.events.record(
                    EventKind.PS_BACK,
                    task.task,
                    f"{task.task} answers again, holding {values.get('num_variables', 0)} "
                    "variables",
                )
        else:
            self._fold_worker(task, previous, values, was_lost)
        task.values, task.last_seen = values, answer.time

    def _fold_worker(self, task: _Task, previous: Mapping, values: dict, was_lost: bool) -> None:
        incarnation = (values["pid"], values["started_at"])
        new_process = task.incarnation is not None and incarnation != task.incarnation
        if new_process:
            previous = {}
            task.restarts += 1
            task.replaced_pending = True
            self.events.record(
                EventKind.WORKER_REPLACED,
                task.task,
                f"{task.task} replaced: pid {task.incarnation[0]} -> {values['pid']}",
                {"old_pid": task.incarnation[0], "pid": values["pid"]},
            )
        elif was_lost:
            self.events.record(EventKind.WORKER_BACK, task.task, f"{task.task} answers again")
        task.incarnation = incarnation
        ran = values["closures_run"] - previous.get("closures_run", values["closures_run"])
        if new_process:
            ran = values["closures_run"]
        if ran > 0:
            task.replaced_pending = False
        task.state = "running" if ran > 0 else "replaced" if task.replaced_pending else "ready"

    # -- the document -----------------------------------------------------------------
    def _ps_json(self, task: _Task) -> dict[str, Any]:
        v = task.values
        histogram = v.get("staleness_histogram", {})
        return {
            "task": task.task,
            "address": task.address,
            "state": task.state,
            "error": task.error,
            "last_seen": task.last_seen,
            "variables": int(v.get("num_variables", 0)),
            "variable_bytes": int(v.get("variable_bytes", 0)),
            "bytes_in": int(v.get("bytes_in", 0)),
            "bytes_out": int(v.get("bytes_out", 0)),
            "pushes_applied": int(v.get("pushes_applied", 0)),
            "pushes_duplicate": int(v.get("pushes_duplicate", 0)),
            "pulls": int(v.get("pulls", 0)),
            "sync_steps_applied": int(v.get("sync_steps_applied", 0)),
            "rejected": {str(k): int(n) for k, n in v.get("rejected", {}).items()},
            "staleness_histogram": [
                {"staleness": int(s), "count": int(histogram[s])} for s in sorted(histogram)
            ],
            "max_staleness": int(v.get("max_staleness", 0)),
            **{rate: task.rates.get(rate) for rate in _RATES},
            "tables": [_table_json(t) for t in v.get("tables", [])],
        }

    def _worker_json(self, task: _Task, now: float) -> dict[str, Any]:
        v = task.values
        return {
            "task": task.task,
            "address": task.address,
            "state": task.state,
            "error": task.error,
            "pid": v.get("pid"),
            "started_at": v.get("started_at"),
            "restarts": task.restarts,
            "sessions": int(v.get("sessions", 0)),
            "closures_run": int(v.get("closures_run", 0)),
            "closures_failed": int(v.get("closures_failed", 0)),
            "closures_requeued": self.events.count(EventKind.CLOSURE_REQUEUED, task.task),
            "last_heartbeat": task.last_seen,
            "heartbeat_age_seconds": None if task.last_seen is None else now - task.last_seen,
        }

    def snapshot(self) -> dict[str, Any]:
        """The ``/api/cluster`` document (see ``tests/schemas/cluster_api.schema.json``)."""
        now = time.time()
        with self._lock:
            ps = [self._ps_json(t) for t in self._tasks if t.job == "ps"]
            workers = [self._worker_json(t, now) for t in self._tasks if t.job == "worker"]
            rounds = self._rounds
            job = self._job
        document = {
            "version": API_VERSION,
            "time": now,
            "uptime_seconds": now - self._started,
            "probe_rounds": rounds,
            "probe_interval_seconds": self._interval,
            "ps": ps,
            "workers": workers,
            "training": self._progress.snapshot(),
            "events": [e.as_json() for e in self.events.events()[-EVENTS_SHOWN:]],
        }
        return apply_job_status(document, job)

    def close(self) -> None:
        """Stops probing (waits up to one round) and closes the probe."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._probe.timeout + 5.0)
        self.write_document()  # the final state: training ended, the last events
        self._probe.close()
