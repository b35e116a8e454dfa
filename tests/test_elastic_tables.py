"""Dynamic embedding tables through a resize of the parameter servers (real PS processes).

Rows are hashed over the PS tasks; a resize re-shards them with their optimizer
slots and admission counts, and the clients hash by the new count. The chief
trains here by itself (no worker): the tables move at the resize's step boundary.
"""

from __future__ import annotations

import signal

import numpy as np
import pytest

import psflow as pf
from psflow import errors
from psflow.distribute.ps.inprocess import InProcessEmbeddingClient
from psflow.distribute.ps.table_moves import move_tables
from psflow.ps.key_index import shard_of
from tests.test_elastic_cluster import NOWHERE, _drained, _Listing

pytestmark = pytest.mark.slow

DIM, SEED = 4, 9
rng = np.random.default_rng(0)
VOCAB = np.unique(rng.integers(-(2**62), 2**62, size=60, dtype=np.int64))
# seen once before the first resize: with min_count=2 they are admitted only after it
LATE = VOCAB[:10]


def _model(name: str) -> pf.keras.Model:
    return pf.keras.Sequential(
        [
            pf.keras.layers.DynamicEmbedding(
                DIM, seed=SEED, input_shape=(3,), table_name=name, min_count=2
            ),
            pf.keras.layers.Flatten(),
            pf.keras.layers.Dense(1, kernel_initializer=pf.keras.initializers.GlorotUniform(1)),
        ]
    )


def _batches():
    data = np.random.default_rng(1)
    for s in range(9):
        ids = data.choice(VOCAB[10:], size=(8, 3))
        if s == 2:
            ids[0] = LATE[:3]  # counted once, below min_count
        if s >= 4:
            ids[1] = LATE[:3]  # counted again: admitted, on whichever task owns them then
        yield ids, data.normal(size=(8, 1)).astype(np.float32)


