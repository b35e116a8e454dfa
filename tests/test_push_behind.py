"""Pushes behind the compute (psflow.distribute.ps.push_behind), with real processes.

An async worker's closure ends while its push is on the wire, so the next
closure computes meanwhile; its reply still waits for the push.  These tests
pin what that may change (async: one step of the worker's own staleness, no
more) and what it must not (sync results bit for bit, exactly-once, how a
lost parameter server surfaces).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import psflow as pf
from psflow import errors

pytestmark = pytest.mark.slow

OFF = {"PSFLOW_PUSH_BEHIND": "off"}
ON = {"PSFLOW_PUSH_BEHIND": "on"}  # opt-in: one step more staleness in async mode


def _regression(n: int = 96, d: int = 6, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    w = rng.normal(size=(d, 1)).astype(np.float32)
    return x, (x @ w).astype(np.float32)


def _train(cluster, mode: str, steps: int, batch: int, join_each: bool = False):
    """Trains a linear model; returns (strategy, weights, loss of every closure)."""
    x, y = _regression()
    pf.random.set_seed(0)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver(), mode=mode)
    with strategy.scope():
        model = pf.keras.Sequential(
            [
                pf.keras.layers.Dense(
                    1,
                    input_shape=(x.shape[1],),
                    kernel_initializer=pf.keras.initializers.GlorotUniform(seed=1),
                )
            ]
        )
        optimizer = pf.keras.optimizers.SGD(0.05)
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)

    def dataset_fn(ctx):
        ds = pf.data.Dataset.from_tensor_slices((x, y))
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).repeat().batch(batch)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step(it):
        xb, yb = next(it)

        def replica(xb, yb):
            with pf.GradientTape() as tape:
                loss = pf.reduce_mean(pf.square(model(xb, training=True) - yb))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.run(replica, args=(xb, yb))

    losses = []
    for _ in range(steps):
        losses.append(coordinator.schedule(step, args=(iterator,)))
        if join_each:
            coordinator.join()
    coordinator.join()
    weights = [w.numpy() for w in model.weights]
    return strategy, weights, [float(v.fetch()) for v in losses]


def test_sync_training_is_bit_for_bit_the_same_with_pushes_behind_on_and_off(start_cluster):
    behind = start_cluster(num_ps=1, num_workers=2, worker_env=ON)
    _, got, got_losses = _train(behind, "sync", steps=12, batch=4)
    waiting = start_cluster(num_ps=1, num_workers=2, worker_env=OFF)
    _, want, want_losses = _train(waiting, "sync", steps=12, batch=4)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    # which worker runs which closure varies from run to run; every loss is the same
    assert sorted(got_losses) == sorted(want_losses)


def _staleness_of(strategy) -> list[int]:
    """Every applied push's staleness: ``applied_version - 1 - base_version``."""
    (stats,) = strategy.ps_stats(include_log=True)
    return [applied - 1 - base for _name, _client, base, applied in stats["log"]]


def test_async_worker_pushing_behind_converges_one_step_stale_at_most(start_cluster):
    cluster = start_cluster(num_ps=1, num_workers=1, worker_env=ON)
    strategy, _, losses = _train(cluster, "async", steps=40, batch=8)
    # the versions each gradient was computed from: never more than the worker's own
    # previous step behind (a single worker: nobody else moves the variables)
    staleness = _staleness_of(strategy)
    assert len(staleness) == 40 * 2  # kernel and bias, every step
    assert min(staleness) >= 0 and max(staleness) <= 1, staleness
    assert staleness.count(1) > 0  # the next step did compute while the push was in flight
    assert np.mean(losses[-8:]) < 0.2 * np.mean(losses[:8])


def test_async_worker_waiting_for_its_pushes_is_never_stale(start_cluster):
    # the reference the staleness above is measured against: the same run with it off
    cluster = start_cluster(num_ps=1, num_workers=1, worker_env=OFF)
    strategy, _, _ = _train(cluster, "async", steps=20, batch=8)
    assert set(_staleness_of(strategy)) == {0}


def test_a_closure_joined_after_each_step_sees_its_own_update(start_cluster):
    # its reply waits for its push: join() means applied, as before
    cluster = start_cluster(num_ps=1, num_workers=1, worker_env=ON)
    strategy, _, _ = _train(cluster, "async", steps=6, batch=8, join_each=True)
    assert set(_staleness_of(strategy)) == {0}


def test_a_ps_killed_while_pushes_are_in_flight_fails_the_closures_typed_without_a_hang(
    start_cluster,
):
    # as when the worker waited for its pushes: the push's UnavailableError, naming the task
    cluster = start_cluster(num_ps=2, num_workers=1, worker_env=ON)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    with strategy.scope():
        a = pf.Variable(np.zeros(256, np.float32), name="behind_a")
        b = pf.Variable(np.zeros(256, np.float32), name="behind_b")
        optimizer = pf.keras.optimizers.SGD(0.01)
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)

    def step():
        with pf.GradientTape() as tape:
            loss = pf.reduce_sum(a * a + b)
        optimizer.apply_gradients(zip(tape.gradient(loss, [a, b]), [a, b]))

    for _ in range(4):
        coordinator.schedule(step)
    coordinator.join()
    start = time.monotonic()
    with pytest.raises(errors.OpError) as info:
        for i in range(400):
            coordinator.schedule(step)
            if i == 20:
                os.kill(cluster.ps[1].proc.pid, signal.SIGKILL)
        coordinator.join(timeout=120)
    assert time.monotonic() - start < 120
    assert isinstance(info.value, errors.UnavailableError), info.value
    assert "ps:1" in str(info.value)
    # the worker itself is fine: it runs the next closure that needs no PS
    assert coordinator.schedule(lambda: 7).fetch() == 7


