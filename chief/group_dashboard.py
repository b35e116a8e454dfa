"""``psflow local --mode multi-worker --dashboard``: the group's page, served by the launcher.

A multi-worker group has no chief to serve the dashboard, so the launcher
does: a :class:`~psflow.dashboard.group.GroupMonitor` asks every worker
slot's door for the group's membership (each change becomes an event),
probes the hybrid mode's PS tasks, and reads what the launcher knows of
every process it started (pid, exit status, restarts).  When the workers are
done the page says so and stays up ``--dashboard-linger`` seconds.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from chief.dashboard_host import job_status
from chief.restart import RestartPolicy
from chief.supervisor import Supervisor
from psflow.dashboard.group import GroupMonitor
from psflow.dashboard.job_status import JobStatus
from psflow.dashboard.server import DashboardServer
from psflow.observability.events import EventLog
from psflow.security.config import SecurityConfig

log = logging.getLogger("chief.peers")

__all__ = ["GroupDashboard"]


class GroupDashboard:
    """The live page of a multi-worker group and its final state.

    Args:
        host, port: where the page is served (port 0: a free one).
        workers: every worker slot's address (its door), by id.
        ps: the hybrid mode's PS addresses.
        environ: the workers' environment (the group's token or TLS).
        restart: the launcher's restart policy (shown on the page).

    Raises:
        InvalidArgumentError: a bad security setting in ``environ``.
        FailedPreconditionError, UnavailableError: the port cannot be served.
    """

    def __init__(
        self,
        host: str,
        port: int,
        workers: Sequence[str],
        ps: Sequence[str],
        environ: Mapping[str, str],
        restart: RestartPolicy,
    ) -> None:
        security = SecurityConfig.from_environment(environ)
        self._restart = restart
        self._supervisors: list[Supervisor] = []
        self._finished = False
        self.monitor = GroupMonitor(
            workers, security, EventLog(), ps=ps, job_status=self.job_status
        )
        self.server = DashboardServer(self.monitor, host, port, security=security)
        self.monitor.start()

    @property
    def url(self) -> str:
        """Where the page is."""
        return self.server.url

    def watch(self, supervisor: Supervisor) -> None:
        """Adds ``supervisor``'s roles (a worker generation, or the PS tasks) to the page."""
        self._supervisors.append(supervisor)

    def job_status(self) -> JobStatus:
        """Every slot's latest process as the launcher sees it (read by the monitor's thread)."""
        roles = [r for supervisor in list(self._supervisors) for r in list(supervisor.roles)]
        starts = collections.Counter(r.name for r in roles)
        return job_status(roles, self._restart, lambda name: starts[name] - 1, self._finished)

    def finish(self, linger: float, interrupted: Callable[[], bool]) -> None:
        """Says the job finished, serves its final state up to ``linger`` seconds, then closes."""
        self._finished = True
        try:
            self.monitor.finish()  # the final statuses, before the page says "finished"
            if linger > 0 and not interrupted():
                until = "until Ctrl-C" if linger == float("inf") else f"for {linger:g} s"
                log.info(
                    "workers done; the dashboard at %s shows the final state %s", self.url, until
                )
                end = time.monotonic() + linger
                while not interrupted() and time.monotonic() < end:
                    time.sleep(0.1)
        finally:
            self.close()

    def close(self) -> None:
        """Stops the page and the monitor (idempotent)."""
        self.monitor.close()
        self.server.close()
