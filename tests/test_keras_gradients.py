"""Analytic gradients of every Keras layer and loss against central finite differences.

Everything runs in float64 (layers built with ``dtype="float64"``), so a
central difference with step 1e-6 is accurate to ~1e-9 and the tape's
gradients must agree to a relative error below 1e-6.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import psflow as pf
from psflow import keras

RTOL = 1e-6
EPS = 1e-6


def _numeric_grad(f: Callable[[], float], arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Central differences of the scalar ``f()`` w.r.t. each array, perturbed in place."""
    out = []
    for a in arrays:
        g = np.zeros(a.shape, dtype=np.float64)
        for idx in np.ndindex(a.shape):
            old = a[idx]
            a[idx] = old + EPS
            plus = f()
            a[idx] = old - EPS
            minus = f()
            a[idx] = old
            g[idx] = (plus - minus) / (2 * EPS)
        out.append(g)
    return out


def _dense(g: object) -> np.ndarray:
    if isinstance(g, pf.IndexedSlices):
        return np.asarray(g.dense_array())
    return g.numpy()


def _rel_err(analytic: np.ndarray, numeric: np.ndarray) -> float:
    scale = max(np.abs(analytic).max(initial=0), np.abs(numeric).max(initial=0), 1e-12)
    return float(np.abs(analytic - numeric).max(initial=0) / scale)


def _assert_close(analytic: list[np.ndarray], numeric: list[np.ndarray], what: str) -> None:
    assert len(analytic) == len(numeric)
    for i, (a, n) in enumerate(zip(analytic, numeric)):
        assert a.shape == n.shape, f"{what}[{i}]: shape {a.shape} vs {n.shape}"
        err = _rel_err(a, n)
        assert err < RTOL, f"{what}[{i}]: relative error {err:.3g}\nanalytic={a}\nnumeric={n}"
        assert np.abs(n).max() > 0, f"{what}[{i}]: the numeric gradient is all zeros"


def _check_layer(
    layer: keras.layers.Layer,
    x: np.ndarray,
    training: bool | None = None,
    before_call: Callable[[], None] | None = None,
    wrt_input: bool = True,
) -> None:
    """Checks d sum(R * layer(x)) / d(x, weights) for a fixed random R."""
    rng = np.random.default_rng(7)

    def forward(xt: object) -> object:
        if before_call is not None:
            before_call()
        return layer(xt, training=training) if training is not None else layer(xt)

    y0 = forward(pf.constant(x))  # builds the layer
    weights = layer.trainable_weights
    r = rng.normal(size=tuple(y0.shape))

    xt = pf.constant(x)
    with pf.GradientTape() as tape:
        if wrt_input:
            tape.watch(xt)
        y = forward(xt)
        target = pf.reduce_sum(y * pf.constant(r, dtype=y.dtype))
    sources = ([xt] if wrt_input else []) + list(weights)
    grads = tape.gradient(target, sources)
    analytic = [_dense(g) for g in grads]

    x_buf = np.array(x, dtype=np.float64 if x.dtype.kind == "f" else x.dtype)

    def f() -> float:
        return float(np.sum(forward(pf.constant(x_buf)).numpy() * r))

    arrays = ([x_buf] if wrt_input else []) + [w._array() for w in weights]
    _assert_close(analytic, _numeric_grad(f, arrays), type(layer).__name__)


ACTIVATIONS = [
    None,
    "linear",
    "relu",
    "sigmoid",
    "tanh",
    "softmax",
    "log_softmax",
    "softplus",
    "elu",
    "selu",
    "gelu",
    "swish",
    "leaky_relu",
    "exponential",
]


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_dense_gradients_match_finite_differences(activation: str | None) -> None:
    pf.random.set_seed(1)
    x = np.random.default_rng(1).normal(size=(4, 3))
    layer = keras.layers.Dense(5, activation=activation, dtype="float64")
    _check_layer(layer, x)


def test_dense_without_bias_has_only_a_kernel_and_correct_gradients() -> None:
    pf.random.set_seed(2)
    layer = keras.layers.Dense(4, use_bias=False, activation="tanh", dtype="float64")
    x = np.random.default_rng(2).normal(size=(3, 6))
    _check_layer(layer, x)
    assert [w.name.split("/")[-1] for w in layer.weights] == ["kernel:0"]
    assert layer.bias is None


def test_dense_on_rank3_inputs_contracts_the_last_axis() -> None:
    pf.random.set_seed(3)
    layer = keras.layers.Dense(3, activation="sigmoid", dtype="float64")
    x = np.random.default_rng(3).normal(size=(2, 4, 5))
    _check_layer(layer, x)
    y = layer(pf.constant(x)).numpy()
    kernel, bias = (w.numpy() for w in layer.weights)
    ref = 1 / (1 + np.exp(-(x @ kernel + bias)))
    np.testing.assert_allclose(y, ref, rtol=1e-12)
    assert y.shape == (2, 4, 3)


