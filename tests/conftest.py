"""Process fixtures: real servers on 127.0.0.1, every wait bounded, every child reaped.

``start_ps(*args)`` starts ``python -m ps_server --port 0 *args`` and returns a
:class:`ServerProcess` once its ``PSFLOW_READY`` line gave the port; every
process a test started is killed and reaped when the test ends.  ``ps_server``
is one shared PS process for the whole session (tests use unique variable
names), ``ps_client`` a fresh client to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for child processes: this checkout first on PYTHONPATH."""
    env = dict(os.environ)
    paths = [str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@dataclasses.dataclass
class ServerProcess:
    """A started server: its address, process and log file."""

    proc: subprocess.Popen
    port: int
    log_path: pathlib.Path
    ready_line: str

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>``."""
        return f"127.0.0.1:{self.port}"

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines the server logged."""
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

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
    """Starts ``python -m module args`` and waits (bounded) for its ready line."""
    log_path = log_dir / f"{module}-{uuid.uuid4().hex[:6]}.log"
    log_file = open(log_path, "wb")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=log_file,
        env=child_env(env),
        cwd=ROOT,
    )
    log_file.close()
    server = ServerProcess(proc, 0, log_path, "")
    deadline = time.monotonic() + timeout
    buffer = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None:
                server.reap()
                raise RuntimeError(
                    f"{module} {args} not ready (exit {proc.returncode}):\n{server.log_tail()}"
                )
            if not sel.select(min(left, 0.5)):
                continue
            chunk = os.read(proc.stdout.fileno(), 4096)
            buffer += chunk
            for line in buffer.decode(errors="replace").splitlines():
                if line.startswith(ready_prefix):
                    fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
                    server.port = int(fields["port"])
                    server.ready_line = line
                    return server


@contextlib.contextmanager
def _ps_factory(log_dir: pathlib.Path):
    started: list[ServerProcess] = []

    def start(*args: str, timeout: float = 60.0, env: dict[str, str] | None = None):
        server = start_server(
            "ps_server",
            ["--port", "0", *args],
            "PSFLOW_READY ps",
            log_dir=log_dir,
            timeout=timeout,
            env=env,
        )
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.reap()


@pytest.fixture
def start_ps(tmp_path):
    """Factory: ``start_ps("--grace", "5")`` -> a ready :class:`ServerProcess`, reaped after."""
    with _ps_factory(tmp_path) as start:
        yield start


@pytest.fixture(scope="module")
def start_ps_module(tmp_path_factory):
    """Like ``start_ps``, but the processes live until the module's tests are done."""
    with _ps_factory(tmp_path_factory.mktemp("ps")) as start:
        yield start


@pytest.fixture(scope="session")
def ps_server():
    """One PS process shared by the session (use unique variable names)."""
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="psflow-ps-"))
    server = start_server("ps_server", ["--port", "0"], "PSFLOW_READY ps", log_dir=log_dir)
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
