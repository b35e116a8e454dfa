"""Sync-on-read variables (``synchronization=ON_READ``) under both strategies.

MirroredStrategy: one copy per replica, written locally inside ``run`` and
aggregated when read outside it; the whole behaviour is compared with what
TensorFlow 2.21 printed for the same program (``tests/data/sync_on_read_tf_2_21.json``,
rerun against TensorFlow itself by ``test_sync_on_read_tf_reference.py``).
ParameterServerStrategy: as TensorFlow's, one variable on a parameter server
that every worker updates (its ``_create_var_creator`` ignores ON_READ).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import errors
from tests.sync_on_read_scenario import scenario
from tests.test_mirrored_training import logical_cpus

TF_2_21 = json.loads((Path(__file__).parent / "data" / "sync_on_read_tf_2_21.json").read_text())
ON_READ = pf.VariableSynchronization.ON_READ


def test_mirrored_sync_on_read_variables_behave_as_tensorflow_printed() -> None:
    with logical_cpus(2):
        ours = scenario(pf, pf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    assert ours.keys() == TF_2_21.keys()
    for key, want in TF_2_21.items():
        assert ours[key] == want, key


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_per_replica_counts_read_as_the_single_device_totals(replicas: int) -> None:
    """A metric-like accumulator: each replica adds its share of each batch, with no
    communication; the cross-replica read is what one device counting everything gets."""
    x = np.random.default_rng(3).normal(size=(10, 2)).astype(np.float32)
    with logical_cpus(replicas):
        strategy = pf.distribute.MirroredStrategy()
        with strategy.scope():
            total = pf.Variable(
                np.zeros(2, np.float32),
                synchronization=ON_READ,
                aggregation=pf.VariableAggregation.SUM,
            )
            count = pf.Variable(0, synchronization=ON_READ, aggregation=pf.VariableAggregation.SUM)

        def step(batch: Any) -> None:
            total.assign_add(pf.reduce_sum(batch, axis=0))
            count.assign_add(pf.shape(batch)[0])

        ds = pf.data.Dataset.from_tensor_slices(x).batch(4)  # 4, 4, 2: some replicas get 0
        for batch in strategy.experimental_distribute_dataset(ds):
            strategy.run(step, args=(batch,))
        np.testing.assert_allclose(total.numpy(), x.sum(axis=0), rtol=1e-6)
        assert int(count) == 10
        # the copies were never synchronized: each saw only its replica's rows
        assert sum(int(c.numpy()) for c in count.values) == 10
        assert len(total.values) == replicas
        # reset in cross-replica context (as a metric's reset_state): the sum reads 0
        total.assign(np.zeros(2, np.float32))
        count.assign(0)
        np.testing.assert_array_equal(total.numpy(), [0.0, 0.0])
        assert int(count) == 0


def test_cross_replica_writes_that_tensorflow_refuses_change_nothing() -> None:
    with logical_cpus(2):
        strategy = pf.distribute.MirroredStrategy()
        with strategy.scope():
            v = pf.Variable(
                [1.0, 2.0], synchronization=ON_READ, aggregation=pf.VariableAggregation.SUM
            )
        strategy.run(lambda: v.assign_add([1.0, 1.0]))
        before = [c.numpy() for c in v.values]
        with pytest.raises(errors.InvalidArgumentError, match="assign_add on Variable:0"):
            v.assign_add([1.0, 1.0])
        with pytest.raises(errors.InvalidArgumentError, match=r"shape \(2,\) got shape \(3,\)"):
            v.assign([1.0, 2.0, 3.0])
        with pytest.raises(errors.InvalidArgumentError, match="dtype float32 got dtype int32"):
            v.assign(pf.constant([1, 2]))
        for c, b in zip(v.values, before):
            np.testing.assert_array_equal(c.numpy(), b)
        with (
            strategy.scope(),
            pytest.raises(errors.InvalidArgumentError, match="MEAN needs a float"),
        ):
            pf.Variable(
                0, synchronization=ON_READ, aggregation=pf.VariableAggregation.MEAN, name="steps"
            )
        with strategy.scope():
            none = pf.Variable(1.0, synchronization=ON_READ)
        with pytest.raises(errors.InvalidArgumentError, match="aggregation=NONE"):
            none.numpy()


def test_a_checkpoint_saves_the_aggregate_and_restores_it(tmp_path: Path) -> None:
    with logical_cpus(2):
        strategy = pf.distribute.MirroredStrategy()
        with strategy.scope():
            v = pf.Variable(
                [0.0, 0.0], synchronization=ON_READ, aggregation=pf.VariableAggregation.SUM
            )
        strategy.run(lambda: v.assign_add([3.0, 5.0]))  # copies [3, 5] and [3, 5]: reads [6, 10]
        path = pf.train.Checkpoint(v=v).save(str(tmp_path / "ckpt"))
        strategy.run(lambda: v.assign([0.0, 0.0]))
        pf.train.Checkpoint(v=v).restore(path)
        np.testing.assert_array_equal(v.numpy(), [6.0, 10.0])
        # TensorFlow restores a SUM variable as a cross-replica assign: half on each copy
        for c in v.values:
            np.testing.assert_array_equal(c.numpy(), [3.0, 5.0])


def test_parameter_server_strategy_keeps_one_variable_that_every_worker_updates() -> None:
    """TensorFlow's PSS creates an ON_READ variable as a plain PS variable: workers'
    ``assign_add`` accumulate on it and a cross-replica ``assign`` is not divided."""
    from psflow.distribute.coordinator.cluster_coordinator import (
        ClusterCoordinator,
        shutdown_all,
    )

    strategy = pf.distribute.ParameterServerStrategy()
    try:
        with strategy.scope():
            v = pf.Variable(0.0, synchronization=ON_READ, aggregation=pf.VariableAggregation.SUM)
        assert not v.trainable and v.synchronization is ON_READ
        coordinator = ClusterCoordinator(strategy)
        for k in range(4):
            coordinator.schedule(lambda k=k: v.assign_add(float(k + 1)))
        coordinator.join()
        assert float(v.numpy()) == 10.0
        v.assign(7.0)
        assert float(v.numpy()) == 7.0
    finally:
        shutdown_all()


def test_the_module_example_runs() -> None:
    import doctest

    import psflow.distribute.sync_on_read as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_a_bad_write_inside_run_fails_run_and_leaves_that_copy_alone() -> None:
    with logical_cpus(2):
        strategy = pf.distribute.MirroredStrategy()
        with strategy.scope():
            v = pf.Variable(
                [1.0, 2.0], synchronization=ON_READ, aggregation=pf.VariableAggregation.MEAN
            )

        def step() -> None:
            rid = int(pf.distribute.get_replica_context().replica_id_in_sync_group)
            v.assign([5.0, 6.0] if rid == 0 else [7.0, 8.0, 9.0])

        with pytest.raises(errors.InvalidArgumentError, match=r"got shape \(3,\)"):
            strategy.run(step)
        np.testing.assert_array_equal(v.values[0].numpy(), [5.0, 6.0])  # its own write
        np.testing.assert_array_equal(v.values[1].numpy(), [1.0, 2.0])


def test_read_var_gives_the_aggregate_in_both_contexts() -> None:
    """TensorFlow's ``strategy.extended.read_var``: the aggregate of a sync-on-read variable
    (what a layer's inference may read instead of its replica's own copy)."""
    with logical_cpus(2):
        strategy = pf.distribute.MirroredStrategy()
        with strategy.scope():
            v = pf.Variable(
                [1.0, 2.0], synchronization=ON_READ, aggregation=pf.VariableAggregation.MEAN
            )
            w = pf.Variable([4.0])
        strategy.run(
            lambda: v.assign_add(
                pf.fill(
                    [2],
                    pf.cast(
                        pf.distribute.get_replica_context().replica_id_in_sync_group, "float32"
                    ),
                )
            )
        )
        np.testing.assert_array_equal(strategy.extended.read_var(v), [1.5, 2.5])
        np.testing.assert_array_equal(strategy.extended.read_var(w), [4.0])
        inside = strategy.run(lambda: (v.read_value(), strategy.extended.read_var(v)))
        own = [t.numpy().tolist() for t in strategy.experimental_local_results(inside[0])]
        assert own == [[1.0, 2.0], [2.0, 3.0]]
        for t in strategy.experimental_local_results(inside[1]):
            np.testing.assert_array_equal(t, [1.5, 2.5])


def test_batch_normalization_predicts_under_mirrored_as_on_one_device() -> None:
    """BatchNormalization keeps its moving statistics sync-on-read (ON_READ, MEAN): each
    replica moves its own copy while training; inference must read their aggregate
    (``strategy.extended.read_var``), not its replica's copy, to predict as one device
    with the same weights does. (Skipped in trees without the layer.)"""
    if not hasattr(pf.keras.layers, "BatchNormalization"):
        pytest.skip("this tree has no BatchNormalization")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    x[16:] += 3.0  # the replicas' halves of each batch differ: so do their copies
    y = rng.normal(size=(32, 1)).astype(np.float32)

    def make() -> Any:
        model = pf.keras.Sequential(
            [
                pf.keras.layers.BatchNormalization(momentum=0.5),
                pf.keras.layers.Dense(1, kernel_initializer="ones"),
            ]
        )
        model.build((None, 4))
        model.compile(optimizer=pf.keras.optimizers.SGD(0.01), loss="mse")
        return model

    with logical_cpus(2):
        strategy = pf.distribute.MirroredStrategy()
        with strategy.scope():
            model = make()
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        got = model.predict(x, batch_size=32, verbose=0)
        weights = model.get_weights()
    one = make()
    one.set_weights(weights)
    np.testing.assert_allclose(got, one.predict(x, batch_size=32, verbose=0), rtol=1e-5, atol=1e-5)
