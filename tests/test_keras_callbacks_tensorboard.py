"""The TensorBoard callback: its event files, read back with TensorBoard's own reader."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import errors
from tests.test_mirrored_training import logical_cpus

keras = pf.keras
needs_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="the optional 'tensorboard' package is not installed (pip install 'psflow[tensorboard]')",
)
RNG = np.random.default_rng(5)
X = RNG.normal(size=(32, 3)).astype(np.float32)
Y = (X @ np.array([[1.0], [-1.0], [2.0]], np.float32)).astype(np.float32)


def read_scalars(directory: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in ``directory``'s event files, by tag, through TensorBoard's reader."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    acc = event_accumulator.EventAccumulator(directory, size_guidance={"tensors": 0})
    acc.Reload()
    return {
        tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
        for tag in acc.Tags()["tensors"]
    }


def fit_with_tensorboard(log_dir: str, strategy: Any = None, **kwargs: Any) -> dict[str, list]:
    scope = (strategy or pf.distribute.get_strategy()).scope()
    with scope:
        model = keras.Sequential([keras.Input(shape=(3,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    history = model.fit(
        X[:24],
        Y[:24],
        batch_size=8,
        epochs=3,
        validation_data=(X[24:], Y[24:]),
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.TensorBoard(log_dir, **kwargs)],
    )
    return history.history


@needs_tensorboard
def test_epoch_scalars_load_in_tensorboard_and_equal_the_history(tmp_path: Any) -> None:
    history = fit_with_tensorboard(str(tmp_path))
    train = read_scalars(str(tmp_path / "train"))
    val = read_scalars(str(tmp_path / "validation"))
    assert sorted(train) == ["epoch_loss", "epoch_mae"]
    assert sorted(val) == ["epoch_loss", "epoch_mae"]
    for name in ("loss", "mae"):
        assert [s for s, _ in train[f"epoch_{name}"]] == [0, 1, 2]
        np.testing.assert_allclose([v for _, v in train[f"epoch_{name}"]], history[name], rtol=1e-6)
        np.testing.assert_allclose(
            [v for _, v in val[f"epoch_{name}"]], history[f"val_{name}"], rtol=1e-6
        )


@needs_tensorboard
def test_update_freq_writes_batch_scalars_every_n_batches(tmp_path: Any) -> None:
    fit_with_tensorboard(str(tmp_path), update_freq=2, write_steps_per_second=True)
    train = read_scalars(str(tmp_path / "train"))
    # 3 batches per epoch, 3 epochs: global batches 2, 4, 6, 8
    assert [s for s, _ in train["batch_loss"]] == [2, 4, 6, 8]
    assert all(np.isfinite(v) and v > 0 for _, v in train["batch_loss"])
    assert [s for s, _ in train["epoch_steps_per_second"]] == [0, 1, 2]


@needs_tensorboard
@pytest.mark.parametrize("kind", ["mirrored", "parameter_server"])
def test_every_strategy_writes_the_same_tags(tmp_path: Any, kind: str) -> None:
    if kind == "mirrored":
        with logical_cpus(2):
            history = fit_with_tensorboard(str(tmp_path), pf.distribute.MirroredStrategy())
    else:
        strategy = pf.distribute.ParameterServerStrategy()
        try:
            history = fit_with_tensorboard(str(tmp_path), strategy, update_freq=1)
        finally:
            pf.distribute.coordinator.ClusterCoordinator(strategy).shutdown()
    train = read_scalars(str(tmp_path / "train"))
    assert {"epoch_loss", "epoch_mae"} <= set(train)
    np.testing.assert_allclose([v for _, v in train["epoch_loss"]], history["loss"], rtol=1e-6)
    assert sorted(os.listdir(tmp_path)) == ["train", "validation"]


@needs_tensorboard
def test_bad_update_freq_is_rejected() -> None:
    with pytest.raises(errors.InvalidArgumentError, match="'often'"):
        keras.callbacks.TensorBoard("logs", update_freq="often")
    with pytest.raises(errors.InvalidArgumentError, match="0"):
        keras.callbacks.TensorBoard("logs", update_freq=0)


def test_missing_library_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # a None entry makes "import" fail, as if the package were not installed
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(
        errors.FailedPreconditionError, match=r"pip install 'psflow\[tensorboard\]'"
    ):
        keras.callbacks.TensorBoard("logs")
