"""The shared-memory fast path: seqlock mirrors, push payload segments, fallbacks."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from psflow import errors
from psflow.distribute.ps.connection import Grad, VarSpec
from psflow.distribute.ps.grpc_connection import GrpcPSConnection
from psflow.proto import ps_pb2
from psflow.ps.push_types import PushContext
from psflow.transport import codec, framing, shm
from psflow.transport.service import method_path

pytestmark = pytest.mark.skipif(not shm.enabled(), reason="no usable /dev/shm on this machine")


def test_a_reader_never_sees_a_torn_value_while_the_writer_publishes():
    value = np.zeros(1 << 20, np.float32)  # 4 MB: copies release the GIL, so the threads overlap
    mirror = shm.Mirror(f"{shm.new_prefix()}-torn", value)
    reader = shm.MirrorReader(mirror.name, value.dtype, value.shape)
    stop = threading.Event()

    def writer():
        k = 0
        while not stop.is_set() and k < 3000:
            k += 1
            value.fill(k)
            mirror.publish(value, k)
            time.sleep(0.0002)  # a PS publishes after each update, not back to back

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(300):
            got, version = reader.read()
            assert got.min() == got.max(), "a read mixed two writes"
            assert got[0] == version
    finally:
        stop.set()
        t.join(30)
        reader.close()
        mirror.close()


def test_a_retired_mirror_is_reported_to_its_readers():
    mirror = shm.Mirror(f"{shm.new_prefix()}-retire", np.ones(4, np.float64))
    reader = shm.MirrorReader(mirror.name, np.float64, (4,))
    assert reader.read()[0].tolist() == [1.0] * 4
    mirror.close()
    with pytest.raises(shm.MirrorRetiredError):
        reader.read()


def test_segment_names_are_checked():
    for bad in ["../etc/passwd", "psflow-1-zzzz-x", "other", "psflow-12-0123abcd-a/b"]:
        with pytest.raises(errors.InvalidArgumentError, match="segment name"):
            shm.check_name(bad)


def test_segments_of_dead_processes_are_removed():
    script = (
        "import os, numpy as np, psflow.transport.shm as s\n"
        "b = s.PayloadBuffer()\n"
        "print(b.write([np.ones(3)]), flush=True)\n"
        "os._exit(0)  # like a killed process: nothing cleans up\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    name = proc.stdout.strip()
    assert os.path.exists(os.path.join(shm.SHM_DIR, name))  # its process is gone, the file stays
    assert shm.remove_stale() >= 1
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))


def test_a_payload_that_fills_the_segment_but_its_header_grows_it():
    """The segment holds a 64-byte header before the payload: a payload whose size
    lies between the room left after the header and the whole segment must grow the
    segment, not overrun it (this once broke a Keras PS run's push)."""
    buffer = shm.PayloadBuffer()
    try:
        buffer.write([np.ones(1, np.uint8)])
        whole = buffer._segment.size
        payload = [np.arange(whole - shm.HEADER_BYTES + 2, dtype=np.uint8)]
        name = buffer.write(payload)
        segment = shm.Segment(name, 0, create=False, writable=False)
        try:
            got = segment.array(np.uint8, (segment.size,))[shm.HEADER_BYTES :]
            np.testing.assert_array_equal(got[: payload[0].size], payload[0])
        finally:
            segment.close()
    finally:
        buffer.close()


def test_pulls_and_pushes_go_through_shared_memory_and_match_grpc(start_ps):
    server = start_ps()
    fast = GrpcPSConnection(server.address)
    try:
        value = np.arange(12, dtype=np.float32).reshape(3, 4)
        fast.create([VarSpec("w", value.dtype, value.shape, True)], [value])
        fast.configure_optimizer(["w"], {"name": "sgd", "learning_rate": 0.5})
        ((pulled, _),) = fast.pull(["w"])
        assert fast._mirrors["w"] is not None  # the value came from the PS's mirror
        np.testing.assert_array_equal(pulled, value)
        grad = np.ones((3, 4), np.float32)
        fast.push([Grad("w", grad)], PushContext(("t", 1)))
        assert fast._payload is not None  # the gradient went through our segment
        ((after, version),) = fast.pull(["w"])
        np.testing.assert_array_equal(after, value - 0.5)
        os.environ["PSFLOW_SHM"] = "0"
        try:
            slow = GrpcPSConnection(server.address)
        finally:
            del os.environ["PSFLOW_SHM"]
        ((over_grpc, grpc_version),) = slow.pull(["w"])
        np.testing.assert_array_equal(over_grpc, after)
        assert grpc_version == version
        slow.close()
    finally:
        fast.close()


def test_a_large_mixed_push_in_chunks_equals_the_same_push_over_grpc(start_ps):
    """The PS applies a shared-memory payload in 1 MB chunks; tensors that straddle
    chunk boundaries (a float16 one of odd length puts the next off alignment) and
    Adam's slots must come out exactly as the streamed gRPC path leaves them."""
    rng = np.random.default_rng(3)
    values = {
        "h": rng.standard_normal(1_000_001).astype(np.float16),
        "f": rng.standard_normal(700_001).astype(np.float32),
        "d": rng.standard_normal(300_000).astype(np.float64),
    }
    grads = [{k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in values.items()}
             for _ in range(2)]  # fmt: skip
    results = []
    for use_shm in (True, False):
        server = start_ps()
        if not use_shm:
            os.environ["PSFLOW_SHM"] = "0"
        try:
            conn = GrpcPSConnection(server.address)
        finally:
            os.environ.pop("PSFLOW_SHM", None)
        try:
            specs = [VarSpec(k, v.dtype, v.shape, True) for k, v in values.items()]
            conn.create(specs, list(values.values()))
            conn.configure_optimizer(list(values), {"name": "adam", "learning_rate": 0.01})
            for i, g in enumerate(grads):
                conn.push([Grad(k, v) for k, v in g.items()], PushContext(("t", i)))
            assert (conn._payload is not None) == use_shm
            results.append([a for a, _ in conn.pull(list(values))])
        finally:
            conn.close()
    for via_shm, via_grpc in zip(*results, strict=True):
        assert via_shm.tobytes() == via_grpc.tobytes()


def test_a_push_naming_a_bad_segment_is_rejected_and_changes_nothing(start_ps):
    server = start_ps()
    conn = GrpcPSConnection(server.address)
    try:
        conn.create([VarSpec("v", np.dtype(np.float32), (2,), True)], [np.zeros(2, np.float32)])
        conn.configure_optimizer(["v"], {"name": "sgd", "learning_rate": 1.0})
        for name, code in [
            ("../../etc/passwd", grpc.StatusCode.INVALID_ARGUMENT),
            # SegmentUnreachableError: the one push answer that sends a client to gRPC
            (f"{shm.new_prefix()}-nope-{'0' * 32}", grpc.StatusCode.UNIMPLEMENTED),
        ]:
            header = ps_pb2.PushHeader(shm_payload=name)
            header.id.client_id, header.id.sequence = "bad", 1
            header.items.add(name="v", values=codec.spec_to_proto(np.float32, (2,)))
            message = framing.encode_message(header.SerializeToString(), [])
            with (
                grpc.insecure_channel(server.address) as channel,
                pytest.raises(grpc.RpcError) as info,
            ):
                channel.unary_unary(method_path("Push"))(message, timeout=10)
            assert info.value.code() == code, info.value.details()
        ((v, _),) = conn.pull(["v"])
        assert v.tolist() == [0.0, 0.0]
    finally:
        conn.close()


def test_a_push_the_ps_cannot_see_falls_back_to_grpc_and_applies_once(
    start_ps, tmp_path, monkeypatch
):
    # The client's segments go to a directory the PS never looks in: to the PS the
    # client is on another host (the PS answers SegmentUnreachableError, UNIMPLEMENTED).
    server = start_ps()
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    conn = GrpcPSConnection(server.address)
    try:
        conn.create([VarSpec("far", np.dtype(np.float32), (3,), True)], [np.zeros(3, np.float32)])
        conn.configure_optimizer(["far"], {"name": "sgd", "learning_rate": 1.0})
        conn.push([Grad("far", np.ones(3, np.float32))], PushContext(("far", 1)))
        assert conn._shm is False  # later pushes go straight over gRPC
        conn.push([Grad("far", np.ones(3, np.float32))], PushContext(("far", 2)))
        ((v, _),) = conn.pull(["far"])
        assert v.tolist() == [-2.0, -2.0, -2.0]  # each push applied exactly once
    finally:
        conn.close()


def test_a_restarted_ps_is_read_afresh_not_from_its_old_mirror(start_ps, tmp_path):
    server = start_ps()
    conn = GrpcPSConnection(server.address)
    try:
        conn.create([VarSpec("r", np.dtype(np.float64), (3,), True)], [np.full(3, 7.0)])
        assert conn.pull(["r"])[0][0].tolist() == [7.0] * 3
        port = server.port
        server.reap()  # SIGKILL: the old mirror is never retired by its PS
        from tests.conftest import start_server

        again = start_server(
            "ps_server", ["--port", str(port)], "PSFLOW_READY ps", log_dir=tmp_path
        )
        try:
            conn.create([VarSpec("r", np.dtype(np.float64), (3,), True)], [np.full(3, 1.0)])
            assert conn.pull(["r"])[0][0].tolist() == [1.0] * 3
        finally:
            again.reap()
    finally:
        conn.close()


# -- segments someone else put under /dev/shm (issue 21) ----------------------------------------
def _payload_file(path: str, token: bytes, payload: bytes, mode: int = 0o600) -> None:
    """A file laid out as a genuine push segment: magic, token, then the payload."""
    header = np.zeros(shm.HEADER_BYTES, np.uint8)
    header[:8] = np.frombuffer(np.int64(shm.PAYLOAD_MAGIC).tobytes(), np.uint8)
    header[8:24] = np.frombuffer(token, np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, header.tobytes() + payload)
    finally:
        os.close(fd)
    os.chmod(path, mode)


def _planted(kind: str, name: str, token: bytes, tmp_path) -> None:
    """Puts ``kind`` of thing at /dev/shm/<name>."""
    path = os.path.join(shm.SHM_DIR, name)
    secret = np.full(2, 1000.0, np.float32).tobytes()  # what a leak would apply
    if kind == "symlink":  # to a file the server can read, even one laid out as a segment
        target = tmp_path / "secret"
        _payload_file(str(target), token, secret)
        os.symlink(target, path)
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "directory":
        os.mkdir(path, 0o700)
    elif kind == "no token":
        _payload_file(path, b"\0" * 16, secret)
    elif kind == "open to others":
        _payload_file(path, token, secret, mode=0o644)
    else:
        raise AssertionError(kind)


@pytest.fixture(scope="module")
def planted_ps(start_ps_module):
    return start_ps_module()


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, code",
    [
        ("symlink", grpc.StatusCode.INVALID_ARGUMENT),
        ("fifo", grpc.StatusCode.INVALID_ARGUMENT),
        ("directory", grpc.StatusCode.INVALID_ARGUMENT),
        ("no token", grpc.StatusCode.INVALID_ARGUMENT),
        ("open to others", grpc.StatusCode.PERMISSION_DENIED),
    ],
)
def test_a_push_segment_the_client_did_not_create_is_refused(planted_ps, tmp_path, kind, code):
    server = planted_ps
    var = f"v-{kind.replace(' ', '-')}"
    conn = GrpcPSConnection(server.address)
    token = os.urandom(16)
    name = f"{shm.new_prefix()}-evil-{token.hex()}"
    _planted(kind, name, token, tmp_path)
    try:
        conn.create([VarSpec(var, np.dtype(np.float32), (2,), True)], [np.zeros(2, np.float32)])
        conn.configure_optimizer([var], {"name": "sgd", "learning_rate": 1.0})
        header = ps_pb2.PushHeader(shm_payload=name)
        header.id.client_id, header.id.sequence = "planted", 1
        header.items.add(name=var, values=codec.spec_to_proto(np.float32, (2,)))
        message = framing.encode_message(header.SerializeToString(), [])
        with grpc.insecure_channel(server.address) as channel:
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary(method_path("Push"))(message, timeout=20)
            assert info.value.code() == code, info.value.details()
            assert time.monotonic() - start < 10  # a FIFO does not block the open
        # nothing applied, and our own shared-memory pushes still go through
        conn.push([Grad(var, np.ones(2, np.float32))], PushContext((var, 1)))
        assert conn._payload is not None
        ((v, _),) = conn.pull([var])
        assert v.tolist() == [-1.0, -1.0]
    finally:
        conn.close()
        path = os.path.join(shm.SHM_DIR, name)
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.unlink(path)


def test_a_mirror_reader_does_not_follow_links(tmp_path):
    value = np.arange(3, dtype=np.float64)
    mirror = shm.Mirror(f"{shm.new_prefix()}-v1", value)
    link = f"{shm.new_prefix()}-v1"
    os.symlink(os.path.join(shm.SHM_DIR, mirror.name), os.path.join(shm.SHM_DIR, link))
    try:
        with pytest.raises(errors.InvalidArgumentError, match="cannot be used"):
            shm.MirrorReader(link, np.float64, (3,))
        reader = shm.MirrorReader(mirror.name, np.float64, (3,))
        assert reader.read()[0].tolist() == [0.0, 1.0, 2.0]
        reader.close()
    finally:
        os.unlink(os.path.join(shm.SHM_DIR, link))
        mirror.close()
