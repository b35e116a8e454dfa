"""The data plane's door against attackers: a real PS process with a token, and one with TLS.

Each phase attacks the data port as an outsider (no token, a wrong one,
malformed and oversized HELLOs, silent sockets by the hundred, bytes dripped
before the HELLO) or as a client with the token (a frame dripped after it, a
sync push whose client leaves mid-call, idle connections at the limit), and
checks what the issue asks: the PS's memory stays within 32 MB of its start,
its descriptors and threads come back to their baseline within seconds of the
attackers closing, a new legitimate client is served over the data plane
promptly during the attack, health stays SERVING and a tracked variable keeps
its bits.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from psflow.observability.metrics import parse_exposition
from psflow.proto import ps_pb2
from psflow.security.config import SecurityConfig
from psflow.transport.client import PSClient
from psflow.transport.dataplane import DataPlaneClient, auth, frames
from tests.conftest import ServerProcess
from tests.test_auth_tls import make_pki, tls

pytestmark = pytest.mark.slow

TOKEN = "door-test-token-0123456789abcdef"
GOOD = SecurityConfig(token=TOKEN)
CONTROL = np.arange(6, dtype=np.float32) / 3
HELLO_TIMEOUT, IO_TIMEOUT, MAX_CONNECTIONS = 2.0, 3.0, 32
PROMPT = 3.0  # seconds a legitimate client may take to be served on a loaded 2-core host
MB = 1 << 20


def _flags(token_file) -> list[str]:
    return [
        "--auth-token-file", str(token_file), "--shm", "off", "--metrics-port", "auto",
        "--data-hello-timeout", str(HELLO_TIMEOUT), "--data-io-timeout", str(IO_TIMEOUT),
        "--data-max-connections", str(MAX_CONNECTIONS), "--max-sync-contributors", "4",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def ps(start_ps_module, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("door") / "token"
    token_file.write_text(TOKEN)
    server = start_ps_module(*_flags(token_file))
    with PSClient(server.address, security=GOOD, timeout=30) as client:
        client.create_variable("control", CONTROL, optimizer={"name": "sgd"})
    _legit_pull(server)  # warm: the first call's imports and buffers are not an attack's cost
    return server


def _data_port(server: ServerProcess) -> int:
    return int(server.ready_line.split("data_port=")[1].split()[0])


def _legit_pull(server: ServerProcess, security: SecurityConfig = GOOD) -> float:
    """A new client pulls ``control`` over the data plane; returns the seconds it took."""
    start = time.monotonic()
    request = ps_pb2.PullRequest(items=[ps_pb2.PullItem(name="control")])
    with DataPlaneClient(f"127.0.0.1:{_data_port(server)}", security, task="ps:0") as client:
        _, payload = client.call("Pull", request.SerializeToString(), timeout=20)
    assert bytes(payload) == CONTROL.tobytes()
    return time.monotonic() - start


def _proc(pid: int) -> tuple[int, int, int]:
    """RSS bytes, open descriptors and threads of process ``pid``."""
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f.read().splitlines())
    rss = int(status["VmRSS"].split()[0]) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd")), int(status["Threads"])


def _settles(server: ServerProcess, fds: int, threads: int, timeout: float = 15.0) -> None:
    """Waits (bounded) for the PS's descriptors and threads to be back at most at a baseline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, now_fds, now_threads = _proc(server.proc.pid)
        if now_fds <= fds and now_threads <= threads:
            return
        time.sleep(0.1)
    raise AssertionError(f"fds {_proc(server.proc.pid)[1]} > {fds} or threads > {threads}")


@contextlib.contextmanager
def _attack(server: ServerProcess, max_growth: int = 32 * MB) -> Iterator[None]:
    """Baseline before, and after: memory, descriptors, threads, health, the control."""
    rss, fds, threads = _proc(server.proc.pid)
    yield
    _settles(server, fds, threads)
    assert _proc(server.proc.pid)[0] - rss < max_growth
    _unchanged(server)


