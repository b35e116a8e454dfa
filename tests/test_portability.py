"""The default path runs where Python runs: no ``epoll``, no shared memory, many open files.

A platform without ``select.epoll`` (macOS, the BSDs, Windows) is simulated by
deleting it: in this process for the data-plane server, and through a
``sitecustomize`` on the children's ``PYTHONPATH`` for a whole local cluster
(which also reports a non-x86 machine, so the shared-memory path must turn
itself off as on an ARM Mac).  A process with more than 1024 open descriptors
(``select``'s ``FD_SETSIZE``) must still reuse its data-plane connections.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import resource
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from psflow.security.config import SecurityConfig
from psflow.transport import shm
from psflow.transport.dataplane import DataPlaneClient, DataPlaneServer, Reply, Request
from tests.conftest import ROOT, child_env

TOKEN = "portability-test-token-0123456789"


def _peer_echo(request: Request) -> Reply:
    """Answers with the caller's address (which tells one connection from another)."""
    return Reply(request.peer.encode(), [np.frombuffer(request.payload, np.uint8).copy()])


@contextlib.contextmanager
def _served(**kwargs) -> Iterator[DataPlaneServer]:
    server = DataPlaneServer(
        "127.0.0.1", 0, SecurityConfig(token=TOKEN), {"Echo": _peer_echo}, **kwargs
    ).start()
    try:
        yield server
    finally:
        server.stop()


def _client(server: DataPlaneServer) -> DataPlaneClient:
    return DataPlaneClient(f"127.0.0.1:{server.port}", SecurityConfig(token=TOKEN), task="ps:0")


def test_server_without_epoll_serves_each_connection_on_its_own_thread(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delattr(select, "epoll")
    caplog.set_level(logging.INFO, logger="psflow.transport.dataplane.server")
    with _served() as server:
        assert [r for r in caplog.records if "no epoll on this platform" in r.getMessage()]
        errors: list[BaseException] = []

        def run(k: int) -> None:
            try:
                with _client(server) as client:
                    for i in range(20):
                        data = np.full(1000 + k, i, np.uint8)
                        _, payload = client.call("Echo", b"", [data], timeout=20)
                        assert np.array_equal(np.frombuffer(payload, np.uint8), data)
            except BaseException as e:  # carried to the main thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and not any(t.is_alive() for t in threads)
        assert server.loop_threads == 0  # no event loop was started


def test_server_without_epoll_still_closes_an_idle_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(select, "epoll")
    with _served(idle_timeout=0.5) as server, _client(server) as client:
        client.call("Echo", b"", [np.ones(8, np.uint8)], timeout=10)
        deadline = time.monotonic() + 10
        while server.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.connections == 0
        time.sleep(1.2)  # past the client's "fresh" window: it asks the socket before reuse
        # and the client notices, dials again and is served
        header, _ = client.call("Echo", b"", [np.ones(8, np.uint8)], timeout=10)
        assert header.startswith(b"ipv4:127.0.0.1:")


@pytest.fixture
def many_descriptors() -> Iterator[int]:
    """Holds open enough descriptors that the next socket's number is above 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1200
    if hard != resource.RLIM_INFINITY and hard < want + 64:
        pytest.skip(f"the hard limit on open files is {hard}")
    if soft != resource.RLIM_INFINITY and soft < want + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want + 64, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(want)]
    try:
        probe = socket.socket()
        number = probe.fileno()
        probe.close()
        assert number >= 1024, number
        yield number
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_client_with_over_1024_descriptors_reuses_its_connection(many_descriptors: int) -> None:
    with _served() as server, _client(server) as client:
        first, _ = client.call("Echo", b"", [np.ones(8, np.uint8)], timeout=10)
        time.sleep(1.2)  # past the client's "fresh" window: it now asks the socket
        second, _ = client.call("Echo", b"", [np.ones(8, np.uint8)], timeout=10)
        assert second == first  # one connection, same client port
        assert server.connections == 1


def test_client_with_over_1024_descriptors_sees_a_connection_the_server_closed(
    many_descriptors: int,
) -> None:
    with _served(idle_timeout=0.5) as server, _client(server) as client:
        first, _ = client.call("Echo", b"", [np.ones(8, np.uint8)], timeout=10)
        deadline = time.monotonic() + 10
        while server.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.2)
        second, payload = client.call("Echo", b"", [np.arange(8, dtype=np.uint8)], timeout=10)
        assert second != first  # the closed one was dropped, not written into
        np.testing.assert_array_equal(np.frombuffer(payload, np.uint8), np.arange(8))


def test_shared_memory_turns_itself_off_on_another_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shm.platform, "machine", lambda: "arm64")
    assert shm.enabled() is False


_NOT_LINUX = """\
# A platform like macOS on ARM, for this test's children: no epoll, not x86-64.
import platform
import select

del select.epoll
platform.machine = lambda: "arm64"
"""


@pytest.mark.slow
def test_local_cluster_trains_without_epoll_or_shared_memory(tmp_path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(_NOT_LINUX))
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    env.pop("TF_CONFIG", None)
    argv = [sys.executable, "-m", "psflow", "local", "--ps", "2", "--workers", "1"]
    argv += [str(ROOT / "examples" / "digits_ps.py"), "--epochs", "3", "--min-accuracy", "0.85"]
    result = subprocess.run(
        argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    # both PS tasks served their data plane without epoll and set up no shared memory ...
    assert len(re.findall(r"\[ps:\d\].*no epoll on this platform", out)) == 2, out[-4000:]
    assert len(re.findall(r"\[ps:\d\].*shared memory is off: it needs x86-64", out)) == 2
    # ... and so did the worker, for the chief's closures
    assert re.search(r"\[worker:0\].*no epoll on this platform", out), out[-4000:]
    # ... and the clients used the data plane (no fall-back to gRPC)
    assert "which cannot be used" not in out, out[-4000:]
    assert "stopped: ps:0=0, ps:1=0, worker:0=0, chief=0" in out
