"""``Model.fit``/``evaluate``/``predict`` and friends, each checked against a hand-run reference."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import errors, keras

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _data(n: int = 40, d: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = (x @ np.arange(1.0, d + 1) + 0.5).astype(np.float32).reshape(-1, 1)
    return x, y


def _mlp(d: int = 3, seed: int = 0, dropout: float = 0.0) -> keras.Sequential:
    pf.random.set_seed(seed)
    layers: list[Any] = [keras.layers.Dense(8, activation="tanh", input_shape=(d,))]
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    layers.append(keras.layers.Dense(1))
    return keras.Sequential(layers)


class BatchRecorder(keras.callbacks.Callback):
    """Counts train/test batches per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.train_batches: list[int] = []
        self.test_batches = 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.train_batches.append(0)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.train_batches[-1] += 1

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.test_batches += 1


class RecordingSequential(keras.Sequential):
    """A Sequential that remembers the x of every training batch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[np.ndarray] = []

    def train_step(self, data: Any) -> dict[str, Any]:
        self.seen.append(data[0].numpy().copy())
        return super().train_step(data)


# -- reproducibility ---------------------------------------------------------------------

_SEEDED_RUN = textwrap.dedent(
    """
    import hashlib
    import numpy as np
    import psflow as pf
    from psflow import keras

    def seeded_run():
        pf.random.set_seed(0)
        x = pf.random.normal([64, 5]).numpy()
        y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
        model = keras.Sequential([
            keras.layers.Dense(16, activation="relu", input_shape=(5,)),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(1, activation="sigmoid"),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss="binary_crossentropy", metrics=["accuracy"])
        hist = model.fit(x, y, epochs=3, batch_size=8, shuffle=True, verbose=0,
                         validation_split=0.25)
        h = hashlib.sha256()
        for w in model.get_weights():
            h.update(w.tobytes())
        h.update(repr(sorted(hist.history.items())).encode())
        return h.hexdigest()
    """
)


def _seeded_run() -> str:
    scope: dict[str, Any] = {}
    exec(_SEEDED_RUN, scope)  # the same source the subprocesses run
    return scope["seeded_run"]()


def test_seeded_fit_is_bit_identical_in_process() -> None:
    assert _seeded_run() == _seeded_run()


@pytest.mark.slow
def test_seeded_fit_is_bit_identical_across_processes() -> None:
    code = _SEEDED_RUN + "\nprint(seeded_run())\n"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            outs.append(out.strip())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert outs[0] == outs[1] == _seeded_run()


def test_different_seeds_give_different_runs() -> None:
    x, y = _data()
    finals = []
    for seed in (1, 2):
        model = _mlp(seed=seed)
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, epochs=1, batch_size=8, verbose=0)
        finals.append(model.get_weights()[0])
    assert not np.array_equal(finals[0], finals[1])


# -- fit against a hand-written loop -----------------------------------------------------


def _manual_epoch(
    model: keras.Model,
    x: np.ndarray,
    y: np.ndarray,
    batch: int,
    lr: float,
    sw: np.ndarray | None = None,
    order: np.ndarray | None = None,
) -> list[float]:
    """One epoch of the custom-loop idiom; returns the per-batch losses."""
    loss_fn = keras.losses.MeanSquaredError()
    opt = keras.optimizers.SGD(lr)
    order = np.arange(len(x)) if order is None else order
    losses = []
    for start in range(0, len(x), batch):
        idx = order[start : start + batch]
        with pf.GradientTape() as tape:
            pred = model(pf.constant(x[idx]), training=True)
            loss = loss_fn(pf.constant(y[idx]), pred, None if sw is None else pf.constant(sw[idx]))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss.numpy()))
    return losses


def test_fit_without_shuffle_equals_a_custom_training_loop() -> None:
    x, y = _data(n=36)
    a, b = _mlp(seed=3), _mlp(seed=3)
    np.testing.assert_array_equal(a.get_weights()[0], b.get_weights()[0])
    a.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    hist = a.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    losses = _manual_epoch(b, x, y, batch=8, lr=0.05)
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(wa, wb, rtol=1e-6, atol=1e-7)
    # The epoch's loss is the mean over examples of the per-batch means (last batch has 4).
    sizes = np.array([8, 8, 8, 8, 4])
    np.testing.assert_allclose(hist.history["loss"][0], (np.array(losses) * sizes).sum() / 36, 1e-5)


def test_fit_with_sample_weight_equals_a_weighted_custom_loop() -> None:
    x, y = _data(n=24)
    sw = np.random.default_rng(1).uniform(0, 2, size=24).astype(np.float32)
    a, b = _mlp(seed=4), _mlp(seed=4)
    a.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    a.fit(x, y, sample_weight=sw, batch_size=6, epochs=1, shuffle=False, verbose=0)
    _manual_epoch(b, x, y, batch=6, lr=0.05, sw=sw)
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(wa, wb, rtol=1e-6, atol=1e-7)
    # And the weights matter: unweighted training ends elsewhere.
    c = _mlp(seed=4)
    c.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    c.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    assert not np.allclose(a.get_weights()[0], c.get_weights()[0])


def test_shuffle_off_keeps_order_and_shuffle_on_permutes_every_epoch() -> None:
    x, _ = _data(n=20)
    y = np.arange(20, dtype=np.float32).reshape(-1, 1)
    x[:, 0] = np.arange(20)  # tag each example
    for shuffle in (False, True):
        pf.random.set_seed(0)
        model = RecordingSequential([keras.layers.Dense(1, input_shape=(3,))])
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        model.fit(x, y, batch_size=6, epochs=3, shuffle=shuffle, verbose=0)
        assert [len(b) for b in model.seen] == [6, 6, 6, 2] * 3
        epochs = [np.concatenate(model.seen[i * 4 : i * 4 + 4])[:, 0] for i in range(3)]
        for tags in epochs:
            assert sorted(tags.tolist()) == list(range(20))  # every example once per epoch
        if shuffle:
            assert not np.array_equal(epochs[0], np.arange(20))
            assert not np.array_equal(epochs[0], epochs[1])
        else:
            for tags in epochs:
                np.testing.assert_array_equal(tags, np.arange(20))


def test_fit_learns_a_linear_function() -> None:
    x, y = _data(n=128)
    pf.random.set_seed(0)
    model = keras.Sequential([keras.layers.Dense(1, input_shape=(3,))])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    hist = model.fit(x, y, batch_size=16, epochs=20, verbose=0)
    assert hist.history["loss"][-1] < 1e-3 < hist.history["loss"][0]
    kernel, bias = model.get_weights()
    np.testing.assert_allclose(kernel.ravel(), [1, 2, 3], atol=0.02)
    np.testing.assert_allclose(bias, [0.5], atol=0.02)


# -- validation ----------------------------------------------------------------------------


def test_validation_split_holds_out_the_last_examples_before_shuffling() -> None:
    x, y = _data(n=50)
    model = RecordingSequential([keras.layers.Dense(1, input_shape=(3,))])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
    rec = BatchRecorder()
    hist = model.fit(
        x, y, batch_size=10, epochs=2, validation_split=0.2, callbacks=[rec], verbose=0
    )
    assert rec.train_batches == [4, 4]
    seen = np.concatenate(model.seen)
    assert len(seen) == 80
    held_out = {tuple(r) for r in x[40:]}
    assert not any(tuple(r) in held_out for r in seen)
    assert set(hist.history) == {"loss", "mae", "val_loss", "val_mae"}
    # The last epoch's validation numbers are evaluate() on the held-out tail.
    val_loss, val_mae = model.evaluate(x[40:], y[40:], batch_size=10, verbose=0)
    assert hist.history["val_loss"][-1] == pytest.approx(val_loss, rel=1e-6)
    assert hist.history["val_mae"][-1] == pytest.approx(val_mae, rel=1e-6)


def test_validation_data_with_and_without_sample_weights() -> None:
    x, y = _data(n=30)
    vx, vy = _data(n=12, seed=9)
    vsw = np.linspace(0, 2, 12).astype(np.float32)
    model = _mlp(seed=5)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    h1 = model.fit(x, y, epochs=1, validation_data=(vx, vy), verbose=0)
    assert h1.history["val_loss"][0] == pytest.approx(model.evaluate(vx, vy, verbose=0), rel=1e-6)
    h2 = model.fit(x, y, epochs=1, validation_data=(vx, vy, vsw), verbose=0)
    weighted = model.evaluate(vx, vy, sample_weight=vsw, verbose=0)
    assert h2.history["val_loss"][0] == pytest.approx(weighted, rel=1e-6)
    pred = model.predict(vx, verbose=0)
    per_example = ((pred - vy) ** 2).mean(axis=1)
    assert weighted == pytest.approx((per_example * vsw).sum() / 12, rel=1e-5)


def test_validation_freq_skips_epochs() -> None:
    x, y = _data(n=16)
    model = _mlp()
    model.compile(optimizer="sgd", loss="mse")
    rec = keras.callbacks.LambdaCallback()
    logs_seen: list[set[str]] = []
    rec.on_epoch_end = lambda epoch, logs: logs_seen.append(set(logs))
    model.fit(x, y, epochs=4, validation_data=(x, y), validation_freq=2, callbacks=[rec], verbose=0)
    assert ["val_loss" in s for s in logs_seen] == [False, True, False, True]


# -- History ----------------------------------------------------------------------------


def test_history_records_every_epoch() -> None:
    x, y = _data(n=24)
    model = _mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.02), loss="mse", metrics=["mae", "mse"])
    hist = model.fit(x, y, epochs=3, batch_size=8, verbose=0, validation_data=(x, y))
    assert isinstance(hist, keras.callbacks.History)
    assert model.history is hist
    assert hist.epoch == [0, 1, 2]
    assert list(hist.history) == ["loss", "mae", "mse", "val_loss", "val_mae", "val_mse"]
    assert all(len(v) == 3 for v in hist.history.values())
    assert all(isinstance(v, float) for vs in hist.history.values() for v in vs)
    # mse metric == mse loss (no regularization)
    np.testing.assert_allclose(hist.history["loss"], hist.history["mse"], rtol=1e-6)
    assert hist.history["loss"][2] < hist.history["loss"][0]
    assert hist.params["epochs"] == 3 and hist.params["steps"] == 3


def test_initial_epoch_and_zero_epochs() -> None:
    x, y = _data(n=16)
    model = _mlp()
    model.compile(optimizer="sgd", loss="mse")
    hist = model.fit(x, y, epochs=3, initial_epoch=1, verbose=0)
    assert hist.epoch == [1, 2]
    before = model.get_weights()
    hist = model.fit(x, y, epochs=0, verbose=0)
    assert hist.history == {}
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


# -- steps_per_epoch and other inputs ---------------------------------------------------------


def test_steps_per_epoch_limits_array_epochs() -> None:
    x, y = _data(n=40)
    model = RecordingSequential([keras.layers.Dense(1, input_shape=(3,))])
    model.compile(optimizer="sgd", loss="mse")
    rec = BatchRecorder()
    hist = model.fit(
        x, y, batch_size=5, epochs=3, steps_per_epoch=2, shuffle=False, callbacks=[rec], verbose=0
    )
    assert rec.train_batches == [2, 2, 2]
    assert hist.params["steps"] == 2
    np.testing.assert_array_equal(np.concatenate(model.seen[:2]), x[:10])


def test_steps_per_epoch_with_a_generator_continues_across_epochs() -> None:
    x, y = _data(n=40)

    def batches() -> Any:
        for i in range(8):
            yield x[i * 5 : i * 5 + 5], y[i * 5 : i * 5 + 5]

    model = RecordingSequential([keras.layers.Dense(1, input_shape=(3,))])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(batches(), epochs=4, steps_per_epoch=2, verbose=0)
    np.testing.assert_array_equal(np.concatenate(model.seen), x)


def test_fit_on_a_generator_builds_the_model_without_losing_the_first_batch() -> None:
    x, y = _data(n=12)

    def batches() -> Any:
        for i in range(3):
            yield x[i * 4 : i * 4 + 4], y[i * 4 : i * 4 + 4]

    model = RecordingSequential([keras.layers.Dense(2), keras.layers.Dense(1)])
    assert not model.built
    model.compile(optimizer="sgd", loss="mse")
    model.fit(batches(), epochs=1, verbose=0)
    np.testing.assert_array_equal(np.concatenate(model.seen), x)


def test_fit_accepts_tensors_and_lists() -> None:
    x, y = _data(n=12)
    model = _mlp()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(pf.constant(x), pf.constant(y), epochs=1, verbose=0)
    model.fit(x.tolist(), y.tolist(), epochs=1, verbose=0)
    assert model.evaluate(pf.constant(x), y, verbose=0) == pytest.approx(
        model.evaluate(x, y, verbose=0), rel=1e-6
    )


# -- evaluate / predict ----------------------------------------------------------------------


def test_evaluate_returns_a_scalar_a_list_or_a_dict() -> None:
    x, y = _data(n=20)
    model = _mlp()
    model.compile(optimizer="sgd", loss="mse")
    loss = model.evaluate(x, y, verbose=0)
    assert isinstance(loss, float)
    pred = model.predict(x, verbose=0)
    assert loss == pytest.approx(float(((pred - y) ** 2).mean()), rel=1e-5)
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    both = model.evaluate(x, y, batch_size=7, verbose=0)
    assert isinstance(both, list) and len(both) == 2
    assert both[0] == pytest.approx(loss, rel=1e-6)
    assert both[1] == pytest.approx(float(np.abs(pred - y).mean()), rel=1e-5)
    as_dict = model.evaluate(x, y, verbose=0, return_dict=True)
    assert as_dict == pytest.approx({"loss": both[0], "mae": both[1]}, rel=1e-6)
    assert model.metrics_names == ["loss", "mae"]


def test_evaluate_with_steps_uses_only_the_first_batches() -> None:
    x, y = _data(n=20)
    model = _mlp()
    model.compile(optimizer="sgd", loss="mse")
    first = model.evaluate(x[:8], y[:8], verbose=0)
    assert model.evaluate(x, y, batch_size=4, steps=2, verbose=0) == pytest.approx(first, 1e-6)


@pytest.mark.parametrize("batch_size", [None, 1, 7, 64])
def test_predict_concatenates_batches(batch_size: int | None) -> None:
    x, _ = _data(n=50)
    model = _mlp()
    out = model.predict(x, batch_size=batch_size, verbose=0)
    assert isinstance(out, np.ndarray) and out.shape == (50, 1) and out.dtype == np.float32
    np.testing.assert_allclose(out, model(pf.constant(x)).numpy(), rtol=1e-6)


def test_predict_returns_the_structure_of_the_outputs() -> None:
    class TwoHeads(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.a = keras.layers.Dense(2)
            self.b = keras.layers.Dense(3, activation="softmax")

        def call(self, inputs: Any) -> Any:
            return {"a": self.a(inputs), "b": self.b(inputs)}

    x, _ = _data(n=9)
    out = TwoHeads().predict(x, batch_size=4, verbose=0)
    assert set(out) == {"a", "b"}
    assert out["a"].shape == (9, 2) and out["b"].shape == (9, 3)
    np.testing.assert_allclose(out["b"].sum(axis=1), np.ones(9), rtol=1e-5)


def test_predict_on_an_unbuilt_model_builds_it() -> None:
    model = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(2)])
    assert not model.built
    out = model.predict(np.ones((3, 5), np.float32), verbose=0)
    assert out.shape == (3, 2) and model.built
    assert model.layers[0].kernel.shape == (5, 4)


# -- single batches --------------------------------------------------------------------------


def test_train_on_batch_test_on_batch_and_predict_on_batch() -> None:
    x, y = _data(n=16)
    model = _mlp(seed=6)
    ref = _mlp(seed=6)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    loss = model.train_on_batch(x, y)
    losses = _manual_epoch(ref, x, y, batch=16, lr=0.1)
    assert isinstance(loss, float) and loss == pytest.approx(losses[0], rel=1e-6)
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    out = model.train_on_batch(x, y, return_dict=True)
    assert set(out) == {"loss", "mae"}
    test = model.test_on_batch(x, y)
    assert isinstance(test, list) and len(test) == 2
    assert test == pytest.approx(model.evaluate(x, y, verbose=0, batch_size=16), rel=1e-6)
    pred = model.predict_on_batch(x)
    assert isinstance(pred, np.ndarray) and pred.shape == (16, 1)


# -- custom loops and subclassing ---------------------------------------------------------------


def test_custom_loop_with_model_variables_and_apply_gradients() -> None:
    x, y = _data(n=32)
    model = _mlp(seed=7, dropout=0.0)
    assert [tuple(v.shape) for v in model.trainable_variables] == [(3, 8), (8,), (8, 1), (1,)]
    opt = keras.optimizers.Adam(0.05)
    loss_fn = keras.losses.MeanSquaredError()
    first = None
    for _ in range(30):
        with pf.GradientTape() as tape:
            loss = loss_fn(pf.constant(y), model(pf.constant(x), training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        assert all(g is not None for g in grads)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        first = float(loss.numpy()) if first is None else first
    assert float(loss.numpy()) < 0.5 * first
    assert int(opt.iterations) == 30


def test_training_flag_reaches_dropout_through_the_model() -> None:
    model = _mlp(seed=8, dropout=0.5)
    x = pf.constant(np.ones((64, 3), np.float32))
    a = model(x, training=False).numpy()
    np.testing.assert_array_equal(a, model(x).numpy())
    b = model(x, training=True).numpy()
    assert not np.allclose(a, b)


class SubclassedRegressor(keras.Model):
    """A two-layer regressor with a skip connection (not expressible as Sequential)."""

    def __init__(self, units: int = 8) -> None:
        super().__init__(name="regressor")
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.out = keras.layers.Dense(1)
        self.skip = keras.layers.Dense(1, use_bias=False)

    def call(self, inputs: Any, training: Any = None) -> Any:
        return self.out(self.hidden(inputs)) + self.skip(inputs)


def test_subclassed_model_trains_evaluates_and_predicts() -> None:
    x, y = _data(n=64)
    pf.random.set_seed(0)
    model = SubclassedRegressor()
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", metrics=["mae"])
    hist = model.fit(x, y, epochs=15, batch_size=16, verbose=0)
    assert hist.history["loss"][-1] < 0.1 * hist.history["loss"][0]
    assert len(model.trainable_variables) == 5
    assert model.count_params() == 3 * 8 + 8 + 8 + 1 + 3
    loss, _ = model.evaluate(x, y, verbose=0)
    assert loss == pytest.approx(hist.history["loss"][-1], rel=0.5)
    assert model.predict(x, verbose=0).shape == (64, 1)
    model.hidden.trainable = False
    assert len(model.trainable_variables) == 3
    frozen = model.hidden.kernel.numpy().copy()
    model.fit(x, y, epochs=1, verbose=0)
    np.testing.assert_array_equal(model.hidden.kernel.numpy(), frozen)


def test_set_and_get_weights_round_trip_and_reject_bad_shapes() -> None:
    a, b = _mlp(seed=1), _mlp(seed=2)
    b.set_weights(a.get_weights())
    x = pf.constant(np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(a(x).numpy(), b(x).numpy())
    bad = a.get_weights()
    bad[0] = bad[0].T
    with pytest.raises(errors.InvalidArgumentError, match=r"\[3, 8\].*\[8, 3\]"):
        b.set_weights(bad)
    with pytest.raises(errors.InvalidArgumentError, match="3 arrays for 4 weights"):
        b.set_weights(a.get_weights()[:3])


def test_save_and_load_weights_round_trip(tmp_path: Any) -> None:
    pytest.importorskip("psflow.io.safetensors")
    a, b = _mlp(seed=1), _mlp(seed=2)
    path = tmp_path / "w.safetensors"
    a.save_weights(str(path))
    b.load_weights(str(path))
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_array_equal(wa, wb)


# -- summary --------------------------------------------------------------------------------


def _summary_lines(model: keras.Model, **kwargs: Any) -> list[str]:
    lines: list[str] = []
    model.summary(print_fn=lines.append, **kwargs)
    return lines


def test_summary_prints_keras_2_table() -> None:
    keras.clear_session()
    model = keras.Sequential(
        [
            keras.layers.Dense(64, activation="relu", input_shape=(784,)),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(10),
        ]
    )
    lines = _summary_lines(model)
    assert lines == [
        'Model: "sequential"',
        "_" * 65,
        " Layer (type)                Output Shape              Param #   ",
        "=" * 65,
        " dense (Dense)               (None, 64)                50240     ",
        " " * 65,
        " dropout (Dropout)           (None, 64)                0         ",
        " " * 65,
        " dense_1 (Dense)             (None, 10)                650       ",
        " " * 65,
        "=" * 65,
        "Total params: 50890 (198.79 KB)",
        "Trainable params: 50890 (198.79 KB)",
        "Non-trainable params: 0 (0.00 Byte)",
        "_" * 65,
    ]


def test_summary_after_fit_shows_an_unknown_batch_dimension() -> None:
    keras.clear_session()
    x, y = _data(n=12)
    model = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    lines = _summary_lines(model)
    assert lines[4].startswith(" dense (Dense)               (None, 4)                 16")
    assert lines[6].startswith(" dense_1 (Dense)             (None, 1)                 5")
    assert all(len(line) == 65 for line in lines if line[:1] in " _=")


def test_summary_with_frozen_layer_and_line_length() -> None:
    keras.clear_session()
    model = keras.Sequential([keras.layers.Dense(4, input_shape=(2,)), keras.layers.Dense(1)])
    model.layers[0].trainable = False
    lines = _summary_lines(model, line_length=80)
    assert lines[1] == "_" * 80 and lines[3] == "=" * 80
    assert "Total params: 17 (68.00 Byte)" in lines
    assert "Trainable params: 5 (20.00 Byte)" in lines
    assert "Non-trainable params: 12 (48.00 Byte)" in lines
