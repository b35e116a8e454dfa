"""A real ``python -m ps_server`` process driven through PSClient and raw gRPC calls."""

from __future__ import annotations

import json
import socket
import threading
import time

import grpc
import numpy as np
import pytest

from psflow.errors import (
    AbortedError,
    AlreadyExistsError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from psflow.proto import ps_pb2
from psflow.transport import framing
from psflow.transport.client import PSClient
from psflow.transport.service import method_path
from psflow.update_rules import rule_from_config

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
OPTIMIZERS = [
    {"name": "sgd", "learning_rate": 0.1},
    {"name": "sgd", "learning_rate": 0.1, "momentum": 0.9, "nesterov": True},
    {"name": "adam", "learning_rate": 0.01},
    {"name": "adam", "learning_rate": 0.01, "amsgrad": True},
    {"name": "adagrad", "learning_rate": 0.1},
    {"name": "rmsprop", "learning_rate": 0.01, "momentum": 0.5, "centered": True},
]


def raw_unary(address: str, method: str, payload: bytes, timeout: float = 10.0) -> bytes:
    with grpc.insecure_channel(address) as channel:
        return channel.unary_unary(method_path(method))(payload, timeout=timeout)


def raw_stream(address: str, method: str, messages: list[bytes], timeout: float = 10.0) -> bytes:
    with grpc.insecure_channel(address) as channel:
        return channel.stream_unary(method_path(method))(iter(messages), timeout=timeout)


@pytest.fixture
def streaming_client(ps_server):
    """Streams anything above 1 KiB, in 4 KiB chunks: exercises the chunked paths."""
    client = PSClient(ps_server.address, timeout=30.0, chunk_bytes=4096, stream_threshold=1024)
    try:
        yield client
    finally:
        client.close()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 0, 2), (33, 65)])
@pytest.mark.parametrize("streamed", [False, True])
def test_create_pull_assign_round_trip(ps_client, streaming_client, unique, dtype, shape, streamed):
    client = streaming_client if streamed else ps_client
    rng = np.random.default_rng(1)
    value = np.asarray(rng.standard_normal(shape) * 100).astype(dtype)
    name = f"{unique}v"
    assert client.create_variable(name, value, trainable=False)
    got, version = client.pull(name, return_versions=True)
    assert got.dtype == value.dtype and got.shape == value.shape and version == 0
    assert got.tobytes() == value.tobytes()
    other = np.asarray(rng.standard_normal(shape) * 100).astype(dtype)
    assert client.assign(name, other) == {name: 1}
    client.assign_add(name, value)
    assert client.pull(name).tobytes() == (other + value).tobytes()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("streamed", [False, True])
def test_push_round_trip_every_float_dtype(ps_client, streaming_client, unique, dtype, streamed):
    client = streaming_client if streamed else ps_client
    rng = np.random.default_rng(2)
    shapes = {"w": (40, 30), "b": (30,), "s": ()}
    values = {
        unique + k: np.asarray(rng.standard_normal(s)).astype(dtype) for k, s in shapes.items()
    }
    client.create_variables(values, optimizer={"name": "sgd", "learning_rate": 0.5})
    grads = {k: np.asarray(rng.standard_normal(v.shape)).astype(dtype) for k, v in values.items()}
    reply = client.push(grads)  # one RPC for all three
    assert reply.applied and reply.versions == (1, 1, 1)
    got = client.pull(list(values))
    for (k, v), g in zip(values.items(), got, strict=True):
        expected = v - grads[k] * np.dtype(dtype).type(0.5)
        assert g.tobytes() == np.asarray(expected).tobytes(), k


@pytest.mark.parametrize("cfg", OPTIMIZERS, ids=lambda c: json.dumps(c, sort_keys=True))
def test_every_optimizer_on_the_ps_matches_local_bit_for_bit(
    ps_client, streaming_client, unique, cfg
):
    rng = np.random.default_rng(4)
    init = {"dense": rng.standard_normal((64, 40)), "emb": rng.standard_normal((50, 8))}
    init = {unique + k: v.astype(np.float32) for k, v in init.items()}
    ps_client.create_variables(init)
    ps_client.configure_optimizer(list(init), cfg)
    rule = rule_from_config(cfg)
    local = {k: v.copy() for k, v in init.items()}
    slots = {k: rule.init_slots(v) for k, v in local.items()}
    dense, emb = list(init)
    for step in range(1, 4):
        g = rng.standard_normal((64, 40)).astype(np.float32)
        rows = rng.integers(0, 50, 12)  # with repeats
        vals = rng.standard_normal((12, 8)).astype(np.float32)
        client = streaming_client if step % 2 else ps_client
        client.push({dense: g, emb: (rows, vals)})
        rule.apply_dense(local[dense], g, slots[dense], step)
        rule.apply_sparse(local[emb], rows, vals, slots[emb], step)
    for name, got in zip(init, ps_client.pull(list(init)), strict=True):
        assert got.tobytes() == local[name].tobytes(), name


