"""Training callbacks: the hooks' order and arguments, and each built-in callback's effect."""

from __future__ import annotations

import csv
import math
import os
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import keras


def _data(n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    return x, (x @ np.array([1.0, -2.0, 0.5])).astype(np.float32).reshape(-1, 1)


def _model(lr: float = 0.05, metrics: list[str] | None = None) -> keras.Sequential:
    pf.random.set_seed(0)
    model = keras.Sequential([keras.layers.Dense(4, input_shape=(3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse", metrics=metrics)
    return model


class Inject(keras.callbacks.Callback):
    """Overwrites ``logs[key]`` at each epoch end with a scripted value (runs before the rest)."""

    def __init__(self, key: str, values: list[float]) -> None:
        super().__init__()
        self.key, self.values = key, values
        self.weights: list[list[np.ndarray]] = []

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        assert logs is not None
        logs[self.key] = self.values[epoch]
        self.weights.append([w.copy() for w in self.model.get_weights()])


# -- hooks --------------------------------------------------------------------------------


def test_lambda_callback_hooks_run_in_keras_order_with_their_arguments() -> None:
    x, y = _data(12)
    calls: list[tuple[Any, ...]] = []
    cb = keras.callbacks.LambdaCallback(
        on_train_begin=lambda logs: calls.append(("train_begin",)),
        on_epoch_begin=lambda epoch, logs: calls.append(("epoch_begin", epoch)),
        on_train_batch_begin=lambda batch, logs: calls.append(("batch_begin", batch)),
        on_train_batch_end=lambda batch, logs: calls.append(("batch_end", batch, sorted(logs))),
        on_epoch_end=lambda epoch, logs: calls.append(("epoch_end", epoch, sorted(logs))),
        on_train_end=lambda logs: calls.append(("train_end", sorted(logs))),
    )
    model = _model(metrics=["mae"])
    model.fit(x, y, batch_size=8, epochs=2, callbacks=[cb], validation_data=(x, y), verbose=0)
    epoch_keys = ["loss", "mae", "val_loss", "val_mae"]
    per_epoch = lambda e: [  # noqa: E731
        ("epoch_begin", e),
        ("batch_begin", 0),
        ("batch_end", 0, ["loss", "mae"]),
        ("batch_begin", 1),
        ("batch_end", 1, ["loss", "mae"]),
        ("epoch_end", e, epoch_keys),
    ]
    assert calls == [("train_begin",), *per_epoch(0), *per_epoch(1), ("train_end", epoch_keys)]


def test_lambda_callback_accepts_keras_2_batch_aliases_and_rejects_unknown_hooks() -> None:
    x, y = _data(12)
    seen: list[int] = []
    cb = keras.callbacks.LambdaCallback(on_batch_end=lambda batch, logs: seen.append(batch))
    _model().fit(x, y, batch_size=4, epochs=1, callbacks=[cb], verbose=0)
    assert seen == [0, 1, 2]
    with pytest.raises(ValueError, match="on_epoch_ending"):
        keras.callbacks.LambdaCallback(on_epoch_ending=print)


def test_batch_logs_are_running_means_over_the_epoch() -> None:
    x, y = _data(12)
    batch_losses: list[float] = []
    cb = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch_losses.append(logs["loss"])
    )
    model = _model(lr=0.0)  # the weights stay put, so each batch's loss is a fixed number
    model.fit(x, y, batch_size=4, epochs=1, callbacks=[cb], shuffle=False, verbose=0)
    pred = model.predict(x, verbose=0)
    per_batch = [float(((pred[i : i + 4] - y[i : i + 4]) ** 2).mean()) for i in (0, 4, 8)]
    running = [np.mean(per_batch[: k + 1]) for k in range(3)]
    np.testing.assert_allclose(batch_losses, running, rtol=1e-5)


def test_evaluate_and_predict_call_their_hooks() -> None:
    x, y = _data(10)
    calls: list[str] = []

    class Hooks(keras.callbacks.Callback):
        def on_test_begin(self, logs: dict | None = None) -> None:
            calls.append("test_begin")

        def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
            calls.append(f"test_batch_{batch}")

        def on_test_end(self, logs: dict | None = None) -> None:
            calls.append(f"test_end:{sorted(logs or {})}")

        def on_predict_begin(self, logs: dict | None = None) -> None:
            calls.append("predict_begin")

        def on_predict_batch_end(self, batch: int, logs: dict | None = None) -> None:
            calls.append(f"predict_batch_{batch}")

        def on_predict_end(self, logs: dict | None = None) -> None:
            calls.append("predict_end")

    model = _model()
    model.evaluate(x, y, batch_size=5, callbacks=[Hooks()], verbose=0)
    model.predict(x, batch_size=5, callbacks=[Hooks()], verbose=0)
    assert calls == [
        "test_begin",
        "test_batch_0",
        "test_batch_1",
        "test_end:['loss']",
        "predict_begin",
        "predict_batch_0",
        "predict_batch_1",
        "predict_end",
    ]


# -- EarlyStopping ----------------------------------------------------------------------------


@pytest.mark.parametrize("patience", [0, 1, 3])
def test_early_stopping_waits_patience_epochs_without_improvement(patience: int) -> None:
    x, y = _data()
    model = _model(lr=0.0)  # nothing improves after the first epoch
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=patience)
    # unshuffled, every epoch's loss is the same sums of the same batches, bit for bit;
    # shuffled, the batches differ and the mean may drop by an ulp (an "improvement")
    hist = model.fit(x, y, epochs=10, callbacks=[stop], verbose=0, shuffle=False)
    assert len(hist.epoch) == max(patience, 1) + 1  # wait counts from epoch 1 on
    assert stop.stopped_epoch == hist.epoch[-1]


def test_early_stopping_resets_its_patience_on_improvement_and_honours_min_delta() -> None:
    x, y = _data()
    monitored = [5.0, 4.0, 4.5, 3.0, 3.5, 3.2, 2.95, 2.99, 2.98, 1.0]
    model = _model()
    stop = keras.callbacks.EarlyStopping(monitor="score", patience=2, min_delta=0.1)
    hist = model.fit(x, y, epochs=10, callbacks=[Inject("score", monitored), stop], verbose=0)
    # Improvements: 5.0 (e0), 4.0 (e1), 3.0 (e3); 2.95 is within min_delta of 3.0.
    # Waits after e3: e4 -> 1, e5 -> 2 = patience: stop at epoch 5.
    assert hist.epoch == [0, 1, 2, 3, 4, 5]
    assert stop.stopped_epoch == 5 and stop.best == 3.0 and stop.best_epoch == 3


def test_early_stopping_mode_max_for_accuracy_like_monitors() -> None:
    x, y = _data()
    model = _model()
    stop = keras.callbacks.EarlyStopping(monitor="val_accuracy", patience=2)
    inject = Inject("val_accuracy", [0.5, 0.6, 0.55, 0.7] + [0.1] * 6)
    hist = model.fit(x, y, epochs=10, callbacks=[inject, stop], verbose=0)
    assert hist.epoch == [0, 1, 2, 3, 4, 5] and stop.best == 0.7


def test_early_stopping_restores_the_best_weights_when_it_stops() -> None:
    x, y = _data()
    model = _model()
    inject = Inject("val_loss", [3.0, 1.0, 2.0, 2.5, 2.6, 0.1, 0.1, 0.1])
    stop = keras.callbacks.EarlyStopping(patience=2, restore_best_weights=True)
    hist = model.fit(x, y, epochs=8, callbacks=[inject, stop], verbose=0)
    assert hist.epoch == [0, 1, 2, 3]
    for a, b in zip(model.get_weights(), inject.weights[1]):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(inject.weights[1][0], inject.weights[3][0])


def test_early_stopping_without_restore_keeps_the_last_weights() -> None:
    x, y = _data()
    model = _model()
    inject = Inject("val_loss", [3.0, 1.0, 2.0, 2.5])
    hist = model.fit(
        x, y, epochs=4, callbacks=[inject, keras.callbacks.EarlyStopping(patience=2)], verbose=0
    )
    assert hist.epoch == [0, 1, 2, 3]
    for a, b in zip(model.get_weights(), inject.weights[3]):
        np.testing.assert_array_equal(a, b)


def test_early_stopping_prints_the_stopping_epoch_when_verbose(capsys: Any) -> None:
    x, y = _data()
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=1, verbose=1)
    _model(lr=0.0).fit(x, y, epochs=5, callbacks=[stop], verbose=0)
    assert capsys.readouterr().out == "Epoch 2: early stopping\n"


# -- CSVLogger -----------------------------------------------------------------------------


def test_csv_logger_writes_a_header_and_one_row_per_epoch(tmp_path: Any) -> None:
    x, y = _data()
    path = tmp_path / "log.csv"
    model = _model(metrics=["mae"])
    hist = model.fit(
        x,
        y,
        epochs=3,
        validation_split=0.25,
        callbacks=[keras.callbacks.CSVLogger(str(path))],
        verbose=0,
    )
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["epoch", "loss", "mae", "val_loss", "val_mae"]
    assert [r[0] for r in rows[1:]] == ["0", "1", "2"]
    for i, key in enumerate(rows[0][1:], start=1):
        assert [float(r[i]) for r in rows[1:]] == hist.history[key]  # exact round trip


def test_csv_logger_appends_without_a_second_header_and_uses_the_separator(tmp_path: Any) -> None:
    x, y = _data()
    path = tmp_path / "log.tsv"
    model = _model()
    model.fit(x, y, epochs=2, callbacks=[keras.callbacks.CSVLogger(str(path), "\t")], verbose=0)
    model.fit(
        x, y, epochs=1, callbacks=[keras.callbacks.CSVLogger(str(path), "\t", True)], verbose=0
    )
    lines = path.read_text().splitlines()
    assert lines[0] == "epoch\tloss"
    assert [line.split("\t")[0] for line in lines[1:]] == ["0", "1", "0"]
    # A fresh logger without append starts the file over.
    model.fit(x, y, epochs=1, callbacks=[keras.callbacks.CSVLogger(str(path), "\t")], verbose=0)
    assert len(path.read_text().splitlines()) == 2


# -- TerminateOnNaN ------------------------------------------------------------------------


def test_terminate_on_nan_stops_at_the_first_bad_batch(capsys: Any) -> None:
    x, y = _data(20)
    y[8:12] = np.nan  # the third batch of four
    batches: list[int] = []
    cb = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: batches.append(b))
    hist = _model().fit(
        x,
        y,
        batch_size=4,
        epochs=5,
        shuffle=False,
        callbacks=[keras.callbacks.TerminateOnNaN(), cb],
        verbose=0,
    )
    assert batches == [0, 1, 2]
    assert hist.epoch == [0] and math.isnan(hist.history["loss"][0])
    assert capsys.readouterr().out == "Batch 2: Invalid loss, terminating training\n"


def test_terminate_on_nan_ignores_finite_losses() -> None:
    x, y = _data(20)
    hist = _model().fit(x, y, epochs=3, callbacks=[keras.callbacks.TerminateOnNaN()], verbose=0)
    assert hist.epoch == [0, 1, 2]


# -- LearningRateScheduler --------------------------------------------------------------------


def test_learning_rate_scheduler_sets_the_rate_each_epoch(capsys: Any) -> None:
    x, y = _data()
    model = _model(lr=0.1)
    rates: list[float] = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda e, logs: rates.append(model.optimizer.learning_rate)
    )
    sched = keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5, verbose=1)
    model.fit(x, y, epochs=3, callbacks=[sched, record], verbose=0)
    assert rates == [0.05, 0.025, 0.0125]
    assert capsys.readouterr().out.splitlines() == [
        "Epoch 1: LearningRateScheduler setting learning rate to 0.05.",
        "Epoch 2: LearningRateScheduler setting learning rate to 0.025.",
        "Epoch 3: LearningRateScheduler setting learning rate to 0.0125.",
    ]


