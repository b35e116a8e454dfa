"""``start_dashboard``: everything the chief runs for its dashboard, started and stopped together.

It installs an :class:`~psflow.observability.events.EventLog` and a
:class:`~psflow.observability.progress.TrainingProgress` in this process (so
``Model.fit``, checkpoints and the coordinator report to them), probes the
cluster's tasks from a daemon thread and serves the page.

Example:
    >>> dash = start_dashboard({}, port=0)   # embedded: no cluster, training only
    >>> dash.url.startswith("http://127.0.0.1:")
    True
    >>> dash.close()
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence

from psflow.observability import events, progress
from psflow.security.config import SecurityConfig, default_security

from .collector import ClusterMonitor
from .job_status import DOCUMENT_FILE, ROLES_FILE, JobStatus, read_json
from .probe import ClusterProbe
from .server import DashboardServer

__all__ = ["Dashboard", "start_dashboard"]


class Dashboard:
    """A running dashboard: its server, its monitor and what it installed; close it once."""

    def __init__(
        self,
        server: DashboardServer,
        monitor: ClusterMonitor,
        previous: tuple[events.EventLog | None, progress.TrainingProgress | None],
    ) -> None:
        self.server = server
        self.monitor = monitor
        self._previous = previous
        self._closed = False

    @property
    def url(self) -> str:
        """Where the page is, ``http://HOST:PORT/``."""
        return self.server.url

    def close(self) -> None:
        """Stops serving and probing; restores what was installed before (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.server.close()
        self.monitor.close()
        events.install(self._previous[0])
        progress.install(self._previous[1])

    def __enter__(self) -> Dashboard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_dashboard(
    cluster: Mapping[str, Sequence[str]],
    *,
    port: int = 0,
    bind: str = "127.0.0.1",
    security: SecurityConfig | None = None,
    interval: float = 1.0,
    ps_view: Callable[[], Sequence[str]] | None = None,
    launcher_dir: str | None = None,
) -> Dashboard:
    """Starts probing ``cluster`` and serving the page on ``bind:port`` (0: a free port).

    ``ps_view``, when given, returns the PS addresses the job runs on now; the
    page then follows a resize of the parameter servers. ``launcher_dir``: the
    directory ``psflow local`` shares with its chief (:mod:`.job_status`): the
    page shows how tasks' processes ended, and the document is left there for
    the launcher to serve after the chief exits.

    Raises:
        FailedPreconditionError: ``bind`` is not loopback and ``security`` has no token.
        UnavailableError: the port cannot be bound.
        OpError: the environment's credentials cannot be read (``security`` None).
        InvalidArgumentError: the cluster is malformed or ``interval`` <= 0.
    """
    security = default_security() if security is None else security
    log = events.EventLog()
    recorder = progress.TrainingProgress()
    probe = ClusterProbe(cluster, security=security)
    job_status = document_path = None
    if launcher_dir is not None:
        roles = os.path.join(launcher_dir, ROLES_FILE)
        job_status = functools.partial(_read_job_status, roles)
        document_path = os.path.join(launcher_dir, DOCUMENT_FILE)
    monitor = ClusterMonitor(
        probe,
        log,
        recorder,
        interval=interval,
        ps_view=ps_view,
        job_status=job_status,
        document_path=document_path,
    )
    try:
        server = DashboardServer(monitor, bind, port, security=security)
    except Exception:
        monitor.close()
        raise
    previous = (events.install(log), progress.install(recorder))
    monitor.start()
    return Dashboard(server, monitor, previous)


def _read_job_status(path: str) -> JobStatus | None:
    return JobStatus.from_json(read_json(path))