def test_sparse_rows_pull_and_push(ps_client, unique):
    name = unique + "emb"
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    ps_client.create_variable(name, table, optimizer={"name": "sgd", "learning_rate": 1.0})
    np.testing.assert_array_equal(ps_client.pull_rows(name, [3, 3, 0]), table[[3, 3, 0]])
    assert ps_client.pull_rows(name, np.array([], np.int64)).shape == (0, 4)
    ps_client.push({name: (np.array([2, 2, 9]), np.ones((3, 4), np.float32))})
    expected = table.copy()
    expected[2] -= 2
    expected[9] -= 1
    np.testing.assert_array_equal(ps_client.pull(name), expected)
    with pytest.raises(InvalidArgumentError, match="row index 10"):
        ps_client.pull_rows(name, [1, 10])
    with pytest.raises(InvalidArgumentError, match="index 10"):
        ps_client.push({name: (np.array([10]), np.ones((1, 4), np.float32))})
    np.testing.assert_array_equal(ps_client.pull(name), expected)


def test_duplicate_push_id_is_applied_once(ps_client, unique):
    name = unique + "w"
    ps_client.create_variable(name, np.zeros(3), optimizer={"name": "sgd", "learning_rate": 1.0})
    first = ps_client.push({name: -np.ones(3)}, push_id=41)
    again = ps_client.push({name: -np.ones(3)}, push_id=41)
    assert not first.duplicate and again.duplicate and again.versions == first.versions
    np.testing.assert_array_equal(ps_client.pull(name), np.ones(3))
    assert ps_client.stats()["pushes_duplicate"] >= 1


def test_sync_aggregation_over_concurrent_clients(ps_server, ps_client, unique):
    name = unique + "w"
    ps_client.create_variable(name, np.zeros(4), optimizer={"name": "sgd", "learning_rate": 1.0})
    clients = [PSClient(ps_server.address, timeout=30.0) for _ in range(3)]
    grads = [np.full(4, float(i + 1)) for i in range(3)]
    replies = [None] * 3

    def contribute(i):
        replies[i] = clients[i].push(
            {name: grads[i]}, step=0, num_required=3, wait_applied=True, timeout=30
        )

    threads = [threading.Thread(target=contribute, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(r is not None and r.applied and r.versions == (1,) for r in replies)
        np.testing.assert_array_equal(ps_client.pull(name), -np.full(4, 2.0))
        with pytest.raises(AbortedError, match="already applied"):
            clients[0].push({name: grads[0]}, step=0, num_required=3)
        assert ps_client.list_variables()  # still serving
        info = {v.name: v for v in ps_client.list_variables()}[name]
        assert info.sync_step == 0 and info.version == 1
    finally:
        for c in clients:
            c.close()


def test_create_conflicts_and_configure_errors(ps_client, unique):
    name = unique + "w"
    ps_client.create_variable(name, np.zeros(2, np.float32))
    assert not ps_client.create_variable(name, np.ones(2, np.float32))  # idempotent
    with pytest.raises(AlreadyExistsError, match=name):
        ps_client.create_variable(name, np.zeros(3, np.float32))
    with pytest.raises(InvalidArgumentError, match="unknown optimizer 'nope'"):
        ps_client.configure_optimizer([name], {"name": "nope"})
    with pytest.raises(FailedPreconditionError, match="no optimizer"):
        ps_client.push({name: np.ones(2, np.float32)})


def test_bad_requests_change_nothing(ps_server, ps_client, unique):
    a, b = unique + "a", unique + "b"
    ps_client.create_variables(
        {a: np.ones((4, 3), np.float32), b: np.zeros(5, np.float32)},
        optimizer={"name": "adam"},
    )
    before = [x.tobytes() for x in ps_client.pull([a, b])]
    cases = [
        (
            NotFoundError,
            f"'{unique}zz'",
            lambda: ps_client.push({a: np.ones((4, 3), np.float32), unique + "zz": np.ones(1)}),
        ),
        (NotFoundError, f"'{unique}zz'", lambda: ps_client.pull([a, unique + "zz"])),
        (
            InvalidArgumentError,
            r"\(3, 4\)",
            lambda: ps_client.push({b: np.ones(5, np.float32), a: np.ones((3, 4), np.float32)}),
        ),
        (
            InvalidArgumentError,
            "float64",
            lambda: ps_client.push({b: np.ones(5, np.float32), a: np.ones((4, 3))}),
        ),
        (InvalidArgumentError, "float64", lambda: ps_client.assign(b, np.ones(5))),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match) as info:
            call()
        assert info.value.task == "ps:0"
    assert [x.tobytes() for x in ps_client.pull([a, b])] == before


def _push_header(name, dtype, shape, *, seq=1, sparse=False):
    header = ps_pb2.PushHeader(items=[ps_pb2.PushItem(name=name, sparse=sparse, base_version=-1)])
    header.id.client_id, header.id.sequence = "raw", seq
    header.items[0].values.dtype = dtype
    header.items[0].values.shape.extend(shape)
    return header.SerializeToString()


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda n: b"\xff\xff\xff", "malformed"),
        (lambda n: framing.encode_message(None, [bytes(12)]), "no header"),
        (lambda n: framing.encode_message(b"\x0a\xff", [bytes(12)]), "malformed PushHeader"),
        (lambda n: framing.encode_message(_push_header(n, 2, [3]), [bytes(11)]), "truncated"),
        (lambda n: framing.encode_message(_push_header(n, 2, [3]), [bytes(13)]), "more than"),
        (lambda n: framing.encode_message(_push_header(n, 2, [-3]), []), "negative"),
        (lambda n: framing.encode_message(_push_header(n, 99, [3]), [bytes(12)]), "code 99"),
        (lambda n: framing.encode_message(_push_header(n, 2, [2, 3]), [bytes(24)]), r"\(2, 3\)"),
    ],
    ids=[
        "garbage",
        "no-header",
        "bad-header",
        "short",
        "long",
        "negative",
        "dtype",
        "shape",
    ],
)
def test_malformed_raw_pushes_are_invalid_argument(ps_server, ps_client, unique, build, match):
    name = unique + "w"
    ps_client.create_variable(name, np.ones(3, np.float32), optimizer={"name": "sgd"})
    with pytest.raises(grpc.RpcError) as info:
        raw_unary(ps_server.address, "Push", build(name))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert pytest.importorskip("re").search(match, info.value.details()), info.value.details()
    np.testing.assert_array_equal(ps_client.pull(name), np.ones(3, np.float32))


