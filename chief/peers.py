"""``psflow local --mode multi-worker``: N peer processes of one script on loopback.

Example::

    psflow local --mode multi-worker --workers 2 examples/multi_worker_custom_loop.py

starts ``python SCRIPT ARGS`` ``--workers`` times, each with a ``TF_CONFIG``
naming a worker-only cluster on free loopback ports and its own
``worker`` task, as ``MultiWorkerMirroredStrategy`` expects (there is no
parameter server and no separate chief: worker 0 acts as chief).  Every line
a worker writes is copied with its name in front (``[worker:1] ...``); every
worker gets the same random ``PSFLOW_AUTH_TOKEN`` (unless the environment
already configures a token or TLS) and ``--devices-per-worker`` devices.

Exit status: 0 when every worker exited 0, else the status of the first
worker that failed (``128 + N`` for signal N).  When one fails, the others
fail on their own within their collective deadline (a typed error naming
it); after ``--grace`` seconds more the launcher stops them.  With
``--restart on-failure`` the whole group is then started again in its slots,
up to ``--max-restarts`` times.  SIGINT, SIGTERM or SIGHUP stop every worker
and the launcher exits ``128 + signal``.

With ``--elastic`` (scripts whose strategy has ``ElasticOptions``) a worker
that fails or drains is only reported: the others go on without it, and the
launcher's status is that of the last worker to exit.  ``--workers-max N``
reserves N ports and a control directory (:mod:`chief.control`): ``psflow
scale --workers K`` starts workers (each with a ``TF_CONFIG`` listing the
workers up to itself; the group admits it at a step boundary) or sends the
highest-numbered ones SIGTERM (each drains at the next step boundary).  Every
worker gets ``PSFLOW_ELASTIC_MAX_WORKERS=N``, the bound of an
``ElasticOptions`` without ``max_workers``.

``--ps N`` adds N parameter servers to the cluster (hybrid mode: the
group's ``DynamicEmbedding`` tables live on them), started and ready before
the workers, kept across a restarted or rescaled group, stopped last
(:mod:`chief.peer_servers`).  A server that exits is the job's failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence

from chief.control import ControlDir, LauncherState, default_cluster_dir
from chief.group_dashboard import GroupDashboard
from chief.local import (
    gpu_ids,
    host_port,
    pick_ports,
    tf_config,
    worker_device_env,
)
from chief.peer_servers import PeerServers
from chief.restart import RestartBook, RestartPolicy
from chief.script import Target
from chief.supervisor import RoleProcess, Supervisor, shell_status
from chief.thread_plan import plan_threads
from psflow.distribute.elastic.options import MAX_WORKERS_ENV
from psflow.errors import InvalidArgumentError
from psflow.security.config import with_generated_token
from psflow.thread_budget import available_cores

log = logging.getLogger("chief.peers")

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _signals_noted(received: list[int]) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, lambda n, f: received.append(n)) for s in _STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def worker_cluster(
    num_workers: int, host: str, ports: list[int], ps: Sequence[str] = ()
) -> dict[str, list[str]]:
    """The ``TF_CONFIG`` cluster of a multi-worker job (``ps``: its PS tasks, if any).

    Example:
        >>> worker_cluster(2, "127.0.0.1", [5000, 5001])
        {'worker': ['127.0.0.1:5000', '127.0.0.1:5001']}
        >>> worker_cluster(1, "127.0.0.1", [5000], ["127.0.0.1:5002"])
        {'worker': ['127.0.0.1:5000'], 'ps': ['127.0.0.1:5002']}
    """
    cluster = {"worker": [host_port(host, p) for p in ports[:num_workers]]}
    return {**cluster, "ps": list(ps)} if ps else cluster


def run_peers(
    target: Target,
    num_workers: int,
    *,
    devices_per_worker: int | None = None,
    host: str = "127.0.0.1",
    port_base: int | None = None,
    grace: float = 15.0,
    restart: RestartPolicy | None = None,
    environ: Mapping[str, str] | None = None,
    elastic: bool = False,
    workers_max: int | None = None,
    cluster_dir: str | None = None,
    num_ps: int = 0,
    ready_timeout: float = 60.0,
    dashboard_port: int | None = None,
    dashboard_linger: float = 0.0,
) -> int:
    """Runs ``num_workers`` peers of ``target``; returns the launcher's exit status.

    With ``restart`` on failure, a failed group is stopped and every worker
    started again in its slot (same ports, ``TF_CONFIG`` and token): a
    collective group cannot go on without a member, so it restarts whole
    (as TensorFlow requires); ``BackupAndRestore`` resumes training.

    ``workers_max`` (with ``elastic``): see the module docstring; ``cluster_dir``
    is its control directory.  ``num_ps`` parameter servers (hybrid mode) are
    started first, each given ``ready_timeout`` seconds to be ready.
    ``dashboard_port``: the launcher serves the group's dashboard there
    (:mod:`chief.group_dashboard`; 0: a free port), and its final state
    ``dashboard_linger`` seconds after the workers are done.

    Raises:
        InvalidArgumentError: see :func:`chief.local.worker_device_env`; ``workers_max``
            below ``num_workers`` or without ``elastic``; ``num_ps`` below 0.
        UnavailableError: a port from ``port_base`` is taken.
        FailedPreconditionError, DeadlineExceededError: a PS task did not start
            (:meth:`chief.peer_servers.PeerServers.start`).
    """
    slots = num_workers
    if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 0:
        raise InvalidArgumentError(f"--ps must be an integer >= 0, got {num_ps!r}")
    if workers_max is not None:
        if not elastic or workers_max < num_workers:
            raise InvalidArgumentError(
                f"--workers-max {workers_max} needs --elastic and at least --workers {num_workers}"
            )
        slots = workers_max
    base_env = with_generated_token(os.environ if environ is None else environ)
    if workers_max is not None:
        base_env = {**base_env, MAX_WORKERS_ENV: str(workers_max)}
    ports = pick_ports(slots + num_ps, host, port_base)
    ps = [host_port(host, p) for p in ports[slots:]]
    cluster = worker_cluster(num_workers, host, ports, ps)
    devices = worker_device_env(devices_per_worker, slots, gpu_ids(base_env))
    # N peers share the cores with the PS tasks (a group of "N - 1 workers and a chief")
    threads = plan_threads(num_ps, num_workers - 1, None, base_env, cores=available_cores())
    log.info(
        "BLAS threads per worker: %d (%s, %d cores)",
        threads.threads["worker"],
        threads.source,
        threads.cores,
    )
    servers = None
    if num_ps:
        server_env = {**threads.env("ps"), **base_env, "PYTHONUNBUFFERED": "1"}
        servers = PeerServers(ps, host, server_env, ready_timeout)
    envs = [
        {
            **threads.env("worker"),
            **base_env,
            # a worker beyond the starting ones lists the workers up to itself
            "TF_CONFIG": tf_config(
                worker_cluster(max(num_workers, i + 1), host, ports, ps), "worker", i
            ),
            **devices[i],
            "PYTHONUNBUFFERED": "1",
        }
        for i in range(slots)
    ]
    argv = [sys.executable, *target.argv, *target.args]
    book = RestartBook(restart or RestartPolicy())
    received: list[int] = []
    dashboard = None
    if dashboard_port is not None:
        doors = worker_cluster(slots, host, ports)["worker"]
        dashboard = GroupDashboard(host, dashboard_port, doors, ps, base_env, book.policy)
        log.info("dashboard at %s", dashboard.url)
        if servers is not None:
            dashboard.watch(servers.supervisor)
    control = None
    if workers_max is not None:
        control = ControlDir(cluster_dir or default_cluster_dir())
        control.create()
        log.info(
            "elastic workers: %d of up to %d running; control directory %s "
            "(psflow scale --workers K)",
            num_workers,
            workers_max,
            control.path,
        )
    with _signals_noted(received):
        try:
            if servers is not None:
                log.info("%d parameter servers on %s", num_ps, ", ".join(ps))
                servers.start(interrupted=lambda: bool(received))
                if received:
                    return 128 + received[0]
            log.info("%d workers of %s on %s", num_workers, target, ", ".join(cluster["worker"]))
            while True:
                status = _run_group(
                    argv,
                    envs[:num_workers],
                    grace,
                    received,
                    elastic,
                    control,
                    envs,
                    servers,
                    dashboard,
                )
                if received:
                    return 128 + received[0]
                if servers is not None and servers.failed is not None:
                    return servers.status
                delay = book.next_delay("group", status, is_chief=False)
                if delay is None:
                    return status
                log.warning(
                    "the workers failed (status %d): restarting all of them in their slots "
                    "(restart %d of %d) in %.1fs",
                    status,
                    book.used("group"),
                    book.policy.max_restarts,
                    delay,
                )
                deadline = time.monotonic() + delay
                while time.monotonic() < deadline and not received:
                    time.sleep(0.05)
                if received:
                    return 128 + received[0]
        finally:
            if servers is not None:
                servers.stop(grace)
            if control is not None:
                control.remove()
            if dashboard is not None:
                seen = len(received)
                dashboard.finish(dashboard_linger, lambda: len(received) > seen)


class _WorkerScaler:
    """Answers ``psflow scale --workers K`` for a running elastic group (module docstring)."""

    def __init__(
        self,
        control: ControlDir,
        supervisor: Supervisor,
        argv: list[str],
        envs: list[dict[str, str]],
    ) -> None:
        self.control, self.supervisor = control, supervisor
        self.argv, self.envs = argv, envs
        self.publish()

    def running(self) -> dict[int, RoleProcess]:
        """The live workers by id."""
        return {int(r.name.split(":")[1]): r for r in self.supervisor.roles if r.running}

    def publish(self) -> None:
        """Writes the launcher's state (the workers running now)."""
        count = len(self.running())
        self.control.write_state(LauncherState(os.getpid(), 0, 0, "", len(self.envs), count))

    def poll(self) -> None:
        """Takes one queued request, if any, and acts on it."""
        taken = self.control.next_request("num_workers")
        if taken is None:
            return
        request_id, wanted = taken
        running = self.running()
        if isinstance(wanted, bool) or not isinstance(wanted, int):
            message = f"bad request: num_workers {wanted!r}"
            self.control.put_result(request_id, False, message, len(running), "num_workers")
            return
        if not 1 <= wanted <= len(self.envs):
            message = f"--workers {wanted} is not within 1..{len(self.envs)}"
            self.control.put_result(request_id, False, message, len(running), "num_workers")
            return
        if wanted > len(running):
            free = [i for i in range(len(self.envs)) if i not in running]
            added = free[: wanted - len(running)]
            for i in added:
                self.supervisor.start(f"worker:{i}", self.argv, self.envs[i])
            names = ", ".join(f"worker:{i}" for i in added)
            message = f"started {names}: the group admits it at a step boundary"
        elif wanted < len(running):
            leaving = sorted(running)[wanted:]
            for i in leaving:
                running[i].signal_group(signal.SIGTERM)
            names = ", ".join(f"worker:{i}" for i in leaving)
            message = f"asked {names} to drain: it leaves at the next step boundary"
        else:
            message = f"already {wanted} workers"
        log.info("psflow scale: %s", message)
        self.control.put_result(request_id, True, message, wanted, "num_workers")
        self.publish()


