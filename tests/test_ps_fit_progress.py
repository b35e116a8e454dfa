"""The progress bar of PSS ``fit`` promises the steps an epoch really takes."""

from __future__ import annotations

import numpy as np
import pytest

import psflow as pf


class _Steps(pf.keras.callbacks.Callback):
    """Records the promised steps and the batches that ended, per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.promised: list[int | None] = []
        self.ran: list[int] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.promised.append(self.params.get("steps"))
        self.ran.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.ran[-1] += 1


@pytest.mark.slow
def test_two_workers_run_as_many_steps_as_the_progress_bar_promises(start_cluster):
    # 90 examples in batches of 32: 3 global batches (the chief hands them out),
    # not 2 x ceil(45 / 32) = 4 as when each worker read its own shard
    cluster = start_cluster(num_ps=1, num_workers=2)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    with strategy.scope():
        model = pf.keras.Sequential([pf.keras.layers.Dense(1, input_shape=(3,))])
        model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(90, 3)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    steps = _Steps()
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[steps])
    assert steps.promised == [3, 3]
    assert steps.ran == [3, 3]