def test_truncated_and_misaligned_streams(ps_server, ps_client, unique):
    name = unique + "w"
    ps_client.create_variable(name, np.ones(1000), optimizer={"name": "sgd", "learning_rate": 1.0})
    grad = np.arange(1000, dtype=np.float64)
    data = grad.tobytes()
    header = _push_header(name, 3, [1000], seq=1)
    # truncated: the stream ends 5 bytes early -> nothing applied
    messages = [
        framing.encode_message(header, [data[:3001]]),
        framing.encode_message(None, [data[3001:-5]]),
    ]
    with pytest.raises(grpc.RpcError) as info:
        raw_stream(ps_server.address, "PushStream", messages)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "truncated" in info.value.details()
    np.testing.assert_array_equal(ps_client.pull(name), np.ones(1000))
    # chunks cut in the middle of elements are joined and applied correctly
    messages = [framing.encode_message(header, [data[:3001]])]
    messages += [framing.encode_message(None, [data[i : i + 777]]) for i in range(3001, 8000, 777)]
    ps_client_reply = ps_pb2.PushResponse.FromString(
        raw_stream(ps_server.address, "PushStream", messages)
    )
    assert ps_client_reply.applied
    np.testing.assert_array_equal(ps_client.pull(name), 1 - grad)


def test_unreachable_task_error_names_task_and_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens
    client = PSClient(f"127.0.0.1:{port}", task="ps:7", timeout=1.0)
    with client, pytest.raises((UnavailableError, DeadlineExceededError)) as info:
        client.pull(["w"])
    assert f"ps:7 at 127.0.0.1:{port}" in str(info.value)
    assert info.value.task == "ps:7"


def test_async_calls_to_two_ps_tasks(start_ps):
    servers = [start_ps("--task", f"ps:{i}") for i in range(2)]
    clients = [PSClient(s.address, task=f"ps:{i}", timeout=30) for i, s in enumerate(servers)]
    try:
        for i, c in enumerate(clients):
            c.create_variable("w", np.full(3, float(i)), optimizer={"name": "sgd"})
        pushes = [c.push_async({"w": np.ones(3)}) for c in clients]
        assert all(f.result(30).applied for f in pushes)
        pulls = [c.pull_async("w") for c in clients]
        np.testing.assert_allclose(pulls[0].result(30), -0.01)
        np.testing.assert_allclose(pulls[1].result(30), 0.99)
    finally:
        for c in clients:
            c.close()


def test_reflection_and_health_are_served(ps_server, ps_client):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    assert ps_client.health() == "SERVING"
    assert ps_client.health("psflow.v1.ParameterServer") == "SERVING"
    with grpc.insecure_channel(ps_server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    names = {s.name for s in reply.list_services_response.service}
    assert "psflow.v1.ParameterServer" in names and "grpc.health.v1.Health" in names


def test_calls_retry_until_a_late_server_comes_up(start_ps):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = PSClient(f"127.0.0.1:{port}", timeout=60)
    started = {}

    def start_later():
        time.sleep(1.0)
        started["server"] = start_ps("--port", str(port))

    late = threading.Thread(target=start_later)
    late.start()
    try:
        # Issued before anything listens: retried with backoff until the PS is up.
        assert client.create_variable("w", np.ones(2, np.float32))
        late.join(60)
        assert started["server"].port == port
        np.testing.assert_array_equal(client.pull("w"), np.ones(2, np.float32))
    finally:
        late.join(60)
        client.close()
