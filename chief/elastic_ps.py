"""The launcher's side of ``psflow scale``: start parameter servers, publish the view, see drains.

``psflow local --ps-max N --ps K`` reserves ports for ``N`` PS tasks, starts
``K`` and publishes the cluster view (``cluster.json``, tasks ``ps:0..K-1``)
that the chief's :class:`~psflow.distribute.coordinator.elastic_watch.ClusterWatch`
follows.  A :class:`PSScaler` takes the requests of ``psflow scale`` one at a
time (:mod:`chief.control`):

* **up** (``K' > K``): starts ``ps:K..K'-1`` in their reserved slots, waits
  until each printed its ready line, then publishes the view with ``K'`` tasks
  and answers; the chief resizes on its next poll.  A new PS that exits or is
  not ready in time is stopped, the view is left as it was, and the answer is
  an error.
* **down** (``K' < K``): publishes the view with ``K'`` tasks first - the
  chief then moves every shard off ``ps:K'..K-1`` and tells them to exit -
  and answers once each of them exited 0 after printing ``PSFLOW_DRAINED``,
  or with an error when one failed or did not exit within the drain timeout.

A parameter server that exits 0 after ``PSFLOW_DRAINED`` is never restarted
and never counted as a failure, asked for or not (a program may resize by
itself); when it was the last task of the view, the view shrinks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence

from chief.control import ControlDir, LauncherState
from chief.supervisor import RoleProcess, shell_status
from psflow.distribute.cluster_resolver import write_cluster_file

log = logging.getLogger("chief.local")

DRAINED_LINE = "PSFLOW_DRAINED"
"""What a parameter server prints on stdout before it exits 0 after being drained."""

DEFAULT_DRAIN_TIMEOUT = 300.0
"""Seconds a drained PS has to exit once the view no longer lists it."""


@dataclasses.dataclass
class _Operation:
    request_id: str
    old: int
    new: int
    deadline: float
    roles: list[RoleProcess]


class PSScaler:
    """Runs scale requests against the launcher's PS slots (see the module docstring).

    Args:
        control: the control directory.
        cluster: the whole cluster with every reserved PS slot
            (``{"ps": [ps_max addresses], "worker": [...], "chief": [...]}``).
        num_ps: the PS tasks running at start.
        start_ps: starts PS slot ``i``; returns its process.
        ps_roles: the launcher's PS processes, oldest first.
        is_ready: whether a started role printed its ready line.
        ready_timeout: seconds a new PS has to become ready.
        drain_timeout: seconds a drained PS has to exit.
    """

    def __init__(
        self,
        control: ControlDir,
        cluster: Mapping[str, Sequence[str]],
        num_ps: int,
        start_ps: Callable[[int], RoleProcess],
        ps_roles: Callable[[], list[RoleProcess]],
        is_ready: Callable[[RoleProcess], bool],
        *,
        ready_timeout: float,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    ) -> None:
        self._control = control
        self._cluster = {job: list(tasks) for job, tasks in cluster.items()}
        self._ps_max = len(self._cluster["ps"])
        self._num_ps = num_ps
        self._start_ps = start_ps
        self._ps_roles = ps_roles
        self._is_ready = is_ready
        self._ready_timeout = ready_timeout
        self._drain_timeout = drain_timeout
        self._op: _Operation | None = None
        self._drained: set[int] = set()  # pids that printed DRAINED_LINE
        self._abandoned: set[int] = set()  # pids of new PS stopped after a failed scale-up
        self._gone: set[int] = set()  # slots whose PS drained and exited, still in the view

    @property
    def num_ps(self) -> int:
        """The PS tasks the published view lists."""
        return self._num_ps

    @property
    def busy(self) -> bool:
        """Whether a request is in flight (it ends by its own deadline)."""
        return self._op is not None

    def view(self, num_ps: int) -> dict[str, list[str]]:
        """The cluster with ``ps:0..num_ps-1``."""
        return {**self._cluster, "ps": self._cluster["ps"][:num_ps]}

    def publish(self) -> None:
        """Writes the view, then the state (``psflow scale`` reads the state)."""
        write_cluster_file(self._control.cluster_file, self.view(self._num_ps))
        self._control.write_state(
            LauncherState(
                pid=os.getpid(),
                ps_max=self._ps_max,
                num_ps=self._num_ps,
                cluster_file=self._control.cluster_file,
            )
        )

    # -- hooks from the launcher's loop ---------------------------------------------------
    def on_line(self, role: RoleProcess, line: str, from_stdout: bool) -> None:
        """Notes a parameter server's ``PSFLOW_DRAINED`` line."""
        if from_stdout and role.name.startswith("ps:") and line.split(" ", 1)[0] == DRAINED_LINE:
            self._drained.add(role.pid)

    def claims_exit(self, role: RoleProcess) -> bool:
        """Whether ``role``'s exit is the scaler's business (then: no restart, no failure)."""
        if not role.name.startswith("ps:"):
            return False
        index = int(role.name.partition(":")[2])
        status = shell_status(role.returncode or 0)
        op = self._op
        if role.pid in self._abandoned:
            self._abandoned.discard(role.pid)
            return True
        if role.pid in self._drained and status == 0:
            self._drained.discard(role.pid)
            log.info("%s drained: exited 0 (%s); not restarting it", role.name, DRAINED_LINE)
            if op is None and index < self._num_ps:
                # A program resized by itself: tasks >= its count drain in any order, and the
                # view shrinks only past slots that all exited (a lower one may exit first).
                self._gone.add(index)
                num_ps = self._num_ps
                while num_ps - 1 in self._gone:
                    num_ps -= 1
                    self._gone.discard(num_ps)
                if num_ps != self._num_ps:
                    self._num_ps = num_ps
                    self.publish()
            return True
        if op is not None and any(r is role for r in op.roles):
            what = "starting" if op.new > op.old else "draining"
            if op.new > op.old:
                self._abandon([r for r in op.roles if r is not role])
            self._finish(
                False,
                f"{role.name} exited with status {status} while {what}; "
                + (
                    "the view still lists "
                    if op.new > op.old
                    else "the view lists "  # shrunk already: its shards went to recovery
                )
                + f"{self._num_ps} PS",
            )
            return True
        return False

    def step(self, now: float | None = None) -> None:
        """Advances the running request, or takes the next one."""
        now = time.monotonic() if now is None else now
        if self._op is not None:
            self._advance(now)
            return
        taken = self._control.next_request()
        if taken is None:
            return
        request_id, num_ps = taken
        if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 1:
            self._control.put_result(
                request_id, False, f"--ps {num_ps!r} must be >= 1", self._num_ps
            )
            return
        if num_ps > self._ps_max:
            self._control.put_result(
                request_id,
                False,
                f"--ps {num_ps} is above --ps-max {self._ps_max}",
                self._num_ps,
            )
            return
        old = self._num_ps
        if num_ps == old:
            self._control.put_result(request_id, True, f"already {old} PS", old)
            return
        if num_ps > old:
            # A slot whose PS was dropped but never drained (no chief watching) still runs
            # it: list it again rather than start a second process on its port.
            running = {r.name: r for r in self._ps_roles() if r.running}
            roles = [running.get(f"ps:{i}") or self._start_ps(i) for i in range(old, num_ps)]
            self._gone -= set(range(old, num_ps))
            log.info("scale: starting %s", ", ".join(r.name for r in roles))
            self._op = _Operation(request_id, old, num_ps, now + self._ready_timeout, roles)
            return
        draining = [
            r
            for r in self._ps_roles()
            if num_ps <= int(r.name.partition(":")[2]) < old and r.running
        ]
        self._num_ps = num_ps
        self._gone = {i for i in self._gone if i < num_ps}
        self.publish()
        log.info(
            "scale: the view lists %d PS; the chief drains %s",
            num_ps,
            ", ".join(r.name for r in draining) or "nothing",
        )
        self._op = _Operation(request_id, old, num_ps, now + self._drain_timeout, draining)
        self._advance(now)

    # -- internals ----------------------------------------------------------------------
    def _abandon(self, roles: list[RoleProcess]) -> None:
        """Stops new PS processes of a failed scale-up; their exits are nobody's failure."""
        for r in roles:
            if r.running:
                self._abandoned.add(r.pid)
                r.signal_group(signal.SIGTERM)

    def _advance(self, now: float) -> None:
        op = self._op
        assert op is not None
        if op.new > op.old:
            if all(self._is_ready(r) for r in op.roles):
                self._num_ps = op.new
                self.publish()
                names = ", ".join(f"{r.name} (pid {r.pid})" for r in op.roles)
                self._finish(True, f"started {names}; the view lists {op.new} PS")
            elif now > op.deadline:
                self._abandon(op.roles)
                late = ", ".join(r.name for r in op.roles if not self._is_ready(r))
                self._finish(
                    False,
                    f"{late} not ready within {self._ready_timeout:g}s; stopped, the view still "
                    f"lists {self._num_ps} PS",
                )
            return
        if all(not r.running for r in op.roles):
            self._finish(True, f"drained {op.old - op.new} PS; the view lists {op.new} PS")
        elif now > op.deadline:
            late = ", ".join(r.name for r in op.roles if r.running)
            self._finish(
                False,
                f"{late} still running {self._drain_timeout:g}s after the view dropped it: is the "
                "chief watching the cluster (ClusterWatch), or a hybrid group following it?",
            )

    def _finish(self, ok: bool, message: str) -> None:
        op = self._op
        assert op is not None
        self._op = None
        (log.info if ok else log.error)("scale %d -> %d: %s", op.old, op.new, message)
        self._control.put_result(op.request_id, ok, message, self._num_ps)
