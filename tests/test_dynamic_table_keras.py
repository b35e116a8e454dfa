"""DynamicEmbedding in Keras models: local, embedded PS, and a real PS cluster.

The reference is the same model with a fixed-vocabulary ``Embedding`` whose
rows start as the dynamic table's rows of those ids: training both on the same
batches must give the same weights.
"""

from __future__ import annotations

import numpy as np
import pytest

import psflow as pf
from psflow.framework.indexed_slices import IndexedSlices
from psflow.ps.dynamic_table import initial_rows
from psflow.ps.hot_rows import HotRowPolicy

VOCAB = np.array([7, 2**40 + 1, -5, 123456789, 42, 2**62 + 3], np.int64)
DIM, SEED = 4, 9


def _data(n: int = 48, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.choice(VOCAB, size=(n, 3))  # repeated ids within rows and batches
    y = rng.normal(size=(n, 1)).astype(np.float32)
    return ids, y


def _dense_head() -> pf.keras.layers.Dense:
    return pf.keras.layers.Dense(1, kernel_initializer=pf.keras.initializers.GlorotUniform(seed=3))


def _dynamic_model(hot_rows=None) -> pf.keras.Model:
    return pf.keras.Sequential(
        [
            pf.keras.layers.DynamicEmbedding(DIM, seed=SEED, input_shape=(3,), hot_rows=hot_rows),
            pf.keras.layers.Flatten(),
            _dense_head(),
        ]
    )


def _reference_model(head: np.ndarray) -> tuple[pf.keras.Model, dict[int, int]]:
    emb = pf.keras.layers.Embedding(len(VOCAB), DIM, input_shape=(3,))
    model = pf.keras.Sequential([emb, pf.keras.layers.Flatten(), _dense_head()])
    emb.embeddings.assign(initial_rows("uniform", SEED, VOCAB, DIM, 0.05, np.dtype("float32")))
    model.layers[2].kernel.assign(head)
    return model, {int(k): i for i, k in enumerate(VOCAB)}


def _train_reference(make_optimizer, ids, y, batch, steps, head):
    model, row_of = _reference_model(head)
    optimizer = make_optimizer()
    index = np.vectorize(row_of.get)(ids)
    for s in range(steps):
        xb, yb = index[s * batch : (s + 1) * batch], y[s * batch : (s + 1) * batch]
        with pf.GradientTape() as tape:
            loss = pf.reduce_mean(pf.square(model(pf.constant(xb)) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return model


def _rows(model: pf.keras.Model) -> np.ndarray:
    table = model.layers[0].table
    return table.backend.client.lookup(table.config.name, VOCAB)


def _custom_loop(model, optimizer, ids, y, batch, steps):
    for s in range(steps):
        xb, yb = ids[s * batch : (s + 1) * batch], y[s * batch : (s + 1) * batch]
        with pf.GradientTape() as tape:
            loss = pf.reduce_mean(pf.square(model(pf.constant(xb)) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        assert isinstance(grads[0], IndexedSlices)  # sparse rows, indexed by id
        optimizer.apply_gradients(zip(grads, model.trainable_variables))


@pytest.mark.parametrize(
    "make_optimizer, tol",
    [(lambda: pf.keras.optimizers.SGD(0.1), 0.0), (lambda: pf.keras.optimizers.Adam(0.01), 1e-6)],
    ids=["sgd", "adam"],
)
def test_custom_loop_without_strategy_equals_a_fixed_vocabulary_embedding(make_optimizer, tol):
    ids, y = _data()
    model = _dynamic_model()
    reference = _train_reference(make_optimizer, ids, y, 8, 6, model.layers[2].kernel.numpy())
    _custom_loop(model, make_optimizer(), ids, y, 8, 6)
    np.testing.assert_allclose(
        _rows(model), reference.layers[0].embeddings.numpy(), atol=tol, rtol=0
    )
    np.testing.assert_allclose(
        model.layers[2].kernel.numpy(), reference.layers[2].kernel.numpy(), atol=tol, rtol=0
    )


def test_fit_under_the_embedded_parameter_server_equals_the_reference(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    ids, y = _data()
    strategy = pf.distribute.ParameterServerStrategy()
    with strategy.scope():
        model = _dynamic_model()
        model.compile(optimizer=pf.keras.optimizers.SGD(0.1), loss="mse")
    head = model.layers[2].kernel.numpy()
    reference = _train_reference(lambda: pf.keras.optimizers.SGD(0.1), ids, y, 8, 6, head)
    model.fit(ids, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(_rows(model), reference.layers[0].embeddings.numpy(), atol=1e-6)
    np.testing.assert_allclose(
        model.layers[2].kernel.numpy(), reference.layers[2].kernel.numpy(), atol=1e-6
    )
    assert model.count_params() == DIM * 3 + 1  # the dense head; a dynamic table has no fixed size


def test_evaluate_and_predict_on_unseen_ids_leave_the_table_unchanged(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    ids, y = _data()
    strategy = pf.distribute.ParameterServerStrategy()
    with strategy.scope():
        model = _dynamic_model()
        model.compile(optimizer=pf.keras.optimizers.SGD(0.1), loss="mse")
    model.fit(ids, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    client = model.layers[0].table.backend.client
    before = client.stats()
    unseen = (ids * 7 + 1) % (2**62)  # no id of VOCAB
    assert not np.isin(unseen, VOCAB).any()
    model.evaluate(unseen, y, batch_size=8, verbose=0)
    scores = model.predict(unseen, batch_size=8, verbose=0)
    assert client.stats() == before  # no row made, no counter moved
    # An unseen id reads its initial row, the one training would create.
    rows = initial_rows("uniform", SEED, unseen.reshape(-1), DIM, 0.05, np.dtype("float32"))
    head = model.layers[2]
    expected = rows.reshape(len(unseen), -1) @ head.kernel.numpy() + head.bias.numpy()
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)
    model(unseen[:1], training=True)  # a training call still makes rows
    assert sum(s[model.layers[0].table.config.name].rows for s in client.stats()) > sum(
        s[model.layers[0].table.config.name].rows for s in before
    )


def _table_state(model: pf.keras.Model) -> dict[str, np.ndarray]:
    client = model.layers[0].table.backend.client
    return client.registry.table(model.layers[0].table.config.name).export_state()


def test_checkpoint_restores_every_row_slot_and_counter_of_a_table(tmp_path):
    ids, y = _data()
    model = _dynamic_model()
    optimizer = pf.keras.optimizers.Adagrad(0.1)
    _custom_loop(model, optimizer, ids, y, 8, 3)
    ckpt = pf.train.Checkpoint(model=model, optimizer=optimizer)
    path = ckpt.save(str(tmp_path / "ckpt"))
    saved = _table_state(model)
    _custom_loop(model, optimizer, ids[24:], y[24:], 8, 3)  # moves rows, slots, counters
    model.layers[0].table.backend.client.lookup(model.layers[0].table.config.name, [10**9])
    assert _table_state(model)["ids"].size == saved["ids"].size + 1
    ckpt.restore(path).assert_consumed()
    restored = _table_state(model)
    assert sorted(restored) == sorted(saved) and "slot/accumulator" in saved
    for key, value in saved.items():
        np.testing.assert_array_equal(restored[key], value, err_msg=key)


def test_dynamic_embedding_rejects_bad_arguments():
    with pytest.raises(pf.errors.InvalidArgumentError, match="-2"):
        pf.keras.layers.DynamicEmbedding(-2)
    with pytest.raises(pf.errors.InvalidArgumentError, match="initializer"):
        pf.keras.layers.DynamicEmbedding(2, initializer="glorot")
    layer = pf.keras.layers.DynamicEmbedding(2)
    with pytest.raises(pf.errors.InvalidArgumentError, match="integers"):
        layer(np.array([[1.5]]))


@pytest.mark.slow
def test_one_worker_cluster_equals_the_reference_step_for_step(start_cluster):
    # The worker caches hot rows, refreshed at every lookup: exact, and it
    # shows the policy travels with the model to the worker.
    cluster = start_cluster(num_ps=2, num_workers=1)
    ids, y = _data()
    batch, steps = 8, 6
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    with strategy.scope():
        model = _dynamic_model(HotRowPolicy(count=8, refresh_every=1))
        optimizer = pf.keras.optimizers.SGD(0.1)
    head = model.layers[2].kernel.numpy()
    reference = _train_reference(lambda: pf.keras.optimizers.SGD(0.1), ids, y, batch, steps, head)
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
    dataset = pf.data.Dataset.from_tensor_slices((ids, y)).batch(batch)
    iterator = iter(coordinator.create_per_worker_dataset(lambda: dataset))

    def step(iterator):
        x, yb = next(iterator)

        def replica(x, yb):
            with pf.GradientTape() as tape:
                loss = pf.reduce_mean(pf.square(model(x, training=True) - yb))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.run(replica, args=(x, yb))

    for _ in range(steps):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    np.testing.assert_allclose(_rows(model), reference.layers[0].embeddings.numpy(), atol=1e-6)
    np.testing.assert_allclose(
        model.layers[2].kernel.numpy(), reference.layers[2].kernel.numpy(), atol=1e-6
    )
    stats = model.layers[0].table.backend.client.stats()
    assert sum(s[model.layers[0].config.name].rows for s in stats) == len(VOCAB)
    # Every id is hot (8 cached per shard): the worker sends a Lookup only for
    # ids it sees for the first time (at most one per id); without the cache it
    # would send one per shard per step (12), plus the chief's check above (2).
    lookups = sum(s[model.layers[0].config.name].lookups for s in stats)
    assert lookups <= len(VOCAB) + 2 < 2 * steps + 2


def _die_once(marker: str) -> None:
    """Kills this worker process the first time (after its push reached the PS)."""
    import os
    import pathlib

    path = pathlib.Path(marker)
    if not path.exists():
        path.write_text("died once")
        os._exit(17)  # like a crash: the reply never leaves this worker


@pytest.mark.slow
def test_a_rerun_closures_table_push_is_applied_once(start_cluster, tmp_path):
    # loss = sum of id 7's row: its gradient is 1 per step whatever the weights, so
    # with SGD(1.0) three closures move the row by exactly -3, one of them run twice
    cluster = start_cluster(num_ps=1, num_workers=2)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    with strategy.scope():
        layer = pf.keras.layers.DynamicEmbedding(DIM, seed=SEED)
        layer.build((None, 1))
        optimizer = pf.keras.optimizers.SGD(1.0)
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
    marker = str(tmp_path / "died")

    def step(x: float) -> None:
        with pf.GradientTape() as tape:
            loss = pf.reduce_sum(layer(pf.constant([[7]], dtype=pf.int64)))
        grads = tape.gradient(loss, layer.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables))
        if x == 2.0:
            _die_once(marker)

    for x in (1.0, 2.0, 3.0):
        coordinator.schedule(step, args=(x,))
    coordinator.join()
    assert (tmp_path / "died").exists()  # the crash happened: one closure ran twice
    start = initial_rows("uniform", SEED, np.array([7], np.int64), DIM, 0.05, np.dtype("float32"))
    got = layer.table.backend.client.lookup(layer.config.name, np.array([7], np.int64))
    np.testing.assert_allclose(got, start - 3.0, atol=1e-6)


def test_each_table_push_carries_the_rule_of_its_step():
    """A table binds its first push's rule; a later step's rate (a schedule) is
    refused by name, never pushed with the first step's rule (kept per rule)."""
    ids, y = _data()
    model = _dynamic_model()
    schedule = pf.keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)
    optimizer = pf.keras.optimizers.SGD(schedule)
    _custom_loop(model, optimizer, ids, y, 8, 1)
    with pytest.raises(pf.errors.FailedPreconditionError, match=r"0\.05"):
        _custom_loop(model, optimizer, ids[8:], y[8:], 8, 1)