def test_learning_rate_scheduler_rate_is_what_the_optimizer_applies() -> None:
    x, y = _data()
    model = _model()
    inject = Inject("unused", [0.0] * 4)
    sched = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.0 if epoch % 2 else 0.05)
    model.fit(x, y, epochs=4, callbacks=[sched, inject], verbose=0)
    w = [ws[0] for ws in inject.weights]
    np.testing.assert_array_equal(w[0], w[1])  # epoch 1 ran at rate 0
    assert not np.array_equal(w[1], w[2])
    np.testing.assert_array_equal(w[2], w[3])


# -- ModelCheckpoint ---------------------------------------------------------------------------


def test_model_checkpoint_saves_each_epoch_and_only_the_best(tmp_path: Any) -> None:
    pytest.importorskip("psflow.io.safetensors")
    x, y = _data()
    model = _model()
    every = keras.callbacks.ModelCheckpoint(str(tmp_path / "e{epoch:02d}.weights"))
    inject = Inject("val_loss", [3.0, 1.0, 2.0])
    best = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "best.weights"), monitor="val_loss", save_best_only=True
    )
    model.fit(x, y, epochs=3, callbacks=[inject, every, best], verbose=0)
    assert sorted(os.listdir(tmp_path)) == [
        "best.weights",
        "checkpoint",  # the state file naming the latest save (train.latest_checkpoint)
        "e01.weights",
        "e02.weights",
        "e03.weights",
    ]
    fresh = _model()
    fresh.load_weights(str(tmp_path / "best.weights"))
    for a, b in zip(fresh.get_weights(), inject.weights[1]):
        np.testing.assert_array_equal(a, b)
    fresh.load_weights(str(tmp_path / "e03.weights"))
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
