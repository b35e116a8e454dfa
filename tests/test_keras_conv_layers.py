"""Convolution, pooling and normalization layers: finite-difference gradients, configs,
shapes, bad input, BatchNormalization's statistics, and the tutorial CNN trained on digits
(single device, and under MirroredStrategy against single-device training)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import keras
from psflow.keras import layers
from tests.test_keras_gradients import _check_layer
from tests.test_mirrored_training import logical_cpus

CONV2D_CASES = [
    dict(filters=3, kernel_size=3),
    dict(filters=2, kernel_size=(2, 3), strides=2, padding="same", activation="relu"),
    dict(filters=2, kernel_size=2, dilation_rate=2, padding="same", activation="tanh"),
    dict(filters=3, kernel_size=(3, 1), strides=(1, 2), use_bias=False),
]
CONV1D_CASES = [
    dict(filters=2, kernel_size=3, padding="causal", dilation_rate=2),
    dict(filters=3, kernel_size=2, strides=2, padding="same", activation="sigmoid"),
    dict(filters=2, kernel_size=3),
]


def _x(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape)


@pytest.mark.parametrize("kwargs", CONV2D_CASES, ids=str)
def test_conv2d_layer_gradients_match_finite_differences(kwargs: dict[str, Any]) -> None:
    pf.random.set_seed(1)
    layer = layers.Conv2D(dtype="float64", **kwargs)
    _check_layer(layer, _x((2, 5, 6, 2)))


@pytest.mark.parametrize("kwargs", CONV1D_CASES, ids=str)
def test_conv1d_layer_gradients_match_finite_differences(kwargs: dict[str, Any]) -> None:
    pf.random.set_seed(2)
    layer = layers.Conv1D(dtype="float64", **kwargs)
    _check_layer(layer, _x((2, 7, 2)))


POOL_CASES = [
    (layers.MaxPooling2D, dict(), (2, 5, 4, 2)),
    (layers.MaxPooling2D, dict(pool_size=3, strides=1, padding="same"), (2, 4, 5, 2)),
    (layers.AveragePooling2D, dict(pool_size=(2, 3), padding="same"), (2, 5, 4, 2)),
    (layers.AveragePooling2D, dict(strides=1), (1, 4, 4, 3)),
    (layers.MaxPooling1D, dict(pool_size=3, strides=2, padding="same"), (2, 7, 2)),
    (layers.AveragePooling1D, dict(), (2, 6, 3)),
    (layers.GlobalAveragePooling2D, dict(), (2, 3, 4, 2)),
    (layers.GlobalMaxPooling2D, dict(keepdims=True), (2, 3, 4, 2)),
    (layers.GlobalAveragePooling1D, dict(keepdims=True), (2, 5, 3)),
    (layers.GlobalMaxPooling1D, dict(), (2, 5, 3)),
]


@pytest.mark.parametrize(("cls", "kwargs", "shape"), POOL_CASES, ids=str)
def test_pooling_layer_gradients_match_finite_differences(
    cls: type, kwargs: dict[str, Any], shape: tuple[int, ...]
) -> None:
    _check_layer(cls(dtype="float64", **kwargs), _x(shape, 3))


NORM_CASES = [
    (layers.BatchNormalization, dict(), (6, 3), True),
    (layers.BatchNormalization, dict(axis=1, center=False), (4, 3, 2, 2), True),
    (layers.BatchNormalization, dict(scale=False), (2, 3, 2, 4), False),
    (layers.LayerNormalization, dict(), (3, 4), None),
    (layers.LayerNormalization, dict(axis=[1, 2], epsilon=1e-2), (2, 3, 2, 2), None),
]


@pytest.mark.parametrize(("cls", "kwargs", "shape", "training"), NORM_CASES, ids=str)
def test_normalization_layer_gradients_match_finite_differences(
    cls: type, kwargs: dict[str, Any], shape: tuple[int, ...], training: bool | None
) -> None:
    layer = cls(dtype="float64", **kwargs)
    layer.build((None, *shape[1:]))
    rng = np.random.default_rng(5)
    # gamma and beta away from their 1/0 defaults, so their gradients are exercised in general
    layer.set_weights([rng.uniform(0.5, 1.5, size=w.shape) for w in layer.get_weights()])
    _check_layer(layer, _x(shape, 4) * 2 + 1, training=training)


ALL_LAYERS = [
    *((layers.Conv2D, kw, (2, 6, 6, 2)) for kw in CONV2D_CASES),
    *((layers.Conv1D, kw, (2, 7, 2)) for kw in CONV1D_CASES),
    *POOL_CASES,
    *((cls, kw, shape) for cls, kw, shape, _ in NORM_CASES),
]


@pytest.mark.parametrize(("cls", "kwargs", "shape"), ALL_LAYERS, ids=str)
def test_get_config_rebuilds_an_equal_layer(
    cls: type, kwargs: dict[str, Any], shape: tuple[int, ...]
) -> None:
    layer = cls(**kwargs)
    x = _x(shape, 6).astype(np.float32)
    y = layer(x)
    assert tuple(layer.compute_output_shape((None, *shape[1:])))[1:] == tuple(y.shape)[1:]
    config = layer.get_config()
    twin = cls(**config)
    assert twin.get_config() == config
    twin(x)
    twin.set_weights(layer.get_weights())
    np.testing.assert_array_equal(twin(x).numpy(), y.numpy())


@pytest.mark.parametrize(
    ("make", "good", "bad", "fragment"),
    [
        (lambda: layers.Conv2D(2, 3), (2, 6, 6, 3), (1, 5, 5, 2), "3 channels"),
        (lambda: layers.Conv2D(2, 3), (2, 6, 6, 3), (1, 5, 3), "rank 4"),
        (lambda: layers.Conv1D(2, 3), (2, 6, 3), (1, 5, 2, 3), "rank 3"),
        (lambda: layers.MaxPooling2D(), (1, 4, 4, 3), (1, 4, 3), "rank 4"),
        (lambda: layers.BatchNormalization(), (4, 3), (4, 2), "[3]"),
        (lambda: layers.LayerNormalization(), (4, 3), (4, 2), "[3]"),
    ],
)
def test_bad_input_raises_invalid_argument_and_changes_no_weight(
    make: Any, good: tuple[int, ...], bad: tuple[int, ...], fragment: str
) -> None:
    layer = make()
    layer(np.ones(good, np.float32), training=True)  # builds (and moves BN's statistics)
    before = [w.copy() for w in layer.get_weights()]
    with pytest.raises(pf.errors.InvalidArgumentError) as info:
        layer(np.ones(bad, np.float32), training=True)
    assert fragment in str(info.value)
    for a, b in zip(before, layer.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: layers.Conv2D(0, 3), "filters"),
        (lambda: layers.Conv2D(2, (3, 3, 3)), "kernel_size"),
        (lambda: layers.Conv2D(2, 3, strides=2, dilation_rate=2), "dilation_rate"),
        (lambda: layers.Conv2D(2, 3, padding="causal"), "causal"),
        (lambda: layers.Conv2D(2, 3, data_format="channels_first"), "channels_first"),
        (lambda: layers.MaxPooling2D(pool_size=-1), "-1"),
        (lambda: layers.BatchNormalization(momentum=1.5), "1.5"),
        (lambda: layers.LayerNormalization(epsilon=0), "epsilon"),
    ],
)
def test_bad_constructor_arguments_raise_invalid_argument(make: Any, fragment: str) -> None:
    with pytest.raises(pf.errors.InvalidArgumentError) as info:
        make()
    assert fragment in str(info.value)


def test_batch_normalization_moves_its_statistics_only_in_training() -> None:
    x = _x((16, 3), 8).astype(np.float32) * 3 + 2
    bn = layers.BatchNormalization(momentum=0.8, epsilon=1e-3)
    y_infer = bn(x).numpy()  # inference: moving mean 0, variance 1
    np.testing.assert_allclose(y_infer, x / np.sqrt(1 + 1e-3), rtol=1e-6)
    np.testing.assert_array_equal(bn.moving_mean.numpy(), np.zeros(3))
    y = bn(x, training=True).numpy()
    mean, var = x.mean(axis=0), x.var(axis=0)
    np.testing.assert_allclose(y, (x - mean) / np.sqrt(var + 1e-3), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.2 * mean, rtol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), 0.8 + 0.2 * var, rtol=1e-5)
    assert [w.name.split("/")[-1].split(":")[0] for w in bn.weights] == [
        "gamma",
        "beta",
        "moving_mean",
        "moving_variance",
    ]
    assert len(bn.trainable_weights) == 2 and len(bn.non_trainable_weights) == 2
    bn.trainable = False  # a frozen layer normalizes by its moving statistics, as Keras's
    moved = bn.moving_mean.numpy()
    bn(x, training=True)
    np.testing.assert_array_equal(bn.moving_mean.numpy(), moved)


def test_batch_normalization_under_mirrored_strategy_averages_replica_statistics() -> None:
    x = _x((8, 4), 9).astype(np.float32)
    with logical_cpus(2):
        strategy = pf.distribute.MirroredStrategy()
        with strategy.scope():
            bn = layers.BatchNormalization(momentum=0.5)
            bn.build((None, 4))
        halves = strategy.experimental_distribute_values_from_function(
            lambda ctx: x[4 * ctx.replica_id_in_sync_group : 4 * ctx.replica_id_in_sync_group + 4]
        )
        strategy.run(lambda xb: bn(xb, training=True), args=(halves,))
        mirrored = [w.numpy() for w in bn.weights]
    expect_mean = 0.5 * (x[:4].mean(0) + x[4:].mean(0)) * 0.5
    expect_var = 0.5 + 0.5 * 0.5 * (x[:4].var(0) + x[4:].var(0))
    np.testing.assert_allclose(mirrored[2], expect_mean, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(mirrored[3], expect_var, rtol=1e-5)


# -- the tutorial CNN ----------------------------------------------------------------------


def tutorial_cnn(input_shape: tuple[int, int, int] = (8, 8, 1)) -> Any:
    """TF's "Distributed training with Keras" model, on digits-sized inputs."""
    return keras.Sequential(
        [
            layers.Conv2D(32, 3, activation="relu", input_shape=input_shape),
            layers.MaxPooling2D(),
            layers.Flatten(),
            layers.Dense(64, activation="relu"),
            layers.Dense(10),
        ]
    )


