"""The data plane's event loop (:mod:`psflow.transport.dataplane.loop`) under
hostile and slow peers: a real :class:`DataPlaneServer` on 127.0.0.1, real
sockets writing bytes the way a broken or slow client would.

A plain connection is read by the loop's threads after its HELLO; these tests
check what a thread per connection gave for free: a slow sender or a blocked
handler does not hold up the others, fragments and back-to-back frames parse
as one stream, and a peer that vanishes mid-call costs only its connection.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from psflow.security.config import SecurityConfig
from psflow.transport.dataplane import (
    DataPlaneClient,
    DataPlaneServer,
    Reply,
    Request,
    auth,
    frames,
    loop,
)

TOKEN = "dataplane-loop-token-0123456789"
ECHO = frames.method_id("Echo")


class Handlers:
    """Echo (header reversed, payload back), and Block (waits for ``release``)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.blocked_done = threading.Event()
        self.calls = 0
        self.blocked = 0
        self.lock = threading.Lock()

    def echo(self, request: Request) -> Reply:
        with self.lock:
            self.calls += 1
        return Reply(request.header[::-1], [bytes(request.payload)])

    def spin(self, request: Request) -> Reply:
        end = time.thread_time() + float(request.header)  # CPU seconds: busy, not blocked
        while time.thread_time() < end:
            pass
        return Reply(b"spun")

    def block(self, request: Request) -> Reply:
        with self.lock:
            self.blocked += 1
        self.entered.set()
        self.release.wait(20)
        self.blocked_done.set()
        return Reply(b"released")


@pytest.fixture(params=[1.0])
def served(request):
    """A server and its handlers; ``request.param``: its io_timeout."""
    h = Handlers()
    server = DataPlaneServer(
        "127.0.0.1",
        0,
        SecurityConfig(token=TOKEN),
        {"Echo": h.echo, "Block": h.block, "Spin": h.spin},
        io_timeout=request.param,
    ).start()
    try:
        yield server, h
    finally:
        h.release.set()
        server.stop()


def _client(server: DataPlaneServer) -> DataPlaneClient:
    return DataPlaneClient(f"127.0.0.1:{server.port}", SecurityConfig(token=TOKEN), task="ps:0")


