"""``model.fit`` while a ``ClusterWatch`` thread resizes the parameter servers 2 -> 3 -> 2.

The watch starts before ``fit``; the cluster's listing changes in the middle of
an epoch (a callback flips it), so the resize runs while ``fit`` schedules. Sync
mode must end equal, bit for bit, to the same fit on a fixed layout; async mode
must apply every step's push exactly once to every variable.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import psflow as pf
from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver
from psflow.distribute.coordinator.elastic_watch import ClusterWatch

pytestmark = pytest.mark.slow

EPOCHS, BATCHES = 3, 8  # batches per epoch (a multiple of the 2 workers, for sync mode)


class _Listing(SimpleClusterResolver):
    """The first ``num_ps`` PS tasks of ``cluster``, read afresh on every call; this is the chief."""

    def __init__(self, cluster, num_ps: int) -> None:
        self.cluster = cluster
        self.num_ps = num_ps
        super().__init__(self._spec(), task_type="chief", task_id=0)

    def _spec(self) -> ClusterSpec:
        return ClusterSpec(
            {
                "ps": [p.address for p in self.cluster.ps[: self.num_ps]],
                "worker": [w.address for w in self.cluster.workers],
                "chief": ["127.0.0.1:1"],
            }
        )

    def cluster_spec(self) -> ClusterSpec:
        return self._spec()


class _Resizes(pf.keras.callbacks.Callback):
    """Lists 3 PS tasks mid-epoch 0, 2 mid-epoch 1; each epoch's end waits for the watch."""

    def __init__(self, resolver, watch) -> None:
        super().__init__()
        self.resolver = resolver
        self.watch = watch
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if batch == BATCHES // 2 and self.epoch < 2:
            self.resolver.num_ps = (3, 2)[self.epoch]

    def on_epoch_end(self, epoch, logs=None):
        # every batch is scheduled (a whole sync step): the watch's resize can finish
        deadline = time.monotonic() + 60
        while len(self.watch.reports) <= epoch and epoch < 2 and time.monotonic() < deadline:
            time.sleep(0.02)


def _fit(cluster, mode: str, elastic: bool):
    """Fits a small model for EPOCHS; returns weights, per-variable optimizer steps, reports."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(BATCHES * 8, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5, 1)) + 0.1).astype(np.float32)
    pf.random.set_seed(0)
    resolver = _Listing(cluster, 2)
    strategy = pf.distribute.ParameterServerStrategy(resolver, mode=mode)
    with strategy.scope():
        model = pf.keras.Sequential(
            [
                pf.keras.layers.Dense(
                    6,
                    activation="tanh",
                    input_shape=(5,),
                    kernel_initializer=pf.keras.initializers.GlorotUniform(seed=1),
                ),
                pf.keras.layers.Dense(
                    1, kernel_initializer=pf.keras.initializers.GlorotUniform(seed=2)
                ),
            ]
        )
        model.compile(optimizer=pf.keras.optimizers.SGD(0.05), loss="mse")
    watch = ClusterWatch(strategy, resolver, interval=0.05, resize_timeout=60)
    callbacks = [_Resizes(resolver, watch)] if elastic else []
    with watch:  # started before fit: it resizes through fit's coordinator
        model.fit(x, y, batch_size=8, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    steps = {}
    for c in strategy._session.connections:
        steps.update({v["name"]: v["optimizer_step"] for v in c.list_variables()})
    weights = [w.numpy() for w in model.weights]
    return weights, steps, watch.reports


def test_sync_fit_through_a_watched_2_3_2_resize_equals_the_fixed_layout(start_cluster):
    fixed, fixed_steps, _ = _fit(start_cluster(num_ps=2, num_workers=2), "sync", elastic=False)
    cluster = start_cluster(num_ps=3, num_workers=2)
    weights, steps, reports = _fit(cluster, "sync", elastic=True)
    assert [(r.old_num_ps, r.new_num_ps) for r in reports] == [(2, 3), (3, 2)]
    for a, b in zip(fixed, weights):
        np.testing.assert_array_equal(a, b)
    # a sync step is one batch from each worker
    assert set(steps.values()) == set(fixed_steps.values()) == {EPOCHS * BATCHES // 2}
    assert cluster.ps[2].proc.wait(30) == 0  # drained


def test_async_fit_through_a_watched_2_3_2_resize_applies_every_push_once(start_cluster):
    cluster = start_cluster(num_ps=3, num_workers=2)
    _, steps, reports = _fit(cluster, "async", elastic=True)
    assert [(r.old_num_ps, r.new_num_ps) for r in reports] == [(2, 3), (3, 2)]
    assert len(steps) == 4 and set(steps.values()) == {EPOCHS * BATCHES}
    assert cluster.ps[2].proc.wait(30) == 0
