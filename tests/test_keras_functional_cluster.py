"""A functional multi-output model trained, saved and loaded on a real PS cluster (processes)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow.distribute.ps.values import PSVariable
from tests.test_keras_functional import XA, XB, Y1, Y2, two_headed

keras = pf.keras


@pytest.mark.slow
def test_functional_model_trains_saves_and_loads_on_a_cluster(
    start_cluster: Any, tmp_path: Any
) -> None:
    cluster = start_cluster(num_ps=1, num_workers=2)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    with strategy.scope():
        model = two_headed()
        model.compile(
            keras.optimizers.SGD(0.1),
            loss={"out1": "mse", "out2": "sparse_categorical_crossentropy"},
            loss_weights={"out1": 0.5, "out2": 2.0},
            metrics={"out2": ["accuracy"]},
        )
    assert all(isinstance(v, PSVariable) for v in model.weights)
    before = model.evaluate([XA, XB], [Y1, Y2], batch_size=4, verbose=0, return_dict=True)
    have_tensorboard = importlib.util.find_spec("tensorboard") is not None
    log_dir = tmp_path / "logs"
    callbacks = [keras.callbacks.TensorBoard(log_dir, update_freq=2)] if have_tensorboard else []
    history = model.fit(
        [XA, XB], [Y1, Y2], batch_size=4, epochs=3, verbose=0, callbacks=callbacks
    ).history
    assert sorted(history) == ["loss", "out1_loss", "out2_accuracy", "out2_loss"]
    after = model.evaluate([XA, XB], [Y1, Y2], batch_size=4, verbose=0, return_dict=True)
    assert after["loss"] < before["loss"]
    # the logged total is the weighted sum of the logged per-output losses
    assert after["loss"] == pytest.approx(
        0.5 * after["out1_loss"] + 2.0 * after["out2_loss"], rel=1e-5
    )
    if have_tensorboard:  # event files are named after the writing process: only this one
        files = os.listdir(log_dir / "train")
        assert files and all(f".{os.getpid()}." in name for name in files), files
    model.save(tmp_path / "cluster.keras")
    want = model.predict([XA, XB], verbose=0)
    loaded = keras.models.load_model(tmp_path / "cluster.keras")  # outside the strategy: local
    got = loaded.predict([XA, XB], verbose=0)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
