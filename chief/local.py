"""``psflow local`` (``python -m chief.local``): a whole cluster as separate processes on loopback.

Example::

    psflow local --ps 2 --workers 2 examples/cluster_hello.py --steps 6

starts two ``python -m ps_server`` and two ``python -m worker`` processes, each
with a ``TF_CONFIG`` naming the cluster (``ps``, ``worker`` and ``chief`` jobs
on free loopback ports) and its own task, waits until each has printed its
``PSFLOW_READY`` line, then runs the script as the chief (``python -m chief
SCRIPT ARGS`` with the chief's ``TF_CONFIG``).  Every line a role writes is
copied to this process's stdout or stderr with the role in front
(``[ps:0] ...``, ``[worker:1] ...``, ``[chief] ...``); the launcher's own
messages start with ``[local]``.

Failures and teardown:

* a role that exits or is not ready within ``--ready-timeout`` seconds during
  startup: an error naming it, everything torn down, exit 1;
* a ps or worker that exits while the chief runs is reported and the chief
  keeps running, as TensorFlow's coordinator does: it re-queues a lost worker's
  closures, and a lost parameter server surfaces in the chief as an error
  (exit 138 from ``python -m chief``: retryable) - at once without
  ``BackupAndRestore``, else after ``PSFLOW_PS_RECOVERY_TIMEOUT`` seconds;
* with ``--restart on-failure`` (:mod:`chief.restart`) a role that failed is
  started again in its slot - same task, port and token, as a StatefulSet
  would - up to ``--max-restarts`` times each: a worker rejoins, a parameter
  server comes back empty and ``fit`` with ``BackupAndRestore`` rolls back to
  its last backup, a chief that exited retryable (128-255) runs again; a
  ready parameter server that fails its health checks for ``--health-grace``
  seconds (frozen, cut off) is killed and so restarted too
  (:mod:`chief.liveness`);
* when the chief exits, every role is stopped (SIGTERM, ``--grace`` seconds,
  SIGKILL) and the launcher exits with the chief's status (``128 + N`` if
  signal N killed it);
* SIGINT, SIGTERM or SIGHUP to the launcher stop the chief, then the workers,
  then the parameter servers, the same way, and it exits ``128 + signal``; a
  second signal cuts the grace periods short;
* every role runs in its own process group and gets SIGKILL from the kernel if
  the launcher itself is killed (:mod:`chief.pdeathsig`).

Every role gets the same random ``PSFLOW_AUTH_TOKEN`` in its environment
(unless the launcher's environment already sets a token or TLS), so the
cluster's servers accept calls only from its own processes.

``--ps-max N`` makes the parameter servers elastic (:mod:`chief.elastic_ps`):
ports for ``N`` PS tasks are reserved at start, ``--ps`` of them run, and the
chief gets ``PSFLOW_CLUSTER_FILE``, a cluster view in the control directory
(``--cluster-dir``, :mod:`chief.control`) that ``psflow scale --ps K`` changes:
the launcher starts new parameter servers or lets the chief drain the last
ones, and a chief running a ``ClusterWatch`` resizes to the view.  A drained
PS exits 0 after ``PSFLOW_DRAINED`` and is neither restarted nor a failure.

Every role gets a BLAS/OpenMP thread budget (:mod:`chief.thread_plan`), so
that the processes do not oversubscribe the cores they share: 1 thread per
parameter server, the cores left split among the workers and the chief
(``--threads-per-process N`` for N everywhere; a user's
``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` wins). The
launcher prints it at start (``[local] INFO BLAS threads per process: ...``)
and each ps and worker reports its own in its ready line (``blas_threads=N``).

``--devices-per-worker K`` gives each worker K devices: ``K`` disjoint GPUs
(``CUDA_VISIBLE_DEVICES``) when CuPy and GPUs are present, otherwise ``K``
logical CPU devices (``PSFLOW_NUM_CPU_DEVICES=K``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import ipaddress
import json
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from chief import thread_plan
from chief.control import ControlDir, default_cluster_dir
from chief.dashboard_host import LauncherDashboard, describe_exits
from chief.elastic_ps import DEFAULT_DRAIN_TIMEOUT, PSScaler
from chief.liveness import LivenessProber
from chief.restart import DEFAULT_MAX_RESTARTS, RestartBook, RestartMode, RestartPolicy
from chief.script import Target, split_command
from chief.status import LauncherStatus
from chief.supervisor import RoleProcess, Supervisor, shell_status
from psflow.distribute.cluster_resolver import CLUSTER_FILE_ENV
from psflow.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    OpError,
    UnavailableError,
)
from psflow.exit_codes import ExitCode
from psflow.launch import READY_PREFIX, parse_ready
from psflow.security.config import with_generated_token
from psflow.thread_budget import available_cores, parse_threads

log = logging.getLogger("chief.local")

PS, WORKER, CHIEF = "ps", "worker", "chief"
MAX_TASKS_PER_JOB = 256
"""The most ps or worker tasks one machine is asked to run (a guard against typos)."""

DEFAULT_HEALTH_GRACE = 30.0
"""Seconds a parameter server may fail health checks under ``--restart on-failure``."""
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclasses.dataclass(frozen=True)
class LocalClusterConfig:
    """What ``psflow local`` runs, validated at construction.

    Attributes:
        num_ps: parameter-server tasks (at least 1).
        num_workers: worker tasks (at least 1).
        target: the chief's program and its arguments.
        devices_per_worker: devices each worker gets, or None to leave them alone.
        port_base: the first of consecutive ports (ps, then workers, then the
            chief), or None for free ports the system picks.
        host: the loopback address every task binds and is reached at.
        ready_timeout: seconds each ps and worker has to print its ready line.
        grace: seconds a role has to exit after SIGTERM before SIGKILL.
        dashboard_port: the chief serves its dashboard on this port of ``host``
            (0: a free one the launcher picks), or None for none.
        dashboard_linger: with a dashboard, seconds the launcher keeps serving
            the finished job's page after every role stopped (inf: until
            SIGINT/SIGTERM; None: until then on an interactive terminal, else 0).
        status_interval: show every role's state every this many seconds
            (:mod:`chief.status`), or None for no status view.
        restart: whether and how often a role that died is started again in
            its slot (:mod:`chief.restart`; never by default).
        health_grace: with restarts on, seconds a ready parameter server may
            fail its health checks (frozen, cut off) before it is killed and
            restarted (:mod:`chief.liveness`); None: not probed.
        ps_max: the most PS tasks ``psflow scale`` may ask for (ports reserved
            at start), or None for a fixed number of parameter servers.
        cluster_dir: with ``ps_max``, the control directory ``psflow scale``
            finds the launcher in (None: :func:`chief.control.default_cluster_dir`).
        drain_timeout: with ``ps_max``, seconds a drained PS has to exit.
        threads_per_process: BLAS threads of every role (``--threads-per-process``),
            or None for psflow's budget (:mod:`chief.thread_plan`).

    Raises:
        InvalidArgumentError: a value is out of range (the message names it).
    """

    num_ps: int
    num_workers: int
    target: Target
    devices_per_worker: int | None = None
    port_base: int | None = None
    host: str = "127.0.0.1"
    ready_timeout: float = 60.0
    grace: float = 15.0
    dashboard_port: int | None = None
    dashboard_linger: float | None = None
    status_interval: float | None = None
    restart: RestartPolicy = dataclasses.field(default_factory=RestartPolicy)
    health_grace: float | None = None
    ps_max: int | None = None
    cluster_dir: str | None = None
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    threads_per_process: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_ps", "num_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(f"{name} {value!r} must be an integer")
            if not 1 <= value <= MAX_TASKS_PER_JOB:
                raise InvalidArgumentError(
                    f"{name} {value} must be between 1 and {MAX_TASKS_PER_JOB}"
                )
        m = self.ps_max
        if m is not None:
            if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= MAX_TASKS_PER_JOB:
                raise InvalidArgumentError(
                    f"ps_max {m!r} must be an integer between 1 and {MAX_TASKS_PER_JOB}"
                )
            if m < self.num_ps:
                raise InvalidArgumentError(f"ps_max {m} is below num_ps {self.num_ps}")
        elif self.cluster_dir is not None:
            raise InvalidArgumentError(
                f"cluster_dir {self.cluster_dir!r} needs ps_max (elastic parameter servers)"
            )
        t = self.threads_per_process
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise InvalidArgumentError(f"threads_per_process {t!r} must be an integer >= 1")
        if not self.drain_timeout > 0:
            raise InvalidArgumentError(f"drain_timeout {self.drain_timeout!r} must be > 0")
        k = self.devices_per_worker
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise InvalidArgumentError(f"devices_per_worker {k!r} must be an integer >= 1")
        if self.port_base is not None:
            last = self.port_base + self.num_tasks - 1
            if self.port_base < 1 or last > 65535:
                raise InvalidArgumentError(
                    f"port_base {self.port_base!r}: ports {self.port_base}..{last} for "
                    f"{self.num_tasks} tasks must lie within 1..65535"
                )
        check_loopback(self.host)
        if not self.ready_timeout > 0:
            raise InvalidArgumentError(f"ready_timeout {self.ready_timeout!r} must be > 0")
        if not self.grace >= 0:
            raise InvalidArgumentError(f"grace {self.grace!r} must be >= 0")
        d = self.dashboard_port
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= 65535):
            raise InvalidArgumentError(f"dashboard port {d!r} must be an integer in 0..65535")
        linger = self.dashboard_linger
        if linger is not None and not linger >= 0:  # NaN too
            raise InvalidArgumentError(f"dashboard linger {linger!r} must be >= 0 seconds")
        if self.status_interval is not None and not self.status_interval > 0:
            raise InvalidArgumentError(f"status interval {self.status_interval!r} must be > 0")
        if not isinstance(self.restart, RestartPolicy):
            raise InvalidArgumentError(f"restart {self.restart!r} must be a RestartPolicy")
        g = self.health_grace
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or g <= 0):
            raise InvalidArgumentError(f"health_grace {g!r} must be a number of seconds > 0")
        if self.target.path is not None and not os.path.isfile(self.target.path):
            raise InvalidArgumentError(f"script {self.target.path!r} does not exist")
        if self.target.path is None and not self.target.module:
            raise InvalidArgumentError("no script or module to run as the chief")

    @property
    def ps_slots(self) -> int:
        """PS tasks with a reserved port: ``ps_max``, else ``num_ps``."""
        return self.num_ps if self.ps_max is None else self.ps_max

    @property
    def num_tasks(self) -> int:
        """Tasks (with a port) in the cluster, every PS slot and the chief included."""
        return self.ps_slots + self.num_workers + 1


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    """One process to start: its task, address, command and environment additions."""

    task_type: str
    index: int
    address: str
    argv: tuple[str, ...]
    env: Mapping[str, str]

    @property
    def name(self) -> str:
        """``"ps:0"``, ``"worker:1"``, or ``"chief"`` for the one chief."""
        return CHIEF if self.task_type == CHIEF else f"{self.task_type}:{self.index}"

    @property
    def port(self) -> int:
        """The port of :attr:`address`."""
        return int(self.address.rpartition(":")[2])


def check_loopback(host: str) -> str:
    """Returns ``host`` if it is a loopback address (or ``localhost``).

    Workers run the closures they are sent, unauthenticated: a local cluster
    must not be reachable from other machines.

    Raises:
        InvalidArgumentError: ``host`` is not a loopback address.
    """
    if host == "localhost":
        return host
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise InvalidArgumentError(
            f"host {host!r} must be a loopback address such as 127.0.0.1 or ::1: a local "
            "cluster's workers execute whatever they are sent"
        )
    return host


def host_port(host: str, port: int) -> str:
    """``host:port``, IPv6 hosts in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _socket_for(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # As the servers will: a port left in TIME_WAIT by an earlier run is free.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


_LOWEST_PICKED = 10000  # below it: well-known and registered services' usual ports


def ephemeral_ports() -> tuple[int, int]:
    """The range the system takes a connection's local port from (Linux: its setting;
    elsewhere IANA's dynamic range, which macOS and Windows use)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def pick_ports(count: int, host: str = "127.0.0.1", base: int | None = None) -> list[int]:
    """Returns ``count`` distinct ports that are free on ``host`` right now.

    With ``base``, the ports ``base .. base+count-1``, each checked; without,
    free ports below the system's ephemeral range (all held open together, so
    they are distinct): a slot reserved for a task started later (``--ps-max``,
    ``--workers-max``) cannot be taken meanwhile by the local end of some
    outgoing connection, as a port the system picks could (then, or where
    that range leaves no room, the system picks).

    Raises:
        UnavailableError: a port from ``base`` is in use (the message names it).
    """
    if base is not None:
        for port in range(base, base + count):
            with _socket_for(host) as sock:
                try:
                    sock.bind((host, port))
                except OSError as e:
                    raise UnavailableError(f"port {port} on {host} is not free: {e}") from None
        return list(range(base, base + count))
    low = ephemeral_ports()[0]
    candidates = list(range(_LOWEST_PICKED, low))
    random.SystemRandom().shuffle(candidates)  # never a seeded sequence another launcher shares
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for port in candidates[: 50 * count]:  # bounded: most are free
            if len(ports) == count:
                break
            sock = stack.enter_context(_socket_for(host))
            try:
                sock.bind((host, port))
            except OSError:
                continue
            ports.append(port)
        while len(ports) < count:
            sock = stack.enter_context(_socket_for(host))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        return ports


def cluster_dict(num_ps: int, num_workers: int, host: str, ports: Sequence[int]) -> dict:
    """The ``TF_CONFIG`` cluster: ps, then workers, then the chief, on ``ports`` in that order.

    Example:
        >>> cluster_dict(1, 2, "127.0.0.1", [5000, 5001, 5002, 5003])
        {'ps': ['127.0.0.1:5000'], 'worker': ['127.0.0.1:5001', '127.0.0.1:5002'], \
'chief': ['127.0.0.1:5003']}
    """
    if len(ports) != num_ps + num_workers + 1:
        raise InvalidArgumentError(
            f"{len(ports)} ports {list(ports)} for {num_ps} ps, {num_workers} workers and a chief"
        )
    addresses = [host_port(host, p) for p in ports]
    return {
        PS: addresses[:num_ps],
        WORKER: addresses[num_ps : num_ps + num_workers],
        CHIEF: addresses[num_ps + num_workers :],
    }


def tf_config(cluster: Mapping[str, Sequence[str]], task_type: str, index: int) -> str:
    """The ``TF_CONFIG`` text for task ``task_type:index`` of ``cluster``."""
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def gpu_ids(environ: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs workers could use, without initializing CUDA here; ``[]`` without CuPy.

    ``CUDA_VISIBLE_DEVICES`` entries when it is set, else ``0..n-1`` for the
    GPUs the driver lists.
    """
    from psflow.distribute.cluster_resolver import visible_gpu_count

    env = os.environ if environ is None else environ
    if importlib.util.find_spec("cupy") is None:
        return []
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    return [str(i) for i in range(visible_gpu_count(env))]


