"""Metrics against direct NumPy computations (and against Keras where TensorFlow is installed)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import keras

M = keras.metrics
rng = np.random.default_rng(0)


def _value(metric: M.Metric | pf.Tensor) -> float:
    """The metric's result (or a result calling the metric returned), checked as a float32 scalar."""
    result = metric.result() if isinstance(metric, M.Metric) else metric
    assert result.dtype == pf.float32 and result.shape == ()
    return float(result.numpy())


def _ranked_auc(y: np.ndarray, score: np.ndarray) -> float:
    """Exact ROC AUC: the Mann-Whitney U statistic from average ranks (ties shared)."""
    order = np.argsort(score, kind="mergesort")
    ranks = np.empty(len(score))
    ranks[order] = np.arange(1, len(score) + 1)
    for value in np.unique(score):  # average the ranks of tied scores
        tied = score == value
        ranks[tied] = ranks[tied].mean()
    pos = y == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


# -- accuracy --------------------------------------------------------------------------------

N, K = 60, 4
LOGITS = rng.normal(size=(N, K)).astype(np.float32)
IDS = rng.integers(0, K, N)
PROBS1 = rng.uniform(0, 1, (N, 1)).astype(np.float32)
BIN = (rng.uniform(0, 1, (N, 1)) < PROBS1).astype(np.float32)  # correlated with the scores


def test_accuracy_variants_match_direct_counts() -> None:
    sparse = (LOGITS.argmax(1) == IDS).mean()
    assert _value(M.SparseCategoricalAccuracy()(IDS, LOGITS)) == pytest.approx(sparse)
    assert _value(M.SparseCategoricalAccuracy()(IDS[:, None], LOGITS)) == pytest.approx(sparse)
    onehot = np.eye(K)[IDS]
    assert _value(M.CategoricalAccuracy()(onehot, LOGITS)) == pytest.approx(sparse)
    binary = ((PROBS1 > 0.5) == BIN).mean()
    assert _value(M.BinaryAccuracy()(BIN, PROBS1)) == pytest.approx(binary)
    at_07 = ((PROBS1 > 0.7) == BIN).mean()
    assert _value(M.BinaryAccuracy(threshold=0.7)(BIN, PROBS1)) == pytest.approx(at_07)
    exact = M.Accuracy()([1, 2, 3, 4], [1, 2, 0, 4])
    assert _value(exact) == pytest.approx(0.75)
    top2 = (np.argsort(-LOGITS, 1)[:, :2] == IDS[:, None]).any(1).mean()
    assert _value(M.SparseTopKCategoricalAccuracy(k=2)(IDS, LOGITS)) == pytest.approx(top2)
    assert _value(M.TopKCategoricalAccuracy(k=2)(onehot, LOGITS)) == pytest.approx(top2)


@pytest.mark.parametrize(
    ("y_true", "y_pred", "expected"),
    [
        (BIN, PROBS1, ((PROBS1 > 0.5) == BIN).mean()),  # one column of scores: binary
        (BIN[:, 0], PROBS1[:, 0], ((PROBS1 > 0.5) == BIN).mean()),  # vectors: binary
        (BIN[:, 0], PROBS1, ((PROBS1 > 0.5) == BIN).mean()),  # labels (n,), scores (n, 1)
        (IDS, LOGITS, (LOGITS.argmax(1) == IDS).mean()),  # class ids: sparse
        (IDS[:, None], LOGITS, (LOGITS.argmax(1) == IDS).mean()),  # a column of ids: sparse
        (np.eye(K)[IDS], LOGITS, (LOGITS.argmax(1) == IDS).mean()),  # one-hot: categorical
    ],
    ids=["binary_column", "binary_vector", "binary_mixed", "sparse", "sparse_column", "onehot"],
)
def test_accuracy_by_name_resolves_like_keras(
    y_true: np.ndarray, y_pred: np.ndarray, expected: float
) -> None:
    for name in ("accuracy", "acc"):
        metric = M.get(name)
        metric.update_state(y_true, y_pred)
        assert metric.name == name
        assert _value(metric) == pytest.approx(expected)