def _run_group(
    argv: list[str],
    envs: list[dict[str, str]],
    grace: float,
    received: list[int],
    elastic: bool = False,
    control: ControlDir | None = None,
    slots: list[dict[str, str]] | None = None,
    servers: PeerServers | None = None,
    dashboard: GroupDashboard | None = None,
) -> int:
    """Runs one generation of the workers; returns the first failure's status (0: none).

    ``elastic``: a failed worker is left behind; the status is the last exit's.
    ``control``: requests of ``psflow scale --workers`` start workers of
    ``slots`` (the environment of every reserved worker slot) or drain them.
    ``servers``: the group's PS tasks, watched with it: one that exits fails
    the group (the workers get ``grace`` seconds to end on their own errors).
    ``dashboard``: shows this generation's processes.
    """
    supervisor = Supervisor()
    if dashboard is not None:
        dashboard.watch(supervisor)
    first_failure: RoleProcess | None = None
    failed_at = 0.0
    last_status = 0
    try:
        for i, env in enumerate(envs):
            supervisor.start(f"worker:{i}", argv, env)
        scaler = None
        if control is not None and slots is not None:
            scaler = _WorkerScaler(control, supervisor, argv, slots)
        while any(r.running for r in supervisor.roles):
            if scaler is not None:
                scaler.poll()
            if received:
                log.warning("signal %d: stopping the workers", received[0])
                supervisor.stop(grace, escalate=lambda: len(received) > 1)
                return 128 + received[0]
            supervisor.pump(0.1)
            if servers is not None and servers.pump() is not None and first_failure is None:
                first_failure, failed_at = servers.failed, time.monotonic()
            for role in supervisor.poll():
                status = shell_status(role.returncode or 0)
                log.info("%s exited with status %d", role.name, status)
                last_status = status
                if status and elastic:
                    log.warning("%s was lost (status %d); the others go on", role.name, status)
                    continue
                if status and first_failure is None:
                    first_failure, failed_at = role, time.monotonic()
                if scaler is not None:
                    scaler.publish()
            if first_failure is not None and time.monotonic() - failed_at > grace:
                log.warning("%s failed; stopping the others", first_failure.name)
                break
    finally:
        supervisor.stop(grace)
    if servers is not None and servers.failed is not None:
        return servers.status
    if elastic:
        return last_status
    return 0 if first_failure is None else shell_status(first_failure.returncode or 1)