def worker_device_env(
    devices_per_worker: int | None, num_workers: int, gpus: Sequence[str]
) -> list[dict[str, str]]:
    """Each worker's environment additions for ``devices_per_worker`` devices.

    With ``gpus``, worker ``i`` gets GPUs ``gpus[i*K:(i+1)*K]``; without, ``K``
    logical CPU devices.  None leaves the environment alone.

    Raises:
        InvalidArgumentError: there are GPUs, but fewer than the workers need.

    Example:
        >>> worker_device_env(2, 2, [])
        [{'PSFLOW_NUM_CPU_DEVICES': '2'}, {'PSFLOW_NUM_CPU_DEVICES': '2'}]
        >>> worker_device_env(1, 2, ["0", "1"])
        [{'CUDA_VISIBLE_DEVICES': '0'}, {'CUDA_VISIBLE_DEVICES': '1'}]
    """
    k = devices_per_worker
    if k is None:
        return [{} for _ in range(num_workers)]
    if not gpus:
        return [{"PSFLOW_NUM_CPU_DEVICES": str(k)} for _ in range(num_workers)]
    if k * num_workers > len(gpus):
        raise InvalidArgumentError(
            f"devices_per_worker {k} for {num_workers} workers needs {k * num_workers} GPUs; "
            f"this machine has {len(gpus)} ({','.join(gpus)})"
        )
    return [
        {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * k : (i + 1) * k])} for i in range(num_workers)
    ]


