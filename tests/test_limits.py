"""Server limits on live processes: RESOURCE_EXHAUSTED naming the limit and the value, no change.

PS: ``--max-tensor-bytes`` (variables, gradients, row indices),
``--max-variables``, ``--max-streams`` and ``--max-streams-per-client`` (calls
in progress; the one above is refused at once), ``--stream-idle-timeout`` (an
idle streaming call is cancelled, its slot freed; a client giving up is not a
server error).  Worker: ``--max-closure-bytes``.
"""

from __future__ import annotations

import threading
import time
import urllib.request

import cloudpickle
import grpc
import numpy as np
import pytest

from psflow.distribute.coordinator.workers import GrpcWorker
from psflow.errors import InvalidArgumentError, ResourceExhaustedError
from psflow.observability.metrics import parse_exposition
from psflow.proto import ps_pb2, worker_pb2
from psflow.security.limits import PSLimits, StreamGate, WorkerLimits
from psflow.transport import framing
from psflow.transport.client import PSClient
from psflow.transport.service import method_path
from tests.conftest import start_server

TENSOR_LIMIT = 4096


def test_limit_values_are_validated():
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidArgumentError, match="max_streams"):
            PSLimits(max_streams=bad)
        with pytest.raises(InvalidArgumentError, match="max_closure_bytes"):
            WorkerLimits(max_closure_bytes=bad)


def test_stream_gate_counts_and_releases():
    gate = StreamGate(2)
    with gate.admit(), gate.admit():
        assert gate.active == 2
        with (
            pytest.raises(ResourceExhaustedError, match="3 concurrent calls exceeds") as info,
            gate.admit(),
        ):
            pass
        assert info.value.reason == "too_many_streams" and info.value.limit == 2
        assert gate.active == 2
    assert gate.active == 0


def test_gate_acquire_and_release_count_per_client():
    gate = StreamGate(3, per_client=2)
    gate.acquire("a")
    gate.acquire("a")
    with pytest.raises(ResourceExhaustedError, match="3 concurrent calls from one client") as info:
        gate.acquire("a")  # refused without taking a slot
    assert info.value.reason == "too_many_streams_per_client" and gate.active == 2
    gate.acquire("b")
    with pytest.raises(ResourceExhaustedError, match="4 concurrent calls exceeds"):
        gate.acquire("c")
    gate.release("a")
    gate.acquire("c")  # the slot "a" gave back
    for client in ("a", "b", "c"):
        gate.release(client)
    assert gate.active == 0


@pytest.fixture(scope="module")
def limited_ps(start_ps_module):
    return start_ps_module(
        "--max-tensor-bytes",
        str(TENSOR_LIMIT),
        "--max-variables",
        "3",
        "--max-streams",
        "2",
        "--metrics-port",
        "auto",
    )


def _scrape(server) -> dict:
    fields = dict(f.split("=", 1) for f in server.ready_line.split() if "=" in f)
    url = f"http://127.0.0.1:{fields['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return parse_exposition(reply.read().decode())


def _rejected(server, reason: str) -> float:
    return _scrape(server).get(
        ("psflow_ps_rejected_total", (("reason", reason), ("task", "ps:0"))), 0.0
    )


def _raw_push(name: str, shape, payload: bytes, seq: int) -> bytes:
    header = ps_pb2.PushHeader(items=[ps_pb2.PushItem(name=name, base_version=-1)])
    header.id.client_id, header.id.sequence = "limits", seq
    header.items[0].values.dtype = 2  # float32
    header.items[0].values.shape.extend(shape)
    return framing.encode_message(header.SerializeToString(), [payload])


