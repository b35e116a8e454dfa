"""Learning-rate schedules under PS ``fit`` on a local cluster give one process's per-step rates.

Each step closure carries its step and the rate the chief's schedule gives
there; with one worker (closures run one after another) the weights must then
follow single-process training step for step.
"""

from __future__ import annotations

import numpy as np
import pytest

import psflow as pf

pytestmark = pytest.mark.slow


def _data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(96, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5, 1)) + 0.3).astype(np.float32)
    return x, y


def _fit(strategy, learning_rate, callbacks_fn, steps_per_execution=1):
    x, y = _data()
    pf.random.set_seed(0)
    scope = strategy.scope() if strategy is not None else pf.distribute.get_strategy().scope()
    with scope:
        model = pf.keras.Sequential(
            [
                pf.keras.layers.Dense(
                    4,
                    activation="tanh",
                    input_shape=(5,),
                    kernel_initializer=pf.keras.initializers.GlorotUniform(seed=1),
                ),
                pf.keras.layers.Dense(
                    1, kernel_initializer=pf.keras.initializers.GlorotUniform(seed=2)
                ),
            ]
        )
        model.compile(
            optimizer=pf.keras.optimizers.SGD(learning_rate),
            loss="mse",
            steps_per_execution=steps_per_execution,
        )
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=callbacks_fn())
    return model


SCHEDULES = {
    "exponential": (lambda: pf.keras.optimizers.schedules.ExponentialDecay(0.2, 4, 0.5), list),
    "piecewise": (
        lambda: pf.keras.optimizers.schedules.PiecewiseConstantDecay([5, 11], [0.2, 0.05, 0.01]),
        list,
    ),
    "scheduler_callback": (
        lambda: 0.2,
        lambda: [pf.keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.2 * 0.3**epoch)],
    ),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_gives_single_process_steps_under_ps_fit(start_cluster, monkeypatch, name):
    # one closure at a time: two sent at once may start in either order on the worker,
    # which would change the order of the batches (not their rates)
    monkeypatch.setenv("PSFLOW_CLOSURES_IN_FLIGHT", "1")
    make_lr, callbacks_fn = SCHEDULES[name]
    reference = _fit(None, make_lr(), callbacks_fn)
    cluster = start_cluster(num_ps=1, num_workers=1)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    model = _fit(strategy, make_lr(), callbacks_fn)
    steps = 3 * (96 // 16)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == steps
    for got, want in zip(model.weights, reference.weights):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    # a frozen rate (the schedule's first value every step) would end elsewhere
    frozen = _fit(None, float(make_lr()(0)) if callable(make_lr()) else make_lr(), list)
    assert not np.allclose(frozen.weights[0].numpy(), model.weights[0].numpy(), atol=1e-4)


def test_several_steps_per_closure_train_as_one_process_with_callbacks_per_execution(
    start_cluster, monkeypatch
):
    monkeypatch.setenv("PSFLOW_CLOSURES_IN_FLIGHT", "1")
    make_lr, _ = SCHEDULES["exponential"]
    ends: list[int] = []

    def callbacks():
        return [
            pf.keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: ends.append(b))
        ]

    reference = _fit(None, make_lr(), list)
    cluster = start_cluster(num_ps=1, num_workers=1)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    model = _fit(strategy, make_lr(), callbacks, steps_per_execution=4)
    # 6 batches an epoch: closures of 4 and 2 batches, the hooks once per closure with
    # the index of its last batch (Keras's numbering), the rate of every batch its own
    assert ends == [3, 5] * 3
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 18
    for got, want in zip(model.weights, reference.weights):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    (stats,) = strategy.ps_stats()
    assert stats["pushes_applied"] == 18  # one push per batch, each applied once


def test_schedule_in_the_embedded_default_matches_one_process():
    make_lr = SCHEDULES["exponential"][0]
    reference = _fit(None, make_lr(), list)
    model = _fit(pf.distribute.ParameterServerStrategy(), make_lr(), list)
    assert int(model.optimizer.iterations) == 3 * (96 // 16)
    for got, want in zip(model.weights, reference.weights):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
