"""The raw TCP data plane's core: frames, server, client, auth, against real sockets.

A :class:`DataPlaneServer` runs on 127.0.0.1 port 0 in this process (its own
threads, real sockets); the clients are real :class:`DataPlaneClient` objects
or raw sockets writing hostile bytes.  Every error is compared with what the
gRPC path raises for the same failure.
"""

from __future__ import annotations

import socket
import threading
import time
import types

import numpy as np
import pytest

from ps_server.edge import Edge
from psflow.errors import (
    AbortedError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    MovedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from psflow.security.config import SecurityConfig
from psflow.transport.dataplane import (
    DataPlaneClient,
    DataPlaneServer,
    Reply,
    Request,
    Route,
    auth,
    frames,
)
from tests.test_auth_tls import make_pki, tls

TOKEN = "dataplane-test-token-0123456789"


class Recorder:
    """Handlers that echo, fail or stall, counting the calls that reached them."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()
        self.release = threading.Event()

    def _count(self) -> None:
        with self.lock:
            self.calls += 1

    def echo(self, request: Request) -> Reply:
        self._count()
        payload = np.frombuffer(request.payload, np.uint8).copy()
        return Reply(
            request.header[::-1], [payload[: len(payload) // 2], payload[len(payload) // 2 :]]
        )

    def fail(self, request: Request) -> Reply:
        self._count()
        raise AbortedError(f"refused {request.header.decode()!r}")

    def moved(self, request: Request) -> Reply:
        self._count()
        raise MovedError("w moved", key="w", owner=3, address="127.0.0.1:9", version=7)

    def stall(self, request: Request) -> Reply:
        self._count()
        self.release.wait(10)
        return Reply(b"late")

    def deadline(self, request: Request) -> Reply:
        return Reply(repr(round(request.time_remaining() or -1.0)).encode())

    def respond(self, request: Request) -> None:  # sends its reply itself
        payload = np.frombuffer(request.payload, np.uint8).copy()
        return request.respond(header=request.header + b"!", buffers=[payload])

    def handlers(self) -> dict:
        sum_route = Route(  # decode, apply, finish; a payload not of int64s refused typed
            _int64s,
            np.sum,
            lambda decoded, total: Reply(str(int(total)).encode()),
        )
        return {
            "Respond": self.respond,
            "Sum": sum_route,
            "Echo": self.echo,
            "Fail": self.fail,
            "Moved": self.moved,
            "Stall": self.stall,
            "Deadline": self.deadline,
        }


def _int64s(request: Request) -> types.SimpleNamespace:
    if len(request.payload) % 8:
        raise InvalidArgumentError(f"{len(request.payload)} bytes are no int64s")
    return types.SimpleNamespace(args=(np.frombuffer(request.payload, np.int64),))


def _server(security=None, **kwargs) -> tuple[DataPlaneServer, Recorder]:
    rec = Recorder()
    server = DataPlaneServer(
        "127.0.0.1", 0, security or SecurityConfig(), rec.handlers(), **kwargs
    ).start()
    return server, rec


@pytest.fixture
def served():
    server, rec = _server(SecurityConfig(token=TOKEN))
    try:
        yield server, rec
    finally:
        rec.release.set()
        server.stop()


def _client(server, token=TOKEN, **kwargs) -> DataPlaneClient:
    return DataPlaneClient(
        f"127.0.0.1:{server.port}", SecurityConfig(token=token), task="ps:0", **kwargs
    )


def test_echo_small_and_large_payloads_bit_exact(served):
    server, rec = served
    with _client(server) as client:
        assert client.call("Echo", b"abc", timeout=10) == (b"cba", memoryview(b""))
        rng = np.random.default_rng(0)
        for n in (1, 4096, 100_000, 9 << 20):
            data = rng.integers(0, 256, n, dtype=np.uint8)
            header, payload = client.call("Echo", b"h", [data[:7], data[7:]], timeout=20)
            assert header == b"h"
            np.testing.assert_array_equal(np.frombuffer(payload, np.uint8), data)
    assert rec.calls == 5


def test_a_request_of_more_pieces_than_one_sendmsg_takes_and_handlers_replying_themselves(
    served,
):
    server, _ = served
    with _client(server) as client:
        parts = [np.full(100, i % 251, np.uint8) for i in range(700)]  # > IOV_MAX pieces
        header, payload = client.call("Respond", b"h", parts, timeout=10)
        assert header == b"h!"
        np.testing.assert_array_equal(np.frombuffer(payload, np.uint8), np.concatenate(parts))
        values = np.arange(5000, dtype=np.int64)  # 40 kB: not joined to the headers
        assert client.call("Sum", b"", [values], timeout=10)[0] == str(values.sum()).encode()
        with pytest.raises(InvalidArgumentError, match="3 bytes are no int64s"):
            client.call("Sum", b"", [np.zeros(3, np.uint8)], timeout=10)
        assert client.call("Respond", b"", timeout=10)[0] == b"!"  # the connection goes on


def test_a_handler_whose_own_reply_fails_ends_only_its_connection(caplog):
    gate, failed = threading.Event(), []

    def big(request: Request) -> None:  # replies itself, to a client that left meanwhile
        gate.wait(10)
        try:
            return request.respond(buffers=[np.zeros(64 << 20, np.uint8)])
        except OSError as e:
            failed.append(e)
            raise

    handlers = {"Big": big, "Echo": Recorder().echo}
    server = DataPlaneServer("127.0.0.1", 0, SecurityConfig(token=TOKEN), handlers).start()
    try:
        with _client(server) as client:
            client.send("Big", b"", timeout=10).cancel()  # its connection closed
            gate.set()
            assert client.call("Echo", b"ok", timeout=10)[0] == b"ko"
            deadline = time.monotonic() + 10
            while (not failed or server.connections > 1) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert failed and server.connections == 1  # the echo's, pooled
        assert not [r for r in caplog.records if "Big failed" in r.getMessage()]
    finally:
        server.stop()


@pytest.mark.parametrize("edge", [False, True], ids=["bare", "ps-edge"])
def test_a_handler_failing_with_an_os_error_answers_internal_and_keeps_the_connection(edge):
    """A handler's own OSError (a disk tier's read, say) is a server error to answer, not
    a client gone: the caller gets INTERNAL naming it at once, and its connection lives on."""

    def read_disk(request: Request) -> Reply:
        raise OSError(5, "Input/output error", "table.tier")

    handlers = {"Read": read_disk, "Echo": Recorder().echo}
    around = Edge("ps:0").plane_call if edge else None
    server = DataPlaneServer(
        "127.0.0.1", 0, SecurityConfig(token=TOKEN), handlers, around=around
    ).start()
    try:
        with _client(server) as client:
            for _ in range(2):  # the same connection, twice
                with pytest.raises(InternalError, match=r"Read: OSError: .*table\.tier"):
                    client.call("Read", b"", timeout=10)
            assert client.call("Echo", b"ok", timeout=10)[0] == b"ko"
            assert server.connections == 1
    finally:
        server.stop()


def test_reply_goes_into_the_sink(served):
    server, _ = served
    data = np.arange(1000, dtype=np.float32)
    out = np.zeros_like(data)
    seen = []

    def sink(header: bytes, n: int) -> memoryview:
        seen.append((header, n))
        return memoryview(out).cast("B")

    with _client(server) as client:
        _, _payload = client.call("Echo", b"x", [data], timeout=10, sink=sink)
    assert seen == [(b"x", data.nbytes)]
    np.testing.assert_array_equal(out, data)


def test_concurrent_calls_share_the_pool(served):
    server, _ = served
    errors = []
    with _client(server, max_connections=3) as client:

        def run(k: int) -> None:
            try:
                for i in range(20):
                    data = np.full(1000 + k, i, np.int32)
                    _, payload = client.call("Echo", b"%d" % k, [data], timeout=20)
                    assert np.array_equal(np.frombuffer(payload, np.int32), data)
            except Exception as e:  # carried to the main thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors
    assert server.connections <= 3


def test_sent_calls_are_answered_in_any_order_and_hold_a_connection_each(served):
    server, rec = served
    with _client(server, max_connections=2) as client:
        first = client.send("Stall", b"", timeout=20)
        second = client.send("Echo", b"ab", [np.arange(5, dtype=np.int32)], timeout=20)
        # both connections are held until their replies are read: a third call waits
        with pytest.raises(DeadlineExceededError, match="no free data-plane connection"):
            client.call("Echo", b"x", timeout=0.3)
        header, payload = second.result()
        assert header == b"ba" and np.frombuffer(payload, np.int32).tolist() == [0, 1, 2, 3, 4]
        rec.release.set()
        assert first.result()[0] == b"late"
        with pytest.raises(InvalidArgumentError, match="read or given up"):
            first.result()
        # both connections went back to the pool and serve the next calls
        assert client.call("Echo", b"cd", timeout=10)[0] == b"dc"
        assert server.connections <= 2


def test_a_cancelled_sent_call_frees_its_connection_and_others_go_on(served):
    server, rec = served
    with _client(server, max_connections=1) as client:
        stalled = client.send("Stall", b"", timeout=20)
        stalled.cancel()
        stalled.cancel()  # idempotent
        with pytest.raises(InvalidArgumentError, match="read or given up"):
            stalled.result()
        rec.release.set()
        # the slot is free again and a fresh connection serves the next call
        assert client.call("Echo", b"ef", timeout=10)[0] == b"fe"


def test_a_sent_call_raises_its_typed_error_when_read(served):
    server, rec = served
    with _client(server) as client:
        failing = client.send("Fail", b"y", timeout=10)
        stalled = client.send("Stall", b"", timeout=0.5)
        with pytest.raises(AbortedError, match="refused 'y'"):
            failing.result()
        start = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="Stall to ps:0"):
            stalled.result()
        assert time.monotonic() - start < 3
        rec.release.set()
        assert client.call("Echo", b"gh", timeout=10)[0] == b"hg"


def test_a_sent_call_to_a_server_that_is_gone_is_unavailable_when_read():
    server, rec = _server()
    client = DataPlaneClient(f"127.0.0.1:{server.port}", task="ps:1")
    try:
        sent = client.send("Stall", b"", timeout=20)
        server.stop()  # closes the connection the call waits on
        rec.release.set()
        with pytest.raises(UnavailableError, match="Stall to ps:1"):
            sent.result()
        with pytest.raises(UnavailableError, match="Echo to ps:1"):
            client.send("Echo", b"", timeout=5)
    finally:
        rec.release.set()
        client.close()
        server.stop()


def test_handler_error_raises_the_same_typed_error(served):
    server, _ = served
    with _client(server) as client:
        with pytest.raises(AbortedError, match="refused 'x'") as info:
            client.call("Fail", b"x", timeout=10)
        assert info.value.task == "ps:0"
        assert "Fail to ps:0 at 127.0.0.1:" in str(info.value)
        with pytest.raises(MovedError) as moved:
            client.call("Moved", b"", timeout=10)
        assert (moved.value.key, moved.value.owner, moved.value.address, moved.value.version) == (
            "w",
            3,
            "127.0.0.1:9",
            7,
        )
        with pytest.raises(UnimplementedError, match="no method"):
            client.call("Nope", b"", timeout=10)
        # the connection survives a status: the next call on it works
        assert client.call("Echo", b"ok", timeout=10)[0] == b"ko"
    assert server.connections <= 1


def test_deadline_travels_to_the_handler(served):
    server, _ = served
    with _client(server) as client:
        assert client.call("Deadline", b"", timeout=30)[0] in (b"29", b"30")


@pytest.mark.parametrize("token", [None, "wrong-token-wrong-token-0123"])
def test_wrong_or_missing_token_is_refused(served, token):
    server, rec = served
    start = time.monotonic()
    with (
        DataPlaneClient(f"127.0.0.1:{server.port}", SecurityConfig(token=token)) as client,
        pytest.raises(UnauthenticatedError, match="token"),
    ):
        client.call("Echo", b"x", [b"payload"], timeout=10)
    assert time.monotonic() - start < 5
    assert rec.calls == 0


def _raw(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (reads EOF or a reset, maybe after an ERROR frame)."""
    try:
        data = sock.recv(1 << 16)
        while data:
            data = sock.recv(1 << 16)
        return True
    except ConnectionResetError:
        return True