def plan_roles(
    config: LocalClusterConfig, ports: Sequence[int], gpus: Sequence[str] = ()
) -> list[RoleSpec]:
    """The processes of the cluster: every ps, every worker, then the chief.

    Raises:
        InvalidArgumentError: see :func:`worker_device_env` and :func:`cluster_dict`.
    """
    full = cluster_dict(config.ps_slots, config.num_workers, config.host, ports)
    # Workers and the chief start with the running PS tasks; each PS slot knows its own.
    cluster = {**full, PS: full[PS][: config.num_ps]}
    devices = worker_device_env(config.devices_per_worker, config.num_workers, gpus)
    python = sys.executable
    roles = []
    for i, address in enumerate(full[PS]):
        argv = (python, "-m", "ps_server", "--bind", config.host)
        roles.append(RoleSpec(PS, i, address, argv, {"TF_CONFIG": tf_config(full, PS, i)}))
    for i, address in enumerate(cluster[WORKER]):
        argv = (python, "-m", "worker", "--bind", config.host)
        env = {"TF_CONFIG": tf_config(cluster, WORKER, i), **devices[i]}
        roles.append(RoleSpec(WORKER, i, address, argv, env))
    target = config.target
    dashboard = (
        () if config.dashboard_port is None else ("--dashboard-port", str(config.dashboard_port))
    )
    argv = (python, "-m", "chief", *dashboard, *target.argv, *target.args)
    env = {"TF_CONFIG": tf_config(cluster, CHIEF, 0)}
    roles.append(RoleSpec(CHIEF, 0, cluster[CHIEF][0], argv, env))
    return roles


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class LocalCluster:
    """Runs one :class:`LocalClusterConfig`: start, wait until ready, run the chief, tear down.

    Args:
        config: what to run.
        environ: the base environment of every role (``os.environ`` by default).
        stdout: where roles' stdout goes (``sys.stdout`` by default).
        stderr: where roles' stderr goes (``sys.stderr`` by default).
        gpus: the GPU ids workers may use (found with :func:`gpu_ids` by default).
    """

    def __init__(
        self,
        config: LocalClusterConfig,
        *,
        environ: Mapping[str, str] | None = None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        gpus: Sequence[str] | None = None,
    ) -> None:
        self.config = config
        # One random token for the whole cluster, unless the environment configures auth.
        self._environ = with_generated_token(os.environ if environ is None else environ)
        self._gpus = list(gpu_ids(self._environ) if gpus is None else gpus)
        self._stdout = stdout
        self._stderr = stderr
        self._signals: list[int] = []
        self._specs: dict[str, RoleSpec] = {}
        self._ready: set[str] = set()
        self._startup_error: OpError | None = None
        self._supervisor: Supervisor | None = None
        self._status: LauncherStatus | None = None
        self._started: dict[str, list[RoleProcess]] = {PS: [], WORKER: [], CHIEF: []}
        self._restarts = RestartBook(config.restart)
        self._due: dict[str, float] = {}  # role name -> when to start it again
        self._threads = thread_plan.ThreadPlan({}, thread_plan.AUTO, 1, 0)  # set by run()
        self._scaler: PSScaler | None = None
        self._control: ControlDir | None = None
        self._dashboard: LauncherDashboard | None = None
        self._dashboard_url: str | None = None  # the finished job's page, once served
        self._prober = (
            LivenessProber(config.health_grace)
            if config.health_grace is not None and config.restart.enabled
            else None
        )

    def plan_threads(self) -> thread_plan.ThreadPlan:
        """Every role's BLAS threads (:mod:`chief.thread_plan`).

        Raises:
            InvalidArgumentError: a thread variable of the environment is bad.
        """
        config = self.config
        return thread_plan.plan_threads(
            config.ps_slots,
            config.num_workers,
            config.threads_per_process,
            self._environ,
            cores=available_cores(),
        )

    # -- signals ------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals.append(signum)

    @contextlib.contextmanager
    def _signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # only the main thread may set handlers; the caller handles signals
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _check_signals(self) -> None:
        if self._signals:
            raise _Interrupted(self._signals[0])

    # -- readiness ----------------------------------------------------------------------
    def _on_line(self, role: RoleProcess, line: str, from_stdout: bool) -> None:
        if self._scaler is not None:
            self._scaler.on_line(role, line, from_stdout)
        ready = parse_ready(line) if from_stdout else None
        if ready is None or role.name in self._ready:
            return
        spec = self._specs[role.name]
        if ready.task != role.name or ready.port != spec.port:
            self._startup_error = FailedPreconditionError(
                f"{role.name} announced {line!r}, expected task={role.name} port={spec.port}",
                task=role.name,
            )
            return
        self._ready.add(role.name)
        if self._prober is not None and spec.task_type == PS:
            self._prober.watch(role.name, spec.address)
        if self._restarts.used(role.name):
            log.warning(
                "%s is back at %s (pid %d, restart %d)",
                role.name,
                spec.address,
                role.pid,
                self._restarts.used(role.name),
            )
        else:
            log.info("%s ready at %s (pid %d)", role.name, spec.address, role.pid)

    def _wait_ready(self, servers: list[RoleProcess]) -> None:
        supervisor = self._require_supervisor()
        deadline = time.monotonic() + self.config.ready_timeout
        while any(r.name not in self._ready for r in servers):
            self._check_signals()
            supervisor.pump(0.1)
            for role in supervisor.poll():
                raise FailedPreconditionError(
                    f"{role.name} exited with status {shell_status(role.returncode or 0)} "
                    "before the chief started; see its output above",
                    task=role.name,
                )
            if self._startup_error is not None:
                raise self._startup_error
            if time.monotonic() > deadline:
                late = [r.name for r in servers if r.name not in self._ready]
                raise DeadlineExceededError(
                    f"{', '.join(late)} not ready within {self.config.ready_timeout}s "
                    f"(no {READY_PREFIX.strip()} line)",
                    task=late[0],
                )

    # -- the chief ----------------------------------------------------------------------
    def _watch(self, chief: RoleProcess) -> int:
        supervisor = self._require_supervisor()
        while True:
            self._check_signals()
            supervisor.pump(0.1)
            if self._status is not None:
                self._status.refresh()
            exited = supervisor.poll()
            if exited:
                self._publish_roles()
            for role in exited:
                if self._prober is not None:
                    self._prober.forget(role.name)
                if self._scaler is not None and self._scaler.claims_exit(role):
                    continue
                if role.name != CHIEF:
                    self._on_role_exit(role)
            if self._scaler is not None:
                self._scaler.step()
                self._forget_dropped_slots(self._scaler.num_ps)
            self._kill_silent()
            self._start_due()
            chief = self._started[CHIEF][-1] if self._started[CHIEF] else chief  # restarted?
            if chief.running or CHIEF in self._due:
                continue
            status = shell_status(chief.returncode or 0)
            if self._schedule_restart(chief, status):
                continue
            log.info("chief exited with status %d; stopping the cluster", status)
            return status

    def _on_role_exit(self, role: RoleProcess) -> None:
        """A ps or worker exited while the chief runs: say so; restart it if the policy says so."""
        status = shell_status(role.returncode or 0)
        if self._schedule_restart(role, status):
            return
        if role.name.startswith(WORKER):
            consequence = "the chief keeps running; its closures move to the other workers"
        else:
            consequence = (
                "the chief keeps running; fit with BackupAndRestore waits for it up to "
                "PSFLOW_PS_RECOVERY_TIMEOUT (300 s) and then exits 138, other programs get "
                "errors for its variables (restart it in its slot: --restart on-failure)"
            )
        log.error(
            "%s exited with status %d while the chief runs; %s", role.name, status, consequence
        )

    def _forget_dropped_slots(self, num_ps: int) -> None:
        """Cancels restarts of PS slots the view no longer lists (scaled down meanwhile)."""
        for name in [n for n in self._due if n.startswith(f"{PS}:")]:
            if int(name.partition(":")[2]) >= num_ps:
                log.info("%s is no longer in the cluster view: not restarting it", name)
                del self._due[name]

    def _kill_silent(self) -> None:
        """SIGKILLs a parameter server that failed its health checks past the grace period.

        Its exit then goes through the restart policy like any other failure.
        """
        if self._prober is None:
            return
        for name, silent_for in self._prober.silent():
            self._prober.forget(name)
            running = [r for r in self._require_supervisor().roles if r.name == name and r.running]
            if not running:
                continue
            log.warning(
                "%s has not answered health checks for %.1fs (--health-grace %g): "
                "treating it as failed (SIGKILL)",
                name,
                silent_for,
                self._prober.grace,
            )
            running[-1].signal_group(signal.SIGKILL)

    def _schedule_restart(self, role: RoleProcess, status: int) -> bool:
        """Plans ``role``'s restart in its slot if the policy allows; returns whether it did."""
        is_chief = role.name == CHIEF
        delay = self._restarts.next_delay(role.name, status, is_chief=is_chief)
        if delay is None:
            policy = self.config.restart
            if policy.enabled and self._restarts.failed(status, is_chief=is_chief):
                log.error(
                    "%s exited with status %d and was restarted %d times already "
                    "(--max-restarts %d): not restarting it",
                    role.name,
                    status,
                    self._restarts.used(role.name),
                    policy.max_restarts,
                )
            return False
        spec = self._specs[role.name]
        log.warning(
            "%s exited with status %d; restarting it at %s in %.1fs (restart %d of %d)",
            role.name,
            status,
            spec.address,
            delay,
            self._restarts.used(role.name),
            self.config.restart.max_restarts,
        )
        self._due[role.name] = time.monotonic() + delay
        return True

    def _start_due(self) -> None:
        """Starts every role whose restart is due, in its slot (same task, port and token)."""
        now = time.monotonic()
        for name, due in list(self._due.items()):
            if due > now:
                continue
            del self._due[name]
            spec = self._specs[name]
            self._ready.discard(name)
            self._started[spec.task_type].append(self._start(spec))

    def _require_supervisor(self) -> Supervisor:
        if self._supervisor is None:
            raise FailedPreconditionError("the local cluster is not running")
        return self._supervisor

    # -- running ------------------------------------------------------------------------
    def _start(self, spec: RoleSpec) -> RoleProcess:
        supervisor = self._require_supervisor()
        env = {**self._environ, **self._threads.env(spec.task_type), **spec.env}
        env["PYTHONUNBUFFERED"] = "1"
        self._specs[spec.name] = spec
        role = supervisor.start(spec.name, spec.argv, env)
        self._publish_roles()
        return role

    def _publish_roles(self) -> None:
        """Tells the chief's dashboard how every role's process stands (with --dashboard)."""
        if self._dashboard is not None and self._supervisor is not None:
            self._dashboard.publish(self._supervisor.roles, self._restarts)

    def run(self) -> int:
        """Runs the cluster to the end; returns the launcher's exit status.

        The chief's status when it ran; ``128 + N`` after signal N to the
        launcher; 1 when the cluster could not start.  Every role is reaped
        before it returns.
        """
        config = self.config
        try:
            ports = pick_ports(config.num_tasks, config.host, config.port_base)
            if config.dashboard_port == 0:  # picked here so that the launcher can say where
                port = pick_ports(1, config.host)[0]
                config = self.config = dataclasses.replace(config, dashboard_port=port)
            specs = plan_roles(config, ports, self._gpus)
            self._threads = self.plan_threads()
        except OpError as e:
            log.error("cannot start the local cluster: %s", e)
            return int(ExitCode.USER_ERROR)
        if config.dashboard_port is not None:
            self._dashboard = LauncherDashboard(config.restart)
            chief_spec = specs[-1]
            env = {**chief_spec.env, **self._dashboard.env()}
            specs = [*specs[:-1], dataclasses.replace(chief_spec, env=env)]
        full = cluster_dict(config.ps_slots, config.num_workers, config.host, ports)
        cluster = {**full, PS: full[PS][: config.num_ps]}
        log.info("cluster %s; chief runs %s", json.dumps(cluster), config.target)
        log.info("BLAS threads per process: %s", self._threads.describe())
        if self._threads.inherited and config.threads_per_process is not None:
            log.warning(
                "%s in the environment wins over %s %d",
                self._threads.source,
                thread_plan.FLAG,
                config.threads_per_process,
            )
        if config.ps_max is not None:
            try:
                specs = self._start_control(full, specs)
            except (OpError, OSError) as e:
                log.error("cannot start the local cluster: %s", e)
                return int(ExitCode.USER_ERROR)
        if config.dashboard_port is not None:
            log.info("dashboard at http://%s/", host_port(config.host, config.dashboard_port))
        stdout, stderr = self._stdout, self._stderr
        if config.status_interval is not None:
            self._status = self._start_status(cluster, config.status_interval)
            stdout = self._status.wrap(stdout or sys.stdout)
            stderr = self._status.wrap(stderr or sys.stderr)
        self._supervisor = Supervisor(stdout, stderr, on_line=self._on_line)
        started = self._started
        with self._signal_handlers(), self._status_around_logging():
            try:
                for spec in specs[:-1]:
                    if spec.task_type == PS and spec.index >= config.num_ps:
                        self._specs[spec.name] = spec  # a reserved slot: psflow scale starts it
                        continue
                    started[spec.task_type].append(self._start(spec))
                self._wait_ready(started[PS] + started[WORKER])
                log.info(
                    "all %d ps and %d workers ready; starting the chief",
                    config.num_ps,
                    config.num_workers,
                )
                chief = self._start(specs[-1])
                started[CHIEF].append(chief)
                status = self._watch(chief)
                if self._dashboard is not None:  # the chief's page is gone: keep its final state
                    self._dashboard_url = self._dashboard.serve_final(
                        config.host, int(config.dashboard_port or 0)
                    )
                return status
            except _Interrupted as e:
                log.warning("received %s: stopping the cluster", e)
                return 128 + e.signum
            except OpError as e:
                log.error("the local cluster failed to start: %s", e)
                return int(ExitCode.USER_ERROR)
            finally:
                if self._prober is not None:
                    self._prober.stop()
                self._supervisor.stop(
                    config.grace,
                    escalate=lambda: len(self._signals) >= 2,
                    stages=(started[CHIEF], started[WORKER], started[PS]),
                )
                if self._status is not None:
                    self._status.close()
                if self._control is not None:
                    self._control.remove()
                self._log_statuses()
                self._finish_dashboard()

    def _finish_dashboard(self) -> None:
        """Says the job finished on the page, keeps it up as asked, removes the directory."""
        dashboard = self._dashboard
        if dashboard is None:
            return
        try:
            final = dashboard.finish(self._require_supervisor().roles, self._restarts)
            url = self._dashboard_url
            linger = self.config.dashboard_linger
            if linger is None:
                linger = float("inf") if _interactive() else 0.0
            if url is not None and not self._signals and linger > 0:
                seen = len(self._signals)
                until = "until Ctrl-C" if linger == float("inf") else f"for {linger:g} s"
                log.info(
                    "job finished (%s); the dashboard at %s shows its final state %s",
                    describe_exits(final),
                    url,
                    until,
                )
                dashboard.linger(linger, lambda: len(self._signals) > seen)
        finally:
            dashboard.close()

    def _start_control(self, full: Mapping[str, Sequence[str]], specs: list[RoleSpec]):
        """Creates the control directory and the scaler; returns ``specs``, the chief's amended."""
        config = self.config
        control = ControlDir(config.cluster_dir or default_cluster_dir())
        control.create()
        self._control = control

        def start_ps(index: int) -> RoleProcess:
            spec = self._specs[f"{PS}:{index}"]
            self._ready.discard(spec.name)
            role = self._start(spec)
            self._started[PS].append(role)
            return role

        def is_ready(role: RoleProcess) -> bool:
            return role.name in self._ready and role.running

        self._scaler = PSScaler(
            control,
            full,
            config.num_ps,
            start_ps,
            lambda: list(self._started[PS]),
            is_ready,
            ready_timeout=config.ready_timeout,
            drain_timeout=config.drain_timeout,
        )
        self._scaler.publish()
        log.info(
            "elastic parameter servers: %d of up to %d running; control directory %s "
            "(psflow scale --ps K --cluster-dir %s)",
            config.num_ps,
            config.ps_max,
            control.path,
            control.path,
        )
        chief = specs[-1]
        env = {**chief.env, CLUSTER_FILE_ENV: control.cluster_file}
        return [*specs[:-1], dataclasses.replace(chief, env=env)]

    def _start_status(self, cluster: Mapping[str, Sequence[str]], interval: float):
        def processes() -> dict[str, str]:  # the chief: no probe covers it
            roles = self._supervisor.roles if self._supervisor is not None else []
            return {
                r.name: "running" if r.returncode is None else f"exit {shell_status(r.returncode)}"
                for r in roles
                if r.name == CHIEF
            }

        scaler = self._scaler
        ps_view = None if scaler is None else (lambda: scaler.view(scaler.num_ps)[PS])
        stream = self._stderr or sys.stderr
        return LauncherStatus(
            cluster, self._environ, stream, processes, interval=interval, ps_view=ps_view
        )

    def _status_around_logging(self):
        return self._status.around_logging() if self._status else contextlib.nullcontext()

    def _log_statuses(self) -> None:
        supervisor = self._require_supervisor()
        statuses = ", ".join(
            f"{r.name}={shell_status(r.returncode) if r.returncode is not None else 'running'}"
            for r in supervisor.roles
        )
        log.info("stopped: %s", statuses or "nothing was started")