def test_embedding_gradient_is_sparse_and_matches_finite_differences() -> None:
    pf.random.set_seed(4)
    layer = keras.layers.Embedding(6, 3, dtype="float64")
    ids = np.array([[0, 2, 2], [5, 0, 1]], dtype=np.int64)  # row 2 and 0 repeat
    layer(pf.constant(ids))
    with pf.GradientTape() as tape:
        y = layer(pf.constant(ids))
        target = pf.reduce_sum(y * pf.constant(np.arange(18.0).reshape(2, 3, 3)))
    (g,) = tape.gradient(target, layer.trainable_weights)
    assert isinstance(g, pf.IndexedSlices)
    _check_layer(layer, ids, wrt_input=False)


def test_flatten_and_reshape_gradients() -> None:
    x = np.random.default_rng(5).normal(size=(2, 3, 4))
    _check_layer(keras.layers.Flatten(dtype="float64"), x)
    _check_layer(keras.layers.Reshape((4, 3), dtype="float64"), x)
    _check_layer(keras.layers.Reshape((-1, 2), dtype="float64"), x)
    assert keras.layers.Flatten()(pf.constant(x)).shape == (2, 12)
    assert keras.layers.Reshape((-1, 2))(pf.constant(x)).shape == (2, 6, 2)


@pytest.mark.parametrize("activation", ["relu", "tanh", "softmax", "elu", "sigmoid"])
def test_activation_layer_gradients(activation: str) -> None:
    x = np.random.default_rng(6).normal(size=(3, 4))
    _check_layer(keras.layers.Activation(activation, dtype="float64"), x)


def test_dropout_training_gradient_uses_the_same_mask_as_the_forward_pass() -> None:
    x = np.random.default_rng(8).normal(size=(6, 5))
    layer = keras.layers.Dropout(0.4, seed=11, dtype="float64")
    # Re-seeding before each call replays the same mask, so f is a fixed linear map.
    _check_layer(layer, x, training=True, before_call=lambda: pf.random.set_seed(123))


def test_dropout_masks_and_scales_in_training_and_is_identity_in_inference() -> None:
    x = np.ones((200, 50), dtype=np.float32)
    layer = keras.layers.Dropout(0.25, seed=3)
    pf.random.set_seed(9)
    a = layer(pf.constant(x), training=True).numpy()
    pf.random.set_seed(9)
    b = layer(pf.constant(x), training=True).numpy()
    np.testing.assert_array_equal(a, b)  # a fixed seed replays the mask
    kept = a != 0
    assert set(np.unique(a).tolist()) <= {0.0, np.float32(1 / 0.75)}
    assert abs(kept.mean() - 0.75) < 0.02
    np.testing.assert_array_equal(layer(pf.constant(x), training=False).numpy(), x)
    np.testing.assert_array_equal(layer(pf.constant(x)).numpy(), x)
    c = layer(pf.constant(x), training=True).numpy()  # the next call draws a new mask
    assert (c != a).any()
    with pf.GradientTape() as tape:
        xt = pf.constant(x)
        tape.watch(xt)
        y = layer(xt, training=False)
    np.testing.assert_array_equal(tape.gradient(y, xt).numpy(), np.ones_like(x))


# -- losses --------------------------------------------------------------------------

_rng = np.random.default_rng(42)
N, K = 4, 3


def _probs(shape: tuple[int, ...]) -> np.ndarray:
    return _rng.uniform(0.05, 0.95, size=shape)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _onehot(ids: np.ndarray, k: int) -> np.ndarray:
    return np.eye(k)[ids]


_IDS = np.array([0, 2, 1, 2])

