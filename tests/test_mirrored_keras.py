"""Keras under MirroredStrategy: the spec's progress output, evaluate and predict like one device."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import psflow as pf
from tests.test_mirrored_training import (
    GLOBAL_BATCH,
    data,
    initial_weights,
    logical_cpus,
    make_model,
)

# The spec's line (shared/seeds/mirrored_strategy.ru.txt): "1/1 [====...====] - 0s 200ms/step - loss: 15.2345"
BAR = r"\[=+\] - \d+s \d+(us|ms|s)/step - loss: \d+\.\d{4}"


def compiled(strategy: Any = None) -> Any:
    def build() -> Any:
        model = make_model()
        model.set_weights(initial_weights())
        model.compile(
            optimizer="sgd",
            loss=pf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return model

    if strategy is None:
        return build()
    with strategy.scope():
        return build()


@pytest.mark.parametrize("distributed_input", [False, True], ids=["arrays", "distributed_dataset"])
def test_fit_prints_the_spec_progress_format(
    capsys: pytest.CaptureFixture[str], distributed_input: bool
) -> None:
    x, y = data()
    with logical_cpus(2):
        strategy = pf.distribute.MirroredStrategy()
        model = compiled(strategy)
        if distributed_input:
            ds = pf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
            model.fit(strategy.experimental_distribute_dataset(ds), epochs=2)
        else:
            model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 4, lines
    assert lines[0] == "Epoch 1/2" and lines[2] == "Epoch 2/2"
    for line in lines[1::2]:  # 10 examples in global batches of 4: 3 steps
        assert re.fullmatch(rf"3/3 {BAR} - accuracy: \d\.\d{{4}}", line), line


def test_seed_example_prints_the_spec_line_on_two_devices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with logical_cpus(2):
        strategy = pf.distribute.MirroredStrategy()
        with strategy.scope():
            model = pf.keras.Sequential(
                [pf.keras.layers.Dense(4, activation="relu"), pf.keras.layers.Dense(1)]
            )
            model.compile(optimizer="sgd", loss="mse")
        dataset = pf.data.Dataset.from_tensor_slices(
            (pf.constant([[1.0], [2.0], [3.0], [4.0]]), pf.constant([[2.0], [4.0], [6.0], [8.0]]))
        ).batch(2)
        model.fit(strategy.experimental_distribute_dataset(dataset), epochs=1)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1 and re.fullmatch(rf"2/2 {BAR}", lines[0]), lines


@pytest.mark.parametrize("replicas", [2, 3])
def test_evaluate_and_predict_match_one_device(replicas: int) -> None:
    x, y = data()
    reference = compiled()
    ref_eval = reference.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    ref_pred = reference.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
    with logical_cpus(replicas):
        model = compiled(pf.distribute.MirroredStrategy())
        got_eval = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
        got_pred = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
    np.testing.assert_allclose(got_eval, ref_eval, rtol=1e-5)
    assert got_pred.shape == ref_pred.shape == (len(x), 3)
    np.testing.assert_allclose(got_pred, ref_pred, rtol=1e-5, atol=1e-6)
