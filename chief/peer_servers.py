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

With ``--ps-max`` the addresses are every reserved slot and only the first
``--ps`` start; :meth:`PeerServers.start_slot` starts another one for the
scaler (:class:`chief.elastic_ps.PSScaler`), whose ``claims`` hook takes a
drained server's exit (status 0 after ``PSFLOW_DRAINED``), so it is no failure.

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
        num_started: how many of them :meth:`start` starts (default: all; the
            others are slots for :meth:`start_slot`).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        host: str,
        env: Mapping[str, str],
        ready_timeout: float = 60.0,
        num_started: int | None = None,
    ) -> None:
        self.addresses = list(addresses)
        self.names = [f"ps:{i}" for i in range(len(self.addresses))]
        self._num_started = len(self.addresses) if num_started is None else num_started
        self._host, self._env, self._ready_timeout = host, dict(env), ready_timeout
        self._ready: set[int] = set()  # pids that printed their ready line
        self._wrong: str | None = None
        self._supervisor = Supervisor(on_line=self._on_line)
        self.failed: RoleProcess | None = None
        # the scaler's hooks: its view of every line, and whether an exit is its business
        self.on_line: Callable[[RoleProcess, str, bool], None] | None = None
        self.claims: Callable[[RoleProcess], bool] | None = None

    def _on_line(self, role: RoleProcess, line: str, from_stdout: bool) -> None:
        if self.on_line is not None:
            self.on_line(role, line, from_stdout)
        ready = parse_ready(line) if from_stdout else None
        if ready is None or role.pid in self._ready:
            return
        port = int(self.addresses[self.names.index(role.name)].rsplit(":", 1)[1])
        if ready.task != role.name or ready.port != port:
            self._wrong = f"{role.name} announced {line!r}, expected task={role.name} port={port}"
            return
        self._ready.add(role.pid)
        log.info("%s ready at %s (pid %d)", role.name, ready.port, role.pid)

    def start_slot(self, index: int) -> RoleProcess:
        """Starts the server of slot ``index`` (not waiting for it: see :meth:`is_ready`)."""
        name, address = self.names[index], self.addresses[index]
        port = address.rsplit(":", 1)[1]
        argv = [sys.executable, "-m", "ps_server", "--bind", self._host, "--port", port]
        return self._supervisor.start(name, [*argv, "--task", name], self._env)

    def is_ready(self, role: RoleProcess) -> bool:
        """Whether ``role`` printed its ready line and still runs."""
        return role.pid in self._ready and role.running

    def roles(self) -> list[RoleProcess]:
        """Every server process started, oldest first."""
        return list(self._supervisor.roles)

    def start(self, interrupted: Callable[[], bool] = lambda: False) -> None:
        """Starts every server and returns once all are ready (or ``interrupted()``).

        Raises:
            FailedPreconditionError: one exited, or announced another task or port.
            DeadlineExceededError: one printed no ready line within ``ready_timeout``.
        """
        started = [self.start_slot(i) for i in range(self._num_started)]
        deadline = time.monotonic() + self._ready_timeout
        while not all(r.pid in self._ready for r in started) and not interrupted():
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
                late = [r.name for r in started if r.pid not in self._ready]
                raise DeadlineExceededError(
                    f"{', '.join(late)} not ready within {self._ready_timeout}s "
                    f"(no {READY_PREFIX.strip()} line)",
                    task=late[0],
                )

    def pump(self) -> RoleProcess | None:
        """Copies the servers' output; returns the first server that exited, once."""
        self._supervisor.pump(0.0)
        for role in self._supervisor.poll():
            if self.claims is not None and self.claims(role):
                continue  # drained (or a failed scale-up's): the scaler answered for it
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
