"""Dynamic embedding tables over gRPC: real PS processes on loopback.

The reference is a single in-process DynamicTable (and, for SGD, a dense table
of the same rows): a table sharded over PS processes must read and update the
same bits.  Checkpoints are restored onto a different number of PS processes
and onto a PS killed with SIGKILL and restarted.
"""

from __future__ import annotations

import signal
import time

import grpc
import numpy as np
import pytest

from psflow import errors
from psflow.proto import embedding_pb2
from psflow.ps.dynamic_table import DynamicTable, TableConfig
from psflow.ps.hot_rows import HotRowPolicy
from psflow.ps.key_index import shard_of
from psflow.transport import codec
from psflow.transport.client import PSClient
from psflow.transport.embedding_client import EmbeddingClient

pytestmark = pytest.mark.slow

DIM = 8


def _traffic(seed: int, steps: int, batch: int = 64):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        # Zipf ids from a huge space, with duplicates in each batch.
        ids = (rng.zipf(1.2, size=batch).astype(np.int64) * 2654435761) % (2**62)
        yield ids, rng.standard_normal((batch, DIM)).astype(np.float32)


def _cluster(start_ps, n: int) -> list:
    return [start_ps("--task", f"ps:{i}") for i in range(n)]


def test_sharded_table_equals_one_local_table(start_ps):
    servers = _cluster(start_ps, 2)
    config = TableConfig("emb", DIM, seed=3, optimizer={"name": "sgd", "learning_rate": 0.1})
    reference = DynamicTable(config)
    with EmbeddingClient([s.address for s in servers], timeout=30) as client:
        assert client.create_table(config) is True
        assert client.create_table(config) is False  # idempotent
        for ids, grads in _traffic(0, 15):
            got = client.lookup("emb", ids.reshape(8, 8))
            assert got.shape == (8, 8, DIM)
            assert got.reshape(-1, DIM).tobytes() == reference.lookup(ids).tobytes()
            client.push("emb", ids, grads)
            reference.apply_gradients(ids, grads)
        every = reference.export_state()["ids"]
        assert client.lookup("emb", every).tobytes() == reference.lookup(every).tobytes()
        stats = client.stats()
        assert sum(s["emb"].rows for s in stats) == every.size
        assert all(s["emb"].rows > 0 for s in stats)
        # An inference read (evaluate, predict) of unseen ids makes no row on any shard.
        unseen = np.arange(-40, 0, dtype=np.int64) * 977
        read = client.lookup("emb", unseen, training=False)
        assert read.tobytes() == reference.lookup(unseen, read_only=True).tobytes()
        assert client.stats() == stats
        # Only unique ids travelled: ids + rows of each distinct id per lookup.
        assert client.bytes.pulled < 15 * 64 * (8 + 4 * DIM) + every.size * (8 + 4 * DIM)
        # The servers count the serialized messages: the tensors plus a little framing.
        served_in, served_out = map(sum, zip(*client.server_bytes()))
        tensors = client.bytes.pulled + client.bytes.pushed
        assert tensors < served_in + served_out < 1.2 * tensors


def _raw_call(address: str, method: str, request) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = channel.unary_unary(
            f"/psflow.v1.EmbeddingService/{method}",
            request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
            response_deserializer=lambda b: b,
        )
        try:
            stub(request, timeout=30)
        except grpc.RpcError as e:
            raise errors.from_grpc(e) from None


