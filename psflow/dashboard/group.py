"""The dashboard of a multi-worker group: its membership, each change, its PS tasks.

A ``MultiWorkerMirroredStrategy`` group has no chief process and its workers
serve no gRPC, so :class:`GroupMonitor` asks what it needs elsewhere: every
round it asks each worker slot's door for its view
(:func:`psflow.collective.membership.ask_view`: generation, members,
addresses; an elastic group's door stays open for the whole run), takes the
newest generation that named its members as the group's, and folds in what
the launcher knows of every process.  The PS tasks of the hybrid mode are
probed as :class:`~psflow.dashboard.collector.ClusterMonitor` probes them.

A worker's ``state``:

* ``running``: a member of the group's current generation;
* ``ready``: its door answers but it is not a member (starting, or waiting
  to be admitted at a step boundary);
* ``lost``: it answered before and has not for ``lost_after`` rounds;
  ``killed`` / ``exited`` when the launcher saw its process end;
* ``unknown``: never answered (a group without ``ElasticOptions`` closes its
  doors once its ring is up: its workers show the launcher's view only).

Every change of generation or members is a ``membership_changed`` event
naming the workers that joined and left; the document's ``membership``
says the current generation, its members and how many changes there were.

Example:
    >>> from psflow.observability.events import EventLog
    >>> from psflow.security.config import SecurityConfig
    >>> monitor = GroupMonitor(["127.0.0.1:1"], SecurityConfig(), EventLog())
    >>> monitor.snapshot()["membership"]
    {'generation': None, 'members': [], 'changes': 0}
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from typing import Any

from psflow.collective.membership import View, ask_view
from psflow.errors import OpError
from psflow.observability.events import EventKind, EventLog
from psflow.security.config import SecurityConfig

from .collector import ClusterMonitor, _Task
from .job_status import JobStatus, apply_job_status
from .probe import ClusterProbe, TaskAnswer

__all__ = ["GroupMonitor"]


class GroupMonitor(ClusterMonitor):
    """Watches a multi-worker group for the dashboard (module docstring).

    Args:
        workers: every worker slot's ``host:port`` (its door), by worker id.
        security: the group's token or TLS (a door refuses anyone else).
        events: where membership changes, lost workers and exits are recorded.
        ps: the hybrid mode's PS addresses (probed for their statistics).
        job_status: what the launcher knows of every process, read every round.
        interval: seconds between rounds.
        lost_after: unanswered rounds before a worker that answered is lost.
        timeout: seconds each door has to answer.
    """

    def __init__(
        self,
        workers: Sequence[str],
        security: SecurityConfig,
        events: EventLog,
        *,
        ps: Sequence[str] = (),
        job_status: Callable[[], JobStatus | None] | None = None,
        interval: float = 1.0,
        lost_after: int = 2,
        timeout: float = 1.0,
    ) -> None:
        probe = ClusterProbe({"ps": list(ps)} if ps else {}, security=security)
        super().__init__(
            probe, events, interval=interval, lost_after=lost_after, job_status=job_status
        )
        self._security = security
        self._timeout = timeout
        self._tasks += [_Task("worker", i, a) for i, a in enumerate(workers)]
        self._view: View | None = None
        self._changes = 0
        self._final = False
        self._pool: concurrent.futures.ThreadPoolExecutor | None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(8, max(1, len(workers))), thread_name_prefix="dashboard-view"
        )

    def _ask(self, address: str) -> View | str:
        try:
            return ask_view(address, self._security, self._timeout)
        except OpError as e:
            return f"{type(e).__name__}: {e}"

    def probe_once(self) -> None:
        """One round: the PS tasks and the launcher's statuses, then every worker's door."""
        super().probe_once()
        with self._lock:
            workers = [t for t in self._tasks if t.job == "worker"]
        pool = self._pool
        if pool is None:
            return
        futures = [pool.submit(self._ask, t.address) for t in workers]
        answers = [f.result(timeout=self._timeout + 30.0) for f in futures]
        views = [a for a in answers if isinstance(a, View) and a.members]
        group = max(views, key=lambda v: v.generation, default=None)
        now = time.time()
        with self._lock:
            if group is not None:
                self._note(group)
            members = set(self._view.members) if self._view is not None else set()
            for task, answer in zip(workers, answers, strict=True):
                self._fold_view(task, answer, task.index in members, now)

    def _note(self, group: View) -> None:
        """Records a change of generation or members (lock held)."""
        before = self._view
        if before is not None and (
            group.generation < before.generation
            or (group.generation, group.members) == (before.generation, before.members)
        ):
            return
        self._view = group
        if before is None:
            names = ", ".join(f"worker:{m}" for m in group.members)
            message = f"generation {group.generation}: {names}"
            joined, left = list(group.members), []
        else:
            joined = [m for m in group.members if m not in before.members]
            left = [m for m in before.members if m not in group.members]
            self._changes += 1
            parts = [f"worker:{m} joined" for m in joined] + [f"worker:{m} left" for m in left]
            message = f"generation {group.generation}: " + (", ".join(parts) or "the same members")
            message += f" ({len(group.members)} workers)"
        self.events.record(
            EventKind.MEMBERSHIP_CHANGED,
            "group",
            message,
            {
                "generation": group.generation,
                "members": [f"worker:{m}" for m in group.members],
                "joined": [f"worker:{m}" for m in joined],
                "left": [f"worker:{m}" for m in left],
            },
        )

    def _fold_view(self, task: _Task, answer: View | str, member: bool, now: float) -> None:
        """A worker's state from its door's answer, folded as any probe's (lock held)."""
        role = None if self._job is None else self._job.roles.get(task.task)
        if isinstance(answer, str) and role is not None and not role.running:
            # the launcher saw it end and said so (an exit event): no "lost" guess on top
            task.failures, task.error, task.state = task.failures + 1, answer, "lost"
            return
        if isinstance(answer, str):
            self._fold(task, TaskAnswer("worker", task.index, task.address, now, error=answer))
            return
        values = {"pid": None if role is None else role.pid, "member": member}
        self._fold(task, TaskAnswer("worker", task.index, task.address, now, values=values))

    def _fold_worker(self, task: _Task, previous: Any, values: dict, was_lost: bool) -> None:
        """A member of the current generation runs; a door that answers outside it waits."""
        task.state = "running" if values["member"] else "ready"

    def finish(self) -> None:
        """Stops the rounds after one last one: from now on the document is the
        finished job's (every process that ended shows how)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._timeout * 2 + 35.0)
        self.probe_once()
        self._final = True

    def snapshot(self) -> dict[str, Any]:
        """The ``/api/cluster`` document with the group's ``membership``."""
        document = super().snapshot()
        with self._lock:
            view, changes, job = self._view, self._changes, self._job
        if self._final:
            document = apply_job_status(document, job, final=True)
        document["membership"] = {
            "generation": None if view is None else view.generation,
            "members": [] if view is None else [f"worker:{m}" for m in view.members],
            "changes": changes,
        }
        return document

    def close(self) -> None:
        """Stops the rounds and every connection (idempotent)."""
        if self._pool is None:
            return
        super().close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None
