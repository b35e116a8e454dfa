"""examples/collaborative_filtering.py: the Keras tutorial's recommender on a local cluster.

Both variants (``Embedding`` over encoded indices, ``DynamicEmbedding`` over
raw int64 ids with no vocabulary) train under ParameterServerStrategy on
``psflow local`` (2 PS + 2 workers, real processes); the reference is the
loss of predicting the training set's mean rating for every validation pair.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT, child_env

EXAMPLE = ROOT / "examples" / "collaborative_filtering.py"


def _example():
    spec = importlib.util.spec_from_file_location("collaborative_filtering", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_synthetic_ratings_are_half_stars_over_unstructured_ids():
    cf = _example()
    users, movies, ratings = cf.synthetic_ratings(50, 30, 2000, seed=3)
    assert users.dtype == movies.dtype == np.int64
    assert len(np.unique(users)) <= 50 and users.max() > 2**40  # no 0..n-1 vocabulary
    assert set(np.unique(ratings * 2)) <= set(range(1, 11))  # 0.5 .. 5 in half stars
    again = cf.synthetic_ratings(50, 30, 2000, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip((users, movies, ratings), again))


def test_baseline_is_keras_binary_crossentropy_of_the_mean():
    cf = _example()
    y = np.array([[0.0], [0.25], [1.0]], np.float32)
    p = np.full_like(y, 0.4)
    expected = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    assert cf.binary_crossentropy(y, p) == pytest.approx(expected, rel=1e-6)
    # Keras clips to [1e-7, 1 - 1e-7]: a certain wrong prediction costs -log(1e-7), not inf.
    assert cf.binary_crossentropy(np.ones(1), np.zeros(1)) == pytest.approx(-np.log(1e-7))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("embedding", ["embedding", "dynamic"])
def test_recommender_beats_predicting_the_mean_on_a_local_cluster(embedding):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "chief.local",
            "--ps",
            "2",
            "--workers",
            "2",
            str(EXAMPLE),
            "--embedding",
            embedding,
            # 141 steps an epoch instead of the tutorial's 563, each worth four: the
            # same 5 epochs end further below the mean's loss (dynamic: 0.88x, not 0.92x)
            "--batch-size",
            "256",
            "--learning-rate",
            "0.01",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env=child_env(),
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(
        next(
            line[len("[chief] ") :]
            for line in out.stdout.splitlines()
            if line.startswith("[chief] {")
        )
    )
    assert report["embedding"] == embedding
    # A validation pair's rating was never trained on; only its user's and movie's
    # other ratings inform it: 5% below the mean's loss means the factors learned them.
    assert report["val_loss"] < 0.95 * report["baseline"], report
    assert "worker:0" in out.stdout and "worker:1" in out.stdout  # a real cluster ran it
