"""ReduceLROnPlateau as TensorFlow documents it: patience, factor, cooldown, min_lr, modes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import errors

keras = pf.keras
RNG = np.random.default_rng(11)
X = RNG.normal(size=(16, 3)).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)


def compiled(lr: float = 1.0) -> Any:
    model = keras.Sequential([keras.Input(shape=(3,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(lr), loss="mse")
    return model


def drive(callback: Any, values: list[float], monitor: str = "val_loss") -> list[float]:
    """Feeds ``values`` as the monitored metric of successive epochs; returns the rate after each."""
    callback.set_model(compiled())
    callback.on_train_begin()
    rates = []
    for epoch, value in enumerate(values):
        callback.on_epoch_end(epoch, {monitor: value})
        rates.append(callback.model.optimizer.learning_rate)
    return rates


def test_reduces_after_patience_epochs_without_improvement() -> None:
    cb = keras.callbacks.ReduceLROnPlateau(factor=0.5, patience=2)
    # best 1.0 at epoch 0; epochs 1 and 2 do not improve -> halve at epoch 2; again at 4
    rates = drive(cb, [1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5])
    assert rates == pytest.approx([1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.25])


def test_improvements_smaller_than_min_delta_do_not_count() -> None:
    cb = keras.callbacks.ReduceLROnPlateau(factor=0.1, patience=1, min_delta=0.1)
    rates = drive(cb, [1.0, 0.95, 0.7])
    assert rates == pytest.approx([1.0, 0.1, 0.1])


def test_cooldown_pauses_counting_and_min_lr_is_a_floor() -> None:
    cb = keras.callbacks.ReduceLROnPlateau(factor=0.1, patience=1, cooldown=2, min_lr=0.005)
    rates = drive(cb, [1.0] * 8)
    # reduce at 1; the cooldown counts down at 2 and 3, where counting resumes: reduce at 3;
    # again at 5, to the floor 0.005; at 7 the rate is at the floor and stays
    assert rates == pytest.approx([1.0, 0.1, 0.1, 0.01, 0.01, 0.005, 0.005, 0.005])


def test_auto_mode_maximizes_accuracy() -> None:
    cb = keras.callbacks.ReduceLROnPlateau(monitor="val_accuracy", factor=0.5, patience=1)
    assert drive(cb, [0.5, 0.6, 0.6], "val_accuracy") == pytest.approx([1.0, 1.0, 0.5])


def test_missing_metric_changes_nothing() -> None:
    cb = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", patience=0)
    assert drive(cb, [1.0, 1.0], "loss") == pytest.approx([1.0, 1.0])


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(errors.InvalidArgumentError, match=r"1\.5"):
        keras.callbacks.ReduceLROnPlateau(factor=1.5)
    with pytest.raises(errors.InvalidArgumentError, match="'up'"):
        keras.callbacks.ReduceLROnPlateau(mode="up")


def _fit(strategy: Any) -> tuple[list[np.ndarray], list[float]]:
    with strategy.scope():
        model = keras.Sequential([keras.Input(shape=(3,)), keras.layers.Dense(1)])
        model.set_weights([np.full((3, 1), 0.1, np.float32), np.zeros(1, np.float32)])
        model.compile(keras.optimizers.SGD(0.1), loss="mse")
    # min_delta so large that no epoch after the first improves: the rate halves from then on
    cb = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=1e9)
    history = model.fit(X, Y, batch_size=4, epochs=4, shuffle=False, verbose=0, callbacks=[cb])
    return model.get_weights(), history.history["learning_rate"]


def test_fit_logs_the_rate_and_trains_with_it() -> None:
    weights, rates = _fit(pf.distribute.get_strategy())
    assert rates == pytest.approx([0.1, 0.1, 0.05, 0.025])  # the rate each epoch trained with
    # the same run with the rates set by hand epoch by epoch
    model = keras.Sequential([keras.Input(shape=(3,)), keras.layers.Dense(1)])
    model.set_weights([np.full((3, 1), 0.1, np.float32), np.zeros(1, np.float32)])
    model.compile(keras.optimizers.SGD(0.1), loss="mse")
    for lr in (0.1, 0.1, 0.05, 0.025):
        model.optimizer.learning_rate = lr
        model.fit(X, Y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(weights, model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_parameter_server_workers_use_the_reduced_rate() -> None:
    want_w, want_rates = _fit(pf.distribute.get_strategy())
    strategy = pf.distribute.ParameterServerStrategy()
    try:
        got_w, got_rates = _fit(strategy)
    finally:
        pf.distribute.coordinator.ClusterCoordinator(strategy).shutdown()
    assert got_rates == pytest.approx(want_rates)
    for got, want in zip(got_w, want_w):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