def _interactive() -> bool:
    """Whether a person may be watching: stdin and stderr are terminals."""
    try:
        return sys.stdin.isatty() and sys.stderr.isatty()
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="psflow local",
        usage="psflow local (--ps N | --mode multi-worker) --workers M [OPTIONS] "
        "(SCRIPT | -m MODULE) [ARGS...]",
        description="Run SCRIPT as the chief of a cluster of separate processes on loopback "
        "(with --mode multi-worker: run M peer workers of SCRIPT).",
    )
    p.add_argument(
        "--mode",
        default="ps",
        choices=["ps", "multi-worker"],
        help="ps: parameter servers, workers and SCRIPT as the chief (default); multi-worker: "
        "M processes of SCRIPT as the workers of a MultiWorkerMirroredStrategy (chief/peers.py)",
    )
    p.add_argument(
        "--ps",
        "--num-ps",
        type=int,
        metavar="N",
        help="parameter-server tasks (with --mode multi-worker: the hybrid mode's, for "
        "the group's embedding tables; default none)",
    )
    p.add_argument(
        "--ps-max",
        type=int,
        metavar="N",
        help="elastic parameter servers: reserve N PS slots; `psflow scale --ps K` starts or "
        "drains them while the chief runs (its ClusterWatch resizes; with --mode "
        "multi-worker the workers resize at a step boundary)",
    )
    p.add_argument(
        "--cluster-dir",
        metavar="DIR",
        help="with --ps-max or --workers-max: the control directory psflow scale finds the "
        "cluster in (default: a per-user one under the temporary directory)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT,
        metavar="S",
        help=f"with --ps-max: seconds a drained PS has to exit (default {DEFAULT_DRAIN_TIMEOUT:g})",
    )
    p.add_argument("--workers", type=int, required=True, metavar="M", help="worker tasks")
    p.add_argument(
        "--devices-per-worker",
        type=int,
        metavar="K",
        help="K GPUs per worker if CuPy sees GPUs, else K logical CPU devices",
    )
    p.add_argument(
        "--port-base", type=int, metavar="P", help="use ports P, P+1, ... (default: free ports)"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="loopback address to use (default 127.0.0.1)"
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds for each role to start",
    )
    p.add_argument(
        "--grace", type=float, default=15.0, metavar="S", help="seconds to exit after SIGTERM"
    )
    p.add_argument(
        "--restart",
        default=RestartMode.NEVER.value,
        metavar="{never,on-failure}",
        help="on-failure: start a ps, worker or chief that failed again in its slot "
        "(same task, port and credentials), as Kubernetes restarts a pod (default: never)",
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="with --mode multi-worker: a worker that fails or drains is left behind and the "
        "others go on (the script's strategy needs ElasticOptions)",
    )
    p.add_argument(
        "--workers-max",
        type=int,
        metavar="N",
        help="with --mode multi-worker --elastic: reserve N worker slots; `psflow scale "
        "--workers K` starts workers (the group admits them) or drains the highest ones",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=DEFAULT_MAX_RESTARTS,
        metavar="N",
        help=f"restarts per task with --restart on-failure (default {DEFAULT_MAX_RESTARTS})",
    )
    p.add_argument(
        "--health-grace",
        type=float,
        default=DEFAULT_HEALTH_GRACE,
        metavar="S",
        help="with --restart on-failure: a ps that fails its health checks for S seconds "
        f"(frozen, cut off) is killed and restarted (default {DEFAULT_HEALTH_GRACE:g}; 0: never)",
    )
    p.add_argument(
        thread_plan.FLAG,
        default="auto",
        metavar="N",
        help="BLAS/OpenMP threads of every ps, worker and chief process (default auto: "
        "1 per ps, the cores left shared by the workers and the chief; "
        "OPENBLAS_NUM_THREADS / OMP_NUM_THREADS / MKL_NUM_THREADS in the environment win)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="level of the launcher's own messages",
    )
    p.add_argument(
        "--dashboard",
        nargs="?",
        const=0,
        type=int,
        metavar="PORT",
        help="the chief (with --mode multi-worker: the launcher) serves a live dashboard at "
        "http://HOST:PORT/ (no PORT: a free one)",
    )
    p.add_argument(
        "--dashboard-linger",
        type=float,
        metavar="S",
        help="with --dashboard: keep serving the finished job's page S seconds after every "
        "role stopped (default: until Ctrl-C on a terminal, else 0; inf: until a signal)",
    )
    p.add_argument(
        "--status",
        action="store_true",
        help="show every role's state: a table redrawn in place on a terminal, "
        "a [local] status: line otherwise",
    )
    p.add_argument(
        "--status-interval",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds between --status refreshes (default 2)",
    )
    return p


