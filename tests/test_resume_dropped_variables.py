"""A worker that served another model forgets it: no pulls of it, no recovery loop.

Real PS and worker processes.  The worker first trains model A; then another
chief session trains model B and restores its backup, which holds only B's
variables: the PS tasks drop A's.  The worker still knew A's variables and
prefetched them with every step's first read; the PS answered NotFound, which
the chief took for a PS that came back empty, restored again, and looped.  The
worker now leaves out variables the PS no longer has (B's fit finishes), and a
step prefetches only what its function read before (A's variables, still on
the PS, are not pulled with each of B's steps).
"""

from __future__ import annotations

import numpy as np
import pytest

import psflow as pf

pytestmark = pytest.mark.slow

MAX_EPOCH_STARTS = 12
"""More epoch starts than the fit has epochs means recovery ran; this many means a loop."""


def _model(strategy, prefix: str):
    with strategy.scope():
        model = pf.keras.Sequential(
            [
                pf.keras.layers.Dense(4, input_shape=(3,), name=f"{prefix}_hidden"),
                pf.keras.layers.Dense(1, name=f"{prefix}_out"),
            ]
        )
        model.compile(optimizer=pf.keras.optimizers.SGD(0.05), loss="mse")
    return model


class _Bounded(pf.keras.callbacks.Callback):
    """Fails the fit when it starts epochs endlessly (the recovery loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.starts = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.starts += 1
        if self.starts > MAX_EPOCH_STARTS:
            raise pf.errors.AbortedError(f"fit started {self.starts} epochs: recovery loops")


def test_restore_dropping_another_models_variables_does_not_loop_in_ps_recovery(
    start_cluster, tmp_path
):
    cluster = start_cluster(num_ps=2, num_workers=1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)

    first = pf.distribute.ParameterServerStrategy(cluster.resolver())
    model_a = _model(first, "a")
    model_a.fit(x, y, batch_size=16, epochs=1, verbose=0)  # the worker knows A's variables

    second = pf.distribute.ParameterServerStrategy(cluster.resolver())
    model = _model(second, "b")
    backup = str(tmp_path / "backup")
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=1,
        verbose=0,
        callbacks=[pf.keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)],
    )
    bounded = _Bounded()
    # a backup exists: this fit restores it first (only B's variables: A's are dropped)
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=3,
        verbose=0,
        callbacks=[pf.keras.callbacks.BackupAndRestore(backup), bounded],
    )
    assert len(history.history["loss"]) == 2  # epochs 1 and 2: epoch 0 was backed up
    assert bounded.starts == 2
    with pytest.raises(pf.errors.NotFoundError):  # the restore did drop A's variables
        model_a.layers[0].kernel.numpy()
    assert np.isfinite(history.history["loss"]).all()


def _worker_bytes_pulled() -> int:
    """Runs on the worker: what its PS session has pulled so far."""
    from psflow.distribute.ps import session as session_lib

    return session_lib.current().bytes_pulled


def test_worker_stops_prefetching_the_variables_of_a_model_it_no_longer_trains(start_cluster):
    cluster = start_cluster(num_ps=1, num_workers=1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    with strategy.scope():  # A's variables: 3x2000 + 2000x1 floats, 32 kB
        big = pf.keras.Sequential(
            [pf.keras.layers.Dense(2000, input_shape=(3,)), pf.keras.layers.Dense(1)]
        )
        big.compile(optimizer=pf.keras.optimizers.SGD(0.01), loss="mse")
    big.fit(x, y, batch_size=16, epochs=1, verbose=0)  # the worker knows A's variables
    a_bytes = sum(w.nbytes for w in big.get_weights())
    small = _model(strategy, "b")
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
    before = coordinator.schedule(_worker_bytes_pulled).fetch()
    small.fit(x, y, batch_size=16, epochs=5, verbose=0)  # 20 steps of B
    pulled = coordinator.schedule(_worker_bytes_pulled).fetch() - before
    b_bytes = sum(w.nbytes for w in small.get_weights())
    # B's step function prefetches A's variables at most once (its first step, before
    # it knows what it reads), not 20 times
    assert pulled <= 2 * a_bytes + 20 * 4 * b_bytes, (pulled, a_bytes, b_bytes)
    assert pulled >= 20 * b_bytes