def _welcomed(server: DataPlaneServer) -> socket.socket:
    """A raw socket past its HELLO."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    body = auth.hello(SecurityConfig(token=TOKEN))
    sock.sendall(frames.pack(frames.Kind.HELLO, header_len=len(body)) + body)
    head = frames.unpack(_recv_exactly(sock, frames.FIXED.size), max_header=0, max_payload=0)
    assert head.kind is frames.Kind.WELCOME
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def _request(call_id: int, header: bytes, payload: bytes, method: int = ECHO) -> bytes:
    fixed = frames.pack(
        frames.Kind.REQUEST,
        method=method,
        call_id=call_id,
        header_len=len(header),
        payload_len=len(payload),
    )
    return fixed + header + payload


def _reply(sock: socket.socket) -> tuple[frames.FrameHead, bytes, bytes]:
    head = frames.unpack(
        _recv_exactly(sock, frames.FIXED.size), max_header=1 << 20, max_payload=1 << 30
    )
    return head, _recv_exactly(sock, head.header_len), _recv_exactly(sock, head.payload_len)


def _wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_slow_sender_does_not_stall_others_and_is_closed_after_io_timeout(served):
    server, h = served
    slow = _welcomed(server)
    try:
        frame = _request(1, b"slow", b"x" * 100_000)
        slow.sendall(frame[: len(frame) // 2])  # half a frame, then nothing
        with _client(server) as client:
            start = time.monotonic()
            for k in range(20):
                assert client.call("Echo", b"ab", [bytes([k]) * 10], timeout=10)[0] == b"ba"
            assert time.monotonic() - start < 5
        # the stalled connection is dropped once io_timeout (1 s) passes without bytes
        slow.settimeout(10)
        assert _recv_or_eof(slow) == b""
        assert h.calls == 20
    finally:
        slow.close()


def _recv_or_eof(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1)
    except ConnectionResetError:
        return b""


def test_blocked_handler_does_not_stall_other_connections(served):
    server, h = served
    with _client(server) as blocked, _client(server) as other:
        result: list = []
        t = threading.Thread(target=lambda: result.append(blocked.call("Block", b"", timeout=20)))
        t.start()
        try:
            assert h.entered.wait(10)
            start = time.monotonic()
            for _ in range(10):
                assert other.call("Echo", b"12", timeout=10)[0] == b"21"
            assert time.monotonic() - start < 5
            assert not h.blocked_done.is_set()
        finally:
            h.release.set()
            t.join(20)
        assert result and result[0][0] == b"released"


def test_slow_calls_get_no_extra_thread_but_blocked_ones_do(served):
    # Only calls that wait (no CPU used) earn more than the two threads the loop
    # starts with, not calls that are merely slow (computing, or descheduled on a
    # loaded host); the extra ones retire only after idling (30 s by default).
    server, h = served
    assert server.loop_threads == 2
    with _client(server) as a, _client(server) as b, _client(server) as other:
        spun: list = []

        def spin(client: DataPlaneClient) -> None:
            for _ in range(3):
                spun.append(client.call("Spin", b"0.15", timeout=30)[0])

        spinners = [threading.Thread(target=spin, args=(c,)) for c in (a, b)]
        for t in spinners:  # both loop threads compute at once, 0.45 s each
            t.start()
        for t in spinners:
            t.join(60)
        assert spun == [b"spun"] * 6
        assert server.loop_threads == 2
        results: list = []
        threads = [
            threading.Thread(target=lambda c=c: results.append(c.call("Block", b"", timeout=20)))
            for c in (a, b)
        ]
        for t in threads:
            t.start()
        try:
            assert _wait(lambda: h.blocked == 2)  # both loop threads wait in a call
            assert _wait(lambda: server.loop_threads == 3)
            assert other.call("Echo", b"12", timeout=10)[0] == b"21"  # served meanwhile
        finally:
            h.release.set()
            for t in threads:
                t.join(20)
        assert [r[0] for r in results] == [b"released"] * 2


class _Clocks:
    """Per-thread CPU clocks a test moves by hand (clock id -> seconds)."""

    def __init__(self, *ids: int) -> None:
        self.seconds = dict.fromkeys(ids, 0.0)

    def read(self, clock_id: int) -> float | None:
        return self.seconds.get(clock_id)

    def use(self, cpu: float) -> None:
        for k in self.seconds:
            self.seconds[k] += cpu


def test_a_stall_is_blocked_threads_over_several_on_time_windows_not_a_descheduled_process():
    stall = loop._STALL
    clocks = _Clocks(1, 2)
    judge = loop._StallJudge(clocks.read)
    t = 100.0

    def check(after: float, cpu: float = 0.0) -> bool:
        nonlocal t
        t += after
        clocks.use(cpu)
        return judge.blocked(t, [1, 2])

    # threads waiting in their calls (no CPU), checks on time: a thread after the 3rd window
    assert not check(stall)  # the first check only records the clocks
    assert [check(stall) for _ in range(loop._STALL_WINDOWS)] == [False] * (
        loop._STALL_WINDOWS - 1
    ) + [True]
    # computing threads are never blocked
    judge.reset()
    assert not any(check(stall, cpu=0.01) for _ in range(10))
    # a process kept off the CPU: its threads show no CPU, but the check that sees it
    # runs late, and the count starts again; computing again before the 3rd window
    judge.reset()
    check(stall, cpu=0.01)
    assert not check(stall * 5)  # late: the whole process was descheduled
    assert not check(stall)
    assert not check(stall)
    assert not check(stall, cpu=0.01)  # computing again: no thread
    # a thread that ended meanwhile does not count
    judge.reset()
    check(stall)
    del clocks.seconds[2]
    assert [check(stall) for _ in range(loop._STALL_WINDOWS)][-1]


def test_fragmented_and_back_to_back_frames_parse_as_one_stream(served):
    server, h = served
    sock = _welcomed(server)
    try:
        rng = np.random.default_rng(0)
        payloads = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (0, 5, 70_000)]
        # one byte at a time: every split point of the fixed header and the header
        frame = _request(1, b"abc", payloads[1])
        for k in range(len(frame)):
            sock.sendall(frame[k : k + 1])
            time.sleep(0.001)
        head, header, payload = _reply(sock)
        assert (head.kind, head.call_id, header, payload) == (
            frames.Kind.REPLY,
            1,
            b"cba",
            payloads[1],
        )
        # three requests in one write: each answered, in order, bit-exact
        sock.sendall(b"".join(_request(10 + i, b"h%d" % i, p) for i, p in enumerate(payloads)))
        for i, p in enumerate(payloads):
            head, header, payload = _reply(sock)
            assert (head.call_id, header, payload) == (10 + i, (b"h%d" % i)[::-1], p)
        assert h.calls == 4
    finally:
        sock.close()


@pytest.mark.parametrize(
    "bad",
    [
        b"PSDP\x01\x03\x01\x00" + b"\0" * 28,  # flags set
        frames.pack(frames.Kind.HELLO),  # a second HELLO
        b"\xff" * 36,  # not a frame at all
        frames.pack(frames.Kind.REQUEST, method=ECHO, header_len=(16 << 20) + 1),
    ],
    ids=["flags", "second-hello", "garbage", "huge-header"],
)
def test_hostile_frame_after_a_good_call_closes_only_that_connection(served, bad):
    server, h = served
    sock = _welcomed(server)
    try:
        # the good call and the bad frame in one write: the reply comes, then the close
        sock.sendall(_request(1, b"ok", b"p") + bad)
        head, header, _ = _reply(sock)
        assert (head.call_id, header) == (1, b"ko")
        assert _recv_or_eof(sock) == b""
    finally:
        sock.close()
    with _client(server) as client:
        assert client.call("Echo", b"ab", timeout=10)[0] == b"ba"
    assert h.calls == 2
    assert _wait(lambda: server.connections <= 1)


def test_client_gone_mid_call_costs_only_its_connection(served):
    server, h = served
    sock = _welcomed(server)
    sock.sendall(_request(1, b"", b"", method=frames.method_id("Block")))
    assert h.entered.wait(10)
    sock.close()  # gone while its call runs: the reply has nowhere to go
    h.release.set()
    assert h.blocked_done.wait(10)
    assert _wait(lambda: server.connections == 0)
    with _client(server) as client:
        assert client.call("Echo", b"xy", [b"z" * 3], timeout=10) == (b"yx", memoryview(b"zzz"))


@pytest.mark.parametrize("served", [30.0], indirect=True)  # the reader is slow, not gone
def test_slow_reader_of_a_large_reply_gets_it_whole_and_others_go_on(served):
    server, _ = served
    data = np.random.default_rng(1).integers(0, 256, 24 << 20, dtype=np.uint8).tobytes()
    sock = _welcomed(server)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        sock.sendall(_request(7, b"big", data))
        time.sleep(0.3)  # the reply fills the socket buffers: its sender now waits (bounded)
        with _client(server) as client:
            start = time.monotonic()
            for _ in range(5):
                assert client.call("Echo", b"12", timeout=10)[0] == b"21"
            assert time.monotonic() - start < 5
        head, header, payload = _reply(sock)
        assert (head.call_id, header) == (7, b"gib")
        assert payload == data
    finally:
        sock.close()
