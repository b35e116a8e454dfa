"""One request path for every data-plane connection (:mod:`psflow.transport.dataplane.loop`).

Plain and TLS connections are read by the same event loop and dispatched by
the same code, so a raw peer breaking the rules the same way over either gets
the same answer: UNIMPLEMENTED for an unknown method, DEADLINE_EXCEEDED for a
call whose deadline passed while its frame trickled in, a closed connection
(counted ``malformed_frame``) for an oversize frame.  And the loop's extra
threads, started for calls that block, retire once idle.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import pytest

from psflow.errors import UnimplementedError
from psflow.proto import dataplane_pb2
from psflow.security.config import SecurityConfig
from psflow.transport.dataplane import (
    DataPlaneClient,
    DataPlaneServer,
    Reply,
    Request,
    auth,
    frames,
)
from tests.test_auth_tls import make_pki, tls

TOKEN = "one-path-token-0123456789abcdef"
MAX_PAYLOAD = 1 << 20


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _security(pki, kind: str) -> SecurityConfig:
    return tls(pki, token=TOKEN) if kind == "tls" else SecurityConfig(token=TOKEN)


def _echo(request: Request) -> Reply:
    return Reply(request.header[::-1], [bytes(request.payload)])


@contextlib.contextmanager
def _served(security: SecurityConfig, **kwargs) -> Iterator[tuple[DataPlaneServer, list[str]]]:
    rejected: list[str] = []
    handlers = kwargs.pop("handlers", {"Echo": _echo})
    server = DataPlaneServer(
        "127.0.0.1",
        0,
        security,
        handlers,
        max_payload=MAX_PAYLOAD,
        on_reject=rejected.append,
        **kwargs,
    ).start()
    try:
        yield server, rejected
    finally:
        server.stop()


def _welcomed(server: DataPlaneServer, security: SecurityConfig) -> socket.socket:
    """A raw socket (TLS-wrapped when the server wants TLS) past its HELLO."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    if security.tls is not None:
        sock = auth.client_context(security.tls).wrap_socket(sock, server_hostname="127.0.0.1")
    body = auth.hello(security)
    sock.sendall(frames.pack(frames.Kind.HELLO, header_len=len(body)) + body)
    head = frames.unpack(_exactly(sock, frames.FIXED.size), max_header=0, max_payload=0)
    assert head.kind is frames.Kind.WELCOME
    return sock


def _exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def _answer(sock: socket.socket) -> tuple[frames.FrameHead, bytes]:
    head = frames.unpack(
        _exactly(sock, frames.FIXED.size), max_header=1 << 20, max_payload=MAX_PAYLOAD
    )
    header = _exactly(sock, head.header_len)
    _exactly(sock, head.payload_len)
    return head, header