def _join_dashboard_port(argv: list[str], value_options: set[str]) -> list[str]:
    """``--dashboard 8080`` -> ``--dashboard=8080``: the port is optional, the script is not.

    Only the launcher's own options (before the script) are looked at.

    Example:
        >>> _join_dashboard_port(["--ps", "1", "--dashboard", "80", "t.py", "9"], {"--ps"})
        ['--ps', '1', '--dashboard=80', 't.py', '9']
        >>> _join_dashboard_port(["--dashboard", "t.py"], set())
        ['--dashboard', 't.py']
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--", "-m") or not arg.startswith("-"):
            return out + argv[i:]  # the target begins: its arguments are left alone
        if arg == "--dashboard" and i + 1 < len(argv) and argv[i + 1].isdigit():
            out.append(f"--dashboard={argv[i + 1]}")
            i += 2
        elif arg in value_options and i + 1 < len(argv):
            out += argv[i : i + 2]
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


def _value_options(parser: argparse.ArgumentParser) -> set[str]:
    return {
        option
        for action in parser._actions
        if action.nargs not in (0, "?")  # optional values are written --opt=VALUE
        for option in action.option_strings
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``psflow local``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    try:
        options = _value_options(parser)
        own, target = split_command(_join_dashboard_port(argv, options), options)
    except InvalidArgumentError as e:
        parser.print_usage(sys.stderr)
        sys.stderr.write(f"psflow local: {e}\n")
        return int(ExitCode.USAGE_ERROR)
    args = parser.parse_args(own)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="[local] %(levelname)s %(message)s"
    )
    if args.mode == "multi-worker":
        return _main_peers(parser, args, target)
    if args.ps is None:
        parser.print_usage(sys.stderr)
        sys.stderr.write("psflow local: --ps N is required (or --mode multi-worker)\n")
        return int(ExitCode.USAGE_ERROR)
    if args.workers_max is not None:
        parser.print_usage(sys.stderr)
        sys.stderr.write("psflow local: --workers-max needs --mode multi-worker --elastic\n")
        return int(ExitCode.USAGE_ERROR)
    try:
        config = LocalClusterConfig(
            num_ps=args.ps,
            num_workers=args.workers,
            target=target,
            devices_per_worker=args.devices_per_worker,
            port_base=args.port_base,
            host=args.host,
            ready_timeout=args.ready_timeout,
            grace=args.grace,
            dashboard_port=args.dashboard,
            dashboard_linger=args.dashboard_linger,
            status_interval=args.status_interval if args.status else None,
            restart=RestartPolicy(RestartMode.parse(args.restart), args.max_restarts),
            health_grace=args.health_grace or None,
            ps_max=args.ps_max,
            cluster_dir=args.cluster_dir,
            drain_timeout=args.drain_timeout,
            threads_per_process=parse_threads(args.threads_per_process, thread_plan.FLAG),
        )
        cluster = LocalCluster(config)
        cluster.plan_threads()  # a bad thread variable is a usage error, found before any start
    except InvalidArgumentError as e:
        parser.print_usage(sys.stderr)
        sys.stderr.write(f"psflow local: {e}\n")
        return int(ExitCode.USAGE_ERROR)
    return cluster.run()


def _linger(seconds: float | None) -> float:
    """``--dashboard-linger``'s value; not given: until Ctrl-C on a terminal, else 0."""
    if seconds is None:
        return float("inf") if _interactive() else 0.0
    if not seconds >= 0:
        raise InvalidArgumentError(f"--dashboard-linger {seconds!r} must be >= 0 seconds")
    return seconds


