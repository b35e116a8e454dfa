"""Loss values against NumPy references written from Keras's formulas, and against Keras itself.

The Keras comparisons run only where TensorFlow is installed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import psflow as pf
from psflow import errors, keras

EPS = 1e-7
rng = np.random.default_rng(0)
N, K = 5, 4


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _log_sigmoid(z: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0, -z)


# -- NumPy references: per-example values -------------------------------------------


def ref_mse(t: np.ndarray, p: np.ndarray) -> np.ndarray:
    return ((p - t) ** 2).mean(-1)


def ref_mae(t: np.ndarray, p: np.ndarray) -> np.ndarray:
    return np.abs(p - t).mean(-1)


def ref_mape(t: np.ndarray, p: np.ndarray) -> np.ndarray:
    return 100 * (np.abs(t - p) / np.maximum(np.abs(t), EPS)).mean(-1)


def ref_huber(t: np.ndarray, p: np.ndarray, delta: float = 1.0) -> np.ndarray:
    e = np.abs(p - t)
    return np.where(e <= delta, 0.5 * e**2, delta * e - 0.5 * delta**2).mean(-1)


def ref_bce(
    t: np.ndarray, p: np.ndarray, from_logits: bool = False, smoothing: float = 0.0
) -> np.ndarray:
    t = t * (1 - smoothing) + 0.5 * smoothing
    if from_logits:
        return -(t * _log_sigmoid(p) + (1 - t) * _log_sigmoid(-p)).mean(-1)
    q = np.clip(p, EPS, 1 - EPS)
    return -(t * np.log(q) + (1 - t) * np.log(1 - q)).mean(-1)


def ref_cce(
    t: np.ndarray, p: np.ndarray, from_logits: bool = False, smoothing: float = 0.0
) -> np.ndarray:
    t = t * (1 - smoothing) + smoothing / t.shape[-1]
    if from_logits:
        q = _softmax(p)
    else:
        q = np.clip(p / p.sum(-1, keepdims=True), EPS, 1 - EPS)
    return -(t * np.log(q)).sum(-1)


def ref_scce(ids: np.ndarray, p: np.ndarray, from_logits: bool = False) -> np.ndarray:
    return ref_cce(np.eye(p.shape[-1])[ids.astype(int).reshape(-1)], p, from_logits)


def ref_hinge(t: np.ndarray, p: np.ndarray) -> np.ndarray:
    if np.isin(t, [0, 1]).all():
        t = 2 * t - 1
    return np.maximum(1 - t * p, 0).mean(-1)


def ref_kld(t: np.ndarray, p: np.ndarray) -> np.ndarray:
    t, p = np.clip(t, EPS, 1), np.clip(p, EPS, 1)
    return (t * np.log(t / p)).sum(-1)


def _reduce(values: np.ndarray, sw: np.ndarray | None, reduction: str) -> np.ndarray:
    if sw is not None:
        values = values * sw
    if reduction == "none":
        return values
    if reduction == "sum":
        return values.sum()
    return values.sum() / values.size


IDS = np.array([0, 3, 1, 1, 2])
ONEHOT = np.eye(K)[IDS]
BINARY = rng.integers(0, 2, (N, K)).astype(np.float64)

# name -> (psflow loss factory taking reduction=, NumPy per-example reference, y_true, y_pred)
CASES: dict[str, tuple[Callable[..., keras.losses.Loss], Callable, np.ndarray, np.ndarray]] = {
    "mse": (
        keras.losses.MeanSquaredError,
        ref_mse,
        rng.normal(size=(N, K)),
        rng.normal(size=(N, K)),
    ),
    "mae": (
        keras.losses.MeanAbsoluteError,
        ref_mae,
        rng.normal(size=(N, K)),
        rng.normal(size=(N, K)),
    ),
    "mape": (
        keras.losses.MeanAbsolutePercentageError,
        ref_mape,
        np.array([[1.0, -2.0, 0.0, 4.0]] * N),  # a zero label divides by epsilon
        rng.normal(size=(N, K)),
    ),
    "huber": (keras.losses.Huber, ref_huber, rng.normal(size=(N, K)), 2 * rng.normal(size=(N, K))),
    "huber_delta": (
        lambda **kw: keras.losses.Huber(delta=0.3, **kw),
        lambda t, p: ref_huber(t, p, 0.3),
        rng.normal(size=(N, K)),
        rng.normal(size=(N, K)),
    ),
    "bce_probs": (
        keras.losses.BinaryCrossentropy,
        ref_bce,
        BINARY,
        np.concatenate([rng.uniform(0, 1, (N, K - 1)), np.zeros((N, 1))], 1),  # 0 is clipped
    ),
    "bce_probs_smoothed": (
        lambda **kw: keras.losses.BinaryCrossentropy(label_smoothing=0.2, **kw),
        lambda t, p: ref_bce(t, p, smoothing=0.2),
        BINARY,
        rng.uniform(0, 1, (N, K)),
    ),
    "bce_logits": (
        lambda **kw: keras.losses.BinaryCrossentropy(from_logits=True, **kw),
        lambda t, p: ref_bce(t, p, from_logits=True),
        BINARY,
        np.concatenate([3 * rng.normal(size=(N, K - 1)), np.full((N, 1), 60.0)], 1),
    ),
    "bce_logits_smoothed": (
        lambda **kw: keras.losses.BinaryCrossentropy(from_logits=True, label_smoothing=0.1, **kw),
        lambda t, p: ref_bce(t, p, from_logits=True, smoothing=0.1),
        BINARY,
        3 * rng.normal(size=(N, K)),
    ),
    "cce_probs": (
        keras.losses.CategoricalCrossentropy,
        ref_cce,
        ONEHOT,
        _softmax(rng.normal(size=(N, K))),
    ),
    "cce_unnormalized": (
        keras.losses.CategoricalCrossentropy,
        ref_cce,
        ONEHOT,
        rng.uniform(0.1, 3, (N, K)),
    ),
    "cce_logits": (
        lambda **kw: keras.losses.CategoricalCrossentropy(from_logits=True, **kw),
        lambda t, p: ref_cce(t, p, from_logits=True),
        ONEHOT,
        3 * rng.normal(size=(N, K)),
    ),
    "cce_logits_smoothed": (
        lambda **kw: keras.losses.CategoricalCrossentropy(
            from_logits=True, label_smoothing=0.25, **kw
        ),
        lambda t, p: ref_cce(t, p, from_logits=True, smoothing=0.25),
        ONEHOT,
        3 * rng.normal(size=(N, K)),
    ),
    "cce_probs_smoothed": (
        lambda **kw: keras.losses.CategoricalCrossentropy(label_smoothing=0.1, **kw),
        lambda t, p: ref_cce(t, p, smoothing=0.1),
        ONEHOT,
        _softmax(rng.normal(size=(N, K))),
    ),
    "scce_probs": (
        keras.losses.SparseCategoricalCrossentropy,
        ref_scce,
        IDS,
        _softmax(rng.normal(size=(N, K))),
    ),
    "scce_logits": (
        lambda **kw: keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kw),
        lambda t, p: ref_scce(t, p, from_logits=True),
        IDS,
        3 * rng.normal(size=(N, K)),
    ),
    "scce_logits_column_labels": (
        lambda **kw: keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kw),
        lambda t, p: ref_scce(t, p, from_logits=True),
        IDS.reshape(-1, 1).astype(np.float64),
        3 * rng.normal(size=(N, K)),
    ),
    "hinge_pm1": (
        keras.losses.Hinge,
        ref_hinge,
        2 * BINARY - 1,
        rng.normal(size=(N, K)),
    ),
    "hinge_01": (keras.losses.Hinge, ref_hinge, BINARY, rng.normal(size=(N, K))),
    "kld": (
        keras.losses.KLDivergence,
        ref_kld,
        np.concatenate([_softmax(rng.normal(size=(N, K - 1))), np.zeros((N, 1))], 1),
        _softmax(rng.normal(size=(N, K))),
    ),
}

SW = np.array([1.0, 0.5, 0.0, 2.0, 3.0])


@pytest.mark.parametrize("reduction", ["none", "sum", "sum_over_batch_size"])
@pytest.mark.parametrize("weights", ["none", "per_example", "column"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_value_matches_numpy_reference(case: str, reduction: str, weights: str) -> None:
    make, ref, y_true, y_pred = CASES[case]
    sw = {"none": None, "per_example": SW, "column": SW.reshape(-1, 1)}[weights]
    got = make(reduction=reduction)(
        pf.constant(y_true), pf.constant(y_pred), None if sw is None else pf.constant(sw)
    )
    want = _reduce(ref(y_true, y_pred), None if sw is None else SW, reduction)
    assert got.dtype == pf.float64
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)


def test_loss_functions_and_names_agree_with_the_classes() -> None:
    t, p = rng.normal(size=(N, K)), rng.normal(size=(N, K))
    for fn, cls in [
        (keras.losses.mse, keras.losses.MeanSquaredError),
        (keras.losses.mae, keras.losses.MeanAbsoluteError),
        (keras.losses.kld, keras.losses.KLDivergence),
    ]:
        per_example = fn(pf.constant(t), pf.constant(p)).numpy()
        assert per_example.shape == (N,)
        loss = cls()(pf.constant(t), pf.constant(p)).numpy()
        np.testing.assert_allclose(loss, per_example.mean(), rtol=1e-12)
    for name, cls in [
        ("mse", keras.losses.MeanSquaredError),
        ("mean_absolute_error", keras.losses.MeanAbsoluteError),
        ("huber", keras.losses.Huber),
        ("binary_crossentropy", keras.losses.BinaryCrossentropy),
        ("categorical_crossentropy", keras.losses.CategoricalCrossentropy),
        ("sparse_categorical_crossentropy", keras.losses.SparseCategoricalCrossentropy),
        ("hinge", keras.losses.Hinge),
        ("kld", keras.losses.KLDivergence),
        ("MeanSquaredError", keras.losses.MeanSquaredError),
    ]:
        assert isinstance(keras.losses.get(name), cls), name


def test_a_plain_function_works_as_a_loss() -> None:
    def my_loss(y_true: object, y_pred: object) -> object:
        return pf.reduce_mean(pf.abs(y_true - y_pred) * 2.0, axis=-1)

    loss = keras.losses.get(my_loss)
    t, p = rng.normal(size=(N, K)), rng.normal(size=(N, K))
    np.testing.assert_allclose(
        loss(pf.constant(t), pf.constant(p)).numpy(), 2 * ref_mae(t, p).mean(), rtol=1e-12
    )
    assert loss.name == "my_loss"


def test_mse_broadcasts_a_label_vector_against_a_column_of_predictions() -> None:
    t, p = rng.normal(size=(N,)), rng.normal(size=(N, 1))
    got = keras.losses.MeanSquaredError()(pf.constant(t), pf.constant(p)).numpy()
    np.testing.assert_allclose(got, ((p[:, 0] - t) ** 2).mean(), rtol=1e-12)


def test_unknown_reduction_and_incompatible_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match="'mean'"):
        keras.losses.MeanSquaredError(reduction="mean")
    with pytest.raises(errors.InvalidArgumentError, match=r"\[5, 4\].*\[5, 3\]"):
        keras.losses.CategoricalCrossentropy()(pf.constant(ONEHOT), pf.constant(np.ones((N, 3))))
    with pytest.raises(ValueError, match=r"0\.5"):
        keras.losses.SparseCategoricalCrossentropy()(
            pf.constant([0.5, 1.0]), pf.constant(np.ones((2, 3)) / 3)
        )


# -- against Keras -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tf_keras() -> object:
    tf = pytest.importorskip("tensorflow")
    return tf.keras


def _keras_loss(tfk: object, case: str, reduction: str) -> object:
    L = tfk.losses
    make = {
        "mse": lambda: L.MeanSquaredError(reduction=reduction),
        "mae": lambda: L.MeanAbsoluteError(reduction=reduction),
        "mape": lambda: L.MeanAbsolutePercentageError(reduction=reduction),
        "huber": lambda: L.Huber(reduction=reduction),
        "huber_delta": lambda: L.Huber(delta=0.3, reduction=reduction),
        "bce_probs": lambda: L.BinaryCrossentropy(reduction=reduction),
        "bce_probs_smoothed": lambda: L.BinaryCrossentropy(
            label_smoothing=0.2, reduction=reduction
        ),
        "bce_logits": lambda: L.BinaryCrossentropy(from_logits=True, reduction=reduction),
        "bce_logits_smoothed": lambda: L.BinaryCrossentropy(
            from_logits=True, label_smoothing=0.1, reduction=reduction
        ),
        "cce_probs": lambda: L.CategoricalCrossentropy(reduction=reduction),
        "cce_unnormalized": lambda: L.CategoricalCrossentropy(reduction=reduction),
        "cce_logits": lambda: L.CategoricalCrossentropy(from_logits=True, reduction=reduction),
        "cce_logits_smoothed": lambda: L.CategoricalCrossentropy(
            from_logits=True, label_smoothing=0.25, reduction=reduction
        ),
        "cce_probs_smoothed": lambda: L.CategoricalCrossentropy(
            label_smoothing=0.1, reduction=reduction
        ),
        "scce_probs": lambda: L.SparseCategoricalCrossentropy(reduction=reduction),
        "scce_logits": lambda: L.SparseCategoricalCrossentropy(
            from_logits=True, reduction=reduction
        ),
        "scce_logits_column_labels": lambda: L.SparseCategoricalCrossentropy(
            from_logits=True, reduction=reduction
        ),
        "hinge_pm1": lambda: L.Hinge(reduction=reduction),
        "hinge_01": lambda: L.Hinge(reduction=reduction),
        "kld": lambda: L.KLDivergence(reduction=reduction),
    }
    return make[case]()


@pytest.mark.parametrize("reduction", ["none", "sum", "sum_over_batch_size"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_value_matches_keras(
    tf_keras: object, case: str, reduction: str, weighted: bool
) -> None:
    make, _, y_true, y_pred = CASES[case]
    t32, p32 = y_true.astype(np.float32), y_pred.astype(np.float32)
    sw = SW.astype(np.float32) if weighted else None
    ours = make(reduction=reduction)(
        pf.constant(t32), pf.constant(p32), None if sw is None else pf.constant(sw)
    )
    theirs = _keras_loss(tf_keras, case, reduction)(t32, p32, sample_weight=sw)
    np.testing.assert_allclose(ours.numpy(), np.asarray(theirs), rtol=2e-5, atol=1e-5)


def test_binary_crossentropy_of_a_sigmoid_activation_works_from_its_logits() -> None:
    # A saturated sigmoid (exactly 1.0 in float32): clipping the probability gave a
    # flat loss of -log(1e-7) and no gradient; TensorFlow 2.21 (Keras 3) gives 50 and
    # a gradient of 1 here, from the logits it keeps on the activation's output.
    model = pf.keras.Sequential([pf.keras.layers.Dense(1, activation="sigmoid", input_shape=(1,))])
    model.layers[0].kernel.assign([[50.0]])
    model.layers[0].bias.assign([0.0])
    x, y = np.array([[1.0]], np.float32), np.array([[0.0]], np.float32)
    with pf.GradientTape() as tape:
        loss = pf.keras.losses.BinaryCrossentropy()(y, model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    assert float(loss) == pytest.approx(50.0)
    assert [float(g.numpy().ravel()[0]) for g in grads] == pytest.approx([1.0, 1.0])
    # a probability that is not a sigmoid's output is still clipped, as in Keras
    clipped = pf.keras.losses.binary_crossentropy(y, pf.constant([[1.0]]))
    assert 15.0 < float(clipped[0]) < 17.0  # -log(1e-7) in float32


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_batch_mean_is_the_sum_divided_by_the_count_bit_for_bit(dtype: type) -> None:
    # "sum_over_batch_size" reduces in one op (reduce_mean): its value and gradient must be
    # those of the sum divided by the count, which it replaced
    from psflow.keras.losses import reduce_values

    rng = np.random.default_rng(7)
    for n in (1, 3, 64, 255, 4097):
        v = pf.Variable((rng.standard_normal(n) * rng.uniform(0.1, 100)).astype(dtype))
        sw = pf.constant(rng.uniform(0.5, 1.5, n).astype(dtype))
        for weights in (None, sw):
            with pf.GradientTape(persistent=True) as tape:
                fast = reduce_values(v, weights, "sum_over_batch_size")
                x = v if weights is None else pf.multiply(v, weights)
                slow = pf.divide(pf.reduce_sum(x), float(n))
            assert fast.dtype == slow.dtype == pf.as_dtype(dtype)
            assert fast.numpy().tobytes() == slow.numpy().tobytes()
            assert np.array_equal(tape.gradient(fast, v).numpy(), tape.gradient(slow, v).numpy())
    empty = reduce_values(pf.constant(np.zeros(0, np.float32)), None, "sum_over_batch_size")
    assert float(empty) == 0.0  # no examples: zero, not the mean's nan