def _digits() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    (xtr, ytr), (xte, yte) = keras.datasets.digits.load_data()
    return (xtr.reshape(-1, 8, 8, 1) / 16.0, ytr), (xte.reshape(-1, 8, 8, 1) / 16.0, yte)


def test_tutorial_cnn_learns_digits_to_95_percent() -> None:
    (xtr, ytr), (xte, yte) = _digits()
    pf.random.set_seed(0)
    model = tutorial_cnn()
    model.compile(
        optimizer=keras.optimizers.Adam(0.003),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(xtr.astype(np.float32), ytr, batch_size=32, epochs=6, verbose=0)
    _, accuracy = model.evaluate(xte.astype(np.float32), yte, verbose=0)
    assert accuracy >= 0.95, accuracy


def _train_cnn(strategy: Any, initial: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> Any:
    with strategy.scope():
        model = tutorial_cnn()
        model.set_weights(initial)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    return model


@pytest.mark.slow
def test_tutorial_cnn_under_mirrored_strategy_equals_single_device_training() -> None:
    (xtr, ytr), _ = _digits()
    x, y = xtr[:256].astype(np.float32), ytr[:256]
    pf.random.set_seed(3)
    initial = tutorial_cnn().get_weights()
    single = _train_cnn(pf.distribute.get_strategy(), initial, x, y).get_weights()
    with logical_cpus(2):
        strategy = pf.distribute.MirroredStrategy()
        assert strategy.num_replicas_in_sync == 2
        model = _train_cnn(strategy, initial, x, y)
        mirrored = model.get_weights()
    assert any(not np.array_equal(a, b) for a, b in zip(initial, single))  # it trained
    for a, b in zip(single, mirrored):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
