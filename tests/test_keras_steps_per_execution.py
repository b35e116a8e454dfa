"""``compile(steps_per_execution=N)``: N batches per call into the step function.

Reference: the same fit with one step per execution. Each execution runs the
same steps on the same batches in the same order, so the weights must match
bit for bit (locally and under MirroredStrategy on logical CPUs). Callbacks run
once per execution, with Keras's batch numbering (first batch at begin, last at
end); a shorter last execution ends the epoch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import keras
from psflow.keras.engine import runner as runner_lib
from tests.test_mirrored_training import logical_cpus


def _data(n: int = 80) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    y = (x @ rng.standard_normal((6, 1)) + 0.5).astype(np.float32)
    return x, y


def _model(steps_per_execution: Any) -> Any:
    pf.random.set_seed(11)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss="mse",
        metrics=["mae"],
        steps_per_execution=steps_per_execution,
    )
    return model


class Recorder(keras.callbacks.Callback):
    """Notes every batch hook with its index."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.calls.append(("begin", batch))

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.calls.append(("end", batch))

    def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
        self.calls.append(("test_end", batch))


def _fit(steps_per_execution: Any, **kwargs: Any) -> tuple[Any, Any]:
    x, y = _data()
    model = _model(steps_per_execution)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, **kwargs)
    return model, history


@pytest.mark.parametrize("n", [2, 3, 10, 50])
def test_fit_with_several_steps_per_execution_gives_the_weights_of_one(n: int) -> None:
    one, h1 = _fit(1)
    many, hn = _fit(n)
    for a, b in zip(one.get_weights(), many.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert h1.history == hn.history


def test_an_execution_is_one_call_into_the_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    each = runner_lib._each

    def counting(fn: Any, batches: list[Any]) -> list[Any]:
        calls.append(len(batches))
        return each(fn, batches)

    monkeypatch.setattr(runner_lib, "_each", counting)
    _fit(4)  # 10 batches an epoch: 4 + 4 + 2, twice
    assert calls == [4, 4, 2, 4, 4, 2]


def test_callbacks_run_once_per_execution_with_keras_batch_numbers() -> None:
    recorder = Recorder()
    x, y = _data()
    model = _model(3)
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        callbacks=[recorder],
        validation_data=(x[:40], y[:40]),
    )
    # 10 batches: executions [0-2] [3-5] [6-8] and a shorter last one [9]
    assert recorder.calls == [
        ("begin", 0),
        ("end", 2),
        ("begin", 3),
        ("end", 5),
        ("begin", 6),
        ("end", 8),
        ("begin", 9),
        ("end", 9),
    ]
    recorder.calls.clear()
    model.evaluate(x[:40], y[:40], batch_size=8, verbose=0, callbacks=[recorder])
    assert recorder.calls == [("test_end", 2), ("test_end", 4)]


def test_steps_per_epoch_cuts_the_last_execution() -> None:
    recorder = Recorder()
    x, y = _data()
    model = _model(4)
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=6, verbose=0, callbacks=[recorder])
    assert [c for c in recorder.calls if c[0] == "end"] == [("end", 3), ("end", 5)]
    assert int(model.optimizer.iterations.numpy()) == 6


def test_stop_training_ends_after_the_current_execution() -> None:
    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.model.stop_training = True

    x, y = _data()
    model = _model(3)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[Stop()])
    assert int(model.optimizer.iterations.numpy()) == 3


def test_progress_bar_counts_the_steps_of_each_execution(capsys: pytest.CaptureFixture) -> None:
    x, y = _data()
    _model(3).fit(x, y, batch_size=8, epochs=1, verbose=1)
    out = capsys.readouterr().out
    assert "10/10" in out


def test_predict_returns_every_batch_with_several_steps_per_execution() -> None:
    x, _ = _data()
    one, many = _model(1), _model(3)
    np.testing.assert_array_equal(
        one.predict(x, batch_size=8, verbose=0), many.predict(x, batch_size=8, verbose=0)
    )


def test_model_checkpoint_save_freq_counts_batches_across_executions(tmp_path: Any) -> None:
    saved: list[int] = []

    class Counting(keras.callbacks.ModelCheckpoint):
        def _save(self, epoch: int, logs: Any) -> None:
            saved.append(self._last_batch)

    x, y = _data()
    _model(3).fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        callbacks=[Counting(str(tmp_path / "w.weights.h5"), save_freq=4)],
    )
    # Keras: 3 batches, then 6 >= 4 (save at batch 5), then 3, then 4 (save at batch 9)
    assert saved == [5, 9]


def test_mirrored_fit_with_several_steps_per_execution_gives_the_weights_of_one() -> None:
    weights = []
    with logical_cpus(2):
        for n in (1, 3):
            strategy = pf.distribute.MirroredStrategy()
            with strategy.scope():
                model = _model(n)
            x, y = _data(84)  # a last global batch of 4: a shorter, separate execution
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
            weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)


def test_embedded_ps_fit_with_several_steps_per_closure_gives_the_weights_and_logs_of_one():
    runs = []
    for n in (1, 3):
        strategy = pf.distribute.ParameterServerStrategy()  # embedded: the chief is the worker
        with strategy.scope():
            model = _model(n)
        recorder = Recorder()
        x, y = _data()
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                            callbacks=[recorder])  # fmt: skip
        runs.append((model.get_weights(), history.history, recorder.calls))
    (w1, h1, _), (w3, h3, calls) = runs
    for a, b in zip(w1, w3):
        np.testing.assert_array_equal(a, b)
    assert h1 == h3
    # 10 batches an epoch: closures of 3, 3, 3 and 1, the hooks once per closure
    ends = [b for kind, b in calls if kind == "end"]
    assert ends == [2, 5, 8, 9] * 2


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4", True, [2]])
def test_bad_steps_per_execution_raises_invalid_argument_naming_it(bad: Any) -> None:
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    with pytest.raises(pf.errors.InvalidArgumentError, match="steps_per_execution") as info:
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=bad)
    assert repr(bad) in str(info.value)


def test_none_and_numpy_ints_are_accepted() -> None:
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=None)
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=np.int64(5))
    x, y = _data()
    assert model.fit(x, y, batch_size=8, verbose=0).history["loss"]


def test_load_model_compiles_with_the_saved_steps_per_execution(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    each = runner_lib._each

    def counting(fn: Any, batches: list[Any]) -> list[Any]:
        calls.append(len(batches))
        return each(fn, batches)

    x, y = _data()
    _model(3).save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    monkeypatch.setattr(runner_lib, "_each", counting)
    loaded.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert calls == [3, 3, 3, 1]  # 10 batches, 3 per execution as when saved


def test_a_saved_model_without_steps_per_execution_loads_with_one(tmp_path: Any) -> None:
    import json

    path = tmp_path / "old"
    _model(3).save(path)
    config = json.loads((path / "config.json").read_text())
    del config["compile_config"]["steps_per_execution"]  # as saved before it was kept
    (path / "config.json").write_text(json.dumps(config))
    loaded = keras.models.load_model(path)
    assert loaded.compiled and loaded._steps_per_execution == 1
    recorder = Recorder()
    x, y = _data()
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[recorder])
    assert [c for c in recorder.calls if c[0] == "end"] == [("end", i) for i in range(10)]