def _main_peers(parser: argparse.ArgumentParser, args: argparse.Namespace, target: Target) -> int:
    """``--mode multi-worker``: peer workers of the script (and ``--ps N`` PS tasks), no chief."""
    from chief.peers import run_peers

    try:
        check_loopback(args.host)
        if args.workers < 1:
            raise InvalidArgumentError(f"--workers must be at least 1, got {args.workers}")
        return run_peers(
            target,
            args.workers,
            devices_per_worker=args.devices_per_worker,
            host=args.host,
            port_base=args.port_base,
            grace=args.grace,
            restart=RestartPolicy(RestartMode.parse(args.restart), args.max_restarts),
            elastic=args.elastic,
            workers_max=args.workers_max,
            cluster_dir=args.cluster_dir,
            num_ps=args.ps or 0,
            ready_timeout=args.ready_timeout,
            dashboard_port=args.dashboard,
            dashboard_linger=_linger(args.dashboard_linger),
            ps_max=args.ps_max,
            drain_timeout=args.drain_timeout,
        )
    except InvalidArgumentError as e:
        parser.print_usage(sys.stderr)
        sys.stderr.write(f"psflow local: {e}\n")
        return int(ExitCode.USAGE_ERROR)


if __name__ == "__main__":
    sys.exit(main())
