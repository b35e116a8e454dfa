"""ParameterServerStrategy training against single-process references, with real processes."""

from __future__ import annotations

import numpy as np
import pytest

import psflow as pf

pytestmark = pytest.mark.slow


def _data(n: int = 64, d: int = 5, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    w = rng.normal(size=(d, 1)).astype(np.float32)
    y = (x @ w + 0.1 * rng.normal(size=(n, 1))).astype(np.float32)
    return x, y


def _model() -> pf.keras.Model:
    return pf.keras.Sequential(
        [
            pf.keras.layers.Dense(
                8,
                activation="tanh",
                input_shape=(5,),
                kernel_initializer=pf.keras.initializers.GlorotUniform(seed=1),
            ),
            pf.keras.layers.Dense(
                1, kernel_initializer=pf.keras.initializers.GlorotUniform(seed=2)
            ),
        ]
    )


def _step_fn(strategy, model, optimizer):
    def step(iterator):
        x, y = next(iterator)

        def replica(x, y):
            with pf.GradientTape() as tape:
                pred = model(x, training=True)
                loss = pf.reduce_mean(pf.square(pred - y))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.run(replica, args=(x, y))

    return step


def _local_reference(x, y, batch, steps, make_optimizer):
    pf.random.set_seed(0)
    model = _model()
    optimizer = make_optimizer()
    weights = []
    for s in range(steps):
        xb, yb = x[s * batch : (s + 1) * batch], y[s * batch : (s + 1) * batch]
        with pf.GradientTape() as tape:
            loss = pf.reduce_mean(pf.square(model(pf.constant(xb)) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        weights.append([w.numpy() for w in model.weights])
    return weights


@pytest.mark.parametrize(
    "make_optimizer",
    [lambda: pf.keras.optimizers.SGD(0.1, momentum=0.9), lambda: pf.keras.optimizers.Adam(0.01)],
    ids=["sgd-momentum", "adam"],
)
def test_async_one_worker_equals_local_training_step_for_step(start_cluster, make_optimizer):
    cluster = start_cluster(num_ps=2, num_workers=1)
    x, y = _data()
    batch, steps = 8, 6
    reference = _local_reference(x, y, batch, steps, make_optimizer)

    pf.random.set_seed(0)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    with strategy.scope():
        model = _model()
        optimizer = make_optimizer()
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
    dataset = pf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    iterator = iter(coordinator.create_per_worker_dataset(lambda: dataset))
    step = _step_fn(strategy, model, optimizer)
    for s in range(steps):
        coordinator.schedule(step, args=(iterator,))
        coordinator.join()
        for got, want in zip(model.weights, reference[s]):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-7)


def test_sync_two_workers_equals_local_training_with_the_global_batch(start_cluster):
    cluster = start_cluster(num_ps=2, num_workers=2)
    x, y = _data()
    per_worker, steps = 4, 5
    make_optimizer = lambda: pf.keras.optimizers.SGD(0.05)  # noqa: E731
    # worker k reads elements k, k+2, ...; step s of both workers together is elements
    # [8s, 8s+8): the local reference's global batch s.
    reference = _local_reference(x, y, 2 * per_worker, steps, make_optimizer)

    pf.random.set_seed(0)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver(), mode="sync")
    with strategy.scope():
        model = _model()
        optimizer = make_optimizer()
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)

    def dataset_fn(ctx):
        ds = pf.data.Dataset.from_tensor_slices((x, y))
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(per_worker)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    step = _step_fn(strategy, model, optimizer)
    for _ in range(steps * 2):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    for got, want in zip(model.weights, reference[-1]):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    stats = strategy.ps_stats()
    assert sum(s["sync_steps_applied"] for s in stats) == steps * len(model.weights)


def _clock_gaps(log: list, variable: str) -> list[int]:
    """For each applied push of ``variable``: how far its worker was ahead of the slowest other."""
    clocks: dict[str, int] = {}
    gaps = []
    clients = {entry[1] for entry in log if entry[0] == variable}
    for name, client, _base, _applied in log:
        if name != variable:
            continue
        clocks[client] = clocks.get(client, 0) + 1
        others = [clocks.get(c, 0) for c in clients if c != client]
        if others:
            gaps.append(clocks[client] - min(others) - 1)
    return gaps


@pytest.mark.parametrize("staleness", [0, 2])
def test_bounded_staleness_keeps_workers_within_k_steps(start_cluster, staleness):
    cluster = start_cluster(num_ps=1, num_workers=2)
    strategy = pf.distribute.ParameterServerStrategy(
        cluster.resolver(), mode="bounded", staleness=staleness
    )
    with strategy.scope():
        v = pf.Variable(np.zeros(4, np.float32), name="bounded_v")
        optimizer = pf.keras.optimizers.SGD(0.01)
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)

    def dataset_fn(ctx):
        # worker 1 is slow: each of its elements says to sleep
        delay = 0.05 if ctx.input_pipeline_id == 1 else 0.0
        return pf.data.Dataset.from_tensors(np.float32(delay)).repeat()

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step(it):
        import time

        time.sleep(float(next(it)))
        with pf.GradientTape() as tape:
            loss = pf.reduce_sum(v * v + v)
        optimizer.apply_gradients(zip(tape.gradient(loss, [v]), [v]))

    for _ in range(24):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    (stats,) = strategy.ps_stats(include_log=True)
    gaps = _clock_gaps(stats["log"], "bounded_v")
    assert len(gaps) >= 23
    assert max(gaps) <= staleness, gaps


def test_a_two_device_worker_all_reduces_then_pushes_once_like_local_training(start_cluster):
    cluster = start_cluster(num_ps=2, num_workers=1, worker_env={"PSFLOW_NUM_CPU_DEVICES": "2"})
    x, y = _data()
    batch, steps = 8, 4
    make_optimizer = lambda: pf.keras.optimizers.SGD(0.1)  # noqa: E731
    reference = _local_reference(x, y, batch, steps, make_optimizer)

    pf.random.set_seed(0)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    with strategy.scope():
        model = _model()
        optimizer = make_optimizer()
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
    dataset = pf.data.Dataset.from_tensor_slices((x, y)).batch(batch)

    def dataset_fn():
        # each of the worker's 2 replicas takes half of every global batch
        return strategy.experimental_distribute_dataset(dataset)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step(it):
        x_b, y_b = next(it)  # per-replica halves of one global batch

        def replica(xb, yb):
            with pf.GradientTape() as tape:
                per_example = pf.reduce_mean(pf.square(model(xb, training=True) - yb), axis=1)
                loss = pf.nn.compute_average_loss(per_example, global_batch_size=batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return pf.distribute.get_replica_context().replica_id_in_sync_group

        return strategy.run(replica, args=(x_b, y_b))

    for s in range(steps):
        replicas = coordinator.schedule(step, args=(iterator,)).get()
        coordinator.join()
        assert [int(r) for r in replicas.values] == [0, 1]  # two replicas on the worker
        for got, want in zip(model.weights, reference[s]):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    stats = strategy.ps_stats()
    assert all(st["pushes_applied"] == steps for st in stats)  # one push per step, not per replica
