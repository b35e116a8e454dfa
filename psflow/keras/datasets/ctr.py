"""Synthetic Criteo-shaped click logs with a known ground truth.

Each example has 13 dense features and 26 categorical ones.  A categorical
value is a Zipf-distributed rank (exponent ``zipf_s``, 1.05–1.2 as in real
click logs: a few ids are everywhere, most are rare) hashed with its field into
an int64 id, so ids of different fields never meet and the id space is
unbounded, as with Criteo's hashed features.  The label is drawn from a hidden
logistic model::

    logit = bias + dense @ w + sum_f weight(f, id_f)

where ``weight`` is a pure function of ``(seed, id)`` (the same counter-based
hash that seeds dynamic table rows).  :func:`roc_auc` of the true logits on a
sample is the best AUC any model can reach on it; a model that learns the
frequent ids gets close.

Example:
    >>> x, y, logit = load_data(1000, seed=1)
    >>> x["dense"].shape, x["cat"].shape, x["cat"].dtype, y.shape
    ((1000, 13), (1000, 26), dtype('int64'), (1000, 1))
    >>> 0.7 < roc_auc(y, logit) < 0.95
    True
"""

from __future__ import annotations

import numpy as np

from psflow.errors import InvalidArgumentError
from psflow.ps.dynamic_table import initial_rows
from psflow.ps.key_index import mix64

__all__ = ["NUM_CATEGORICAL", "NUM_DENSE", "load_data", "roc_auc"]

NUM_DENSE = 13
NUM_CATEGORICAL = 26
_DENSE_CENTRE = 0.87
_MAX_RANK = 10**9  # Zipf draws are unbounded; clip the astronomically rare tail


def load_data(
    n: int,
    *,
    seed: int = 0,
    zipf_s: float = 1.1,
    truth_seed: int = 1234,
    id_weight: float = 0.3,
    bias: float = -1.0,
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """``n`` examples: ``({"dense": (n, 13) float32, "cat": (n, 26) int64}, labels, logits)``.

    ``seed`` draws the examples; ``truth_seed`` fixes the hidden model, so
    train and test sets drawn with different seeds share one truth.  Labels are
    ``(n, 1)`` float32 in {0, 1}; ``logits`` are the hidden model's (float64).

    Raises:
        InvalidArgumentError: ``n < 1`` or ``zipf_s <= 1`` (NumPy's Zipf needs > 1).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgumentError(f"n must be an integer >= 1, got {n!r}")
    if not zipf_s > 1.0:
        raise InvalidArgumentError(f"zipf_s must be > 1, got {zipf_s!r}")
    rng = np.random.default_rng(seed)
    dense = rng.lognormal(0.0, 1.0, size=(n, NUM_DENSE)).astype(np.float32)
    dense = np.log1p(dense).astype(np.float32)  # Criteo's usual log transform
    ranks = np.minimum(rng.zipf(zipf_s, size=(n, NUM_CATEGORICAL)), _MAX_RANK).astype(np.int64)
    fields = np.arange(NUM_CATEGORICAL, dtype=np.int64)[None, :]
    cat = mix64((fields << np.int64(40)) | ranks).view(np.int64)
    truth = np.random.default_rng(truth_seed)
    w_dense = truth.normal(0.0, 0.5, size=NUM_DENSE)
    # Every id's hidden weight: deterministic in the id, the same in every sample.
    w_ids = initial_rows("normal", truth_seed, cat.reshape(-1), 1, id_weight, np.dtype("float64"))
    # Centred by a constant (about E[log1p(lognormal)]), not the sample's mean,
    # so every sample follows the same truth.
    logit = bias + (dense - _DENSE_CENTRE) @ w_dense + w_ids.reshape(n, NUM_CATEGORICAL).sum(1)
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return {"dense": dense, "cat": cat}, labels.reshape(n, 1), logit


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC by ranks, ties averaged (the Mann–Whitney U statistic).

    Raises:
        InvalidArgumentError: labels of one class only, or sizes that differ.
    """
    labels = np.asarray(labels).ravel().astype(bool)
    scores = np.asarray(scores, np.float64).ravel()
    if labels.shape != scores.shape:
        raise InvalidArgumentError(f"{labels.size} labels but {scores.size} scores")
    pos = int(labels.sum())
    if pos == 0 or pos == labels.size:
        raise InvalidArgumentError("AUC needs both positive and negative labels")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    # The average rank of each distinct score, 1-based.
    ends = np.cumsum(counts)
    average = ends - (counts - 1) / 2.0
    ranks = average[inverse.reshape(-1)]
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * (labels.size - pos)))