@pytest.mark.parametrize(
    "frame",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 16,
        frames.FIXED.pack(b"PSDP", 9, 1, 0, 0, 0, 0, 0, 0),  # version
        frames.FIXED.pack(b"PSDP", 1, 77, 0, 0, 0, 0, 0, 0),  # kind
        frames.FIXED.pack(b"PSDP", 1, 3, 0, 0, 0, 0, 0, 0),  # a REQUEST before the HELLO
        frames.FIXED.pack(b"PSDP", 1, 1, 0, 0, 0, 1 << 30, 0, 0),  # header too large
    ],
    ids=["http", "version", "kind", "no-hello", "huge-header"],
)
def test_malformed_first_frame_closes_only_that_connection(served, frame):
    server, rec = served
    with _raw(server) as sock:
        sock.sendall(frame)
        assert _closed(sock)
    with _client(server) as client:
        assert client.call("Echo", b"ab", timeout=10)[0] == b"ba"
    assert rec.calls == 1


def test_oversized_or_malformed_request_after_hello_changes_nothing():
    server, rec = _server(SecurityConfig(token=TOKEN), max_payload=1 << 20)
    try:
        hello = frames.pack(frames.Kind.HELLO, header_len=0)

        body = auth.hello(SecurityConfig(token=TOKEN))
        for bad in (
            frames.pack(
                frames.Kind.REQUEST, method=frames.method_id("Echo"), payload_len=(1 << 20) + 1
            ),
            b"PSDP\x01\x03\x01\x00" + b"\0" * 28,  # flags set
            frames.pack(frames.Kind.REPLY),  # a reply sent to the server
        ):
            with _raw(server) as sock:
                sock.sendall(frames.FIXED.pack(*frames.FIXED.unpack(hello)[:6], len(body), 0, 0))
                sock.sendall(body)
                welcome = frames.unpack(sock.recv(36), max_header=0, max_payload=0)
                assert welcome.kind is frames.Kind.WELCOME
                sock.sendall(bad)
                assert _closed(sock)
        assert rec.calls == 0
        with _client(server) as client:  # still serving others
            assert client.call("Echo", b"ab", [b"x" * 1000], timeout=10)[0] == b"ba"
    finally:
        server.stop()