def test_compiled_accuracy_resolves_from_the_model_output() -> None:
    pf.random.set_seed(0)
    x = rng.normal(size=(N, 3)).astype(np.float32)
    multi = keras.Sequential([keras.layers.Dense(K, input_shape=(3,))])
    multi.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    _, acc = multi.evaluate(x, IDS, verbose=0)
    assert acc == pytest.approx((multi.predict(x, verbose=0).argmax(1) == IDS).mean(), abs=1e-6)
    single = keras.Sequential([keras.layers.Dense(1, activation="sigmoid", input_shape=(3,))])
    single.compile(optimizer="sgd", loss="binary_crossentropy", metrics=["accuracy"])
    _, acc = single.evaluate(x, BIN, verbose=0)
    assert acc == pytest.approx(((single.predict(x, verbose=0) > 0.5) == BIN).mean(), abs=1e-6)


def test_accuracy_weighted_by_sample_weight() -> None:
    w = rng.uniform(0, 2, N)
    hits = (LOGITS.argmax(1) == IDS).astype(float)
    metric = M.SparseCategoricalAccuracy()
    metric.update_state(IDS, LOGITS, sample_weight=w)
    assert _value(metric) == pytest.approx((hits * w).sum() / w.sum(), rel=1e-6)


# -- AUC, precision, recall --------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_matches_the_exact_rank_auc(seed: int) -> None:
    r = np.random.default_rng(seed)
    y = r.integers(0, 2, 500)
    score = np.clip(0.5 + (y - 0.5) * r.uniform(0, 0.6) + r.normal(0, 0.25, 500), 0, 1)
    metric = M.AUC(num_thresholds=200)
    metric.update_state(y[:200], score[:200])
    metric.update_state(y[200:], score[200:])  # batches accumulate
    exact = _ranked_auc(y, score)
    assert 0.55 < exact < 0.99
    assert _value(metric) == pytest.approx(exact, abs=1e-2)


def test_auc_extremes_and_reset() -> None:
    y = np.array([0, 0, 1, 1])
    perfect = M.AUC()
    perfect.update_state(y, [0.1, 0.2, 0.8, 0.9])
    assert _value(perfect) == pytest.approx(1.0, abs=1e-6)
    inverted = M.AUC()
    inverted.update_state(y, [0.9, 0.8, 0.2, 0.1])
    assert _value(inverted) == pytest.approx(0.0, abs=1e-6)
    perfect.reset_state()
    assert _value(perfect) == 0.0


def test_precision_and_recall_match_direct_counts() -> None:
    y = rng.integers(0, 2, 100)
    score = rng.uniform(0, 1, 100)
    w = rng.uniform(0, 3, 100)
    pred = score > 0.5
    tp, fp, fn = (
        ((pred & (y == 1)) * w).sum(),
        ((pred & (y == 0)) * w).sum(),
        ((~pred & (y == 1)) * w).sum(),
    )
    p, r = M.Precision(), M.Recall()
    p.update_state(y, score, sample_weight=w)
    r.update_state(y, score, sample_weight=w)
    assert _value(p) == pytest.approx(tp / (tp + fp), rel=1e-6)
    assert _value(r) == pytest.approx(tp / (tp + fn), rel=1e-6)
    strict = M.Precision(thresholds=0.9)
    strict.update_state(y, score)
    hi = score > 0.9
    assert _value(strict) == pytest.approx((hi & (y == 1)).sum() / hi.sum(), rel=1e-6)
    empty = M.Recall()
    empty.update_state([0, 0], [0.9, 0.1])  # no positives: 0, not NaN
    assert _value(empty) == 0.0


# -- means, sums, regression metrics ---------------------------------------------------------------


def test_mean_sum_and_regression_metrics() -> None:
    m = M.Mean()
    m.update_state([1.0, 2.0, 3.0])
    m.update_state([10.0], sample_weight=[3.0])
    assert _value(m) == pytest.approx((1 + 2 + 3 + 30) / 6)
    s = M.Sum()
    s.update_state([1.0, 2.0])
    s.update_state(np.array([[3.0]]))
    assert _value(s) == pytest.approx(6.0)
    t, p = rng.normal(size=(N, 2)), rng.normal(size=(N, 2))
    assert _value(M.MeanSquaredError()(t, p)) == pytest.approx(((t - p) ** 2).mean(), rel=1e-6)
    assert _value(M.MeanAbsoluteError()(t, p)) == pytest.approx(np.abs(t - p).mean(), rel=1e-6)
    rmse = np.sqrt(((t - p) ** 2).mean())
    assert _value(M.RootMeanSquaredError()(t, p)) == pytest.approx(rmse, rel=1e-6)
    for name, cls in [
        ("mse", M.MeanSquaredError),
        ("mae", M.MeanAbsoluteError),
        ("auc", M.AUC),
        ("precision", M.Precision),
        ("recall", M.Recall),
    ]:
        metric = M.get(name)
        assert isinstance(metric, cls) and metric.name == name


