"""Dynamic-table lookups and pushes over the PS's raw TCP data plane.

Real PS processes on loopback.  The reference is the gRPC path of the same
tables: the same traffic must read and write the same bits either way.  The
unhappy variants: a PS killed while lookups run (a typed error, no hang), a
wrong token (refused, nothing changes), malformed frames (typed errors).
"""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

from psflow import errors
from psflow.proto import embedding_pb2
from psflow.ps.dynamic_table import TableConfig
from psflow.security.config import SecurityConfig
from psflow.transport import embedding_plane
from psflow.transport.dataplane import DataPlaneClient
from psflow.transport.embedding_client import EmbeddingClient

pytestmark = pytest.mark.slow

DIM = 8
TOKEN = "embedding-plane-test-token-0123456789"
OPTIMIZER = {"name": "adagrad", "learning_rate": 0.1}


def _traffic(seed: int, steps: int, batch: int = 256):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = (rng.zipf(1.3, size=batch).astype(np.int64) * 2654435761) % (2**62)
        yield ids, rng.standard_normal((batch, DIM)).astype(np.float32)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_lookups_and_pushes_over_the_data_plane_equal_grpc_bit_for_bit(start_ps):
    servers = [start_ps("--task", f"ps:{i}", "--shm", "off") for i in range(2)]
    addresses = [s.address for s in servers]
    with (
        EmbeddingClient(addresses, timeout=30) as plane,
        EmbeddingClient(addresses, timeout=30, data_plane=False) as grpc_only,
    ):
        for client, name in ((plane, "p"), (grpc_only, "g")):
            client.create_table(TableConfig(name, DIM, seed=7, optimizer=OPTIMIZER))
        for ids, grads in _traffic(1, 6):
            rows_p, rows_g = plane.lookup("p", ids), grpc_only.lookup("g", ids)
            assert _same_bits(rows_p, rows_g)
            assert plane.push("p", ids, grads) == grpc_only.push("g", ids, grads)
        probe = np.unique(np.concatenate([i for i, _ in _traffic(1, 6)]))
        assert _same_bits(plane.lookup("p", probe), grpc_only.lookup("g", probe))
        # inference reads create nothing either way
        unseen = np.arange(5, dtype=np.int64) + 10**15
        assert _same_bits(plane.lookup("p", unseen, False), grpc_only.lookup("g", unseen, False))
        assert [s["p"].rows for s in plane.stats()] == [s["g"].rows for s in plane.stats()]
        assert all(a is not None for a in plane.data_plane_addresses)
        assert grpc_only.data_plane_addresses == [None, None]
        # the servers count the data plane's bytes too (the benchmark's bytes/step)
        assert all(b_in > 0 and b_out > 0 for b_in, b_out in plane.server_bytes())


def test_ps_killed_while_lookups_run_gives_a_typed_error_not_a_hang(start_ps):
    servers = [start_ps("--task", f"ps:{i}", "--shm", "off") for i in range(2)]
    ids = np.arange(20_000, dtype=np.int64) * 7919
    with EmbeddingClient([s.address for s in servers], timeout=10) as client:
        client.create_table(TableConfig("t", DIM, optimizer=OPTIMIZER))
        client.lookup("t", ids)
        assert all(a is not None for a in client.data_plane_addresses)
        outcome: list[BaseException] = []

        def loop() -> None:
            deadline = time.monotonic() + 30
            try:
                while time.monotonic() < deadline:
                    client.lookup("t", ids)
            except BaseException as e:  # the test inspects it
                outcome.append(e)

        thread = threading.Thread(target=loop)
        thread.start()
        time.sleep(0.3)
        servers[1].stop(signal.SIGKILL)
        thread.join(40)
        assert not thread.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], errors.UnavailableError), outcome
        assert "ps:1" in str(outcome[0])
        with pytest.raises(errors.UnavailableError, match="ps:1"):
            client.push("t", ids, np.ones((ids.size, DIM), np.float32))


def test_wrong_token_and_malformed_frames_are_refused_and_change_nothing(start_ps):
    server = start_ps("--shm", "off", env={"PSFLOW_AUTH_TOKEN": TOKEN})
    good = SecurityConfig(token=TOKEN)
    ids = np.array([3, 5, 11], np.int64)
    with EmbeddingClient([server.address], timeout=30, security=good) as client:
        client.create_table(TableConfig("t", DIM, optimizer=OPTIMIZER))
        before = client.lookup("t", ids)
        (address,) = client.data_plane_addresses
        assert address is not None
        header, buffers = embedding_plane.push_request(
            "t", ids, np.ones((3, DIM), np.float32), ("intruder", 1), ""
        )
        for token in ("wrong-token-wrong-token-wrong", None):
            with (
                DataPlaneClient(address, SecurityConfig(token=token), task="ps:0") as bad,
                pytest.raises(errors.UnauthenticatedError),
            ):
                bad.call(embedding_plane.PUSH, header, buffers, timeout=10)
        with DataPlaneClient(address, good, task="ps:0") as plane:
            # a payload shorter than its tensors announce
            with pytest.raises(errors.InvalidArgumentError, match="grads"):
                plane.call(embedding_plane.PUSH, header, [buffers[0]], timeout=10)
            # tensor bytes inside the header instead of the payload
            inline = embedding_pb2.LookupRequest(table="t")
            inline.ids.CopyFrom(embedding_plane.spec(ids))
            inline.ids.data = ids.tobytes()
            with pytest.raises(errors.InvalidArgumentError, match="payload"):
                plane.call(embedding_plane.LOOKUP, inline.SerializeToString(), [], timeout=10)
            # int32 ids: the same typed error as over gRPC
            h32, b32 = embedding_plane.lookup_request("t", ids.astype(np.int32), False)
            with pytest.raises(errors.InvalidArgumentError, match="int64"):
                plane.call(embedding_plane.LOOKUP, h32, b32, timeout=10)
            with pytest.raises(errors.InvalidArgumentError, match="malformed"):
                plane.call(embedding_plane.LOOKUP, b"\xff\xff\xff", [], timeout=10)
            with pytest.raises(errors.NotFoundError):
                h, b = embedding_plane.lookup_request("nope", ids, False)
                plane.call(embedding_plane.LOOKUP, h, b, timeout=10)
        assert _same_bits(client.lookup("t", ids), before)
        assert client.stats()[0]["t"].step == 0