# name -> (loss object factory, y_true, y_pred), chosen away from kinks and clip edges
LOSS_CASES: dict[str, tuple[Callable[..., keras.losses.Loss], np.ndarray, np.ndarray]] = {
    "mse": (keras.losses.MeanSquaredError, _rng.normal(size=(N, K)), _rng.normal(size=(N, K))),
    "mae": (
        keras.losses.MeanAbsoluteError,
        np.zeros((N, K)),
        _rng.uniform(0.1, 1, (N, K)) * np.sign(_rng.normal(size=(N, K))),
    ),
    "mape": (
        keras.losses.MeanAbsolutePercentageError,
        _rng.uniform(1, 2, (N, K)),
        _rng.uniform(2.5, 3, (N, K)),
    ),
    "huber": (
        lambda **kw: keras.losses.Huber(delta=0.7, **kw),
        np.zeros((N, K)),
        np.array([[0.1, -0.3, 1.5], [-2.0, 0.5, 0.65], [0.9, -0.8, 0.2], [3.0, -0.1, 0.05]]),
    ),
    "binary_crossentropy_probs": (
        keras.losses.BinaryCrossentropy,
        _rng.integers(0, 2, (N, K)).astype(float),
        _probs((N, K)),
    ),
    "binary_crossentropy_probs_smoothed": (
        lambda **kw: keras.losses.BinaryCrossentropy(label_smoothing=0.2, **kw),
        _rng.integers(0, 2, (N, K)).astype(float),
        _probs((N, K)),
    ),
    "binary_crossentropy_logits": (
        lambda **kw: keras.losses.BinaryCrossentropy(from_logits=True, **kw),
        _rng.integers(0, 2, (N, K)).astype(float),
        _rng.normal(size=(N, K)) * 2,
    ),
    "binary_crossentropy_logits_smoothed": (
        lambda **kw: keras.losses.BinaryCrossentropy(from_logits=True, label_smoothing=0.1, **kw),
        _rng.integers(0, 2, (N, K)).astype(float),
        _rng.normal(size=(N, K)) * 2,
    ),
    "categorical_crossentropy_probs": (
        keras.losses.CategoricalCrossentropy,
        _onehot(_IDS, K),
        _softmax(_rng.normal(size=(N, K))),
    ),
    "categorical_crossentropy_unnormalized_probs": (
        keras.losses.CategoricalCrossentropy,
        _onehot(_IDS, K),
        _rng.uniform(0.5, 2.0, (N, K)),
    ),
    "categorical_crossentropy_logits": (
        lambda **kw: keras.losses.CategoricalCrossentropy(from_logits=True, **kw),
        _onehot(_IDS, K),
        _rng.normal(size=(N, K)),
    ),
    "categorical_crossentropy_logits_smoothed": (
        lambda **kw: keras.losses.CategoricalCrossentropy(
            from_logits=True, label_smoothing=0.3, **kw
        ),
        _onehot(_IDS, K),
        _rng.normal(size=(N, K)),
    ),
    "sparse_categorical_crossentropy_probs": (
        keras.losses.SparseCategoricalCrossentropy,
        _IDS.astype(np.int64),
        _softmax(_rng.normal(size=(N, K))),
    ),
    "sparse_categorical_crossentropy_logits": (
        lambda **kw: keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kw),
        _IDS.astype(np.int64),
        _rng.normal(size=(N, K)),
    ),
    "sparse_categorical_crossentropy_logits_column_labels": (
        lambda **kw: keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kw),
        _IDS.reshape(-1, 1).astype(np.float64),
        _rng.normal(size=(N, K)),
    ),
    "hinge": (
        keras.losses.Hinge,
        _rng.choice([-1.0, 1.0], size=(N, K)),
        np.array([[0.5, -0.2, 1.7], [0.3, 0.8, -0.6], [-1.4, 0.1, 0.4], [0.2, -0.7, 2.5]]),
    ),
    "kld": (
        keras.losses.KLDivergence,
        _softmax(_rng.normal(size=(N, K))),
        _softmax(_rng.normal(size=(N, K))),
    ),
}

SAMPLE_WEIGHT = np.array([0.5, 2.0, 0.0, 1.5])


@pytest.mark.parametrize("reduction", ["none", "sum", "sum_over_batch_size"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("case", sorted(LOSS_CASES))
def test_loss_gradient_matches_finite_differences(
    case: str, reduction: str, weighted: bool
) -> None:
    make, y_true, y_pred = LOSS_CASES[case]
    loss = make(reduction=reduction)
    y_pred = np.array(y_pred, dtype=np.float64)
    sw = pf.constant(SAMPLE_WEIGHT) if weighted else None
    value0 = loss(pf.constant(y_true), pf.constant(y_pred), sw)
    r = np.random.default_rng(3).normal(size=tuple(value0.shape)) if reduction == "none" else 1.0

    yp = pf.constant(y_pred)
    with pf.GradientTape() as tape:
        tape.watch(yp)
        target = pf.reduce_sum(loss(pf.constant(y_true), yp, sw) * pf.constant(r, "float64"))
    analytic = [tape.gradient(target, yp).numpy()]

    def f() -> float:
        return float(np.sum(loss(pf.constant(y_true), pf.constant(y_pred), sw).numpy() * r))

    _assert_close(analytic, _numeric_grad(f, [y_pred]), case)


def test_regularized_dense_gradient_includes_the_penalty() -> None:
    pf.random.set_seed(12)
    layer = keras.layers.Dense(
        3, kernel_regularizer=keras.regularizers.L1L2(l1=0.01, l2=0.1), dtype="float64"
    )
    x = np.random.default_rng(12).normal(size=(4, 2))
    layer(pf.constant(x))
    (kernel, bias) = layer.trainable_weights
    with pf.GradientTape() as tape:
        target = pf.reduce_sum(layer(pf.constant(x))) + pf.add_n(layer.losses)
    analytic = [g.numpy() for g in tape.gradient(target, [kernel, bias])]

    def f() -> float:
        out = layer(pf.constant(x)).numpy().sum()
        return float(out + sum(float(v.numpy()) for v in layer.losses))

    _assert_close(analytic, _numeric_grad(f, [kernel._array(), bias._array()]), "regularized")