def test_function_metric_in_compile_reports_under_its_name() -> None:
    def max_error(y_true: Any, y_pred: Any) -> Any:
        return pf.reduce_max(pf.abs(y_true - y_pred), axis=-1)

    pf.random.set_seed(0)
    model = keras.Sequential([keras.layers.Dense(2, input_shape=(3,))])
    model.compile(optimizer="sgd", loss="mse", metrics=[max_error])
    x = rng.normal(size=(10, 3)).astype(np.float32)
    y = rng.normal(size=(10, 2)).astype(np.float32)
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    pred = model.predict(x, verbose=0)
    assert logs["max_error"] == pytest.approx(np.abs(pred - y).max(axis=1).mean(), rel=1e-5)


# -- merge_state -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [M.Mean, M.SparseCategoricalAccuracy, M.AUC, M.Precision, M.Recall, M.MeanSquaredError],
    ids=lambda c: c.__name__,
)
def test_merging_states_of_halves_equals_the_whole(make: Any) -> None:
    y = rng.integers(0, 2, 80)
    scores = rng.uniform(0, 1, 80)
    two_col = np.stack([1 - scores, scores], axis=1)
    w = rng.uniform(0, 1, 80)

    def feed(metric: M.Metric, sl: slice) -> None:
        if isinstance(metric, M.Mean) and not isinstance(metric, M.MeanMetricWrapper):
            metric.update_state(scores[sl], sample_weight=w[sl])
        elif isinstance(metric, M.SparseCategoricalAccuracy):
            metric.update_state(y[sl], two_col[sl], sample_weight=w[sl])
        else:
            metric.update_state(y[sl], scores[sl], sample_weight=w[sl])

    whole, a, b, merged = make(), make(), make(), make()
    feed(whole, slice(None))
    feed(a, slice(0, 30))
    feed(b, slice(30, None))
    merged.merge_state([a.get_state(), b.get_state()])
    assert _value(merged) == pytest.approx(_value(whole), rel=1e-6)
    a.merge_state(b.get_state())  # a single state merges too
    assert _value(a) == pytest.approx(_value(whole), rel=1e-6)


# -- against Keras ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tf_keras() -> Any:
    tf = pytest.importorskip("tensorflow")
    return tf.keras


@pytest.mark.parametrize(
    ("name", "y_true", "y_pred"),
    [
        ("BinaryAccuracy", BIN, PROBS1),
        ("CategoricalAccuracy", np.eye(K)[IDS], LOGITS),
        ("SparseCategoricalAccuracy", IDS, LOGITS),
        ("AUC", BIN, PROBS1),
        ("Precision", BIN, PROBS1),
        ("Recall", BIN, PROBS1),
        ("MeanSquaredError", PROBS1, BIN),
        ("RootMeanSquaredError", PROBS1, BIN),
    ],
)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_metric_matches_keras(
    tf_keras: Any, name: str, y_true: np.ndarray, y_pred: np.ndarray, weighted: bool
) -> None:
    w = np.linspace(0.1, 2.0, N).astype(np.float32) if weighted else None
    ours, theirs = getattr(M, name)(), getattr(tf_keras.metrics, name)()
    for sl in (slice(0, 25), slice(25, None)):
        ours.update_state(y_true[sl], y_pred[sl], sample_weight=None if w is None else w[sl])
        theirs.update_state(y_true[sl], y_pred[sl], sample_weight=None if w is None else w[sl])
    assert _value(ours) == pytest.approx(float(theirs.result()), rel=1e-5, abs=1e-6)


def test_a_steps_weighted_mean_loss_accumulates_as_the_general_path_does() -> None:
    # fit's loss tracker gets a float32 scalar tensor and the batch size as np.float64: a
    # fast path, whose state must be bit for bit the general path's (values as an array)
    rng = np.random.default_rng(3)
    fast, general = keras.metrics.Mean(), keras.metrics.Mean()
    for _ in range(50):
        loss = np.float32(rng.standard_normal() * 10)
        batch = np.float64(rng.integers(1, 300))
        fast.update_state(pf.constant(np.asarray(loss)), sample_weight=batch)
        general.update_state(np.asarray(loss), sample_weight=np.asarray(batch))
    assert [a.tobytes() for a in fast.get_state()] == [a.tobytes() for a in general.get_state()]
    assert fast.result().numpy().tobytes() == general.result().numpy().tobytes()
