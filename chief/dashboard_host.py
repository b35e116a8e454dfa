"""``psflow local --dashboard``: the launcher's side of the chief's dashboard.

The chief serves the page while it runs; the launcher (which started every
process) tells it how each one ended, and keeps the page up after the chief is
gone. Both go through a private directory (:mod:`psflow.dashboard.job_status`):

1. the launcher creates it and names it to the chief (``PSFLOW_LAUNCHER_DIR``);
2. :meth:`LauncherDashboard.publish` rewrites ``roles.json`` whenever a role
   starts or exits: pid, running, exit status, restarts, the restart policy;
3. the chief's dashboard reads it every probe round (a killed worker shows as
   ``killed by SIGKILL (exit 137)``, with the ``--restart on-failure`` hint when
   restarts are off) and leaves its latest document in ``dashboard.json``;
4. once the chief exited, :meth:`serve_final` binds the same port and serves
   that document with every exit status ("job finished") until the launcher
   exits (:meth:`linger` holds it there on request), then :meth:`close`
   removes the directory.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping

from chief.restart import RestartBook, RestartPolicy
from chief.supervisor import RoleProcess, shell_status
from psflow.dashboard.job_status import (
    LAUNCHER_DIR_ENV,
    ROLES_FILE,
    FinalDocument,
    JobStatus,
    RoleStatus,
    write_json,
)
from psflow.errors import OpError

__all__ = ["LauncherDashboard", "describe_exits", "job_status"]

log = logging.getLogger("psflow.local")

_BIND_ATTEMPTS_SECONDS = 5.0
"""How long the final page keeps trying the chief's port (its socket may close late)."""


class LauncherDashboard:
    """The directory shared with the chief, the final page, and the wait before exit.

    Args:
        restart: the launcher's restart policy (shown on the page, and its hint).
    """

    def __init__(self, restart: RestartPolicy) -> None:
        self.directory = tempfile.mkdtemp(prefix="psflow-local-dashboard-")
        self._restart = restart
        self._server = None
        self._finished = False

    def env(self) -> Mapping[str, str]:
        """What the chief's environment needs to find the directory."""
        return {LAUNCHER_DIR_ENV: self.directory}

    def publish(self, roles: Iterable[RoleProcess], book: RestartBook) -> JobStatus:
        """Rewrites ``roles.json`` from every started role (the latest process per slot)."""
        status = job_status(roles, self._restart, book.used, self._finished)
        try:
            write_json(f"{self.directory}/{ROLES_FILE}", status.to_json())
        except OSError as e:  # the page loses detail, the job goes on
            log.warning("cannot write the dashboard's role file: %s", e)
        return status

    def serve_final(self, host: str, port: int) -> str | None:
        """Serves the finished job's page on ``host:port``; returns its URL (None: not bound)."""
        from psflow.dashboard.server import DashboardServer

        deadline = time.monotonic() + _BIND_ATTEMPTS_SECONDS
        while True:
            try:
                self._server = DashboardServer(FinalDocument(self.directory), host, port)
                return self._server.url
            except OpError as e:
                if time.monotonic() > deadline:
                    log.warning("cannot keep serving the dashboard's final state: %s", e)
                    return None
                time.sleep(0.1)

    def finish(self, roles: Iterable[RoleProcess], book: RestartBook) -> JobStatus:
        """Publishes the final statuses (every role stopped): the page says the job finished."""
        self._finished = True
        return self.publish(roles, book)

    def linger(self, seconds: float, interrupted: Callable[[], bool]) -> None:
        """Keeps serving up to ``seconds`` (inf: until ``interrupted()``) while not interrupted."""
        if self._server is None or seconds <= 0:
            return
        end = time.monotonic() + seconds
        while not interrupted() and time.monotonic() < end:
            time.sleep(0.1)

    def close(self) -> None:
        """Stops the final page and removes the directory (idempotent)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        shutil.rmtree(self.directory, ignore_errors=True)


def job_status(
    roles: Iterable[RoleProcess],
    restart: RestartPolicy,
    restarts: Callable[[str], int],
    finished: bool = False,
) -> JobStatus:
    """Every slot's latest process (roles started in order: the last one of a name
    holds its slot), with ``restarts(name)`` restarts, as the dashboard shows it."""
    latest: dict[str, RoleProcess] = {}
    for role in roles:
        latest[role.name] = role
    return JobStatus(
        restart.mode.value,
        {
            name: RoleStatus(
                name,
                role.pid,
                role.running,
                None if role.running else shell_status(role.returncode or 0),
                restarts(name),
            )
            for name, role in latest.items()
        },
        finished=finished,
    )


def describe_exits(status: JobStatus) -> str:
    """``chief=0, worker:1=137 (SIGKILL), ...`` for the launcher's log."""
    parts = []
    for name, role in status.roles.items():
        code = "running" if role.running else str(role.status)
        parts.append(f"{name}={code}" + (f" ({role.signal})" if role.signal else ""))
    return ", ".join(parts)