def test_stalled_handler_raises_deadline_exceeded_without_hanging(served):
    server, rec = served
    with _client(server) as client:
        start = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="Stall to ps:0"):
            client.call("Stall", b"", timeout=0.5)
        assert time.monotonic() - start < 3
        rec.release.set()
        # a fresh connection serves the next call
        assert client.call("Echo", b"12", timeout=10)[0] == b"21"


def test_server_gone_is_unavailable_and_the_client_reconnects_lazily():
    server, _ = _server(idle_timeout=0.3)
    port = server.port
    client = DataPlaneClient(f"127.0.0.1:{port}", task="ps:1")
    try:
        assert client.call("Echo", b"ab", timeout=10)[0] == b"ba"
        time.sleep(1.5)  # the server closed the idle connection: the client notices, reconnects
        assert client.call("Echo", b"cd", timeout=10)[0] == b"dc"
        server.stop()
        with pytest.raises(UnavailableError, match="Echo to ps:1"):
            client.call("Echo", b"ab", timeout=5)
    finally:
        client.close()
        server.stop()


def test_connection_limit_refuses_with_resource_exhausted():
    server, _ = _server(max_connections=1)
    try:
        with DataPlaneClient(f"127.0.0.1:{server.port}") as first:
            first.connect(10)
            deadline = time.monotonic() + 10
            while server.connections < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            with (
                DataPlaneClient(f"127.0.0.1:{server.port}") as second,
                pytest.raises(ResourceExhaustedError, match="at most 1 connections"),
            ):
                second.call("Echo", b"", timeout=10)
            assert first.call("Echo", b"ab", timeout=10)[0] == b"ba"
    finally:
        server.stop()