def _unchanged(server: ServerProcess, security: SecurityConfig = GOOD) -> None:
    with PSClient(server.address, security=security, timeout=30, data_plane=False) as client:
        assert client.health() == "SERVING"
        assert client.pull("control").tobytes() == CONTROL.tobytes()
    assert "Traceback" not in server.log_tail(400)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _hello(token: str) -> bytes:
    header = auth.hello(SecurityConfig(token=token or None))
    return frames.pack(frames.Kind.HELLO, header_len=len(header)) + header


def _authenticated(port: int) -> socket.socket:
    sock = _connect(port)
    sock.sendall(_hello(TOKEN))
    head = frames.unpack(_recv_exact(sock, frames.FIXED.size), max_header=0, max_payload=0)
    assert head.kind is frames.Kind.WELCOME
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError("closed")
        out += got
    return out


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``sock`` (reading and dropping what it sends), or None."""
    start = time.monotonic()
    deadline = start + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return time.monotonic() - start
        except TimeoutError:
            return None
        except OSError:  # reset
            return time.monotonic() - start
    return None


def _any_closed_within(socks: list[socket.socket], seconds: float) -> bool:
    """Whether the server closed any of ``socks`` within ``seconds`` (dropping what it sends).

    One bounded wait on all of them at once: a wait per socket would cost ``seconds``
    for every socket the server rightly keeps open.
    """
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select(socks, [], [], left)
        for sock in readable:
            try:
                if not sock.recv(65536, socket.MSG_DONTWAIT):
                    return True
            except BlockingIOError:
                continue
            except OSError:  # reset
                return True
    return False


def _drip(sock: socket.socket, data: bytes, every: float, stop: threading.Event) -> None:
    """Sends ``data`` one byte every ``every`` seconds until done, closed or stopped."""
    for i in range(len(data)):
        if stop.wait(every):
            return
        try:
            sock.send(data[i : i + 1])
        except OSError:
            return


def _scrape(server: ServerProcess) -> dict:
    fields = dict(f.split("=", 1) for f in server.ready_line.split() if "=" in f)
    url = f"http://127.0.0.1:{fields['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return parse_exposition(reply.read().decode())


def _counter(samples: dict, name: str, **labels: str) -> float:
    return sum(
        v
        for (n, pairs), v in samples.items()
        if n == name and all(dict(pairs).get(k) == want for k, want in labels.items())
    )


# -- before authentication ---------------------------------------------------------------
def test_a_hello_announcing_a_huge_header_is_closed_before_anything_is_allocated(ps):
    port = _data_port(ps)
    with _attack(ps, max_growth=8 * MB):
        socks = []
        for _ in range(64):  # 64 x 16 MiB would be 1 GiB, read before the token check
            sock = _connect(port)
            sock.sendall(frames.pack(frames.Kind.HELLO, header_len=frames.MAX_HEADER_BYTES))
            socks.append(sock)
        assert all(_closed_within(s, 5) is not None for s in socks)
        assert _legit_pull(ps) < PROMPT
        for s in socks:
            s.close()


@pytest.mark.parametrize(
    "first",
    [
        _hello("wrong-token-0123456789abcdef"),
        _hello(""),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 16,
        frames.pack(frames.Kind.REQUEST, method=frames.method_id("Push"), header_len=8) + b"x" * 8,
        frames.pack(frames.Kind.HELLO, header_len=4, payload_len=1 << 30) + b"abcd",
    ],
    ids=["wrong_token", "no_token", "http", "request_first", "hello_with_payload"],
)
def test_refused_peers_are_closed_at_once_and_logged_once_per_interval(ps, first):
    port = _data_port(ps)
    with _attack(ps):
        for _ in range(50):
            sock = _connect(port)
            sock.sendall(first)
            assert _closed_within(sock, 5) is not None
            sock.close()
        assert _legit_pull(ps) < PROMPT
    # 50 refusals in a few seconds: a handful of lines, not one each
    lines = [line for line in ps.log_tail(2000).splitlines() if "data plane refused" in line]
    assert len(lines) < 50


def test_hundreds_of_silent_sockets_never_lock_a_client_out(ps):
    port = _data_port(ps)
    with _attack(ps):
        socks = [_connect(port) for _ in range(300)]  # more than every budget together
        times = [_legit_pull(ps) for _ in range(3)]
        assert max(times) < PROMPT, times
        # each is closed by its deadline (or earlier, to make room), not held
        assert all(_closed_within(s, HELLO_TIMEOUT + 5) is not None for s in socks)
        for s in socks:
            s.close()


def test_a_slow_loris_before_the_hello_is_closed_at_the_hello_deadline(ps):
    port = _data_port(ps)
    with _attack(ps):
        stop = threading.Event()
        socks = [_connect(port) for _ in range(8)]
        drips = [
            threading.Thread(target=_drip, args=(s, _hello(TOKEN), 0.2, stop), daemon=True)
            for s in socks
        ]
        for t in drips:
            t.start()
        try:
            assert _legit_pull(ps) < PROMPT
            closed = [_closed_within(s, HELLO_TIMEOUT + 4) for s in socks]
            # a byte every 0.2 s would need 10 s for the whole HELLO: cut at the deadline
            assert all(c is not None for c in closed), closed
        finally:
            stop.set()
            for t in drips:
                t.join(5)
            for s in socks:
                s.close()


# -- after authentication ----------------------------------------------------------------
def test_a_frame_dripped_after_the_hello_is_closed_at_its_deadline(ps):
    port = _data_port(ps)
    with _attack(ps):
        stop = threading.Event()
        sock = _authenticated(port)
        request = frames.pack(frames.Kind.REQUEST, method=frames.method_id("Pull"), header_len=64)
        drip = threading.Thread(target=_drip, args=(sock, request, 0.2, stop), daemon=True)
        drip.start()
        try:
            # 36 bytes at 0.2 s each would take 7 s and the 64 header bytes never come
            assert _closed_within(sock, IO_TIMEOUT + 4) is not None
            assert _legit_pull(ps) < PROMPT
        finally:
            stop.set()
            drip.join(5)
            sock.close()


def test_idle_authenticated_connections_make_room_for_a_new_client(ps):
    port = _data_port(ps)
    with _attack(ps):
        held = [_authenticated(port) for _ in range(MAX_CONNECTIONS)]
        time.sleep(2.5)  # idle long enough to give way
        assert _legit_pull(ps) < PROMPT
        assert _any_closed_within(held, 0.5)
        for s in held:
            s.close()


def test_a_sync_push_whose_client_left_stops_waiting(ps):
    port = _data_port(ps)
    header = ps_pb2.PushHeader(items=[ps_pb2.PushItem(name="control", base_version=-1)])
    header.id.client_id, header.id.sequence = "door-sync", 1
    header.items[0].values.dtype, header.items[0].values.shape[:] = 2, [6]
    header.step, header.num_required, header.wait_applied = 1, 2, True  # never completes
    raw = header.SerializeToString()
    payload = np.zeros(6, np.float32).tobytes()
    before = _counter(_scrape(ps), "psflow_ps_rpcs_total", method="Push", code="CANCELLED")
    sock = _authenticated(port)
    sock.sendall(
        frames.pack(
            frames.Kind.REQUEST,
            method=frames.method_id("Push"),
            call_id=1,
            header_len=len(raw),
            timeout=frames.timeout_ms(120.0),
            payload_len=len(payload),
        )
        + raw
        + payload
    )
    time.sleep(0.5)  # the push waits for a second contribution
    sock.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        samples = _scrape(ps)
        if _counter(samples, "psflow_ps_rpcs_total", method="Push", code="CANCELLED") > before:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the push still waits for a client that left")
    assert _legit_pull(ps) < PROMPT
    _unchanged(ps)


def test_table_calls_on_the_data_plane_pass_the_same_gate_and_metrics(ps):
    from psflow.ps.dynamic_table import TableConfig
    from psflow.transport.embedding_client import EmbeddingClient

    with EmbeddingClient([ps.address], security=GOOD, timeout=30) as client:
        client.create_table(TableConfig("door_t", 4, optimizer={"name": "sgd"}))
        ids = np.arange(100, dtype=np.int64)
        for _ in range(3):
            client.push("door_t", ids, np.ones((100, 4), np.float32))
            client.lookup("door_t", ids)
        assert client.data_plane_addresses[0] is not None
    samples = _scrape(ps)
    for method in ("Lookup", "PushGradients"):
        name = f"psflow.v1.EmbeddingService/{method}"
        assert _counter(samples, "psflow_ps_rpcs_total", method=name, code="OK") >= 3


def test_a_future_base_version_is_refused_under_a_staleness_bound(ps):
    with PSClient(ps.address, security=GOOD, timeout=30, data_plane=False) as client:
        version = client.stats()["pushes_applied"]
    header = ps_pb2.PushHeader(items=[ps_pb2.PushItem(name="control", base_version=10**9)])
    header.id.client_id, header.id.sequence = "door-future", 1
    header.items[0].values.dtype, header.items[0].values.shape[:] = 2, [6]
    header.max_staleness = 4
    raw = header.SerializeToString()
    with DataPlaneClient(f"127.0.0.1:{_data_port(ps)}", GOOD, task="ps:0") as client:
        from psflow.errors import AbortedError

        with pytest.raises(AbortedError, match="claims base version 1000000000"):
            client.call("Push", raw, [np.ones(6, np.float32)], timeout=10)
    _unchanged(ps)
    with PSClient(ps.address, security=GOOD, timeout=30, data_plane=False) as client:
        assert client.stats()["pushes_applied"] == version


# -- TLS ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_ps(start_ps_module, tmp_path_factory):
    pki = make_pki(tmp_path_factory.mktemp("door-pki"))
    flags = ["--tls-cert", pki["node.pem"], "--tls-key", pki["node.key"], "--tls-ca", pki["ca.pem"]]
    flags += ["--shm", "off", "--data-hello-timeout", str(HELLO_TIMEOUT)]
    server = start_ps_module(*flags)
    security = tls(pki)
    with PSClient(server.address, security=security, timeout=30) as client:
        client.create_variable("control", CONTROL, optimizer={"name": "sgd"})
    _legit_pull(server, security)
    return server, security


def test_tls_silent_and_dripping_peers_are_closed_and_clients_served(tls_ps):
    server, security = tls_ps
    port = _data_port(server)
    rss, fds, threads = _proc(server.proc.pid)
    stop = threading.Event()
    silent = [_connect(port) for _ in range(200)]
    dripping = [_connect(port) for _ in range(4)]
    client_hello = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64
    drips: list[threading.Thread] = [
        threading.Thread(target=_drip, args=(s, client_hello, 0.2, stop), daemon=True)
        for s in dripping
    ]
    for t in drips:
        t.start()
    try:
        assert _legit_pull(server, security) < PROMPT
        closed: Callable[[socket.socket], float | None] = lambda s: _closed_within(  # noqa: E731
            s, HELLO_TIMEOUT + 5
        )
        assert all(closed(s) is not None for s in dripping)
        assert all(closed(s) is not None for s in silent)
    finally:
        stop.set()
        for t in drips:
            t.join(5)
        for s in silent + dripping:
            s.close()
    _settles(server, fds, threads)
    assert _proc(server.proc.pid)[0] - rss < 32 * MB
    _unchanged(server, security)