def test_bad_input_gets_typed_errors_at_the_wire_and_changes_nothing(start_ps):
    (server,) = _cluster(start_ps, 1)
    config = TableConfig("emb", DIM, optimizer={"name": "adagrad", "learning_rate": 0.1})
    with EmbeddingClient([server.address], timeout=30) as client:
        client.create_table(config)
        ids = np.array([1, 2, 3], np.int64)
        before = client.lookup("emb", ids)
        stats_before = client.stats()[0]["emb"]
        int32_ids = codec.encode_tensor(np.array([1, 2, 3], np.int32))
        grads = codec.encode_tensor(np.ones((3, DIM), np.float32))
        cases = [
            (
                "PushGradients",
                embedding_pb2.PushGradientsRequest(table="emb", ids=int32_ids, grads=grads),
                errors.InvalidArgumentError,
                "int64",
            ),
            (
                "Lookup",
                embedding_pb2.LookupRequest(table="emb", ids=int32_ids),
                errors.InvalidArgumentError,
                "int64",
            ),
            (
                "PushGradients",
                embedding_pb2.PushGradientsRequest(
                    table="emb",
                    ids=codec.encode_tensor(ids),
                    grads=codec.encode_tensor(np.ones((3, DIM + 1), np.float32)),
                ),
                errors.InvalidArgumentError,
                "shape",
            ),
            (
                "Lookup",
                embedding_pb2.LookupRequest(table="nope", ids=codec.encode_tensor(ids)),
                errors.NotFoundError,
                "nope",
            ),
            (
                "CreateTable",
                embedding_pb2.CreateTableRequest(
                    config_json='{"name": "neg", "dim": -4}', shard_index=0, num_shards=1
                ),
                errors.InvalidArgumentError,
                "-4",
            ),
            (
                "CreateTable",
                embedding_pb2.CreateTableRequest(
                    config_json=TableConfig("emb", DIM + 1).to_json(), shard_index=0, num_shards=1
                ),
                errors.AlreadyExistsError,
                "emb",
            ),
            (
                "CreateTable",
                embedding_pb2.CreateTableRequest(
                    config_json=TableConfig("other", DIM).to_json(), shard_index=2, num_shards=2
                ),
                errors.InvalidArgumentError,
                "shard 2",
            ),
            ("Lookup", b"\xff\xff\xff", errors.InvalidArgumentError, "malformed"),
        ]
        for method, request, error, match in cases:
            with pytest.raises(error, match=match):
                _raw_call(server.address, method, request)
        # The client itself rejects non-integer ids before sending.
        with pytest.raises(errors.InvalidArgumentError, match="float"):
            client.lookup("emb", np.array([1.5]))
        np.testing.assert_array_equal(client.lookup("emb", ids), before)
        after = client.stats()[0]
        assert set(after) == {"emb"}
        assert (after["emb"].rows, after["emb"].step) == (stats_before.rows, stats_before.step)


def _train(client: EmbeddingClient, seed: int, steps: int) -> None:
    for ids, grads in _traffic(seed, steps):
        client.lookup("emb", ids)
        client.push("emb", ids, grads)


def test_checkpoint_of_two_ps_restores_onto_three(start_ps, tmp_path):
    config = TableConfig("emb", DIM, optimizer={"name": "adagrad", "learning_rate": 0.1})
    old_servers = _cluster(start_ps, 2)
    with EmbeddingClient([s.address for s in old_servers], timeout=30) as old:
        old.create_table(config)
        _train(old, 1, 10)
        old.save(str(tmp_path))
        ids = np.unique(np.concatenate([i for i, _ in _traffic(1, 10)]))
        rows_before = old.lookup("emb", ids)
        total = sum(s["emb"].rows for s in old.stats())
        new_servers = _cluster(start_ps, 3)
        with EmbeddingClient([s.address for s in new_servers], timeout=30) as new:
            assert new.restore(str(tmp_path)) == total
            stats = new.stats()
            assert [s["emb"].rows for s in stats] == [
                int((shard_of(ids, 3) == i).sum()) for i in range(3)
            ]
            assert new.lookup("emb", ids).tobytes() == rows_before.tobytes()
            # The slots came along: the same gradients give the same rows on both.
            for ids_b, grads in _traffic(2, 3):
                ids_b = ids_b % 7 + ids[:1]  # a few restored ids, repeated
                old.push("emb", ids_b, grads)
                new.push("emb", ids_b, grads)
            assert new.lookup("emb", ids).tobytes() == old.lookup("emb", ids).tobytes()


def _restored(address: str) -> None:
    """Waits until a PS started with ``--restore`` reports SERVING: it answers
    calls while it restores (its health says NOT_SERVING until done)."""
    with PSClient(address, timeout=30) as client:
        client.wait_ready(30)


