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

``--ps-max N`` (with ``--ps K``) reserves ports for N parameter servers,
starts K and publishes the cluster view (``cluster.json`` in the control
directory) that every worker gets as ``PSFLOW_CLUSTER_FILE``; ``psflow scale
--ps K'`` starts servers (once ready, the view lists them) or drops the last
ones from the view and waits for them to drain and exit 0, as in PS mode
(:class:`chief.elastic_ps.PSScaler`).  The workers' strategy follows the
view by itself at a step boundary (:mod:`psflow.distribute.hybrid`).
``--ps-max`` and ``--workers-max`` are not combined (one control directory
scales one kind of task).
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
from chief.elastic_ps import DEFAULT_DRAIN_TIMEOUT, PSScaler
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
from psflow.distribute.cluster_resolver import CLUSTER_FILE_ENV
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
    ps_max: int | None = None,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
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
    ``dashboard_linger`` seconds after the workers are done.  ``ps_max``: ports
    for that many PS tasks, ``psflow scale --ps`` resizes (module docstring);
    ``drain_timeout``: seconds a PS dropped from the view has to exit.

    Raises:
        InvalidArgumentError: see :func:`chief.local.worker_device_env`; ``workers_max``
            below ``num_workers`` or without ``elastic``; ``num_ps`` below 0;
            ``ps_max`` below ``num_ps``, without PS tasks or with ``workers_max``.
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
    if ps_max is not None:
        if isinstance(ps_max, bool) or not isinstance(ps_max, int) or ps_max < max(num_ps, 1):
            raise InvalidArgumentError(
                f"--ps-max {ps_max!r} must be at least --ps {num_ps} (and --ps at least 1)"
            )
        if num_ps < 1:
            raise InvalidArgumentError(f"--ps-max {ps_max} needs --ps K >= 1, got --ps {num_ps}")
        if workers_max is not None:
            raise InvalidArgumentError(
                f"--ps-max {ps_max} and --workers-max {workers_max} are not combined: "
                "scale the PS tasks or the workers"
            )
        if not drain_timeout > 0:
            raise InvalidArgumentError(f"--drain-timeout {drain_timeout!r} must be > 0 seconds")
    ps_slots = num_ps if ps_max is None else ps_max
    base_env = with_generated_token(os.environ if environ is None else environ)
    if workers_max is not None:
        base_env = {**base_env, MAX_WORKERS_ENV: str(workers_max)}
    ports = pick_ports(slots + ps_slots, host, port_base)
    reserved = [host_port(host, p) for p in ports[slots:]]  # every PS slot
    ps = reserved[:num_ps]  # the ones running at start
    cluster = worker_cluster(num_workers, host, ports, ps)
    devices = worker_device_env(devices_per_worker, slots, gpu_ids(base_env))
    # N peers share the cores with the PS tasks (a group of "N - 1 workers and a chief")
    threads = plan_threads(ps_slots, num_workers - 1, None, base_env, cores=available_cores())
    log.info(
        "BLAS threads per worker: %d (%s, %d cores)",
        threads.threads["worker"],
        threads.source,
        threads.cores,
    )
    servers = None
    if num_ps:
        server_env = {**threads.env("ps"), **base_env, "PYTHONUNBUFFERED": "1"}
        servers = PeerServers(reserved, host, server_env, ready_timeout, num_started=num_ps)
    control = None
    if workers_max is not None or ps_max is not None:
        control = ControlDir(cluster_dir or default_cluster_dir())
        control.create()
    ps_scaler = None
    if ps_max is not None and servers is not None and control is not None:
        ps_scaler = PSScaler(
            control,
            worker_cluster(num_workers, host, ports, reserved),
            num_ps,
            servers.start_slot,
            servers.roles,
            servers.is_ready,
            ready_timeout=ready_timeout,
            drain_timeout=drain_timeout,
        )
        servers.on_line, servers.claims = ps_scaler.on_line, ps_scaler.claims_exit
        ps_scaler.publish()
        # the workers' strategy resolves the cluster from the view, and follows it
        base_env = {**base_env, CLUSTER_FILE_ENV: control.cluster_file}
        log.info(
            "elastic parameter servers: %d of up to %d running; control directory %s "
            "(psflow scale --ps K --cluster-dir %s)",
            num_ps,
            ps_max,
            control.path,
            control.path,
        )
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
    if workers_max is not None and control is not None:
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
                    control if workers_max is not None else None,
                    envs,
                    servers,
                    dashboard,
                    ps_scaler,
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
            if ps_scaler is not None and servers is not None:
                # the workers are done: a drain they ended answers before the servers stop
                while ps_scaler.busy and not received:
                    servers.pump()
                    ps_scaler.step()
                    time.sleep(0.05)
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
    ps_scaler: PSScaler | None = None,
) -> int:
    """Runs one generation of the workers; returns the first failure's status (0: none).

    ``elastic``: a failed worker is left behind; the status is the last exit's.
    ``control``: requests of ``psflow scale --workers`` start workers of
    ``slots`` (the environment of every reserved worker slot) or drain them.
    ``servers``: the group's PS tasks, watched with it: one that exits fails
    the group (the workers get ``grace`` seconds to end on their own errors).
    ``dashboard``: shows this generation's processes.  ``ps_scaler``: takes the
    requests of ``psflow scale --ps``, stepped beside the servers' watch.
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
            if ps_scaler is not None:
                ps_scaler.step()
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
