"""The ``ps`` tasks of ``psflow local --mode multi-worker --ps N`` (hybrid mode).

A multi-worker group with ``ps`` tasks in its cluster keeps its
``DynamicEmbedding`` tables on them (:mod:`psflow.distribute.hybrid`).  The
launcher starts the N parameter servers first, each ``python -m ps_server``
on its own loopback port with the group's auth token and its thread budget,
waits (bounded by ``--ready-timeout``) for every ready line, then starts the
workers with a ``TF_CONFIG`` that names both.  The servers outlive a
restarted or rescaled worker group (the tables are theirs) and are stopped
last.  A server that exits while the workers run is a failure of the job:
the workers end on their own typed errors within their deadline.

Example:
    >>> servers = PeerServers(["127.0.0.1:7000"], "127.0.0.1", {}, ready_timeout=60)
    >>> servers.names
    ['ps:0']
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from chief.supervisor import RoleProcess, Supervisor, shell_status
from psflow.errors import DeadlineExceededError, FailedPreconditionError
from psflow.launch import READY_PREFIX, parse_ready

log = logging.getLogger("chief.peers")


class PeerServers:
    """Starts, watches and stops the parameter servers of a multi-worker group.

    Args:
        addresses: ``host:port`` of each PS task, in task order.
        host: the address each binds.
        env: every server's environment (token, thread budget, ...).
        ready_timeout: seconds each has to print its ready line.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        host: str,
        env: Mapping[str, str],
        ready_timeout: float = 60.0,
    ) -> None:
        self.addresses = list(addresses)
        self.names = [f"ps:{i}" for i in range(len(self.addresses))]
        self._host, self._env, self._ready_timeout = host, dict(env), ready_timeout
        self._ready: set[str] = set()
        self._wrong: str | None = None
        self._supervisor = Supervisor(on_line=self._on_line)
        self.failed: RoleProcess | None = None

    def _on_line(self, role: RoleProcess, line: str, from_stdout: bool) -> None:
        ready = parse_ready(line) if from_stdout else None
        if ready is None or role.name in self._ready:
            return
        port = int(self.addresses[self.names.index(role.name)].rsplit(":", 1)[1])
        if ready.task != role.name or ready.port != port:
            self._wrong = f"{role.name} announced {line!r}, expected task={role.name} port={port}"
            return
        self._ready.add(role.name)
        log.info("%s ready at %s (pid %d)", role.name, ready.port, role.pid)

    def start(self, interrupted: Callable[[], bool] = lambda: False) -> None:
        """Starts every server and returns once all are ready (or ``interrupted()``).

        Raises:
            FailedPreconditionError: one exited, or announced another task or port.
            DeadlineExceededError: one printed no ready line within ``ready_timeout``.
        """
        for name, address in zip(self.names, self.addresses):
            port = address.rsplit(":", 1)[1]
            argv = [sys.executable, "-m", "ps_server", "--bind", self._host, "--port", port]
            self._supervisor.start(name, [*argv, "--task", name], self._env)
        deadline = time.monotonic() + self._ready_timeout
        while len(self._ready) < len(self.names) and not interrupted():
            self._supervisor.pump(0.1)
            for role in self._supervisor.poll():
                raise FailedPreconditionError(
                    f"{role.name} exited with status {shell_status(role.returncode or 0)} "
                    "before the workers started; see its output above",
                    task=role.name,
                )
            if self._wrong is not None:
                raise FailedPreconditionError(self._wrong)
            if time.monotonic() > deadline:
                late = [n for n in self.names if n not in self._ready]
                raise DeadlineExceededError(
                    f"{', '.join(late)} not ready within {self._ready_timeout}s "
                    f"(no {READY_PREFIX.strip()} line)",
                    task=late[0],
                )

    def pump(self) -> RoleProcess | None:
        """Copies the servers' output; returns the first server that exited, once."""
        self._supervisor.pump(0.0)
        for role in self._supervisor.poll():
            status = shell_status(role.returncode or 0)
            log.error(
                "%s exited with status %d: the workers stop on their typed errors",
                role.name,
                status,
            )
            if self.failed is None:
                self.failed = role
                return role
        return None

    @property
    def supervisor(self) -> Supervisor:
        """The servers' supervisor (their processes, for the dashboard)."""
        return self._supervisor

    @property
    def status(self) -> int:
        """The failed server's shell-style status (0: none failed)."""
        if self.failed is None:
            return 0
        return shell_status(self.failed.returncode or 0) or 1

    def stop(self, grace: float) -> None:
        """SIGTERM to every server, SIGKILL after ``grace`` seconds; all reaped."""
        self._supervisor.stop(grace)