def test_tensor_and_variable_limits(limited_ps):
    with PSClient(limited_ps.address, timeout=30) as client:
        # a variable above the tensor limit: refused, not created
        with pytest.raises(ResourceExhaustedError, match=r"8192 bytes\) exceeds the limit "
                           r"--max-tensor-bytes=4096"):  # fmt: skip
            client.create_variable("big", np.zeros(1024, np.float64))
        assert [v.name for v in client.list_variables()] == []
        client.create_variables(
            {"a": np.ones(1024, np.float32), "b": np.ones(4, np.float32)},
            optimizer={"name": "sgd", "learning_rate": 1.0},
        )
        # a gradient declared above the limit: refused before its bytes are read
        with grpc.insecure_channel(limited_ps.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary(method_path("Push"))(
                    _raw_push("a", [1 << 40], b"", 1), timeout=10
                )
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "4398046511104 bytes) exceeds the limit --max-tensor-bytes=4096" in (
                info.value.details()
            )
        # row indices above the limit
        with pytest.raises(ResourceExhaustedError, match="row indices for 'a'"):
            client.pull_rows("a", np.zeros(1000, np.int64))
        np.testing.assert_array_equal(client.pull("a"), np.ones(1024, np.float32))
        # the variable count: the third fits, a fourth does not; re-creating is fine
        client.create_variable("c", np.zeros(2, np.float32))
        with pytest.raises(ResourceExhaustedError, match="holds 3, would exceed the limit of 3"):
            client.create_variables({"d": np.zeros(1, np.float32), "a": np.ones(1024, np.float32)})
        assert client.create_variable("c", np.zeros(2, np.float32)) is False
        assert sorted(v.name for v in client.list_variables()) == ["a", "b", "c"]
    assert _rejected(limited_ps, "tensor_too_large") >= 3
    assert _rejected(limited_ps, "too_many_variables") == 1


@pytest.mark.parametrize("via", ["grpc", "data plane"])
def test_calls_above_max_streams_are_refused_at_once(start_ps, via):
    """The data plane's calls pass the same edge as gRPC's: the same gate refuses them."""
    limited_ps = start_ps("--max-streams", "2", "--metrics-port", "auto")
    plane = PSClient(limited_ps.address, timeout=10)
    with PSClient(limited_ps.address, timeout=30) as client:
        client.create_variable("s", np.zeros(4, np.float32), optimizer={"name": "sgd"})
        client.configure_optimizer(["s"], {"name": "sgd", "learning_rate": 1.0})
    plane.push({"s": np.zeros(4, np.float32)})  # its data plane found and connected now
    release = threading.Event()

    def held_push(seq: int, grad: np.ndarray):
        header_only = _raw_push("s", [4], b"", seq)
        yield header_only  # the header, then the payload only once released
        if not release.wait(30):
            return
        yield framing.encode_message(None, [grad.tobytes()])

    grads = [np.full(4, v, np.float32) for v in (1, 2, 40)]
    with grpc.insecure_channel(limited_ps.address) as channel:
        stream = channel.stream_unary(method_path("PushStream"))
        held = [stream.future(held_push(i + 1, grads[i]), timeout=30) for i in range(2)]
        try:
            deadline = time.monotonic() + 20
            active = ("psflow_ps_active_streams", (("task", "ps:0"),))
            while _scrape(limited_ps).get(active) != 2:
                assert time.monotonic() < deadline, "the two held streams never became active"
                time.sleep(0.05)
            start = time.monotonic()
            if via == "grpc":
                with pytest.raises(grpc.RpcError) as info:
                    channel.unary_unary(method_path("Push"))(
                        _raw_push("s", [4], grads[2].tobytes(), 3), timeout=10
                    )
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                details = info.value.details()
            else:
                with pytest.raises(ResourceExhaustedError) as refused:
                    plane.push({"s": grads[2]})
                details = str(refused.value)
            assert time.monotonic() - start < 5
            assert "3 concurrent calls exceeds the limit --max-streams=2" in details
        finally:
            release.set()
            plane.close()
        for future in held:
            assert ps_pb2.PushResponse.FromString(future.result(30)).applied
    with PSClient(limited_ps.address, timeout=30) as client:
        # 1 and 2 applied, the refused 40 not
        np.testing.assert_array_equal(client.pull("s"), np.full(4, -3, np.float32))
    assert _rejected(limited_ps, "too_many_streams") == 1


@pytest.fixture
def limited_worker(start_ps, tmp_path):
    ps = start_ps()
    worker = start_server(
        "worker",
        ["--port", "0", "--ps", ps.address, "--workers", "1", "--max-closure-bytes", "10000"],
        "PSFLOW_READY worker",
        log_dir=tmp_path,
    )
    try:
        yield worker
    finally:
        worker.reap()


def test_closures_above_max_closure_bytes_are_refused(limited_worker):
    client = GrpcWorker(0, limited_worker.address)
    try:

        def run(function: bytes, arguments: bytes = b"") -> worker_pb2.RunClosureResponse:
            request = worker_pb2.RunClosureRequest(
                session_id="s", closure_id=1, function_key="once-f", function=function,
                arguments=arguments,
            )  # fmt: skip
            return client._call(client._stub.RunClosure, request, 30)

        small = cloudpickle.dumps(lambda: 41 + 1)
        assert cloudpickle.loads(run(small).result) == 42
        with pytest.raises(ResourceExhaustedError) as info:
            run(small, b"x" * 12_000)
        message = str(info.value)
        assert "--max-closure-bytes=10000" in message and f"{len(small) + 12_000} bytes" in message
        # far above: gRPC's own message limit (2 x limit + 1 MiB) refuses it unread
        with pytest.raises(ResourceExhaustedError, match="larger than max"):
            run(small, b"x" * (3 << 20))
        status = client.status()
        assert (status.closures_run, status.closures_failed) == (1, 0)
    finally:
        client.close()


# -- idle and abandoned streams (issue 21) -----------------------------------------------------
def _active(server) -> float:
    return _scrape(server).get(("psflow_ps_active_streams", (("task", "ps:0"),)), 0.0)


def _rpcs(server, method: str, code: str) -> float:
    key = ("psflow_ps_rpcs_total", (("code", code), ("method", method), ("task", "ps:0")))
    return _scrape(server).get(key, 0.0)


def _wait_for(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _idle_push(seq: int, release: threading.Event):
    """A PushStream that sends its header, then nothing until released (bounded)."""
    yield _raw_push("s", [4], b"", seq)
    release.wait(60)


def _server_with_s(start_ps, *args: str):
    server = start_ps("--metrics-port", "auto", *args)
    with PSClient(server.address, timeout=30) as client:
        client.create_variable("s", np.zeros(4, np.float32), optimizer={"name": "sgd"})
    return server


def _timed_push(address: str, seq: int) -> float:
    """Seconds a well-behaved push takes on a fresh, already connected channel (its own
    connection, as another process would have: channels of one process share by default)."""
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        start = time.monotonic()
        reply = channel.unary_unary(method_path("Push"))(
            _raw_push("s", [4], np.ones(4, np.float32).tobytes(), seq), timeout=10
        )
        assert ps_pb2.PushResponse.FromString(reply).applied
        return time.monotonic() - start


@pytest.mark.slow
def test_64_idle_streams_of_one_client_leave_room_for_others(start_ps):
    server = _server_with_s(start_ps)  # defaults: 64 streams, 32 per client
    release = threading.Event()
    with grpc.insecure_channel(server.address) as attacker:
        stream = attacker.stream_unary(method_path("PushStream"))
        idle = [stream.future(_idle_push(i + 1, release)) for i in range(64)]  # no deadline
        try:
            _wait_for(lambda: sum(f.done() for f in idle) == 32, "32 refused at once")
            codes = {f.exception().code() for f in idle if f.done()}
            assert codes == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert "--max-streams-per-client=32" in next(
                f.exception().details() for f in idle if f.done()
            )
            assert _active(server) == 32
            assert _timed_push(server.address, 100) < 1.0
        finally:
            release.set()
            for f in idle:
                f.cancel()
    assert _rejected(server, "too_many_streams_per_client") == 32


@pytest.mark.slow
def test_64_idle_connections_yield_their_slots_to_a_well_behaved_push(start_ps):
    server = _server_with_s(start_ps)  # defaults: 64 streams, a 30 s idle timeout
    release = threading.Event()
    options = [("grpc.use_local_subchannel_pool", 1)]  # 64 connections, as 64 processes
    channels = [grpc.insecure_channel(server.address, options=options) for _ in range(64)]
    try:
        idle = [
            ch.stream_unary(method_path("PushStream")).future(_idle_push(i + 1, release))
            for i, ch in enumerate(channels)
        ]
        _wait_for(lambda: _active(server) == 64, "the 64 idle streams never became active")
        time.sleep(1.2)  # idle for over a second: they yield under pressure
        assert _timed_push(server.address, 100) < 1.0
        assert _timed_push(server.address, 101) < 1.0  # (the slot the first one freed)
        _wait_for(lambda: sum(f.done() for f in idle) == 1, "one idle stream yields")
        assert {f.exception().code() for f in idle if f.done()} == {grpc.StatusCode.CANCELLED}
    finally:
        release.set()
        for ch in channels:
            ch.close()
    assert _rejected(server, "stream_idle") == 1
    assert _rejected(server, "too_many_streams") == 0


@pytest.mark.slow
def test_idle_streams_are_cancelled_and_their_slots_freed(start_ps):
    server = _server_with_s(start_ps, "--max-streams", "6", "--stream-idle-timeout", "1")
    release = threading.Event()
    channels = [grpc.insecure_channel(server.address) for _ in range(6)]  # 6 clients
    try:
        idle = [
            ch.stream_unary(method_path("PushStream")).future(_idle_push(i + 1, release))
            for i, ch in enumerate(channels)
        ]
        _wait_for(lambda: all(f.done() for f in idle), "idle streams never cancelled")
        assert {f.exception().code() for f in idle} == {grpc.StatusCode.CANCELLED}
        # a slow stream that keeps moving is not idle: a chunk every 0.4 s for 2.4 s
        grad = np.ones(4, np.float32).tobytes()

        def slow():
            yield _raw_push("s", [4], b"", 50)
            for i in range(0, 16, 4):
                time.sleep(0.6)
                yield framing.encode_message(None, [grad[i : i + 4]])

        with grpc.insecure_channel(server.address) as channel:
            reply = channel.stream_unary(method_path("PushStream"))(slow(), timeout=30)
        assert ps_pb2.PushResponse.FromString(reply).applied
        assert _timed_push(server.address, 51) < 1.0
    finally:
        release.set()
        for ch in channels:
            ch.close()
    assert _rejected(server, "stream_idle") == 6
    # the handlers record their calls just after the clients saw them end
    _wait_for(
        lambda: _rpcs(server, "PushStream", "CANCELLED") == 6,
        str(
            {
                k: v
                for k, v in _scrape(server).items()
                if k[0] in ("psflow_ps_rpcs_total", "psflow_ps_active_streams")
            }
        ),
    )
    assert _rpcs(server, "PushStream", "INTERNAL") == 0
    assert "Traceback" not in server.log_tail(400)
    with PSClient(server.address, timeout=30) as client:
        np.testing.assert_array_equal(client.pull("s"), np.full(4, -0.02, np.float32))


@pytest.mark.slow
def test_a_client_giving_up_is_not_a_server_error(start_ps):
    server = _server_with_s(start_ps)
    release = threading.Event()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stream = channel.stream_unary(method_path("PushStream"))
            cancelled = stream.future(_idle_push(1, release))
            _wait_for(lambda: _active(server) == 1, "the stream never started")
            cancelled.cancel()
            expired = stream.future(_idle_push(2, release), timeout=0.5)
            with pytest.raises(grpc.RpcError) as info:
                expired.result(timeout=30)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        release.set()
    # Neither call counts as a server error. Which code each gets depends on races the
    # server cannot see: the client's cancellation at its deadline can arrive before the
    # server's own copy of the deadline passes, and a cancelled request stream can break
    # off (a truncated request) before gRPC marks the call inactive.
    gave_up = ("DEADLINE_EXCEEDED", "CANCELLED", "INVALID_ARGUMENT")
    _wait_for(
        lambda: sum(_rpcs(server, "PushStream", c) for c in gave_up) == 2,
        str(
            {
                k: v
                for k, v in _scrape(server).items()
                if k[0] in ("psflow_ps_rpcs_total", "psflow_ps_active_streams")
            }
        ),
    )
    assert _rpcs(server, "PushStream", "INTERNAL") == 0
    assert "Traceback" not in server.log_tail(400)
    assert _timed_push(server.address, 3) < 1.0
