"""Process fixtures: real servers on 127.0.0.1, every wait bounded, every child reaped.

``start_ps(*args)`` starts ``python -m ps_server --port P *args`` (``P`` free below
the system's ephemeral range unless ``args`` name a port) and returns a
:class:`ServerProcess` once its ``PSFLOW_READY`` line gave the port; every
process a test started is killed and reaped when the test ends.  ``ps_server``
is one shared PS process for the whole session (tests use unique variable
names), ``ps_client`` a fresh client to it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import pathlib
import random
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from psflow import errors, launch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for child processes: this checkout first on PYTHONPATH."""
    env = dict(os.environ)
    paths = [str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _log_tail(path: pathlib.Path, n: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    return ""


@dataclasses.dataclass
class ServerProcess:
    """A started server: its address, process and log file."""

    proc: subprocess.Popen
    port: int
    log_path: pathlib.Path
    ready_line: str
    #: started for a module's or the session's tests, not the one test running now
    outlives_test: bool = False

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>``."""
        return f"127.0.0.1:{self.port}"

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines the server logged."""
        return _log_tail(self.log_path, n)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Sends ``sig`` and waits for the exit code (kills after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.reap()
            raise

    def reap(self) -> None:
        """Kills the process if it still runs and waits for it."""
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.stdout:
            self.proc.stdout.close()


def start_server(
    module: str,
    args: list[str],
    ready_prefix: str,
    *,
    log_dir: pathlib.Path,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """Starts ``python -m module args`` and waits (bounded) for its ready line.

    ``ready_prefix`` (``"PSFLOW_READY ps"``) names the role whose line counts.
    """
    log_path = log_dir / f"{module}-{uuid.uuid4().hex[:6]}.log"
    role = ready_prefix[len(launch.READY_PREFIX) :].strip() or None
    with open(log_path, "wb") as log_file:  # the child keeps its own descriptor
        try:
            proc, ready = launch.start_role(
                module,
                args,
                role=role,
                env=child_env(env),
                cwd=ROOT,
                stderr=log_file,
                timeout=timeout,
            )
        except errors.OpError as e:
            raise RuntimeError(f"{e}:\n{_log_tail(log_path)}") from None
    server = ServerProcess(proc, ready.port, log_path, ready.line)
    _STARTED.append(server)
    return server


# every server start_server started, so that none outlives the test that started it
_STARTED: list[ServerProcess] = []


@pytest.fixture(autouse=True)
def _no_server_left_running(request):
    """A server a test started and did not stop is killed and reaped when the test ends (and
    the test fails, naming it): a leaked worker keeps heartbeating for the rest of the run."""
    before = len(_STARTED)
    yield
    leaked = [s for s in _STARTED[before:] if not s.outlives_test and s.proc.poll() is None]
    for server in leaked:
        server.reap()
    del _STARTED[before:]  # the earlier ones belong to module and session fixtures
    if leaked:
        names = ", ".join(" ".join(s.proc.args[2:4]) for s in leaked)
        pytest.fail(f"{request.node.nodeid} left {len(leaked)} server(s) running: {names}")


@contextlib.contextmanager
def _ps_factory(log_dir: pathlib.Path, outlives_test: bool = False):
    started: list[ServerProcess] = []

    def start(*args: str, timeout: float = 60.0, env: dict[str, str] | None = None):
        # a port below the ephemeral range (free_port_range), not port 0: a test that
        # restarts a PS on its old port must find it free, not taken meanwhile by the
        # local end of an outgoing connection of a test running beside it
        port = [] if "--port" in args else ["--port", str(free_port_range(1))]
        server = start_server(
            "ps_server",
            [*port, *args],
            "PSFLOW_READY ps",
            log_dir=log_dir,
            timeout=timeout,
            env=env,
        )
        server.outlives_test = outlives_test
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.reap()


@pytest.fixture(autouse=True)
def _no_global_seed_left_behind():
    """Each test starts and ends without a global seed: ``pf.random.set_seed(s)`` in one test
    must not make the next one's unseeded ops (``Dataset.shuffle`` without a seed, initializers)
    replayable, or a test's outcome would depend on which tests ran before it."""
    from psflow import random as pf_random

    pf_random.set_seed(None)
    try:
        yield
    finally:
        pf_random.set_seed(None)


def pytest_sessionfinish(session):
    """Tests kill servers with SIGKILL; remove the shared-memory segments they leave.

    Only once every test has run: under pytest-xdist a worker that finishes early
    would otherwise remove a dead process's segment that a test still running in
    another worker is about to look at (``test_shm``'s stale-segment test).
    """
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller cleans up
        return
    from psflow.transport import shm

    shm.remove_stale()


@pytest.fixture
def start_ps(tmp_path):
    """Factory: ``start_ps("--grace", "5")`` -> a ready :class:`ServerProcess`, reaped after."""
    with _ps_factory(tmp_path) as start:
        yield start


@pytest.fixture(scope="module")
def start_ps_module(tmp_path_factory):
    """Like ``start_ps``, but the processes live until the module's tests are done."""
    with _ps_factory(tmp_path_factory.mktemp("ps"), outlives_test=True) as start:
        yield start


@pytest.fixture(scope="session")
def ps_server():
    """One PS process shared by the session (use unique variable names)."""
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="psflow-ps-"))
    server = start_server("ps_server", ["--port", "0"], "PSFLOW_READY ps", log_dir=log_dir)
    server.outlives_test = True
    try:
        yield server
    finally:
        server.reap()


@pytest.fixture
def ps_client(ps_server):
    """A fresh client of the shared PS."""
    from psflow.transport.client import PSClient

    client = PSClient(ps_server.address, task="ps:0", timeout=30.0)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def unique():
    """A unique prefix for variable names on the shared PS."""
    return f"t{uuid.uuid4().hex[:8]}/"


@dataclasses.dataclass
class Cluster:
    """PS and worker processes on loopback, for a chief running in the test process."""

    ps: list[ServerProcess]
    workers: list[ServerProcess]
    restart: Any = None

    def restart_worker(self, index: int) -> ServerProcess:
        """Starts a new worker process in slot ``index`` (same port), after the old one died."""
        return self.restart("worker", index)

    def restart_ps(self, index: int, *args: str) -> ServerProcess:
        """Starts a new PS process in slot ``index`` (same port), after the old one died."""
        return self.restart("ps", index, *args)

    def spec(self) -> dict[str, list[str]]:
        """The cluster as TF_CONFIG's ``cluster`` dict."""
        return {"ps": [p.address for p in self.ps], "worker": [w.address for w in self.workers]}

    def resolver(self):
        """A resolver naming this process as the chief."""
        from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver

        spec = {**self.spec(), "chief": ["127.0.0.1:1"]}
        return SimpleClusterResolver(ClusterSpec(spec), task_type="chief", task_id=0)


def _start_together(
    starts: list[Callable[[], ServerProcess]], started: list[ServerProcess]
) -> list[ServerProcess]:
    """Runs ``starts`` at once and returns their servers, in order.

    Each start is a process's launch and its bounded wait for the ready line: most
    of it the child's imports, which overlap. Every server that came up is added to
    ``started`` (so the test reaps it) before the first failure is raised.
    """
    if len(starts) <= 1:
        servers = [start() for start in starts]
        started.extend(servers)
        return servers
    with concurrent.futures.ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    servers, failure = [], None
    for future in futures:
        try:
            servers.append(future.result())
        except Exception as e:  # the others still started: they are reaped too
            failure = failure or e
    started.extend(servers)
    if failure is not None:
        raise failure
    return servers


@pytest.fixture
def start_cluster(tmp_path):
    """Factory: ``start_cluster(num_ps, num_workers, worker_env=None)`` -> a ready :class:`Cluster`.

    Workers get the PS addresses on their command line; every process is reaped
    at the end of the test, and coordinators the test created are shut down. Ports
    come from :func:`free_port_range`, so ``cluster.restart(role, i)`` can bind the
    slot's port again.
    """
    started: list[ServerProcess] = []

    def start(
        num_ps: int = 1, num_workers: int = 1, worker_env: dict[str, str] | None = None
    ) -> Cluster:
        # ports below the ephemeral range, not port 0: a process restarted in its slot
        # binds its old port again, which an outgoing connection of a test running beside
        # this one could otherwise have been given meanwhile ("Address already in use")
        base = free_port_range(num_ps + num_workers)
        ps = _start_together(
            [
                functools.partial(
                    start_server,
                    "ps_server",
                    ["--port", str(base + i), "--task", f"ps:{i}"],
                    "PSFLOW_READY ps",
                    log_dir=tmp_path,
                )
                for i in range(num_ps)
            ],
            started,
        )
        addresses = ",".join(p.address for p in ps)
        workers = _start_together(
            [
                functools.partial(
                    start_server,
                    "worker",
                    [
                        "--port",
                        str(base + num_ps + i),
                        "--task",
                        f"worker:{i}",
                        "--ps",
                        addresses,
                        "--workers",
                        str(num_workers),
                    ],
                    "PSFLOW_READY worker",
                    log_dir=tmp_path,
                    env=worker_env,
                )
                for i in range(num_workers)
            ],
            started,
        )
        cluster = Cluster(ps, workers)

        def restart(role: str, index: int, *extra: str) -> ServerProcess:
            old = (cluster.ps if role == "ps" else cluster.workers)[index]
            old.reap()
            if role == "ps":
                args = ["--port", str(old.port), "--task", f"ps:{index}", *extra]
                server = start_server("ps_server", args, "PSFLOW_READY ps", log_dir=tmp_path)
                cluster.ps[index] = server
            else:
                args = [
                    "--port",
                    str(old.port),
                    "--task",
                    f"worker:{index}",
                    "--ps",
                    addresses,
                    "--workers",
                    str(num_workers),
                ]
                server = start_server(
                    "worker", args, "PSFLOW_READY worker", log_dir=tmp_path, env=worker_env
                )
                cluster.workers[index] = server
            started.append(server)
            return server

        cluster.restart = restart
        return cluster

    try:
        yield start
    finally:
        from psflow.distribute.coordinator.cluster_coordinator import shutdown_all

        shutdown_all()
        for server in started:
            server.reap()


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process; a zombie (exited, not yet reaped) counts as gone.

    Reads ``/proc`` (a process reparented to an init that does not reap stays
    a zombie, and ``os.kill(pid, 0)`` would still succeed on it).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    state = stat.rpartition(b")")[2].split()[:1]
    return state not in ([b"Z"], [b"X"])


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Sends ``proc`` SIGSTOP and waits (bounded) until every one of its threads has stopped.

    The signal stops a thread when the kernel next handles its signals: a thread running
    on another core right then (a PS answering the call before) may still read and answer
    one more request. Where ``/proc`` is missing the signal alone is sent.
    """
    proc.send_signal(signal.SIGSTOP)
    task_dir = f"/proc/{proc.pid}/task"
    if not os.path.isdir(task_dir):
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(task_dir):
            try:
                with open(f"{task_dir}/{tid}/stat", "rb") as f:
                    states.append(f.read().rpartition(b")")[2].split()[:1])
            except OSError:  # a thread that just ended
                continue
        if states and all(state in ([b"T"], [b"t"]) for state in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"pid {proc.pid} did not stop within {timeout} s of SIGSTOP")


def wait_gone(pids, timeout: float = 15.0) -> list[int]:
    """Waits (bounded) until no pid in ``pids`` is alive; returns those still alive."""
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if pid_alive(p)]
    return alive


def free_port_range(count: int, host: str = "127.0.0.1") -> int:
    """A base port with ``count`` consecutive ports free on ``host`` right now.

    Picked below the system's ephemeral range (``chief.local.ephemeral_ports``),
    where no port-0 server and no outgoing connection of a test running beside
    this one (pytest-xdist) can take it before the test uses it; each xdist
    worker picks from a share of its own, and never the same port twice.  Where
    that range leaves no room, the system picks a port (as before).
    """
    from chief.local import _LOWEST_PICKED, ephemeral_ports, pick_ports

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    workers = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    share = (ephemeral_ports()[0] - _LOWEST_PICKED) // workers
    first = _LOWEST_PICKED + index * share
    candidates = [p for p in range(first, first + share - count + 1) if p not in _GIVEN]
    random.SystemRandom().shuffle(candidates)  # not a sequence a seeded test could replay
    for base in candidates[:200]:  # bounded: most are free
        try:
            pick_ports(count, host, base)
        except errors.UnavailableError:
            continue
        _GIVEN.update(range(base, base + count))
        return base
    for _ in range(20):  # no room below the ephemeral range: let the system pick
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        with contextlib.suppress(errors.UnavailableError):
            if base + count <= 65535:
                pick_ports(count, host, base)
                return base
    raise AssertionError(f"no {count} consecutive free ports on {host}")


# the ports free_port_range gave in this process: tests ask for several before starting any
_GIVEN: set[int] = set()


def pick_free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (see :func:`free_port_range`)."""
    return free_port_range(1)