def test_stop_closes_connections_and_joins_threads():
    server, _rec = _server()
    client = DataPlaneClient(f"127.0.0.1:{server.port}")
    threads_before = threading.active_count()
    try:
        client.call("Echo", b"", timeout=10)
        start = time.monotonic()
        server.stop(timeout=5)
        assert time.monotonic() - start < 5
        assert server.connections == 0
        assert threading.active_count() < threads_before
    finally:
        client.close()


def test_bad_address_is_invalid_argument():
    with pytest.raises(InvalidArgumentError, match="not host:port"):
        DataPlaneClient("localhost")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_tls_serves_its_own_and_refuses_a_rogue_certificate(pki):
    server, rec = _server(tls(pki, token=TOKEN))
    try:
        with DataPlaneClient(f"127.0.0.1:{server.port}", tls(pki, token=TOKEN)) as client:
            data = np.arange(300_000, dtype=np.uint8)
            _, payload = client.call("Echo", b"t", [data], timeout=20)
            np.testing.assert_array_equal(np.frombuffer(payload, np.uint8), data)
        for bad in (tls(pki, cert="rogue", token=TOKEN), tls(pki, ca="other-ca", token=TOKEN)):
            with (
                DataPlaneClient(f"127.0.0.1:{server.port}", bad) as client,
                pytest.raises(UnauthenticatedError),
            ):
                client.call("Echo", b"x", timeout=10)
        with (
            DataPlaneClient(f"127.0.0.1:{server.port}", SecurityConfig(token=TOKEN)) as plain,
            pytest.raises((UnavailableError, UnauthenticatedError)),
        ):
            plain.call("Echo", b"x", timeout=5)
        assert rec.calls == 1
    finally:
        server.stop()