def _status(header: bytes) -> tuple[str, str]:
    status = dataplane_pb2.DataPlaneStatus.FromString(header)
    return status.code, status.message


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(10)
    try:
        return sock.recv(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True


def _waits(wait: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``thread``: the server sees no epoll and serves each connection on its own
    thread, through the same request path."""
    if wait == "thread":
        monkeypatch.delattr(select, "epoll", raising=False)


@pytest.mark.parametrize("wait", ["epoll", "thread"])
@pytest.mark.parametrize("kind", ["plain", "tls"])
def test_unknown_method_is_unimplemented_over_either_connection(pki, kind, wait, monkeypatch):
    _waits(wait, monkeypatch)
    security = _security(pki, kind)
    with _served(security) as (server, _):
        assert (server.loop_threads == 0) == (wait == "thread")
        sock = _welcomed(server, security)
        try:
            sock.sendall(frames.pack(frames.Kind.REQUEST, method=12345, call_id=3))
            head, header = _answer(sock)
            assert (head.kind, head.call_id) == (frames.Kind.ERROR, 3)
            assert _status(header) == ("UNIMPLEMENTED", "data plane: no method with id 12345")
            # the connection goes on: a good call after it is answered
            sock.sendall(
                frames.pack(
                    frames.Kind.REQUEST, method=frames.method_id("Echo"), call_id=4, header_len=2
                )
                + b"ab"
            )
            head, header = _answer(sock)
            assert (head.kind, head.call_id, header) == (frames.Kind.REPLY, 4, b"ba")
        finally:
            sock.close()
        with (
            DataPlaneClient(f"127.0.0.1:{server.port}", security) as client,
            pytest.raises(UnimplementedError, match="no method with id"),
        ):
            client.call("Nope", b"", timeout=10)


@pytest.mark.parametrize("wait", ["epoll", "thread"])
@pytest.mark.parametrize("kind", ["plain", "tls"])
def test_a_deadline_that_passes_while_the_frame_trickles_in_is_deadline_exceeded(
    pki, kind, wait, monkeypatch
):
    _waits(wait, monkeypatch)
    security = _security(pki, kind)
    ran = threading.Event()

    def echo(request: Request) -> Reply:
        ran.set()
        return _echo(request)

    with _served(security, handlers={"Echo": echo}) as (server, _):
        assert (server.loop_threads == 0) == (wait == "thread")
        sock = _welcomed(server, security)
        try:
            payload = b"x" * 100
            fixed = frames.pack(
                frames.Kind.REQUEST,
                method=frames.method_id("Echo"),
                call_id=9,
                timeout=frames.timeout_ms(0.1),
                payload_len=len(payload),
            )
            sock.sendall(fixed + payload[:10])
            time.sleep(0.4)  # the client's 100 ms run out before the rest arrives
            sock.sendall(payload[10:])
            head, header = _answer(sock)
            assert (head.kind, head.call_id) == (frames.Kind.ERROR, 9)
            code, message = _status(header)
            assert code == "DEADLINE_EXCEEDED"
            assert "deadline of 100 ms passed before it ran" in message
            assert not ran.is_set()  # nobody waits for its answer: the handler never ran
        finally:
            sock.close()


@pytest.mark.parametrize("kind", ["plain", "tls"])
def test_an_oversize_frame_closes_only_its_connection_over_either(pki, kind):
    security = _security(pki, kind)
    with _served(security) as (server, rejected):
        sock = _welcomed(server, security)
        try:
            sock.sendall(
                frames.pack(
                    frames.Kind.REQUEST,
                    method=frames.method_id("Echo"),
                    payload_len=MAX_PAYLOAD + 1,
                )
            )
            assert _closed(sock)
        finally:
            sock.close()
        assert rejected == ["malformed_frame"]
        with DataPlaneClient(f"127.0.0.1:{server.port}", security) as client:
            assert client.call("Echo", b"ok", timeout=10)[0] == b"ko"


def _wait(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.mark.skipif(not hasattr(__import__("select"), "epoll"), reason="the event loop needs epoll")
def test_threads_started_for_blocked_calls_retire_once_idle():
    release, entered = threading.Event(), threading.Semaphore(0)

    def block(request: Request) -> Reply:
        entered.release()
        release.wait(20)
        return Reply(b"released")

    security = SecurityConfig(token=TOKEN)
    handlers = {"Echo": _echo, "Block": block}
    with _served(security, handlers=handlers, thread_idle_timeout=0.5) as (server, _):
        assert server.loop_threads == 2
        for round_ in range(2):  # bounded both ways, every time calls block
            clients = [
                DataPlaneClient(f"127.0.0.1:{server.port}", security, task="ps:0") for _ in range(3)
            ]
            results: list = []
            callers = [
                threading.Thread(
                    target=lambda c=c, out=results: out.append(c.call("Block", b"", timeout=20))
                )
                for c in clients
            ]
            try:
                for t in callers:
                    t.start()
                for _ in callers:  # every blocked call holds a thread of the loop
                    assert entered.acquire(timeout=15), round_
                assert _wait(lambda: server.loop_threads >= 4)
                assert server.loop_threads <= 5  # one per blocked call, plus one waiting
            finally:
                release.set()
                for t in callers:
                    t.join(20)
                for c in clients:
                    c.close()
            assert [r[0] for r in results] == [b"released"] * 3
            release.clear()
            # idle for longer than thread_idle_timeout: back to the two it started with
            assert _wait(lambda: server.loop_threads == 2), server.loop_threads
            with DataPlaneClient(f"127.0.0.1:{server.port}", security) as client:
                assert client.call("Echo", b"12", timeout=10)[0] == b"21"