def test_a_read_after_apply_gradients_in_the_same_step_waits_for_its_push():
    strategy = pf.distribute.ParameterServerStrategy()  # embedded: an in-process PS
    with strategy.scope():
        v = pf.Variable(np.ones(3, np.float32), name="behind_read")
        w = pf.Variable(np.full(2, 4.0, np.float32), name="behind_other")
        optimizer = pf.keras.optimizers.SGD(0.5)
    session = strategy._session
    with session.step(closure_key="test-session/c1", push_behind=True):
        before = v.numpy()
        with pf.GradientTape() as tape:
            loss = pf.reduce_sum(v)
        optimizer.apply_gradients(zip(tape.gradient(loss, [v]), [v]))
        assert session._pushes.touches(v.key)  # on its way, behind the step
        np.testing.assert_array_equal(w.numpy(), [4.0, 4.0])  # not pushed: no wait
        after = v.numpy()  # pushed in this step: waits for the push, then pulls
        pushes = session.detach_pushes()
    pushes.result()
    np.testing.assert_array_equal(before, [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(after, [0.5, 0.5, 0.5])


def test_a_step_that_followed_another_starts_from_its_pull_ahead_one_update_behind():
    strategy = pf.distribute.ParameterServerStrategy()  # embedded: an in-process PS
    with strategy.scope():
        v = pf.Variable(np.ones(2, np.float32), name="ahead_v")
        optimizer = pf.keras.optimizers.SGD(0.25)
    session = strategy._session

    def step(n: int, scope: str, followed: bool) -> np.ndarray:
        with session.step(closure_key=f"ahead/c{n}", scope=scope, push_behind=True,
                          pull_ahead=followed):  # fmt: skip
            seen = v.numpy()
            with pf.GradientTape() as tape:
                loss = pf.reduce_sum(v)
            optimizer.apply_gradients(zip(tape.gradient(loss, [v]), [v]))
            pushes = session.detach_pushes()
        pushes.result()
        return seen

    assert step(1, "f", followed=False).tolist() == [1.0, 1.0]  # pulls; no pull ahead
    assert step(2, "f", followed=True).tolist() == [0.75, 0.75]  # pulls; pulls ahead
    # starts from step 2's pull ahead: without step 2's own update, and only that
    assert step(3, "f", followed=True).tolist() == [0.75, 0.75]
    # nothing ran in between is not known, or another function: pulled afresh
    assert step(4, "f", followed=False).tolist() == [0.25, 0.25]
    step(5, "f", followed=True)  # pulls ahead (the value after step 4's update)
    assert step(6, "g", followed=True).tolist() == [-0.25, -0.25]


def test_a_step_pulls_ahead_what_its_function_reads_not_every_variable_known():
    strategy = pf.distribute.ParameterServerStrategy()  # embedded: an in-process PS
    with strategy.scope():
        unread = pf.Variable(np.zeros(4096, np.float32), name="ahead_unread")
        v = pf.Variable(np.ones(2, np.float32), name="ahead_read")
        optimizer = pf.keras.optimizers.SGD(0.25)
    session = strategy._session

    def step(n: int) -> None:
        with session.step(closure_key=f"narrow/c{n}", scope="f", push_behind=True,
                          pull_ahead=True):  # fmt: skip
            with pf.GradientTape() as tape:
                loss = pf.reduce_sum(v)
            optimizer.apply_gradients(zip(tape.gradient(loss, [v]), [v]))
            pushes = session.detach_pushes()
        pushes.result()

    # a new function's first step pulls every variable known, for itself and ahead
    for n in (1, 2, 3):
        step(n)
    session._ahead[1].result()  # the pull ahead queued behind the last push
    before = session.bytes_pulled
    for n in (4, 5, 6):
        step(n)
    session._ahead[1].result()
    # the steps read only `v`: the pulls ahead carry it alone, not the 16 KiB never read
    assert session.bytes_pulled - before == 3 * v.numpy().nbytes
    assert unread.numpy().nbytes == 4096 * 4


def _pulled_bytes() -> int:
    from psflow.distribute.ps import session as session_lib

    return session_lib.current().bytes_pulled


def test_a_function_key_of_a_new_coordinator_does_not_prefetch_what_the_old_one_read(
    start_cluster,
):
    # every coordinator numbers its functions from fn-0: the worker must not take the
    # reads of the first coordinator's fn-0 (a model built before) for the second's
    cluster = start_cluster(num_ps=1, num_workers=1)
    old_strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    with old_strategy.scope():
        old = pf.Variable(np.zeros(1 << 16, np.float32), name="old_model_weights")
    old_coordinator = pf.distribute.coordinator.ClusterCoordinator(old_strategy)

    def read_old():
        return float(pf.reduce_sum(old))

    for _ in range(2):
        assert old_coordinator.schedule(read_old).fetch() == 0.0
    old_coordinator.shutdown()

    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    with strategy.scope():
        small = pf.Variable(np.ones(4, np.float32), name="new_model_weights")
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)

    def read_small():  # this coordinator's fn-0, as read_old was the old one's
        return float(pf.reduce_sum(small))

    assert coordinator.schedule(read_small).fetch() == 4.0  # its first step pulls all known
    before = coordinator.schedule(_pulled_bytes).fetch()
    for _ in range(3):
        assert coordinator.schedule(read_small).fetch() == 4.0
    after = coordinator.schedule(_pulled_bytes).fetch()
    assert after - before == 3 * small.numpy().nbytes  # not the old model's 256 KiB each time