def _when_reachable(call, timeout: float = 30.0):
    """``call()`` once the channel reconnected (gRPC backs off after a refusal)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except errors.UnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_killed_ps_restarts_with_its_table_from_the_last_checkpoint(start_ps, tmp_path):
    config = TableConfig("emb", DIM, optimizer={"name": "sgd", "learning_rate": 0.5})
    servers = _cluster(start_ps, 2)
    addresses = [s.address for s in servers]
    with EmbeddingClient(addresses, timeout=30) as client:
        client.create_table(config)
        _train(client, 4, 5)
        client.save(str(tmp_path))
        ids = np.unique(np.concatenate([i for i, _ in _traffic(4, 5)]))
        saved = client.lookup("emb", ids)
        _train(client, 5, 3)  # lost on ps:1, kept on ps:0
        now = client.lookup("emb", ids)
        servers[1].stop(signal.SIGKILL)
        with pytest.raises(errors.UnavailableError):
            client.lookup("emb", ids)
        on_1 = shard_of(ids, 2) == 1
        # a push sent without waiting raises when it is waited for
        finish = client.start_push("emb", ids[on_1], np.ones((int(on_1.sum()), DIM), np.float32))
        with pytest.raises(errors.UnavailableError, match="ps:1"):
            finish()
        start_ps("--task", "ps:1", "--port", str(servers[1].port), "--restore", str(tmp_path))
        _restored(servers[1].address)
        after = _when_reachable(lambda: client.lookup("emb", ids))
        assert on_1.any() and (~on_1).any()
        assert after[on_1].tobytes() == saved[on_1].tobytes()
        assert after[~on_1].tobytes() == now[~on_1].tobytes()
        assert client.stats()[1]["emb"].rows == int(on_1.sum())


def test_hot_row_cache_cuts_pulled_bytes_and_is_exact_when_refreshed_every_lookup(start_ps):
    servers = _cluster(start_ps, 2)
    addresses = [s.address for s in servers]
    config = TableConfig("emb", DIM, optimizer={"name": "sgd", "learning_rate": 0.1})
    with (
        EmbeddingClient(addresses, timeout=30) as plain,
        EmbeddingClient(addresses, timeout=30, hot_rows=HotRowPolicy(32, 1)) as exact,
        EmbeddingClient(addresses, timeout=30, hot_rows=HotRowPolicy(128, 15)) as lazy,
    ):
        plain.create_table(config)
        for ids, grads in _traffic(7, 30, batch=256):
            want = plain.lookup("emb", ids)
            assert exact.lookup("emb", ids).tobytes() == want.tobytes()
            stale = lazy.lookup("emb", ids)
            # Only cached rows may be stale, and by at most 14 pushes of 0.1 * N(0, 1) sums.
            assert np.abs(stale - want).max() < 10.0
            plain.push("emb", ids, grads)
        assert lazy.bytes.pulled < 0.8 * plain.bytes.pulled, (lazy.bytes, plain.bytes)


def test_sigterm_writes_the_tables_and_restart_restores_them(start_ps, tmp_path):
    config = TableConfig("emb", DIM, optimizer={"name": "adagrad", "learning_rate": 0.1})
    server = start_ps("--task", "ps:0", "--checkpoint-dir", str(tmp_path))
    with EmbeddingClient([server.address], timeout=30) as client:
        client.create_table(config)
        _train(client, 8, 4)
        ids = np.unique(np.concatenate([i for i, _ in _traffic(8, 4)]))
        before = client.lookup("emb", ids)
        stats = client.stats()[0]["emb"]
    assert server.stop(signal.SIGTERM) == 0
    restarted = start_ps("--task", "ps:0", "--restore", str(tmp_path))
    _restored(restarted.address)
    with EmbeddingClient([restarted.address], timeout=30) as client:
        after = client.stats()[0]["emb"]
        assert (after.rows, after.step) == (stats.rows, stats.step)
        assert client.lookup("emb", ids).tobytes() == before.tobytes()


def test_shards_called_in_parallel_or_in_turn_give_the_same_bits(start_ps):
    servers = _cluster(start_ps, 2)
    addresses = [s.address for s in servers]
    with EmbeddingClient(addresses, timeout=30) as default:
        assert default.parallel is True
    optimizer = {"name": "adagrad", "learning_rate": 0.1}
    with (
        EmbeddingClient(addresses, timeout=30, parallel=True) as fanned,
        EmbeddingClient(addresses, timeout=30, parallel=False) as in_turn,
    ):
        fanned.create_table(TableConfig("a", DIM, seed=5, optimizer=optimizer))
        in_turn.create_table(TableConfig("b", DIM, seed=5, optimizer=optimizer))
        for ids, grads in _traffic(3, 12):
            assert fanned.lookup("a", ids).tobytes() == in_turn.lookup("b", ids).tobytes()
            assert fanned.push("a", ids, grads) == in_turn.push("b", ids, grads)
        assert [s["a"].rows for s in fanned.stats()] == [s["b"].rows for s in in_turn.stats()]


def test_a_push_routes_its_own_ids_after_the_lookup_array_changed(start_ps):
    # The client reuses a lookup's split for a push of the same ids; ids changed in
    # place since (same array, new values) must be split anew: a task rejects ids
    # it does not own, so a stale split would fail the push.
    servers = _cluster(start_ps, 2)
    config = TableConfig("emb", DIM, seed=1, optimizer={"name": "sgd", "learning_rate": 1.0})
    reference = DynamicTable(config)
    with EmbeddingClient([s.address for s in servers], timeout=30) as client:
        client.create_table(config)
        ids = np.arange(1, 65, dtype=np.int64)
        client.lookup("emb", ids)
        reference.lookup(ids)
        ids *= 1000003
        grads = np.ones((64, DIM), np.float32)
        steps = client.push("emb", ids, grads)
        assert all(s >= 1 for s in steps)
        assert sum(s["emb"].dropped_gradients for s in client.stats()) == 64  # no rows yet
        client.lookup("emb", ids)
        reference.lookup(ids)
        client.push("emb", ids, grads)
        reference.apply_gradients(ids, grads)
        assert client.lookup("emb", ids).tobytes() == reference.peek(ids).tobytes()