def _train(cluster, name: str, resizes: dict[int, int]):
    """Nine SGD steps on the chief, resizing before the steps named in ``resizes``."""
    resolver = _Listing(cluster, 2, workers=[NOWHERE])
    strategy = pf.distribute.ParameterServerStrategy(resolver)
    pf.random.set_seed(0)
    with strategy.scope():
        model = _model(name)
        optimizer = pf.keras.optimizers.SGD(0.1)
    reports = []
    for s, (ids, y) in enumerate(_batches()):
        if s in resizes:
            resolver.num_ps = max(resolver.num_ps, resizes[s])
            reports.append(strategy.resize_parameter_servers(resizes[s], timeout=60))
        with pf.GradientTape() as tape:
            loss = pf.reduce_mean(pf.square(model(pf.constant(ids)) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    client = model.layers[0].table.backend.client
    return model, client, reports


def test_a_table_trained_through_2_3_1_resizes_equals_the_fixed_layout_bit_for_bit(
    start_cluster,
):
    fixed_cluster = start_cluster(num_ps=2, num_workers=0)
    fixed, fixed_client, _ = _train(fixed_cluster, "fixed", {})
    cluster = start_cluster(num_ps=3, num_workers=0)
    elastic, client, reports = _train(cluster, "elastic", {3: 3, 6: 1})
    assert [(r.old_num_ps, r.new_num_ps) for r in reports] == [(2, 3), (3, 1)]
    assert client.num_shards == 1
    np.testing.assert_array_equal(
        client.lookup("elastic", VOCAB), fixed_client.lookup("fixed", VOCAB)
    )
    np.testing.assert_array_equal(elastic.layers[2].kernel.numpy(), fixed.layers[2].kernel.numpy())
    # the late ids were admitted after the resize: their counts moved with them
    rows = {
        n: sum(s[n].rows for s in c.stats())
        for n, c in (("elastic", client), ("fixed", fixed_client))
    }
    assert rows["elastic"] == rows["fixed"] > len(VOCAB) // 2
    for server in cluster.ps[1:]:
        assert "PSFLOW_DRAINED" in _drained(server)


def test_every_row_reads_the_same_after_2_3_1_and_each_task_holds_its_own(start_cluster):
    cluster = start_cluster(num_ps=3, num_workers=0)
    resolver = _Listing(cluster, 2, workers=[NOWHERE])
    strategy = pf.distribute.ParameterServerStrategy(resolver)
    with strategy.scope():
        layer = pf.keras.layers.DynamicEmbedding(
            DIM, seed=SEED, table_name="t", optimizer={"name": "adagrad", "learning_rate": 0.1}
        )
        layer.build()
    client = layer.table.backend.client
    client.lookup("t", VOCAB)  # creates the rows
    for s in range(3):  # rows with adagrad accumulators
        client.push("t", VOCAB, np.full((VOCAB.size, DIM), 0.5 + s, np.float32))
    before = client.lookup("t", VOCAB)

    resolver.num_ps = 3
    strategy.resize_parameter_servers(3, timeout=60)
    np.testing.assert_array_equal(client.lookup("t", VOCAB), before)
    held = [s["t"].rows for s in client.stats()]
    owners = shard_of(VOCAB, 3)
    assert held == [int((owners == i).sum()) for i in range(3)]  # none kept twice

    strategy.resize_parameter_servers(1, timeout=60)
    np.testing.assert_array_equal(client.lookup("t", VOCAB), before)
    # the accumulators moved too: one more step equals the same step never moved
    client.push("t", VOCAB, np.ones((VOCAB.size, DIM), np.float32))
    reference = InProcessEmbeddingClient()
    reference.create_table(layer.config)
    reference.lookup("t", VOCAB)
    for s in range(3):
        reference.push("t", VOCAB, np.full((VOCAB.size, DIM), 0.5 + s, np.float32))
    reference.push("t", VOCAB, np.ones((VOCAB.size, DIM), np.float32))
    np.testing.assert_array_equal(client.lookup("t", VOCAB), reference.lookup("t", VOCAB))
    with pytest.raises(errors.InvalidArgumentError):
        client.retarget([])


def _state(client, name: str, directory) -> tuple[dict, dict, np.ndarray]:
    """Every row (value, slots, pushes since its last touch, traffic) and candidate
    (count, age) of table ``name`` by id, and the counters summed over the tasks.

    Read from a checkpoint of every task (``directory`` is for this reading
    only: the move itself has no filesystem)."""
    from psflow.io.safetensors import load_file

    rows, candidates, counters = {}, {}, 0
    for path in client.save(str(directory)):
        part = {k.partition("\x00")[2]: v for k, v in load_file(path).items() if k.startswith(name)}
        step = int(part["step"])
        slots = sorted(k for k in part if k.startswith("slot/"))
        for i, id_ in enumerate(part["ids"].tolist()):
            assert id_ not in rows  # no row is held twice
            rows[id_] = (
                part["rows"][i].tobytes(),
                tuple(part[k][i].tobytes() for k in slots),
                step - int(part["touched"][i]),
                int(part["traffic"][i]),
            )
        for i, id_ in enumerate(part["candidate_ids"].tolist()):
            assert id_ not in candidates
            candidates[id_] = (
                int(part["candidate_counts"][i]),
                step - int(part["candidate_touched"][i]),
            )
        counters = counters + part["counters"]
    return rows, candidates, counters


def test_every_row_slot_and_counter_reads_the_same_after_2_3_1_over_the_wire(start_ps, tmp_path):
    from psflow.ps.dynamic_table import TableConfig
    from psflow.transport.embedding_client import EmbeddingClient

    servers = [start_ps("--task", f"ps:{i}") for i in range(3)]
    addresses = [s.address for s in servers]
    config = TableConfig(
        "t", DIM, seed=SEED, min_count=2, ttl_steps=1000,
        optimizer={"name": "adagrad", "learning_rate": 0.1},
    )  # fmt: skip
    client = EmbeddingClient(addresses[:2])
    try:
        client.create_table(config)
        client.lookup("t", VOCAB[10:])
        client.lookup("t", VOCAB[10:])  # admitted
        client.lookup("t", LATE)  # seen once: candidates
        for s in range(3):
            client.push("t", VOCAB[10:], np.full((VOCAB.size - 10, DIM), 0.5 + s, np.float32))
            client.lookup("t", VOCAB[10 + s :: 7])  # rows touched at different steps
        # ps:0 steps once more than ps:1: the TTL clocks of moved rows keep their age
        first = VOCAB[10:][shard_of(VOCAB[10:], 2) == 0]
        client.push("t", first, np.ones((first.size, DIM), np.float32))
        before = _state(client, "t", tmp_path / "a")
        assert len(before[0]) == VOCAB.size - 10 and len(before[1]) == LATE.size

        # tiny chunks (3 rows each): every table moves in many
        assert move_tables(client, addresses, chunk_bytes=200) == VOCAB.size - 10
        assert client.num_shards == 3
        owners = shard_of(VOCAB[10:], 3)
        assert [s["t"].rows for s in client.stats()] == [int((owners == i).sum()) for i in range(3)]
        assert _state(client, "t", tmp_path / "b")[:2] == before[:2]
        np.testing.assert_array_equal(_state(client, "t", tmp_path / "b2")[2], before[2])

        assert move_tables(client, addresses[:1], chunk_bytes=200) == VOCAB.size - 10
        after = _state(client, "t", tmp_path / "c")
        assert after[:2] == before[:2]
        np.testing.assert_array_equal(after[2], before[2])

        # the candidates kept their counts: one more sighting admits them; the
        # accumulators moved: one more step equals the same steps never moved
        client.lookup("t", LATE)
        client.push("t", VOCAB, np.ones((VOCAB.size, DIM), np.float32))
        reference = InProcessEmbeddingClient()
        reference.create_table(config)
        reference.lookup("t", VOCAB[10:])
        reference.lookup("t", VOCAB[10:])
        reference.lookup("t", LATE)
        for s in range(3):
            reference.push("t", VOCAB[10:], np.full((VOCAB.size - 10, DIM), 0.5 + s, np.float32))
        reference.push("t", first, np.ones((first.size, DIM), np.float32))
        reference.lookup("t", LATE)
        reference.push("t", VOCAB, np.ones((VOCAB.size, DIM), np.float32))
        np.testing.assert_array_equal(
            client.lookup("t", VOCAB, training=False), reference.lookup("t", VOCAB, False)
        )
    finally:
        client.close()


def test_a_target_killed_during_the_move_leaves_the_old_layout_and_a_retry_completes(
    start_ps,
):
    from psflow.ps.dynamic_table import TableConfig
    from psflow.transport.embedding_client import EmbeddingClient

    servers = [start_ps("--task", f"ps:{i}") for i in range(3)]
    addresses = [s.address for s in servers]
    client = EmbeddingClient(addresses[:2], timeout=10)
    try:
        client.create_table(TableConfig("t", DIM, seed=SEED, optimizer={"name": "sgd"}))
        client.lookup("t", VOCAB)
        client.push("t", VOCAB, np.ones((VOCAB.size, DIM), np.float32))
        before = client.lookup("t", VOCAB, training=False)
        held = [s["t"].rows for s in client.stats()]
        # ps:0's rows for ps:1 are staged there before ps:0 meets the dead ps:2
        servers[2].stop(signal.SIGKILL)
        with pytest.raises(errors.UnavailableError, match=r"table 't' from ps:0 to ps:2"):
            move_tables(client, addresses)
        assert client.num_shards == 2  # still routes by the old layout
        assert [s["t"].rows for s in client.stats()] == held  # nothing dropped, nothing merged
        np.testing.assert_array_equal(client.lookup("t", VOCAB, training=False), before)

        restarted = start_ps("--task", "ps:2")
        assert move_tables(client, [*addresses[:2], restarted.address]) == VOCAB.size
        np.testing.assert_array_equal(client.lookup("t", VOCAB, training=False), before)
        owners = shard_of(VOCAB, 3)
        assert [s["t"].rows for s in client.stats()] == [int((owners == i).sum()) for i in range(3)]
    finally:
        client.close()


def test_a_resize_whose_table_move_loses_a_task_drops_nothing_and_a_retry_completes(
    start_cluster, start_ps
):
    cluster = start_cluster(num_ps=3, num_workers=0)
    resolver = _Listing(cluster, 2, workers=[NOWHERE])
    strategy = pf.distribute.ParameterServerStrategy(resolver)
    lost = cluster.ps[2]
    # the added task dies once the variables moved, as the tables start moving
    strategy._session.on_resize(lambda addresses, deadline: lost.stop(signal.SIGKILL))
    with strategy.scope():
        layer = pf.keras.layers.DynamicEmbedding(
            DIM, seed=SEED, table_name="t", optimizer={"name": "sgd", "learning_rate": 0.1}
        )
        layer.build()
    client = layer.table.backend.client
    client.lookup("t", VOCAB)
    client.push("t", VOCAB, np.ones((VOCAB.size, DIM), np.float32))
    before = client.lookup("t", VOCAB, training=False)
    held = [s["t"].rows for s in client.stats()]

    resolver.num_ps = 3
    with pytest.raises(errors.UnavailableError, match=r"table 't' from ps:\d to ps:2"):
        strategy.resize_parameter_servers(3, timeout=30)
    assert client.num_shards == 2
    assert [s["t"].rows for s in client.stats()] == held  # the survivors hold every row
    # the layer reads through the old layout, though the session knows 3 tasks now
    np.testing.assert_array_equal(layer.table.lookup(VOCAB, training=False).numpy(), before)
    assert layer.table.backend.client.num_shards == 2

    strategy._session.resize_steps.pop(0)
    cluster.ps[2] = start_ps("--port", str(lost.port), "--task", "ps:2")
    strategy.resize_parameter_servers(3, timeout=30)
    assert client.num_shards == 3
    np.testing.assert_array_equal(layer.table.lookup(VOCAB, training=False).numpy(), before)
    owners = shard_of(VOCAB, 3)
    assert [s["t"].rows for s in client.stats()] == [int((owners == i).sum()) for i in range(3)]


def test_bad_import_chunks_are_refused_and_a_retried_chunk_counts_once(start_ps):
    from psflow.proto import embedding_pb2
    from psflow.ps.dynamic_table import TableConfig
    from psflow.transport import codec
    from psflow.transport.embedding_client import EmbeddingClient

    servers = [start_ps("--task", f"ps:{i}") for i in range(2)]
    source = EmbeddingClient([servers[0].address])
    target = EmbeddingClient([servers[1].address])
    config = TableConfig("t", DIM, seed=SEED, min_count=2, optimizer={"name": "sgd"})
    try:
        source.create_table(config)
        source.lookup("t", VOCAB[10:])
        source.lookup("t", VOCAB[10:])
        source.lookup("t", LATE)
        target.call(
            0,
            "CreateTable",
            embedding_pb2.CreateTableRequest(
                config_json=config.to_json(), shard_index=1, num_shards=2, move_id="m"
            ),
        )
        assert target.stats() == [{}]  # created for the move: it serves nothing before the switch
        with pytest.raises(errors.NotFoundError):
            target.lookup("t", VOCAB[:1])
        export = embedding_pb2.ExportRowsRequest(
            move_id="m", table="t", num_shards=2, target_shard=1, max_bytes=1 << 20
        )
        chunk = source.call(0, "ExportRows", export).chunk

        def imported(chunk, shard_index=1):
            request = embedding_pb2.ImportRowsRequest(
                move_id="m", source_shard=0, shard_index=shard_index, num_shards=2, chunk=chunk
            )
            return target.call(0, "ImportRows", request)

        wide = embedding_pb2.RowChunk()
        wide.CopyFrom(chunk)
        rows = codec.decode_tensor(chunk.rows)
        wide.rows.CopyFrom(codec.encode_tensor(np.zeros((rows.shape[0], DIM + 1), rows.dtype)))
        with pytest.raises(errors.InvalidArgumentError, match=r"shape \(\d+, 4\)"):
            imported(wide)
        unknown = embedding_pb2.RowChunk()
        unknown.CopyFrom(chunk)
        unknown.config_json = TableConfig("nope", DIM, seed=SEED).to_json()
        with pytest.raises(errors.NotFoundError, match="nope"):
            imported(unknown)
        with pytest.raises(errors.InvalidArgumentError, match="shard 1"):
            imported(chunk, shard_index=0)  # the table here is shard 1
        assert target.stats() == [{}]  # nothing changed
        # a switch of rows never exported (another move) is refused: nothing dropped
        with pytest.raises(errors.FailedPreconditionError, match="never exported"):
            source.call(
                0, "CommitMove", embedding_pb2.CommitMoveRequest(move_id="m2", num_shards=2)
            )
        assert source.stats()[0]["t"].rows == VOCAB.size - 10

        first, again = imported(chunk), imported(chunk)
        assert first.staged == int((shard_of(VOCAB, 2) == 1).sum()) and again.duplicate
        commit = embedding_pb2.CommitMoveRequest(move_id="m", shard_index=1, num_shards=2)
        switched = target.call(0, "CommitMove", commit).rows
        assert switched == first.staged - int((shard_of(LATE, 2) == 1).sum())
        assert target.call(0, "CommitMove", commit).rows == switched  # a retry: no change
        with pytest.raises(errors.FailedPreconditionError, match="committed"):
            imported(chunk)
        # the source switches too; the rows are where shard_of says, each once
        source.call(0, "CommitMove", embedding_pb2.CommitMoveRequest(move_id="m", num_shards=2))
        both = EmbeddingClient([s.address for s in servers])
        try:
            stats = [s["t"] for s in both.stats()]
            assert sum(s.rows for s in stats) == VOCAB.size - 10
            assert sum(s.candidates for s in stats) == LATE.size
            assert sum(s.created for s in stats) == VOCAB.size - 10  # counted once
        finally:
            both.close()
    finally:
        source.close()
        target.close()


def _train_on_a_worker(cluster, name: str, resizes: dict[int, int]):
    """Nine SGD steps as closures on one worker; the chief resizes before the steps named."""
    resolver = _Listing(cluster, 2)
    strategy = pf.distribute.ParameterServerStrategy(resolver)
    pf.random.set_seed(0)
    with strategy.scope():
        model = _model(name)
        optimizer = pf.keras.optimizers.SGD(0.1)
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)

    def step(ids, y):
        def replica(ids, y):
            with pf.GradientTape() as tape:
                loss = pf.reduce_mean(pf.square(model(ids, training=True) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.run(replica, args=(ids, y))

    for s, (ids, y) in enumerate(_batches()):
        if s in resizes:  # a closure may be in flight: the resize waits for it
            resolver.num_ps = max(resolver.num_ps, resizes[s])
            coordinator.resize_parameter_servers(resizes[s], timeout=60)
        coordinator.schedule(step, args=(pf.constant(ids), pf.constant(y)))
    coordinator.join()
    client = model.layers[0].table.backend.client
    rows = client.lookup(name, VOCAB)
    kernel = model.layers[2].kernel.numpy()
    coordinator.shutdown()
    return rows, kernel


def test_a_worker_follows_the_resized_table_and_training_equals_the_fixed_layout(
    start_cluster, start_ps, monkeypatch
):
    monkeypatch.setenv("PSFLOW_CLOSURES_IN_FLIGHT", "1")  # one worker, steps in order
    fixed = _train_on_a_worker(start_cluster(num_ps=2, num_workers=1), "fixed", {})
    # the worker is started with the 2 PS tasks of the view; ps:2 is added later
    cluster = start_cluster(num_ps=2, num_workers=1)
    cluster.ps.append(start_ps("--task", "ps:2"))
    elastic = _train_on_a_worker(cluster, "elastic", {3: 3, 6: 1})
    for a, b in zip(fixed, elastic):
        np.testing.assert_array_equal(a, b)
    for server in cluster.ps[1:]:
        assert "PSFLOW_DRAINED" in _drained(server)
