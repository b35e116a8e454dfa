"""Push and pull over the PS's data plane, compared with the gRPC path on real processes.

Each test starts ``python -m ps_server`` processes on 127.0.0.1 and drives them
with two :class:`PSClient` objects: one on the data plane (the default), one
on gRPC only (``data_plane=False``).  Values are compared bit for bit and every
failure must raise the error class the gRPC path raises for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import threading
import time

import numpy as np
import pytest

from psflow import compression
from psflow.distribute.ps.connection import VarSpec
from psflow.distribute.ps.grpc_connection import GrpcPSConnection
from psflow.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    MovedError,
    NotFoundError,
    UnauthenticatedError,
    UnavailableError,
)
from psflow.proto import ps_pb2
from psflow.ps.push_types import Gradient, PushContext
from psflow.security.config import SecurityConfig
from psflow.transport import codec
from psflow.transport.client import PSClient
from psflow.transport.dataplane import DataPlaneClient, auth, frames
from tests.conftest import pick_free_port, stop_process
from tests.test_auth_tls import make_pki, tls

pytestmark = pytest.mark.slow

TOKEN = "dataplane-ps-test-token-0123456789"
SGD = json.dumps({"name": "sgd", "learning_rate": 1.0}, sort_keys=True)


def _clients(address, **kwargs):
    plane = PSClient(address, timeout=30, **kwargs)
    grpc_only = PSClient(address, timeout=30, data_plane=False, **kwargs)
    return plane, grpc_only


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def ps(start_ps_module):
    return start_ps_module("--shm", "off")


def test_ready_line_names_the_data_port(ps):
    assert " data_port=" in ps.ready_line
    with PSClient(ps.address) as client:
        client.pull  # noqa: B018 - nothing asked yet
        assert client.data_plane_address is None
        client.create_variable("ready/w", np.zeros(2, np.float32))
        client.pull("ready/w")
        port = int(ps.ready_line.split("data_port=")[1].split()[0])
        assert client.data_plane_address == f"127.0.0.1:{port}"


@pytest.mark.parametrize("rule", [{"name": "sgd", "learning_rate": 0.1}, {"name": "adam"}])
def test_push_and_pull_equal_the_grpc_path_bit_for_bit(ps, rule):
    plane, grpc_only = _clients(ps.address)
    rng = np.random.default_rng(7)
    key = rule["name"]
    init = {
        "dense": rng.standard_normal((300, 17)).astype(np.float32),
        "table": rng.standard_normal((50, 8)).astype(np.float64),
        "big": rng.standard_normal(600_000).astype(np.float32),  # above the unary threshold
    }
    try:
        for client, tag in ((plane, "plane"), (grpc_only, "grpc")):
            client.create_variables(
                {f"{key}/{tag}/{n}": v for n, v in init.items()}, optimizer=rule
            )
        for _ in range(4):
            dense = rng.standard_normal((300, 17)).astype(np.float32)
            rows = rng.integers(0, 50, 12)
            values = rng.standard_normal((12, 8)).astype(np.float64)
            big = rng.standard_normal(600_000).astype(np.float32)
            for client, tag in ((plane, "plane"), (grpc_only, "grpc")):
                client.push(
                    {
                        f"{key}/{tag}/dense": dense,
                        f"{key}/{tag}/table": (rows, values),
                        f"{key}/{tag}/big": big,
                    }
                )
        assert plane.data_plane_address is not None
        assert grpc_only.data_plane_address is None
        names = ["dense", "table", "big"]
        got_plane = plane.pull([f"{key}/plane/{n}" for n in names])
        got_grpc = grpc_only.pull([f"{key}/grpc/{n}" for n in names])
        for n, a, b in zip(names, got_plane, got_grpc, strict=True):
            assert _same_bits(a, b), n
            assert not np.array_equal(a, init[n]), n
        idx = np.array([3, 3, 49, 0])
        assert _same_bits(
            plane.pull_rows(f"{key}/plane/table", idx),
            grpc_only.pull_rows(f"{key}/grpc/table", idx),
        )
        out = [np.empty((300, 17), np.float32), np.empty(600_000, np.float32)]
        plane.pull([f"{key}/plane/dense", f"{key}/plane/big"], out=out)
        assert _same_bits(out[0], got_plane[0]) and _same_bits(out[1], got_plane[2])
    finally:
        plane.close()
        grpc_only.close()


def test_retried_push_over_the_data_plane_applies_once(ps):
    with PSClient(ps.address, timeout=30) as client:
        client.create_variable("once/w", np.zeros(4, np.float32), optimizer={"name": "sgd"})
        push_id = client.next_request_id()
        first = client.push({"once/w": np.ones(4, np.float32)}, push_id=push_id)
        again = client.push({"once/w": np.ones(4, np.float32)}, push_id=push_id)
        assert client.data_plane_address is not None
        assert (first.duplicate, again.duplicate) == (False, True)
        np.testing.assert_array_equal(client.pull("once/w"), np.full(4, -0.01, np.float32))


def test_started_pushes_equal_pushes_and_a_resent_one_applies_once(ps):
    rule = {"name": "adam", "learning_rate": 0.01}
    with PSClient(ps.address, timeout=30) as client, PSClient(ps.address, timeout=30) as ref:
        for c in (client, ref):
            c.create_variable(f"started/{id(c)}", np.zeros(64, np.float32), optimizer=rule)
        assert client.start_push({f"started/{id(client)}": np.ones(64, np.float32)}) is None
        client.pull(f"started/{id(client)}")  # asks for the data plane: pushes start from now on
        rng = np.random.default_rng(3)
        for _ in range(5):
            g = rng.standard_normal(64).astype(np.float32)
            started = client.start_push({f"started/{id(client)}": g})
            want = ref.push({f"started/{id(ref)}": g})
            got = started.result()
            assert (got.applied, got.duplicate, got.versions) == (True, False, want.versions)
        assert _same_bits(client.pull(f"started/{id(client)}"), ref.pull(f"started/{id(ref)}"))
        push_id = client.next_request_id()
        name = f"started/{id(client)}"
        first = client.start_push({name: np.ones(64, np.float32)}, push_id=push_id)
        again = client.start_push({name: np.ones(64, np.float32)}, push_id=push_id)
        assert (first.result().duplicate, again.result().duplicate) == (False, True)
        with pytest.raises(InvalidArgumentError, match="read or given up"):
            first.result()  # a reply is read once: never a silent second push
        # the PS's typed error comes back from result(); the connection goes on serving
        unknown = client.start_push({"started/none": np.ones(2, np.float32)})
        with pytest.raises(NotFoundError, match="started/none"):
            unknown.result()
        assert client.start_push({name: np.ones(64, np.float32)}).result().applied


def test_a_connection_starts_plain_pushes_on_the_client_and_compressed_ones_itself(ps, monkeypatch):
    # the session's fan-out calls connection.start_push: where the adapter adds nothing
    # it is the client's own method; compression set after construction (as the strategy
    # sets it) must take it back, or a started push would skip the encoding
    monkeypatch.setenv("PSFLOW_SHM", "0")
    conn = GrpcPSConnection(ps.address, task="ps:0", timeout=30.0)
    name = f"conn/{id(conn)}"
    g = np.full(64, 1 + 2.0**-10, np.float32)  # bf16 rounds it to 1.0

    def push_as_the_session() -> bool:
        context = PushContext(conn.client.next_request_id(), rule_json=SGD)
        started = conn.start_push([Gradient(name, g, None, -1)], context)
        if started is None:
            conn.push([Gradient(name, g, None, -1)], context)
        else:
            assert started.result().applied
        return started is not None

    with contextlib.closing(conn):
        conn.create([VarSpec(name, np.dtype(np.float32), (64,), True)], [np.zeros(64, "f4")])
        conn.pull([name])  # asks for the data plane: pushes start from now on
        assert getattr(conn.start_push, "__self__", None) is conn.client
        assert push_as_the_session()
        np.testing.assert_array_equal(conn.pull([name])[0][0], -g)
        conn.compression = compression.feedback_from_option("bf16")
        assert not push_as_the_session()  # pushed by push(), encoded
        np.testing.assert_array_equal(conn.pull([name])[0][0], -g - 1.0)
        conn.compression = None
        assert push_as_the_session()
        np.testing.assert_array_equal(conn.pull([name])[0][0], -2 * g - 1.0)


def test_a_pending_sync_contribution_outlives_the_reused_receive_buffer(ps):
    # a sync contribution waits at the PS for the step's others while the connection it
    # came on reuses its receive buffer for the next push: the PS must hold its own copy
    early, late = PSClient(ps.address, timeout=30), PSClient(ps.address, timeout=30)
    with early, late:
        early.create_variables(
            {"pending/w": np.zeros(1024, np.float32), "pending/other": np.zeros(1024, np.float32)},
            optimizer={"name": "sgd", "learning_rate": 1.0},
        )
        sync = {"step": 1, "num_required": 2}
        reply = early.push({"pending/w": np.full(1024, 2, np.float32)}, **sync)
        assert not reply.applied and early.data_plane_address is not None
        # the same pooled connection, the same size: the same server buffer, overwritten
        early.push({"pending/other": np.full(1024, 999, np.float32)})
        assert late.push({"pending/w": np.full(1024, 4, np.float32)}, **sync).applied
        np.testing.assert_array_equal(early.pull("pending/w"), np.full(1024, -3, np.float32))


def test_a_started_push_to_a_ps_killed_for_good_raises_unavailable(start_ps):
    server = start_ps("--shm", "off")
    with PSClient(server.address, timeout=5) as client:
        client.create_variable("w", np.zeros(1 << 20, np.float32), optimizer={"name": "sgd"})
        client.pull("w")
        stop_process(server.proc)  # sent while it is stopped, then it dies
        started = client.start_push({"w": np.ones(1 << 20, np.float32)})
        server.proc.kill()
        server.proc.wait(10)
        begin = time.monotonic()
        with pytest.raises(UnavailableError, match=r"Push to ps:0"):
            started.result()
        assert time.monotonic() - begin < 10
        assert client.start_push({"w": np.ones(4, np.float32)}) is None  # plane forgotten


def _push_frame(name: str, data: np.ndarray, client_id: str = "raw") -> tuple[bytes, bytes]:
    header = ps_pb2.PushHeader()
    header.id.client_id, header.id.sequence = client_id, 1
    header.items.add(name=name, values=codec.spec_to_proto(data.dtype, data.shape))
    return header.SerializeToString(), data.tobytes()


def _hello(sock: socket.socket, token: str | None) -> None:
    body = auth.hello(SecurityConfig(token=token))
    sock.sendall(frames.pack(frames.Kind.HELLO, header_len=len(body)) + body)


def _read_frame(sock: socket.socket) -> tuple[frames.FrameHead, bytes]:
    raw = b""
    while len(raw) < frames.FIXED.size:
        chunk = sock.recv(frames.FIXED.size - len(raw))
        assert chunk, "closed"
        raw += chunk
    head = frames.unpack(raw, max_header=1 << 20, max_payload=1 << 30)
    body = b""
    while len(body) < head.header_len:
        body += sock.recv(head.header_len - len(body))
    return head, body


def _closed(sock: socket.socket) -> bool:
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True


def test_wrong_token_and_hostile_frames_change_nothing(start_ps):
    server = start_ps("--shm", "off", env={"PSFLOW_AUTH_TOKEN": TOKEN})
    good = SecurityConfig(token=TOKEN)
    with PSClient(server.address, security=good, timeout=30) as client:
        client.create_variable("w", np.zeros(8, np.float32), optimizer={"name": "sgd"})
        client.pull("w")
        address = client.data_plane_address
        assert address is not None
        host, port = address.rsplit(":", 1)
        header, payload = _push_frame("w", np.ones(8, np.float32))
        for token in ("wrong-token-wrong-token-wrong", None):
            with (
                DataPlaneClient(address, SecurityConfig(token=token), task="ps:0") as bad,
                pytest.raises(UnauthenticatedError),
            ):
                bad.call("Push", header, [payload], timeout=10)
        # a well-formed frame with a malformed protobuf header: an error, the connection lives
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            _hello(sock, TOKEN)
            assert _read_frame(sock)[0].kind is frames.Kind.WELCOME
            junk = b"\xff\xff\xff"
            sock.sendall(
                frames.pack(
                    frames.Kind.REQUEST, method=frames.method_id("Push"), header_len=len(junk)
                )
                + junk
            )
            head, body = _read_frame(sock)
            assert head.kind is frames.Kind.ERROR and b"INVALID_ARGUMENT" in body
            # a payload shorter than the header announces: refused, nothing applied
            sock.sendall(
                frames.pack(
                    frames.Kind.REQUEST,
                    method=frames.method_id("Push"),
                    header_len=len(header),
                    payload_len=8,
                )
                + header
                + payload[:8]
            )
            head, body = _read_frame(sock)
            assert head.kind is frames.Kind.ERROR and b"INVALID_ARGUMENT" in body
            # a payload above every limit: the connection is closed before anything is read
            sock.sendall(
                frames.pack(
                    frames.Kind.REQUEST,
                    method=frames.method_id("Push"),
                    header_len=len(header),
                    payload_len=1 << 50,
                )
                + header
            )
            assert _closed(sock)
        with pytest.raises(InvalidArgumentError, match="shape"):
            client.push({"w": np.ones(9, np.float32)})
        np.testing.assert_array_equal(client.pull("w"), np.zeros(8, np.float32))
        assert client.stats()["pushes_applied"] == 0
        client.push({"w": np.ones(8, np.float32)})  # still serving
        np.testing.assert_array_equal(client.pull("w"), np.full(8, -0.01, np.float32))
    with (
        PSClient(server.address, security=SecurityConfig(token="x" * 32), timeout=5) as wrong,
        pytest.raises(UnauthenticatedError),
    ):
        wrong.push({"w": np.ones(8, np.float32)})


def _failure(client: PSClient, name: str, timeout: float) -> tuple[type, float]:
    start = time.monotonic()
    try:
        client.push({name: np.ones(1 << 20, np.float32)}, timeout=timeout)
    except Exception as e:  # the class is compared with the gRPC path's
        return type(e), time.monotonic() - start
    raise AssertionError("the push succeeded")


def test_stalled_ps_gives_the_deadline_error_of_the_grpc_path(start_ps):
    server = start_ps("--shm", "off")
    plane, grpc_only = _clients(server.address)
    try:
        for c in (plane, grpc_only):
            c.create_variable(f"w{id(c)}", np.zeros(1 << 20, np.float32), optimizer={"name": "sgd"})
            c.pull(f"w{id(c)}")
        stop_process(server.proc)
        try:
            got = [_failure(c, f"w{id(c)}", 1.5) for c in (plane, grpc_only)]
        finally:
            server.proc.send_signal(signal.SIGCONT)
        assert got[0][0] is got[1][0] is DeadlineExceededError
        assert all(elapsed < 10 for _, elapsed in got)
    finally:
        plane.close()
        grpc_only.close()


def test_ps_killed_mid_push_gives_the_error_of_the_grpc_path(start_ps):
    classes = []
    for use_plane in (True, False):
        server = start_ps("--shm", "off")
        with PSClient(server.address, timeout=30, data_plane=use_plane) as client:
            client.create_variable("w", np.zeros(1 << 22, np.float32), optimizer={"name": "sgd"})
            client.pull("w")
            assert (client.data_plane_address is not None) is use_plane
            stop_process(server.proc)  # the push is under way when it dies
            result = {}
            pusher = threading.Thread(
                target=lambda c=client, r=result: r.update(r=_failure(c, "w", 4.0)), daemon=True
            )
            pusher.start()
            time.sleep(0.5)
            server.proc.kill()
            pusher.join(30)
            assert not pusher.is_alive()
            classes.append(result["r"][0])
    assert classes[0] is classes[1]
    assert issubclass(classes[0], (UnavailableError, DeadlineExceededError))


def test_data_plane_off_on_either_side_uses_grpc(start_ps, monkeypatch, caplog):
    off = start_ps("--shm", "off", "--data-plane", "off")
    assert "data_port=" not in off.ready_line
    with PSClient(off.address, timeout=30) as client:
        client.create_variable("w", np.zeros(3, np.float32), optimizer={"name": "sgd"})
        client.push({"w": np.ones(3, np.float32)})
        np.testing.assert_array_equal(client.pull("w"), np.full(3, -0.01, np.float32))
        assert client.data_plane_address is None
    on = start_ps("--shm", "off")
    monkeypatch.setenv("PSFLOW_DATA_PLANE", "off")
    with PSClient(on.address, timeout=30) as client:
        client.create_variable("w", np.zeros(3, np.float32), optimizer={"name": "sgd"})
        client.push({"w": np.ones(3, np.float32)})
        assert client.data_plane_address is None
    monkeypatch.delenv("PSFLOW_DATA_PLANE")
    # an announced address nobody listens on: one warning, then gRPC
    dead = start_ps("--shm", "off", "--data-advertise", f"127.0.0.1:{pick_free_port()}")
    with caplog.at_level(logging.WARNING), PSClient(dead.address, timeout=30) as client:
        client.create_variable("w", np.zeros(3, np.float32), optimizer={"name": "sgd"})
        for _ in range(3):
            client.push({"w": np.ones(3, np.float32)})
        np.testing.assert_array_equal(client.pull("w"), np.full(3, -0.03, np.float32))
        assert client.data_plane_address is None
    assert sum("cannot be used" in r.getMessage() for r in caplog.records) == 1


def test_bad_data_plane_flags_are_usage_errors(start_ps):
    import subprocess
    import sys

    from tests.conftest import ROOT, child_env

    for flags in (["--data-advertise", "nohostport"], ["--data-port", "70000"]):
        proc = subprocess.run(
            [sys.executable, "-m", "ps_server", "--port", "0", *flags],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        assert flags[1] in proc.stderr


def test_moved_error_travels_over_the_data_plane(start_ps):
    old, new = start_ps("--shm", "off"), start_ps("--shm", "off")
    with PSClient(old.address, task="ps:0", timeout=30) as client:
        client.create_variable("m", np.zeros(5, np.float32), optimizer={"name": "sgd"})
        client.pull("m")
        assert client.data_plane_address is not None
        client.release_shard(["m"], 1, new.address, 3)
        with pytest.raises(MovedError) as push_moved:
            client.push({"m": np.ones(5, np.float32)})
        with pytest.raises(MovedError) as pull_moved:
            client.pull("m")
    for e in (push_moved.value, pull_moved.value):
        assert (e.key, e.owner, e.address, e.version) == ("m", 1, new.address, 3)
        assert e.task == "ps:0"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_tls_push_and_pull_over_the_data_plane(start_ps, pki):
    server = start_ps(
        "--shm",
        "off",
        "--tls-cert",
        pki["node.pem"],
        "--tls-key",
        pki["node.key"],
        "--tls-ca",
        pki["ca.pem"],
    )
    with PSClient(server.address, security=tls(pki), timeout=30) as client:
        client.create_variable("w", np.zeros(70_000, np.float32), optimizer={"name": "sgd"})
        client.push({"w": np.ones(70_000, np.float32)})
        np.testing.assert_array_equal(client.pull("w"), np.full(70_000, -0.01, np.float32))
        address = client.data_plane_address
        assert address is not None
    with (
        DataPlaneClient(address, tls(pki, cert="rogue")) as rogue,
        pytest.raises(UnauthenticatedError),
    ):
        rogue.call("Pull", b"", timeout=10)


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the Prometheus text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_data_plane_calls_count_in_the_same_metrics(start_ps):
    import urllib.request

    server = start_ps("--shm", "off", "--metrics-port", "auto")
    url = f"http://127.0.0.1:{server.ready_line.split('metrics_port=')[1].split()[0]}/metrics"
    with PSClient(server.address, timeout=30) as client:
        client.create_variable("w", np.zeros(256, np.float32), optimizer={"name": "sgd"})
        for _ in range(3):
            client.push({"w": np.ones(256, np.float32)})
        client.pull("w")
        with pytest.raises(InvalidArgumentError):
            client.push({"w": np.ones(3, np.float32)})
        assert client.data_plane_address is not None
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    assert _metric(text, "psflow_ps_rpcs_total", method="Push", code="OK") == 3
    assert _metric(text, "psflow_ps_rpcs_total", method="Push", code="INVALID_ARGUMENT") == 1
    assert _metric(text, "psflow_ps_rpcs_total", method="Pull", code="OK") == 1
    assert _metric(text, "psflow_ps_rejected_total", reason="invalid_argument") == 1
    assert _metric(text, "psflow_ps_push_bytes_total", variable="w") == 3 * 256 * 4
